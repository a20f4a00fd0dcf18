"""EXL3 through exllamav3 (see engine.py)."""
