"""AWQ through AutoAWQ (see engine.py)."""
