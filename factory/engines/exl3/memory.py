"""GPU memory of an EXL3 quant with exllamav3 1.6.5 at a context length and KV-cache type, from config.json and
safetensors headers only (no weights read, no GPU): what `qf plan` says for EXL3.

EXL3 with exllamav3 on one GPU, as the GPU's used memory a user sees, in parts (the same kind of model as EXL2's):
  context   the CUDA context, cuBLAS, flash-attn and exllamav3's kernels and buffers outside PyTorch's allocator
            (CONTEXT: 729 MiB in every load measured, 527 MiB of it the bare context)
  weights   every tensor but the embedding, which exllamav3 keeps in system memory: a decoder linear weight at bpw/8
            bytes per weight, the head at head_bits/8, norms at 2; exllamav3's loader carves each tensor of up to
            16 MiB out of 128 MiB slab blocks (its load arena), so those add up to whole blocks
  cache     K and V of every layer for the context: fp16 2 bytes per element; quantized, the bits per element (in
            int32 words) and an fp16 scale per 32 elements, and one layer in fp16 to work in
  scratch   a prefill chunk's work (exllamav3 prefills 2048 tokens at a time): its hidden states, attention and MLP
            activations (CHUNK x (2 hidden + 3 q + 2 intermediate) fp16 values) and SCRATCH_FIXED
  reserve   the caching allocator's blocks beyond its peak: SLACK of it, at least RESERVE_MIN
  vision    a vision-language model's vision tower and projector, at 16 bits (not measured: its own model, which
            exllamav3 loads beside the language model to read images)
Measured on an H200 (torch 2.11, CUDA 13; benchmarks/results/h200-2026-12-02/vram_fit_gemma_exl3.json): Gemma-3-270M
at 2.0-6.0 bpw, 2k to 32k tokens, fp16 and q4 caches: every prediction within 64 MiB (+2.1 to +3.9%; -5.0% at 2k
with an fp16 cache) of what nvidia-smi showed. One shape only so far, so the fixed terms are its numbers; the
random 1.1B Llama's loads are the next measurement.
"""

from __future__ import annotations

import math
from pathlib import Path

from factory.checkpoints.inspection import read_header
from factory.engines.base import Memory, MemoryPlan
from factory.engines.exl3.spec import MEASURE_KLD
from factory.vram import HEADROOM, MiB, Params, Shape, best_bpw, human, plan_room, too_small

CONTEXT = 729 * MiB
SLAB, SLAB_MAX_TENSOR = 128 * MiB, 16 * MiB  # exllamav3's loader: ARENA_BLOCK, ARENA_MAX_TENSOR
CHUNK = 2048  # tokens per prefill forward (its generator's max_chunk_size)
SCRATCH_FIXED = 60 * MiB  # fitted: Gemma at 8k+ and with q4 needs ~52, with fp16 at 2k ~140 (not understood)
SLACK, RESERVE_MIN = 0.02, 24 * MiB  # 9 to 23 MiB measured
CACHES = ("fp16", "q8", "q6", "q4")  # qN: N bits for K and for V (exllamav3 takes 2 to 8)
BPWS = tuple(x / 2 for x in range(2, 17))  # 1.0 .. 8.0


def slabbed(sizes: list[int]) -> int:
    """Bytes on the GPU of tensors of these sizes as exllamav3 loads them."""
    small = sum(n for n in sizes if n <= SLAB_MAX_TENSOR)
    return sum(n for n in sizes if n > SLAB_MAX_TENSOR) + math.ceil(small / SLAB) * SLAB


def layer_linears(shape: Shape) -> list[int]:
    """Weights of each linear of a dense decoder layer: q, k, v, o, gate, up, down."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return [
        shape.hidden * q,
        shape.hidden * kv,
        shape.hidden * kv,
        q * shape.hidden,
        *[shape.hidden * shape.intermediate] * 3,
    ]


def dense_params(shape: Shape) -> Params:
    """A dense decoder's parameter counts from its shape alone (an untied head; four norms a layer)."""
    return Params(
        embed=shape.vocab * shape.hidden,
        head=shape.vocab * shape.hidden,
        linear=shape.layers * sum(layer_linears(shape)),
        other=(4 * shape.layers + 1) * shape.hidden,
    )


def exl3_weights(shape: Shape, params: Params, bpw: float, head_bits: int = 6) -> int:
    """Bytes on the GPU of an EXL3 quant that does not exist yet. Where the checkpoint's linear weights are not a
    dense decoder's (experts), each layer's share of them counts as one tensor per dense linear's size."""
    dense = layer_linears(shape)
    scale = params.linear / (shape.layers * sum(dense)) if shape.layers and sum(dense) else 1.0
    linears = [int(n * scale * bpw / 8) for n in dense] * shape.layers
    return slabbed([*linears, int(params.head * head_bits / 8), params.other * 2])


def quant_weights(tensors: dict[str, int]) -> int:
    """Bytes on the GPU of a finished quant, from its tensors' sizes by name (safetensors headers)."""
    return slabbed([n for name, n in tensors.items() if "embed_tokens" not in name])


def quant_tensor_sizes(folder: Path) -> dict[str, int]:
    return {
        name: info["data_offsets"][1] - info["data_offsets"][0]
        for shard in sorted(folder.glob("*.safetensors"))
        for name, info in read_header(shard).items()
    }


def cache_bytes(shape: Shape, ctx: int, cache: str) -> int:
    elements = ctx * shape.kv_heads * shape.head_dim  # of K (or V) in one layer
    if cache == "fp16":
        return shape.layers * 2 * elements * 2
    bits = int(cache.removeprefix("q"))
    return shape.layers * 2 * (elements * bits // 8 + elements // 32 * 2) + 2 * elements * 2


def scratch_bytes(shape: Shape) -> int:
    values = 2 * shape.hidden + 3 * shape.heads * shape.head_dim + 2 * shape.intermediate
    return CHUNK * values * 2 + SCRATCH_FIXED


def exllamav3(shape: Shape, weights: int, ctx: int, cache: str, vision: int = 0) -> dict[str, int]:
    """The predicted GPU memory in use, in parts and in total."""
    parts = {
        "context": CONTEXT,
        "weights": weights,
        "cache": cache_bytes(shape, ctx, cache),
        "scratch": scratch_bytes(shape),
        "vision": vision,
    }
    parts["reserve"] = max(int(SLACK * (parts["weights"] + parts["cache"] + parts["scratch"])), RESERVE_MIN)
    parts["total"] = sum(parts.values())
    return parts


def same_weights(result: dict) -> str | None:
    """Why a plan's weights do not grow with the bits, where they do not: a model whose tensors are all up to
    SLAB_MAX_TENSOR and weigh less than a block at 8.0 bpw takes the same blocks at every size (Gemma-3-270M peaked
    the same at 2.0 to 6.0 bpw, benchmarks/results/h200-2026-12-02). Not a flaw of the model: exllamav3 does that."""
    if len({r["weights"] for r in result["rows"]}) != 1:
        return None
    return (
        f"EXL3 weights the same at every size: exllamav3 loads tensors of up to {SLAB_MAX_TENSOR // MiB} MiB into "
        f"{SLAB // MiB} MiB blocks"
    )


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
    """Predicted use for every bpw in [1.0, 8.0] and the highest that fits `budget` with `headroom` left (one GPU:
    exllamav3 splits over several, but this model has not been measured there)."""
    ctx, room = plan_room(shape, budget, ctx, cache, CACHES, 1, headroom)

    def parts(bpw: float) -> dict[str, int]:
        return exllamav3(shape, exl3_weights(shape, params, bpw, head_bits), ctx, cache, params.vision * 2)

    rows = [{"bpw": b, **p, "fits": p["total"] <= room} for b in BPWS for p in [parts(b)]]
    best = best_bpw(lambda b: parts(b)["total"], room, lowest=1.0)
    if best is None:
        raise too_small(parts(1.0)["total"], room, budget, headroom, ctx, cache, 1.0)
    return {
        "budget": budget,
        "gpus": 1,
        "headroom": headroom,
        "ctx": ctx,
        "cache": cache,
        "rows": rows,
        "best_bpw": best,
    }


class Exl3Memory(Memory):
    """EXL3's part of an engine: the memory model above (`qf plan`), and its units: 156 s at 1.1B on an H200, 90-93 s
    at Gemma-3-270M (its 262k-word head), 538 s at the random 3B on an H100 beside a second conversion, 919 s at the
    random 8B alone on an H100 (29 s a layer; 2026-12-07, benchmarks/results/gpu-2026-12-06/sitting6/): 20 + 138 s a
    billion, +10% at 1.1B, -19% at 3B, +11% at 8B (10 + 148 before the 8B ran whole: +18% there).
    An optimized size's measurement (MEASURE_KLD): exllamav3's measure runs every module of the source and of three
    quants once, and each group of tensors it tries (two per group at three inputs) through every module after it,
    on 10 x 1024 tokens, moving each state to the CPU and back. Measured on an H100 (2026-12-06,
    benchmarks/results/gpu-2026-12-06-exl3opt/): 19.6 s for the 4-layer tiny Llama, 94.4 s for Gemma-3-270M (0.44
    billion parameters as counted here, its 262k-word embedding and head twice): 20 s and 170 s a billion. Its quant
    is an assembly of the measured quants' tensors (5-8 s), which the ETA predicts as a conversion (it shares
    quantize:exl3's history)."""

    UNIT_SECONDS = {"quantize": (20.0, 138.0), MEASURE_KLD: (20.0, 170.0)}
    runtimes = ("exllamav3", "tabbyapi")

    def need(self, shape, params, spec, ctx: int, cache: str) -> tuple[int, int]:
        weights = exl3_weights(shape, params, spec.bpw, spec.head_bits)
        return weights, exllamav3(shape, weights, ctx, cache, params.vision * 2)["total"]

    def sizes(self) -> list:
        return [self.engine.spec(bpw=b) for b in BPWS]

    def plan(self, shape, params, budget: int, ctx: int | None, cache: str, gpus: int) -> MemoryPlan:
        if gpus > 1:
            return MemoryPlan(
                {"gpus": gpus, "best_bpw": None},
                lines=["EXL3: no estimate for several GPUs yet (its memory model is one card's)"],
            )
        result, h = plan(shape, params, budget, ctx, cache), human  # the module's plan, above
        title = (
            f"EXL3 with exllamav3: {h(budget)}, {result['ctx']} tokens, {cache} cache, "
            f"{h(result['headroom'])} left free"
        )
        told = MemoryPlan.by_bpw(result, title, "EXL3", per_gpu=False)
        if note := same_weights(result):
            told.lines.append(note)
        if vision := result["rows"][0]["vision"]:
            told.lines.append(f"EXL3's OTHER holds the vision tower and projector at 16 bits: {h(vision)}")
        return told

    def unit_cores(self, kind: str, device: str) -> int:
        """exllamav3's conversion keeps about 8 cores busy (on 16 cores two at once took 219 s, one 156 s); its
        measure is one process that feeds the card a module at a time."""
        if device != "cuda":
            return super().unit_cores(kind, device)
        return 1 if kind == MEASURE_KLD else 8
