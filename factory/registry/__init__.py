"""The published quants' names and rows, what every floor may read: quant names (naming.py) and a published quant as
readers see it (published.py). Finding quants by name and removing them are publishing's (factory/publish/)."""
