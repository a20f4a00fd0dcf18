"""The published quants and their names: quant names (naming.py), a published quant as readers see it
(published.py), finding one by name (lookup.py), and removing quants and what finished work leaves (housekeeping.py)."""
