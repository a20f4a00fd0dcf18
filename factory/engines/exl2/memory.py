"""GPU memory of an EXL2 quant with exllamav2 at a context length and KV-cache type, from config.json and safetensors
headers only (no weights read, no GPU): what `qf plan`, `--fit` and the "fits on" tables use.

EXL2 with exllamav2 on one GPU, as the drop of free memory a user sees, in parts:
  context   the CUDA context, cuBLAS and exllamav2's kernels: what the process holds outside PyTorch's allocator
            (CONTEXT_BYTES: 757 MiB in all 62 loads on two H200 machines, 527 MiB of it the bare context)
  weights   every tensor of the quant except the embedding, which exllamav2 keeps in system memory; exact from a
            quant's headers, else bpw/8 bytes per decoder linear weight, HEAD_STORED_BITS/8 per head weight
            (its bits plus scales) and 2 per norm weight
  scratch   exllamav2's fixed per-device scratch (ExLlamaV2.set_device_map): the largest module's
            scratch_space_fixed at max_input_len 2048
  tables    the rotary sin/cos tables for the context
  cache     K and V of every layer for the context: fp16 2 bytes per element, q8 1, q6 1 (K) and 0.5 (V), q4 0.5;
            quantized caches add fp16 scales per 32 elements and one layer of fp16 K/V to work in
  forward   the peak of a prefill chunk's attention without flash-attn (exllamav2's matmul path): two fp16 score
            tensors alive at once (heads x at most max_attention_size each: exllamav2 shrinks the chunk so that
            chunk x context stays under it), the mask, K expanded to every head over the context (grouped-query
            models), the chunk's hidden states and torch's cuBLAS workspace
  reserve   the caching allocator's blocks beyond the peak: SLACK of it, and once a prefill takes more than one
            chunk, one more score tensor (the chunks' growing K/V split the freed score blocks, so the next scores
            need a new one); at least RESERVE_MIN
The allocated peak this predicts is within 20 MiB of torch's in every load measured; the reserve is the rough part
(28 to 430 MiB measured), so a total can be a few percent below what a load takes: `plan` keeps HEADROOM free.
Measured without flash-attn; flash-attn allocates no score tensors, so with it the estimate is high.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal, get_args

from factory.checkpoints.inspection import read_config
from factory.engines.base import Memory, MemoryPlan
from factory.engines.exl2 import ranges
from factory.vram import (  # noqa: F401  (the shared pieces, here too for the arithmetic's tests and benchmark)
    CONTEXT_BYTES,
    HEADROOM,
    GiB,
    MiB,
    Params,
    Shape,
    best_bpw,
    human,
    parse_size,
    plan_room,
    source_shape,
    tensor_bytes,
    too_small,
)

MAX_INPUT_LEN = 2048  # exllamav2's defaults: tokens per forward chunk, attention scores per head, dequant elements
MAX_ATTENTION = 2048**2
MAX_DQ = 512 * 2**20
Cache = Literal["fp16", "q8", "q6", "q4"]  # exllamav2's KV-cache types, the one list of them
CACHES: tuple[str, ...] = get_args(Cache)
_CACHE_BYTES = {"fp16": (2.0, 2.0), "q8": (1.0, 1.0), "q6": (1.0, 0.5), "q4": (0.5, 0.5)}  # per K, V element
HEAD_STORED_BITS = {6: 6.48, 8: 8.04}  # what a head at 6 and 8 bits takes per weight with its scales (real quants)
BPWS = tuple(x / 2 for x in range(4, 17))  # 2.0 .. 8.0
FIT_BUDGETS = (8 * GiB, 12 * GiB, 16 * GiB, 24 * GiB, 48 * GiB)

# Measured on H200s (torch 2.11, CUDA 13; benchmarks/results/vram_fit.json).
CUBLAS_WORKSPACE = 32 * MiB  # torch's cuBLAS workspace on Hopper, inside its allocator
SLACK = 0.02  # the allocator's reserve over its peak, beyond the split score blocks (benchmarks/results/vram_fit.json)
RESERVE_MIN = 64 * MiB  # and at least this much: 28 to 109 MiB were measured for one-chunk prefills


def exl2_weights(params: Params, bpw: float, head_bits: int = 6) -> int:
    """Bytes on the GPU of an EXL2 quant that does not exist yet (the embedding stays in system memory)."""
    head = HEAD_STORED_BITS.get(head_bits, head_bits + 0.5)
    return int(params.linear * bpw / 8 + params.head * head / 8 + params.other * 2)


def on_gpu(groups: dict[str, int]) -> int:
    """Of a quant's tensor bytes by group, those exllamav2 puts on the GPU: all but the embedding."""
    return sum(n for group, n in groups.items() if group != "embed")


def quant_weights(folder: Path) -> int:
    """Bytes on the GPU of a finished EXL2 quant in `folder`."""
    return on_gpu(tensor_bytes(folder))


def cache_bytes(shape: Shape, ctx: int, cache: str) -> int:
    elements = ctx * shape.kv_heads * shape.head_dim  # of K (or V) in one layer
    k, v = _CACHE_BYTES[cache]
    total = shape.layers * elements * (k + v)
    if cache != "fp16":
        total += shape.layers * 2 * (elements // 32) * 2 + 2 * elements * 2  # scales; one fp16 layer to work in
    return int(total)


def scratch_bytes(shape: Shape) -> int:
    """exllamav2's fixed scratch: the largest module's scratch_space_fixed (attention, MLP, head)."""
    n, h, i = MAX_INPUT_LEN, shape.hidden, shape.intermediate
    q = shape.heads * shape.head_dim
    attn = n * max(q, h) * 2 + 2 * min(max(h * q, q * h, h * shape.kv_heads * shape.head_dim), MAX_DQ)
    mlp = n * h * 2 + 2 * n * max(h, i) * 2 + 2 * min(h * i, MAX_DQ)
    head = 2 * min(h * shape.vocab, MAX_DQ)
    return max(attn, mlp, head)


def score_bytes(shape: Shape, ctx: int) -> int:
    """One fp16 attention-score tensor of the largest prefill chunk: heads x chunk x context, at most
    max_attention_size per head."""
    return shape.heads * min(MAX_ATTENTION, min(MAX_INPUT_LEN, ctx) * ctx) * 2


def forward_bytes(shape: Shape, ctx: int) -> int:
    """The attention's peak in a prefill chunk (exllamav2's matmul attention, beyond the scratch): scores and their
    softmax (or scores plus mask) alive together with K expanded to every head; or, later, one score tensor with
    K and V expanded. Plus the mask, the chunk's hidden states and the cuBLAS workspace."""
    chunk = min(MAX_INPUT_LEN, ctx)
    scores = score_bytes(shape, ctx)
    expanded = ctx * shape.heads * shape.head_dim * 2 if shape.kv_heads != shape.heads else 0  # K or V
    attention = max(2 * scores + expanded, scores + 2 * expanded)
    mask = scores // max(shape.heads, 1)
    states = 3 * chunk * max(shape.hidden, shape.heads * shape.head_dim) * 2
    return attention + mask + states + CUBLAS_WORKSPACE


def tables_bytes(shape: Shape, ctx: int) -> int:
    return 2 * shape.head_dim * ctx * 2


def exllamav2(shape: Shape, weights: int, ctx: int, cache: str, gpus: int = 1) -> dict[str, int]:
    """The predicted drop of free GPU memory, in parts and in total; with several GPUs, on each of them (each its
    own context, scratch and forward buffers, a share of the weights and cache: an estimate, exllamav2's autosplit
    fills them in order)."""
    parts = {
        "context": CONTEXT_BYTES,
        "weights": weights // gpus,
        "scratch": scratch_bytes(shape),
        "tables": tables_bytes(shape, ctx),
        "cache": cache_bytes(shape, ctx, cache) // gpus,
        "forward": forward_bytes(shape, ctx),
    }
    allocated = sum(v for k, v in parts.items() if k != "context")
    split_scores = score_bytes(shape, ctx) if ctx > MAX_INPUT_LEN else 0
    parts["reserve"] = max(int(allocated * SLACK) + split_scores, RESERVE_MIN)
    parts["total"] = sum(parts.values())
    return parts


def plan(
    shape: Shape,
    params: Params,
    budget: int,
    ctx: int | None = None,
    cache: str = "fp16",
    gpus: int = 1,
    headroom: int = HEADROOM,
    head_bits: int = 6,
) -> dict:
    """Predicted peak for every bpw in [2.0, 8.0] and the highest that fits `budget` (per GPU) with `headroom`
    left; several GPUs split the layers evenly (an estimate: exllamav2's autosplit fills them in order)."""
    ctx, room = plan_room(shape, budget, ctx, cache, CACHES, gpus, headroom)

    def per_gpu(bpw: float) -> dict[str, int]:
        return exllamav2(shape, exl2_weights(params, bpw, head_bits), ctx, cache, gpus)

    rows = [{"bpw": b, **parts, "fits": parts["total"] <= room} for b in BPWS for parts in [per_gpu(b)]]
    best = best_bpw(lambda b: per_gpu(b)["total"], room, lowest=2.0)
    result = {
        "budget": budget,
        "gpus": gpus,
        "headroom": headroom,
        "ctx": ctx,
        "cache": cache,
        "rows": rows,
        "best_bpw": best,
        "estimate": gpus > 1,
    }
    if best is None:
        raise too_small(per_gpu(2.0)["total"], room, budget, headroom, ctx, cache, 2.0)
    return result


def fits_table(shape: Shape, weights: int, budgets=FIT_BUDGETS, caches=("fp16", "q4")) -> list[dict]:
    """For a finished quant: the longest context (of 2k, 4k, 8k, ... up to the model's maximum) that fits each
    budget with each cache type, with HEADROOM left."""
    contexts = [c for c in (2048, 4096, 8192, 16384, 32768, 65536, 131072) if c <= shape.max_positions]
    if shape.max_positions not in contexts:
        contexts.append(shape.max_positions)
    rows = []
    for budget in budgets:
        row = {"budget": budget}
        for cache in caches:
            fitting = [c for c in contexts if exllamav2(shape, weights, c, cache)["total"] <= budget - HEADROOM]
            row[cache] = max(fitting, default=None)
        rows.append(row)
    return rows


def quant_fits(folder: Path) -> list[dict]:
    """The "fits on" table of a finished EXL2 quant in `folder` (its config.json and safetensors headers)."""
    shape = Shape.of(read_config(folder / "config.json"))
    return fits_table(shape, quant_weights(folder))


RANGES_SLOWER = 1.6  # a range's seconds per billion over a serial measurement's (unit_seconds)


class Exl2Memory(Memory):
    """EXL2's part of an engine: the memory model above (`qf plan`, `--fit`, the card's "fits on" tables), and its
    units on an H200 (docs/measured.md): measurement 184-222 s and a pass 129-149 s at 1.1B; 84 s and 105 s at
    SmolLM2-135M."""

    sizes_to_budget = True
    runtimes = ("exllamav2", "tabbyapi")  # TabbyAPI's releases before its main branch dropped EXL2 (2026-07-14)
    UNIT_SECONDS = {"measure": (60.0, 130.0), "quantize": (90.0, 50.0)}  # the 8B: 963 s (serial), 460 s (4.0 bpw)

    def need(self, shape, params, spec, ctx: int, cache: str) -> tuple[int, int]:
        weights = exl2_weights(params, spec.bpw, spec.head_bits)
        return weights, exllamav2(shape, weights, ctx, cache)["total"]

    def sizes(self) -> list:
        return [self.engine.spec(bpw=b) for b in BPWS]

    def plan(self, shape, params, budget: int, ctx: int | None, cache: str, gpus: int) -> MemoryPlan:
        result, h = plan(shape, params, budget, ctx, cache, gpus), human  # the module's plan, above
        title = (
            f"EXL2 with exllamav2: {h(budget)}{f' x {gpus} GPUs (estimate)' if gpus > 1 else ''}, "
            f"{result['ctx']} tokens, {cache} cache, {h(result['headroom'])} left free"
        )
        return MemoryPlan.by_bpw(result, title, "EXL2", per_gpu=gpus > 1)

    def fit_budgets(
        self, source: str, budgets: str, ctx: int | None, cache: str, written: dict, note: Callable[[str], None]
    ) -> dict:
        """--fit 24GB,16GB -> the highest bpw whose predicted peak fits each budget, with the budget it was for."""
        shape, params = source_shape(source)
        sizes, fits = [], []
        for text in budgets.split(","):
            budget = parse_size(text)
            chosen = plan(shape, params, budget, ctx, cache, head_bits=written.get("head_bits", 6))
            bpw = chosen["best_bpw"]
            note(
                f"--fit {text.strip()}: EXL2 {bpw:.2f} bpw for {chosen['ctx']} tokens with a {cache} cache "
                f"({human(budget)}, {human(chosen['headroom'])} left free)"
            )
            sizes.append(bpw)
            fits.append({"vram": budget, "ctx": chosen["ctx"], "cache": cache})
        return {**written, "bpw": sizes, "fit": fits}

    def fits(self, folder: Path) -> list[dict] | None:
        return quant_fits(folder)

    def unit_gpu_bytes(self, kind: str, spec, shape, params) -> int:
        """The measurement tries every candidate bitrate of a layer: about 1.2 x a pass (1.1B on an H200: 2.4 GiB
        against 2.0), in each of its ranges' processes (factory/engines/exl2/ranges.py), each with its CUDA
        context."""
        one_pass = super().unit_gpu_bytes("quantize", spec, shape, params)
        if kind != "measure":
            return one_pass
        processes = ranges.processes(shape.layers)
        return int(one_pass * 1.2) * processes + (processes - 1) * CONTEXT_BYTES

    def unit_seconds(self, kind: str, parameters: int, device: str, cores: int, spec=None) -> float:
        """The measurement's ranges (one a core) run at once: its per-billion seconds shared among them, at 1.6
        times each (they share the card's SMs, and each range first runs the layers before it): the random 8B's four
        ranges took 440 s on an H100 beside an EXL3 conversion, against about 963 s for one serial measurement."""
        processes = min(cores, ranges.RANGES)
        if kind != "measure" or device != "cuda" or processes <= 1:
            return super().unit_seconds(kind, parameters, device, cores, spec)
        fixed, per_b = self.UNIT_SECONDS["measure"]
        return fixed + RANGES_SLOWER * per_b * parameters / 1e9 / processes

    def unit_cores(self, kind: str, device: str) -> int:
        """A process feeds the card from about one core: the measurement's ranges one each."""
        return ranges.RANGES if kind == "measure" and device == "cuda" else super().unit_cores(kind, device)
