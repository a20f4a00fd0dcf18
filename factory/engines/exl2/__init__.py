"""EXL2 through exllamav2 (see engine.py)."""
