"""Scoring EXL2 quants through exllamav2 itself (CUDA only; it loads EXL2 quants and FP16 folders alike): a whole
window in one forward pass for perplexity, and through its KV caches in chunks (what cache quantization costs).
exllamav2 is imported only here, inside the functions: importing it builds its CUDA extension."""

from __future__ import annotations

import os
from pathlib import Path

WINDOW = 2048
KV_CACHES = {"fp16": "ExLlamaV2Cache", "q8": "ExLlamaV2Cache_Q8", "q6": "ExLlamaV2Cache_Q6", "q4": "ExLlamaV2Cache_Q4"}
KV_EVAL_CACHES = ("fp16", "q8", "q4")  # EXL2 quants are also scored through these exllamav2 caches
KV_CHUNK = 128  # tokens per forward when scoring through a cache
KV_CHUNK_NOTE = f"each window fed {KV_CHUNK} tokens at a time, so every token reads the earlier ones from the cache"


def _model(folder: Path):
    os.environ["EXLLAMA_NO_SDPA"] = "1"  # read at import: its SDPA path is wrong on torch 2.11
    from exllamav2 import ExLlamaV2, ExLlamaV2Config

    config = ExLlamaV2Config(str(folder))
    config.arch_compat_overrides()
    model = ExLlamaV2(config)
    model.load()
    return model


def load(folder: Path):
    """exllamav2's own forward pass over a whole window, no cache."""
    model = _model(folder)
    return lambda ids: model.forward(ids, cache=None)


def cached_loader(cache: str):
    """A loader through a KV cache of type `cache`: each window goes through in KV_CHUNK-token forwards, so every
    token attends to the earlier ones through the (quantized) cache, as in generation."""

    def load_cached(folder: Path, device: str):
        model = _model(folder)
        import exllamav2
        import torch

        kv = getattr(exllamav2, KV_CACHES[cache])(model, max_seq_len=min(WINDOW, model.config.max_seq_len))

        def logits(ids: torch.Tensor) -> torch.Tensor:
            kv.current_seq_len = 0
            chunks = [model.forward(ids[:, i : i + KV_CHUNK], kv) for i in range(0, ids.shape[1], KV_CHUNK)]
            return torch.cat(chunks, 1)

        return logits

    return load_cached
