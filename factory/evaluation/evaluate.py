"""Perplexity on one fixed token stream, the same for the FP16 source and every quant, and each quant's KL
divergence from FP16 and top-1 agreement on the same positions (factory/evaluation/kld.py).

Protocol: the eval text is tokenized once with the source's tokenizer, no BOS added, and cut into
non-overlapping windows of 2048 tokens (fewer if the model's max positions are fewer) from the start; the
first N windows are scored. CPU computes in fp32, CUDA in fp16. The FP16 source is scored with transformers, a
quant through its engine's loader (`Engine.load`: its own runtime, or a dequantization into transformers). The
FP16 evaluation keeps a compact reference of its distributions; a quant's evaluation reads it window by window.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from factory.checkpoints.files import write_atomic
from factory.checkpoints.inspection import multimodal, read_config
from factory.errors import SpecError
from factory.evaluation import kld, layered
from factory.evaluation.layered import ByLayer, Progress  # done, total, unit (a window, or a layer)

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


# How many tokens a prefix is read beyond those asked for: what a cut at a line's start can change in the ids before
# it (a pre-token, or whitespace merged across the cut) is a few tokens at most.
PREFIX_SLACK = 256


def tokenize(tokenizer_dir: Path, text: str, first: int | None = None) -> list[int]:
    """The text's token ids; with `first`, only its first `first` ids (all of them when the text holds fewer),
    read from the shortest prefix that holds them with PREFIX_SLACK to spare (cut where a line starts): the same ids
    as the whole text's, at a fraction of the cost (an eval of 8 windows reads about 2% of builtin:wiki's 2 MB)."""
    ids_of = _encoder(Path(tokenizer_dir))
    if first is not None:
        chars = 4 * (first + PREFIX_SLACK)
        while chars < len(text):
            cut = _line_start(text, chars)
            if cut > 0 and len(ids := ids_of(text[:cut])) >= first + PREFIX_SLACK:
                return ids[:first]
            chars *= 2
        return ids_of(text)[:first]
    return ids_of(text)


def _encoder(tokenizer_dir: Path) -> Callable[[str], list[int]]:
    """The checkpoint's own tokenizer: its tokenizer.json read by `tokenizers`, as the runtimes read it (exllamav3,
    llama.cpp's converter). transformers 5's AutoTokenizer rebuilds some families' tokenizers from the vocabulary
    with the class's own pre-tokenizer, normalizer and special tokens (Qwen2's adds `<|endoftext|>` past a
    vocabulary without it), so its ids can differ from the checkpoint's and pass the model's vocabulary. A
    checkpoint without tokenizer.json (a sentencepiece model only) is read through transformers."""
    if (tokenizer_dir / "tokenizer.json").is_file():
        own = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        return lambda part: own.encode(part, add_special_tokens=False).ids
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
    return lambda part: tokenizer(part, add_special_tokens=False)["input_ids"]


def _line_start(text: str, before: int) -> int:
    """The last place before `before` where a line starts with a character that is not whitespace (0: none)."""
    at = before
    while (at := text.rfind("\n", 0, at)) >= 0:
        if at + 1 < len(text) and not text[at + 1].isspace():
            return at + 1
    return 0


def cached_tokens(tokenizer_dir: Path, text: str, cache_file: Path, first: int | None = None) -> list[int]:
    """`tokenize`, kept in `cache_file` (named by identity.tokens_key, and `first`): a job's later passes (its
    publishing, a helping worker, a retry) and later jobs of the same source and text read the ids instead of
    tokenizing again, which is nearly all of an inspect step (2.5 s of 2.6 for the tiny model's texts on 2 cores)."""
    import numpy as np

    try:
        return np.load(cache_file).tolist()
    except (OSError, ValueError, EOFError):  # not there yet, or empty or cut short (a crash): made again
        pass
    ids = tokenize(tokenizer_dir, text, first)
    data = io.BytesIO()
    np.save(data, np.asarray(ids, dtype=np.int64))
    write_atomic(cache_file, data.getvalue())
    return ids


TOKENIZE_VERSION = 3  # raise it when `tokenize` changes how it calls the tokenizer: cached ids are made again


def tokenizer_version() -> str:
    """What decides a text's ids beside the tokenizer's files (which the source identity covers): the libraries
    that read those files, and `tokenize`."""
    return f"tokenizers {version('tokenizers')}, transformers {version('transformers')}, tokenize {TOKENIZE_VERSION}"


def window_length(max_positions: int | None) -> int:
    return min(WINDOW, max_positions or WINDOW)


def stream(ids: list[int], count: int, max_positions: int | None, name: str) -> Stream:
    length = window_length(max_positions)
    have = len(ids) // length
    if have < count:
        raise SpecError(f"eval text {name!r} holds {have} windows of {length} tokens, fewer than the {count} requested")
    return Stream([ids[i * length : (i + 1) * length] for i in range(count)])


Logits = Callable[["torch.Tensor"], "torch.Tensor"]  # token ids [1, L] on the CPU -> logits [1, L, V]
Model = Logits | ByLayer  # a whole model, called window by window, or one walked layer by layer over all windows
Loader = Callable[[Path, str], Model]  # (folder, device) -> Model


def score(
    model: Model,
    data: Stream,
    on_progress: Progress | None = None,
    reference: kld.Reference | None = None,
    keep: kld.Reference | None = None,
) -> tuple[float, kld.Divergence | None]:
    """Perplexity over the stream's windows; with `reference` (FP16's), the divergence from it on the same
    positions; with `keep`, this model's distributions are kept into it (the FP16 evaluation makes the reference)."""
    import torch

    total_nll, total_tokens = 0.0, 0
    kls, same = [], []
    with torch.inference_mode():
        if isinstance(model, ByLayer):
            every = model.logits(data.windows, on_progress)
        else:
            every = (model(torch.tensor([window])) for window in data.windows)
        for i, (window, logits) in enumerate(zip(data.windows, every, strict=True)):
            ids = torch.tensor(window)
            logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
            del logits
            total_nll -= logp.gather(-1, ids[1:, None].to(logp.device)).sum().item()
            total_tokens += len(window) - 1
            if keep is not None:
                keep.add(logp, i)
            if reference is not None:
                kl, agree = reference.divergence(logp, i)
                kls.append(kl)
                same.append(agree)
            del logp
            if on_progress:
                on_progress(i + 1, len(data.windows), "window")
    ppl = math.exp(total_nll / total_tokens) if math.isfinite(total_nll) else float("inf")
    return ppl, kld.summarize(kls, same) if reference is not None else None


def perplexity(model: Model, data: Stream, on_progress: Progress | None = None) -> float:
    return score(model, data, on_progress)[0]


def quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def torch_dtype(dev: str):
    import torch

    return torch.float16 if dev == "cuda" else torch.float32


def transformers_logits(model, dev: str) -> Logits:
    model = model.to(dev).eval()
    # no cache: a window is one forward, and a hybrid's cache of Mamba layers alone refuses to build a mask
    return lambda ids: model(ids.to(dev), use_cache=False).logits


def source_dtype(folder: Path, dev: str):
    """The unquantized model's precision: float16 on CUDA unless its config says bfloat16 (Gemma 3 overflows in
    float16: H200, 2026-12-01, perplexity inf), float32 on the CPU."""
    import torch

    config = read_config(Path(folder) / "config.json", check_numbers=False)
    if dev == "cuda" and (config.get("torch_dtype") or config.get("dtype")) == "bfloat16":
        return torch.bfloat16
    return torch_dtype(dev)


def auto_model(config: dict):
    """transformers' class for a checkpoint: a vision-language model's whole (scored on text: its language model with
    the vision tower idle), a text model's for causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if multimodal(config) else AutoModelForCausalLM


def load_fp16(folder: Path, dev: str) -> Model:
    """The source model: walked layer by layer where its architecture allows (factory/evaluation/layered.py: memory for
    one layer, not the model), else whole."""
    quiet_transformers()
    dtype = source_dtype(folder, dev)
    config = read_config(Path(folder) / "config.json", check_numbers=False)
    if layered.walkable(config):
        return ByLayer.of(folder, dev, dtype)
    model = auto_model(config).from_pretrained(folder, dtype=dtype, trust_remote_code=False)
    return transformers_logits(model, dev)


FP16_EVALUATOR = "transformers"


@dataclass(frozen=True)
class Result:
    ppl: float
    seconds: float
    evaluator: str
    device: str
    peak_gpu_bytes: int | None = None
    divergence: kld.Divergence | None = None  # from FP16, when scored against its reference


def evaluate(
    folder: Path,
    load: Loader,
    evaluator: str,
    data: Stream,
    on_progress: Progress | None = None,
    reference: kld.Reference | None = None,
    keep: kld.Reference | None = None,
) -> Result:
    """Perplexity of the model in `folder` through `load` (load_fp16, or an engine's loader), and its divergence
    from `reference`; `keep` collects this model's reference (see `score`)."""
    import torch

    dev = device()
    start = time.monotonic()
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = load(folder, dev)
    ppl, divergence = score(model, data, on_progress, reference, keep)
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else None
    del model
    return Result(
        ppl=ppl,
        seconds=time.monotonic() - start,
        evaluator=evaluator,
        device=dev,
        peak_gpu_bytes=peak,
        divergence=divergence,
    )
