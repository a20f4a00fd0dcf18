"""AWQ in compressed-tensors, through llm-compressor (see engine.py)."""
