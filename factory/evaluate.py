"""Perplexity on one fixed token stream, the same for the FP16 source and every quant.

Protocol (DESIGN.md): the eval text is tokenized once with the source's tokenizer, no BOS added, and cut into
non-overlapping windows of 2048 tokens (fewer if the model's max positions are fewer) from the start; the
first N windows are scored. CPU computes in fp32, CUDA in fp16. An AWQ quant is evaluated by dequantizing
its packed weights with AutoAWQ's own `dequantize_gemm` into a transformers model (every other tensor comes
from the AWQ file, which holds the norms AWQ folded its scales into), so it runs on any device.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from factory.errors import SpecError

WINDOW = 2048


@dataclass(frozen=True)
class Stream:
    windows: list[list[int]]

    @property
    def window_length(self) -> int:
        return len(self.windows[0])


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_windows(dev: str) -> int:
    return 48 if dev == "cuda" else 8


def tokenize(tokenizer_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stream(ids: list[int], count: int, max_positions: int | None, name: str) -> Stream:
    length = min(WINDOW, max_positions or WINDOW)
    have = len(ids) // length
    if have < count:
        raise SpecError(f"eval text {name!r} holds {have} windows of {length} tokens, fewer than the {count} requested")
    return Stream([ids[i * length : (i + 1) * length] for i in range(count)])


Logits = Callable[["torch.Tensor"], "torch.Tensor"]  # noqa: F821  token ids [1, L] on the CPU -> logits [1, L, V]


def perplexity(logits_of: Logits, data: Stream, on_window: Callable[[int, int], None] | None = None) -> float:
    import torch

    total_nll, total_tokens = 0.0, 0
    with torch.inference_mode():
        for i, window in enumerate(data.windows):
            ids = torch.tensor([window])
            logits = logits_of(ids)[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:].to(logits.device), reduction="sum")
            total_nll += nll.item()
            total_tokens += len(window) - 1
            if on_window:
                on_window(i + 1, len(data.windows))
    return math.exp(total_nll / total_tokens) if math.isfinite(total_nll) else float("inf")


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def _dtype(dev: str):
    import torch

    return torch.float16 if dev == "cuda" else torch.float32


def _transformers(model, dev: str) -> Logits:
    model = model.to(dev).eval()
    return lambda ids: model(ids.to(dev)).logits


def load_fp16(folder: Path, dev: str) -> Logits:
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    return _transformers(AutoModelForCausalLM.from_pretrained(folder, dtype=_dtype(dev), trust_remote_code=False), dev)


def load_awq(folder: Path, dev: str) -> Logits:
    """A transformers model whose quantized linears hold AutoAWQ's dequantized weights."""
    import warnings

    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    # autoawq's import resets the warning filters and warns of its deprecation in 15 lines: keep them in the log
    with warnings.catch_warnings(record=True) as caught:
        from awq.utils.packing_utils import dequantize_gemm
    log = logging.getLogger(__name__)
    for w in caught:  # the first import only: one line, and the notice itself for whoever logs at debug
        log.info("AutoAWQ is deprecated upstream and still works here (its notice: debug log)")
        log.debug("autoawq: %s", w.message)
    _quiet_transformers()

    config_dict = json.loads((folder / "config.json").read_text())
    qc = config_dict.pop("quantization_config")
    config = AutoConfig.for_model(**config_dict)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    state = {}
    for key, value in tensors.items():
        if key.endswith(".qweight"):
            base = key.removesuffix(".qweight")
            weight = dequantize_gemm(
                value, tensors[f"{base}.qzeros"], tensors[f"{base}.scales"], qc["bits"], qc["group_size"]
            )
            state[f"{base}.weight"] = weight.T.contiguous()
        elif not key.endswith((".qzeros", ".scales")):
            state[key] = value
    model = AutoModelForCausalLM.from_config(config, dtype=_dtype(dev), trust_remote_code=False)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"AWQ tensors do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return _transformers(model, dev)


def _exl2_model(folder: Path):
    """exllamav2's model of `folder` (CUDA only; it loads EXL2 quants and FP16 folders alike)."""
    import os

    os.environ["EXLLAMA_NO_SDPA"] = "1"  # read at import: its SDPA path is wrong on torch 2.11
    from exllamav2 import ExLlamaV2, ExLlamaV2Config

    config = ExLlamaV2Config(str(folder))
    config.arch_compat_overrides()
    model = ExLlamaV2(config)
    model.load()
    return model


def load_exl2(folder: Path, dev: str) -> Logits:
    """exllamav2's own forward pass over a whole window, no cache."""
    model = _exl2_model(folder)
    return lambda ids: model.forward(ids, cache=None)


KV_CACHES = {"fp16": "ExLlamaV2Cache", "q8": "ExLlamaV2Cache_Q8", "q6": "ExLlamaV2Cache_Q6", "q4": "ExLlamaV2Cache_Q4"}
KV_CHUNK = 128  # tokens per forward when scoring through a cache


def load_exl2_cached(folder: Path, dev: str, cache: str) -> Logits:
    """exllamav2 with a KV cache of type `cache`: each window goes through in KV_CHUNK-token forwards, so every
    token attends to the earlier ones through the (quantized) cache, as in generation."""
    model = _exl2_model(folder)
    import exllamav2
    import torch

    kv = getattr(exllamav2, KV_CACHES[cache])(model, max_seq_len=min(WINDOW, model.config.max_seq_len))

    def logits(ids: torch.Tensor) -> torch.Tensor:
        kv.current_seq_len = 0
        return torch.cat([model.forward(ids[:, i : i + KV_CHUNK], kv) for i in range(0, ids.shape[1], KV_CHUNK)], 1)

    return logits


LOADERS = {"fp16": load_fp16, "awq": load_awq, "exl2": load_exl2}
EVALUATORS = {"fp16": "transformers", "awq": "autoawq", "exl2": "exllamav2"}


@dataclass(frozen=True)
class Result:
    ppl: float
    seconds: float
    evaluator: str
    device: str
    peak_gpu_bytes: int | None = None


def evaluate(folder: Path, method: str, data: Stream, on_window=None, kv_cache: str | None = None) -> Result:
    """Perplexity of the model in `folder` through `method`'s loader (fp16: transformers; awq: AutoAWQ's
    dequantization into transformers; exl2: exllamav2, with `kv_cache` through a cache of that type)."""
    import torch

    dev = device()
    start = time.monotonic()
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    logits_of = load_exl2_cached(folder, dev, kv_cache) if kv_cache else LOADERS[method](folder, dev)
    ppl = perplexity(logits_of, data, on_window)
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else None
    del logits_of
    return Result(ppl=ppl, seconds=time.monotonic() - start, evaluator=EVALUATORS[method], device=dev,
                  peak_gpu_bytes=peak)
