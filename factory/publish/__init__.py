"""Publish targets: the registry folder under FACTORY_HOME (folder.py), the Hub (hub.py), the model card
(card.py); publishing.py publishes a job's quant to them, lookup.py finds published quants by name, and
housekeeping.py removes them (`qf rm`) and what finished work leaves (`qf gc`)."""
