"""Perplexity on one fixed token stream, the same for the FP16 source and every quant.

Protocol (DESIGN.md): the eval text is tokenized once with the source's tokenizer, no BOS added, and cut into
non-overlapping windows of 2048 tokens (fewer if the model's max positions are fewer) from the start; the
first N windows are scored. CPU computes in fp32, CUDA in fp16. The FP16 source is scored with transformers, a
quant through its engine's loader (`Engine.load`: its own runtime, or a dequantization into transformers).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from factory.errors import SpecError
from factory.inspect import read_config

if TYPE_CHECKING:
    import torch

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


Logits = Callable[["torch.Tensor"], "torch.Tensor"]  # token ids [1, L] on the CPU -> logits [1, L, V]
Loader = Callable[[Path, str], Logits]  # (folder, device) -> Logits


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


def quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def torch_dtype(dev: str):
    import torch

    return torch.float16 if dev == "cuda" else torch.float32


def transformers_logits(model, dev: str) -> Logits:
    model = model.to(dev).eval()
    return lambda ids: model(ids.to(dev)).logits


def source_dtype(folder: Path, dev: str):
    """The unquantized model's precision: float16 on CUDA unless its config says bfloat16 (Gemma 3 overflows in
    float16: H200, 2026-12-01, perplexity inf), float32 on the CPU."""
    import torch

    config = read_config(Path(folder) / "config.json", check_numbers=False)
    if dev == "cuda" and (config.get("torch_dtype") or config.get("dtype")) == "bfloat16":
        return torch.bfloat16
    return torch_dtype(dev)


def load_fp16(folder: Path, dev: str) -> Logits:
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=source_dtype(folder, dev), trust_remote_code=False)
    return transformers_logits(model, dev)


FP16_EVALUATOR = "transformers"


@dataclass(frozen=True)
class Result:
    ppl: float
    seconds: float
    evaluator: str
    device: str
    peak_gpu_bytes: int | None = None


def evaluate(folder: Path, load: Loader, evaluator: str, data: Stream, on_window=None) -> Result:
    """Perplexity of the model in `folder` through `load` (load_fp16, or an engine's loader)."""
    import torch

    dev = device()
    start = time.monotonic()
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    logits_of = load(folder, dev)
    ppl = perplexity(logits_of, data, on_window)
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else None
    del logits_of
    return Result(ppl=ppl, seconds=time.monotonic() - start, evaluator=evaluator, device=dev, peak_gpu_bytes=peak)
