"""A job's FP16 checkpoint: where it comes from and its identity (sources.py), which of its files are read and
published (files.py), what is refused before any engine starts (inspection.py), and FP8 or MXFP4 sources made BF16
(dequantize.py)."""
