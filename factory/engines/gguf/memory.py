"""GGUF in llama.cpp, for `qf plan`: an estimate (not yet checked against measured memory) of each type's weights, the
KV cache at the context (llama.cpp's default f16 cache, q8_0 or q4_0), and its compute buffer, in RAM or VRAM alike
(llama.cpp runs from either; with every layer offloaded, all of it is on the GPU).

    weights   the decoder's linear weights and the embedding at the type's bits per weight (llama-quantize quantizes
              token_embd too), the output head at Q6_K's 6.56 (Q8_0 and the 16-bit types keep their own), norms f32
    cache     2 (K and V) x layers x context x KV heads x head dim x 2 bytes (f16) 34/32 (q8_0) or 18/32 (q4_0)
    compute   llama.cpp's graph for one 512-token batch: the batch's logits (vocab x 4 bytes each) and the largest
              activation (the MLP's, 4 bytes each), twice over
"""

from __future__ import annotations

from factory.engines.base import Memory, MemoryPlan
from factory.engines.gguf.spec import STANDARD, TYPES
from factory.vram import HEADROOM, Params, Shape, human

HEAD_BITS = TYPES["Q6_K"][0]
UBATCH = 512
CACHE_BYTES = {"fp16": 2.0, "q8": 34 / 32, "q6": 34 / 32, "q4": 18 / 32}  # q6: llama.cpp has none, q8_0 it is


def weights(params: Params, type_: str) -> int:
    bits = TYPES[type_][0]
    head = bits if bits >= 8 else HEAD_BITS
    return int((params.linear + params.embed) * bits / 8 + params.head * head / 8 + params.other * 4)


def cache_bytes(shape: Shape, ctx: int, cache: str = "fp16") -> int:
    return int(2 * shape.layers * ctx * shape.kv_heads * shape.head_dim * CACHE_BYTES.get(cache, 2.0))


def compute_bytes(shape: Shape) -> int:
    return 2 * UBATCH * (shape.vocab + max(shape.intermediate, shape.hidden)) * 4


def plan(shape: Shape, params: Params, budget: int, ctx: int | None, cache: str, gpus: int) -> MemoryPlan:
    ctx = ctx or shape.max_positions
    room = budget * gpus - HEADROOM
    rows, data = [], []
    for type_ in sorted(TYPES, key=lambda t: -TYPES[t][0]):
        parts = {"weights": weights(params, type_), "cache": cache_bytes(shape, ctx, cache)}
        parts["compute"] = compute_bytes(shape)
        total = sum(parts.values())
        data.append({"type": type_, **parts, "total": total, "fits": total <= room})
        if type_ in STANDARD or total <= room:
            rows.append((type_, *(human(parts[k]) for k in parts), human(total), "yes" if total <= room else "no"))
    best = next((r["type"] for r in data if r["fits"]), None)
    title = (
        f"GGUF with llama.cpp (estimate): {human(budget)}{f' x {gpus}' if gpus > 1 else ''} of RAM or VRAM, {ctx} "
        f"tokens, {cache} cache, {human(HEADROOM)} left free"
    )
    lines = [f"largest GGUF type that fits: {best}" if best else "no GGUF type fits"]
    result = {"budget": budget, "gpus": gpus, "ctx": ctx, "cache": cache, "rows": data, "best_type": best}
    return MemoryPlan(result, title, ("TYPE", "WEIGHTS", "CACHE", "COMPUTE", "TOTAL", "FITS"), rows, lines)


class GgufMemory(Memory):
    """GGUF's part of an engine: the estimate above (`qf plan`), and its units: the conversion and importance matrix
    (`measure`) and each llama-quantize (SmolLM2-135M on 2 cores: F16 in 3.5 s, Q4_K_M in 1.4 s)."""

    UNIT_SECONDS = {"measure": (20.0, 60.0), "quantize": (10.0, 20.0)}
    CPU_CORE_SECONDS_PER_B = 200.0
    runtimes = ("llama.cpp", "ollama")

    def need(self, shape, params, spec, ctx: int, cache: str) -> tuple[int, int]:
        w = weights(params, spec.type)
        return w, w + cache_bytes(shape, ctx, cache) + compute_bytes(shape)

    def sizes(self) -> list:
        """Every type but the 16-bit ones (the FP16 model itself)."""
        return [self.engine.spec(type=t) for t in TYPES if TYPES[t][0] < 16]

    def plan(self, shape, params, budget: int, ctx: int | None, cache: str, gpus: int) -> MemoryPlan:
        return plan(shape, params, budget, ctx, cache, gpus)

    def unit_gpu_bytes(self, kind: str, spec, shape, params) -> int:
        """llama-quantize works on the CPU; the importance matrix runs the 16-bit model (on the GPU with CUDA)."""
        return params.total * 2 + compute_bytes(shape) if kind == "measure" else 0
