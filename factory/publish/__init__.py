"""Publish targets: the registry folder under FACTORY_HOME (folder.py); the Hub comes with issue D."""
