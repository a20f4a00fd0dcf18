"""What every memory model shares: sizes as people write them, a model's shape and parameter counts from config.json
and safetensors headers only (no weights read, no GPU), and the headroom left free on a card. Each engine's model
of its runtime's memory lives in its package (factory/engines/<method>/memory.py, behind Engine.memory.plan), and
`qf plan`, `--fit` and the cards' "fits on" tables ask the engines.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from factory.checkpoints import sources
from factory.checkpoints.inspection import VISION_PART, layout_info, read_header
from factory.errors import SpecError

if TYPE_CHECKING:
    from factory.checkpoints.inspection import ModelInfo

GiB, MiB = 2**30, 2**20
# The CUDA context, cuBLAS and the kernels a runtime loads: what a process holds outside PyTorch's allocator,
# measured on H200s (torch 2.11, CUDA 13; benchmarks/results/vram_fit.json): 757 MiB in all 62 loads, 527 MiB of
# it the bare context. Another GPU or driver has another size: a few hundred MiB either way.
CONTEXT_BYTES = 757 * MiB
HEADROOM = 512 * MiB  # left free on the card: the desktop, other processes, fragmentation


def parse_size(text: str) -> int:
    """'24GB', '24 GiB', '24G', '12288MB' -> bytes. GB means GiB, as GPU makers count it (a 24GB card has 24 GiB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(G|GB|GiB|M|MB|MiB|T|TB|TiB)\s*", text, flags=re.I)
    if not m:
        raise SpecError(f"size {text!r} is not a number with a unit (GB or MB), e.g. 24GB")
    value, unit = float(m[1]), m[2][0].upper()
    if value <= 0:
        raise SpecError(f"size {text!r} must be more than zero")
    return int(value * {"M": MiB, "G": GiB, "T": 1024 * GiB}[unit])


def human(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int

    @classmethod
    def of(cls, config: dict) -> Shape:
        heads = config.get("num_attention_heads") or 0  # none in an attention-free model: no KV cache
        return cls(
            hidden=config["hidden_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or (config["hidden_size"] // heads if heads else 0),
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
            max_positions=config.get("max_position_embeddings") or 2048,
        )


@dataclass(frozen=True)
class Params:
    """Parameter counts by group, from the FP16 checkpoint's safetensors headers."""

    embed: int
    head: int  # the output head; a tied head counts here too (exllamav2 and vLLM both hold one)
    linear: int  # the decoder's linear weights, fused experts' too (what a bits-per-weight engine quantizes at bpw)
    other: int  # norms, biases
    vision: int = 0  # a vision-language model's vision tower and projector (kept at 16 bits)

    @property
    def total(self) -> int:
        return self.embed + self.head + self.linear + self.other + self.vision

    @classmethod
    def of(cls, tensors: dict[str, list[int]], shape: Shape) -> Params:
        groups = {"embed": 0, "head": 0, "linear": 0, "other": 0, "vision": 0}
        for name, dims in tensors.items():
            n = math.prod(dims)
            group = (
                "vision"
                if VISION_PART.match(name)
                else "embed"
                if "embed_tokens" in name
                else "head"
                if name.startswith(("lm_head", "language_model.lm_head"))
                else "linear"
                if len(dims) == 2 or (len(dims) == 3 and ".experts." in name)  # experts fused in one tensor
                else "other"
            )
            groups[group] += n
        groups["head"] = groups["head"] or shape.vocab * shape.hidden
        return cls(**groups)


def plan_room(
    shape: Shape, budget: int, ctx: int | None, cache: str, caches: tuple[str, ...], gpus: int, headroom: int
) -> tuple[int, int]:
    """A memory plan's context (the model's maximum by default) and the room it fills, or one sentence on why
    the question cannot be answered."""
    ctx = ctx or shape.max_positions
    if ctx > shape.max_positions:
        raise SpecError(f"a context of {ctx} tokens is more than the model's {shape.max_positions} positions")
    if cache not in caches:
        raise SpecError(f"KV cache {cache!r} is not one of {', '.join(caches)}")
    if gpus < 1:
        raise SpecError("--gpus must be at least 1")
    room = budget - headroom
    if room <= 0:
        raise SpecError(f"a budget of {human(budget)} leaves nothing after {human(headroom)} of headroom")
    return ctx, room


def best_bpw(total: Callable[[float], int], room: int, lowest: float, highest: float = 8.0) -> float | None:
    """The highest bits per weight, in steps of 0.05, whose predicted peak `total(bpw)` fits `room`."""
    steps = round((highest - lowest) / 0.05)
    return next((b for i in range(steps + 1) if total(b := round(highest - i * 0.05, 2)) <= room), None)


def too_small(need: int, room: int, budget: int, headroom: int, ctx: int, cache: str, lowest: float) -> SpecError:
    return SpecError(
        f"even {lowest:.1f} bpw needs {human(need)} with a {ctx}-token {cache} cache, "
        f"{human(need - room)} more than {human(budget)} minus {human(headroom)} of headroom"
    )


def tensor_bytes(folder: Path) -> dict[str, int]:
    """A finished quant's tensor bytes by group (embed, head, layers, vision, other), from its safetensors headers."""
    groups: dict[str, int] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        for name, info in read_header(shard).items():
            begin, end = info["data_offsets"]
            group = (
                "vision"
                if VISION_PART.match(name)
                else "embed"
                if "embed_tokens" in name
                else "head"
                if "lm_head" in name
                else "layers"
                if ".layers." in name
                else "other"
            )
            groups[group] = groups.get(group, 0) + end - begin
    return groups


def source_shape(source: str) -> tuple[Shape, Params]:
    """Shape and parameter counts of an FP16 checkpoint, a local folder or a Hub repo (config and headers only)."""
    shape, params, _ = source_model(source)
    return shape, params


def source_model(source: str) -> tuple[Shape, Params, ModelInfo]:
    """source_shape, and what the engines' `refuse` reads of the checkpoint (`qf plan` leaves out the engines that
    refuse it, with their reason)."""
    config, tensors = sources.layout(source)
    shape = Shape.of(config)
    return shape, Params.of(tensors, shape), layout_info(config, tensors)
