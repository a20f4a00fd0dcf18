"""GGUF in llama.cpp, for `qf plan`, `--fit` and the card's Fits in table: each type's weights, the KV cache at the
context (llama.cpp's default f16 cache, q8_0 or q4_0), and its compute buffer, in RAM or VRAM alike (llama.cpp runs
from either; with every layer offloaded, all of it is on the GPU).

    weights   the decoder's linear weights and the embedding at the type's bits per weight (llama-quantize quantizes
              token_embd too), the output head at Q6_K's 6.56 (Q8_0 and the 16-bit types keep their own), norms f32
    cache     2 (K and V) x layers x context x KV heads x head dim x 2 bytes (f16), 34/32 (q8_0) or 18/32 (q4_0)
    compute   llama.cpp's graph for one micro-batch (512 tokens, fewer for a shorter context): its logits (the
              vocabulary) and the largest activation (the MLP's) in f32, and the attention mask (the context) in f16
    mmproj    a vision-language model's vision tower and projector at 16 bits (`mmproj`), said apart: llama.cpp loads
              it only to read images (--mmproj)

Checked against what llama.cpp allocates (its load log: the model, KV and compute buffers;
tests/support/llama_buffers.py, run by tests/integration/test_engine_gguf.py and tests/integration/test_smollm2.py):
the KV cache to the byte; the compute buffer of SmolLM2-135M 98.25, 102.51 and 98.25 MiB at 512, 2048 and 8192
tokens against 99.5, 101.0 and 107.0 estimated (its allocator reuses memory between the graph's phases, which a sum
over-counts), the tiny test model's 1.25 and 4.25 MiB at 256 and 2048 tokens against 1.38 and 4.5; the weights
within 10% of the file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from factory.engines.base import Memory, MemoryPlan
from factory.engines.gguf import gguf_file
from factory.engines.gguf.spec import LADDER, STANDARD, TYPES, GgufSpec
from factory.errors import SpecError
from factory.vram import HEADROOM, GiB, Params, Shape, human, parse_size, source_shape

HEAD_BITS = TYPES["Q6_K"][0]
UBATCH = 512
CACHE_BYTES = {"fp16": 2.0, "q8": 34 / 32, "q6": 34 / 32, "q4": 18 / 32}  # q6: llama.cpp has none, q8_0 it is


def weights(params: Params, type_: str) -> int:
    bits = TYPES[type_][0]
    head = bits if bits >= 8 else HEAD_BITS
    return int((params.linear + params.embed) * bits / 8 + params.head * head / 8 + params.other * 4)


def cache_bytes(shape: Shape, ctx: int, cache: str = "fp16") -> int:
    return int(2 * shape.layers * ctx * shape.kv_heads * shape.head_dim * CACHE_BYTES.get(cache, 2.0))


def compute_bytes(shape: Shape, ctx: int) -> int:
    return min(UBATCH, ctx) * (4 * (shape.vocab + max(shape.intermediate, shape.hidden)) + 2 * ctx)


def parts(shape: Shape, params: Params, type_: str, ctx: int, cache: str) -> dict[str, int]:
    return {
        "weights": weights(params, type_),
        "cache": cache_bytes(shape, ctx, cache),
        "compute": compute_bytes(shape, ctx),
    }


def plan(shape: Shape, params: Params, budget: int, ctx: int | None, cache: str, gpus: int) -> MemoryPlan:
    ctx = ctx or shape.max_positions
    room = budget * gpus - HEADROOM
    rows, data = [], []
    for type_ in sorted(TYPES, key=lambda t: -TYPES[t][0]):
        need = parts(shape, params, type_, ctx, cache)
        total = sum(need.values())
        data.append({"type": type_, **need, "total": total, "fits": total <= room})
        if type_ in STANDARD or total <= room:
            rows.append((type_, *(human(v) for v in need.values()), human(total), "yes" if total <= room else "no"))
    fits = {r["type"] for r in data if r["fits"]}
    best = next((t for t in LADDER if t in fits), None)
    title = (
        f"GGUF with llama.cpp (estimate): {human(budget)}{f' x {gpus}' if gpus > 1 else ''} of RAM or VRAM, {ctx} "
        f"tokens, {cache} cache, {human(HEADROOM)} left free"
    )
    lines = [f"best GGUF type that fits (of {', '.join(LADDER)}): {best}" if best else "no GGUF type fits"]
    if params.vision:  # not in the totals: llama.cpp loads it only for images (--mmproj)
        lines.append(
            f"GGUF's mmproj file (the vision tower and projector at 16 bits, for images: --mmproj): "
            f"{human(2 * params.vision)} more"
        )
    result = {"budget": budget, "gpus": gpus, "ctx": ctx, "cache": cache, "rows": data, "best_type": best}
    result["mmproj"] = 2 * params.vision
    return MemoryPlan(result, title, ("TYPE", "WEIGHTS", "CACHE", "COMPUTE", "TOTAL", "FITS"), rows, lines)


FIT_BUDGETS = tuple(g * GiB for g in (4, 8, 12, 16, 24, 32, 48, 64))  # RAM and VRAM sizes people have
FIT_CACHES = ("fp16", "q8")


def file_shape(meta: dict) -> Shape:
    """The model's shape as a GGUF file's metadata says it (`<arch>.block_count`, ...)."""

    def get(key: str, default: int = 0) -> int:
        value = meta.get(f"{meta['general.architecture']}.{key}") or default
        return max(value) if isinstance(value, list) else int(value)  # per-layer values (some families): the most

    hidden, heads = get("embedding_length"), get("attention.head_count")  # none in Mamba's: no KV cache
    tokens = meta.get("tokenizer.ggml.tokens", 0)
    return Shape(
        hidden=hidden,
        layers=get("block_count"),
        heads=heads,
        kv_heads=get("attention.head_count_kv", heads),
        head_dim=get("attention.key_length", hidden // heads if heads else 0),
        intermediate=get("feed_forward_length", 4 * hidden),
        vocab=len(tokens) if isinstance(tokens, list) else int(tokens),
        max_positions=get("context_length", 2048),
    )


def fits_table(folder: Path) -> list[dict]:
    """For a finished quant: the longest context (2k, 4k, 8k, ... up to the model's maximum) that fits each budget of
    RAM or VRAM with each KV cache, the file's bytes as its weights and HEADROOM left."""
    files = gguf_file.model_files(folder)
    shape, weights = file_shape(gguf_file.metadata(files[0])), sum(p.stat().st_size for p in files)
    contexts = sorted({c for c in (2048, 4096, 8192, 16384, 32768, 65536, 131072) if c < shape.max_positions})
    contexts.append(shape.max_positions)
    rows = []
    for budget in FIT_BUDGETS:
        row: dict = {"budget": budget}
        for cache in FIT_CACHES:
            room = budget - HEADROOM - weights
            row[cache] = max(
                (c for c in contexts if cache_bytes(shape, c, cache) + compute_bytes(shape, c) <= room), default=None
            )
        rows.append(row)
    return rows


class GgufMemory(Memory):
    """GGUF's part of an engine: the estimate above (`qf plan`), and its units: the 16-bit conversion (`convert`), the
    importance matrix (`imatrix`) and each llama-quantize (SmolLM2-135M on 2 cores: F16 in 3.5 s, Q4_K_M in 1.4 s)."""

    sizes_to_budget = True  # `--gguf fit --fit 16GB,8GB`
    # llama-imatrix on one CPU core: SmolLM2-135M's 128 x 512 tokens (2 x parameters FLOPs each) in 952 s on a busy
    # core, 2026-12-06 (docs/measured.md)
    IMATRIX_FLOPS_PER_CORE = 1.9e10
    UNIT_SECONDS = {"convert": (10.0, 30.0), "imatrix": (10.0, 30.0), "mmproj": (10.0, 30.0), "quantize": (10.0, 20.0)}
    CPU_CORE_SECONDS_PER_B = 200.0
    runtimes = ("llama.cpp", "ollama")

    def need(self, shape, params, spec, ctx: int, cache: str) -> tuple[int, int]:
        w = weights(params, spec.type)
        return w, w + cache_bytes(shape, ctx, cache) + compute_bytes(shape, ctx)

    def sizes(self) -> list:
        """Every type but the 16-bit ones (the FP16 model itself)."""
        return [self.engine.spec(type=t) for t in TYPES if TYPES[t][0] < 16]

    def plan(self, shape, params, budget: int, ctx: int | None, cache: str, gpus: int) -> MemoryPlan:
        return plan(shape, params, budget, ctx, cache, gpus)

    def fit_budgets(
        self, source: str, budgets: str, ctx: int | None, cache: str, written: dict, note: Callable[[str], None]
    ) -> dict:
        """--fit 16GB,8GB -> for each budget the best type of LADDER whose weights, KV cache and compute buffer fit
        it (RAM or VRAM alike), with the budget it was for (the spec's `fit`, on the card); SpecError where none
        does."""
        shape, params = source_shape(source)
        types, fits = [], []
        cache = "q8" if cache == "q6" else cache  # llama.cpp has no q6 cache; q8_0 it is (CACHE_BYTES)
        for text in budgets.split(","):
            budget = parse_size(text)
            chosen = plan(shape, params, budget, ctx, cache, 1).data
            if chosen["best_type"] is None:
                smallest = min(r["total"] for r in chosen["rows"] if r["type"] in LADDER)
                raise SpecError(
                    f"--fit {text.strip()}: no GGUF type fits {human(budget)} with {chosen['ctx']} tokens; "
                    f"{LADDER[-1]} needs {human(smallest + HEADROOM)}"
                )
            best = next(r for r in chosen["rows"] if r["type"] == chosen["best_type"])
            note(
                f"--fit {text.strip()}: GGUF {best['type']} for {chosen['ctx']} tokens with a {cache} cache "
                f"({human(best['total'])} of {human(budget)}, {human(HEADROOM)} left free)"
            )
            types.append(best["type"])
            fits.append({"memory": budget, "ctx": chosen["ctx"], "cache": cache})
        return {**written, "types": types, "fit": fits}

    def unit_seconds(self, kind: str, parameters: int, device: str, cores: int, spec=None) -> float:
        """On the CPU the importance matrix is a forward pass of the 16-bit model over its calibration tokens (the
        spec's chunks x context, by default 128 x 512), far more than a conversion or a llama-quantize."""
        if kind == "imatrix" and device != "cuda":
            fields = GgufSpec.model_fields
            chunks, ctx = (
                (spec.imatrix_chunks, spec.imatrix_ctx)
                if isinstance(spec, GgufSpec)
                else (fields["imatrix_chunks"].default, fields["imatrix_ctx"].default)
            )
            tokens = chunks * ctx
            return 10.0 + 2.0 * parameters * tokens / (self.IMATRIX_FLOPS_PER_CORE * max(cores, 1))
        return super().unit_seconds(kind, parameters, device, cores, spec)

    def fits(self, folder: Path) -> list[dict] | None:
        return fits_table(folder) if gguf_file.model_files(folder) else None

    def unit_gpu_bytes(self, kind: str, spec, shape, params) -> int:
        """The converter and llama-quantize work on the CPU; the importance matrix runs the 16-bit model (on the GPU
        with CUDA)."""
        return params.total * 2 + compute_bytes(shape, spec.imatrix_ctx) if kind == "imatrix" else 0
