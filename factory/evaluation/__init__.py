"""Scoring: perplexity on one fixed token stream (evaluate.py), the KL divergence from FP16 and top-1 agreement
(kld.py), and walking a model a layer at a time so that memory holds one layer (layered.py)."""
