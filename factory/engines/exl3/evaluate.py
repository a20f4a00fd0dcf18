"""Scoring EXL3 quants through exllamav3 itself (CUDA only; it loads EXL3 quants and FP16 folders alike): a whole
window in one forward pass for perplexity, as exllamav3's own eval/ppl.py does, and through its quantized KV cache
in chunks. exllamav3 is imported only here, inside the functions: importing it builds its CUDA extension."""

from __future__ import annotations

from pathlib import Path

from factory.engines.exl3 import compat

WINDOW = 2048
KV_EVAL_CACHES = ("q8", "q4")  # exllamav3's quantized cache at 8 and 4 bits for K and V
KV_CHUNK = 128  # tokens per forward when scoring through a cache
KV_CHUNK_NOTE = f"each window fed {KV_CHUNK} tokens at a time, so every token reads the earlier ones from the cache"


def _model(folder: Path, cache_bits: int | None = None):
    from exllamav3 import Cache, CacheLayer_quant, Config, Model

    with compat.reading(folder):
        config = Config.from_directory(str(folder))
        config.override_dynamic_seq_len(WINDOW)
        model = Model.from_config(config)
        cache = None
        if cache_bits is not None:  # made before the model loads, so its memory is planned with the weights
            cache = Cache(
                model,
                max_num_tokens=WINDOW,
                layer_type=CacheLayer_quant,
                k_bits=cache_bits,
                v_bits=cache_bits,
                max_batch_size=1,  # one window at a time: one slot of recurrent state
            )
        model.load("cuda:0")
    return model, cache, config.vocab_size


def load(folder: Path):
    """exllamav3's forward pass over a whole window, no cache; logits cut to the vocabulary (it pads them)."""
    model, _, vocab = _model(folder)
    return lambda ids: model.forward(ids, {"attn_mode": "flash_attn_nc"})[..., :vocab]


def cached_loader(cache: str):
    """A loader through exllamav3's quantized cache (`q8`, `q4`): each window goes through in KV_CHUNK-token
    forwards, so every token attends to the earlier ones through the cache, as in generation."""
    bits = int(cache.removeprefix("q"))

    def load_cached(folder: Path, device: str):
        model, kv, vocab = _model(folder, bits)
        return lambda ids: chunked(model, kv, ids, vocab)

    return load_cached


def chunked(model, kv, ids, vocab: int):
    """One window's logits, KV_CHUNK tokens a forward. A model with recurrent state (linear attention, short
    convolutions, sliding-window layers that keep only their window) takes one state of the cache's pool for the
    window, as exllamav3's generator and warmup do: passed to every chunk (exllamav3 refuses a chunk past the first
    without it: "Past length given, but no previous state for recurrence") and given back after the window, or the
    pool (one slot here) runs dry at the next window."""
    import torch

    states = [kv.get_new_state()] if model.caps.get("recurrent_states") else None
    chunks = []
    try:
        for start in range(0, ids.shape[1], KV_CHUNK):
            params = {"attn_mode": "flash_attn", "cache": kv, "past_len": start, "batch_shape": (1, WINDOW)}
            if states:
                params["recurrent_states"] = states
            chunks.append(model.forward(ids[:, start : start + KV_CHUNK], params)[..., :vocab])
    finally:
        for state in states or ():
            state.free()
    return torch.cat(chunks, 1)
