"""AWQ w4 served by vLLM, for `qf plan` (AutoAWQ's and AWQ-CT's quants alike): an estimate (not measured here) of
fp16 embedding and head, 4-bit linears with fp16 scales and 4-bit zeros per group, a vision-language model's vision
tower and projector in fp16, the KV cache for the context in fp16 or fp8, the context, CUDA graphs and activations,
and vLLM's own rule that it uses at most gpu_memory_utilization (0.9) of the card."""

from __future__ import annotations

from pathlib import Path

from factory.checkpoints.inspection import read_config
from factory.engines.base import Memory, MemoryPlan
from factory.vram import CONTEXT_BYTES, HEADROOM, GiB, MiB, Params, Shape, human

FIT_BUDGETS = (8 * GiB, 12 * GiB, 16 * GiB, 24 * GiB, 48 * GiB)  # the card sizes EXL2's "fits on" tables use


def vllm_awq(shape: Shape, params: Params, ctx: int, kv: str = "fp16", group: int = 128) -> dict[str, int]:
    """An estimate for vLLM serving AWQ w4 (not measured): weights (the language model's), the vision tower's,
    KV cache, context, CUDA graphs, activations; vLLM takes at most 0.9 of the card, so the budget it needs is
    total / 0.9."""
    weights = int(params.linear * (4 + (16 + 4) / group) / 8 + (params.embed + params.head + params.other) * 2)
    kv_bytes = 2 * shape.layers * ctx * shape.kv_heads * shape.head_dim * (1 if kv == "fp8" else 2)
    activations = 2048 * max(shape.intermediate, shape.vocab) * 4 * 2
    parts = {
        "context": CONTEXT_BYTES,
        "weights": weights,
        "vision": params.vision * 2,
        "cache": kv_bytes,
        "cuda_graphs": 512 * MiB,
        "activations": activations,
    }
    parts["total"] = sum(parts.values())
    parts["budget_needed"] = int(parts["total"] / 0.9)
    return parts


def plan(label: str, shape: Shape, params: Params, budget: int, ctx: int | None, gpus: int) -> MemoryPlan:
    """`qf plan`'s numbers by KV cache and its lines: what vLLM needs, and of what."""
    ctx = ctx or shape.max_positions
    estimates = {kv: vllm_awq(shape, params, ctx, kv) for kv in ("fp16", "fp8")}
    lines = []
    for kv, e in estimates.items():
        fits = "fits" if e["budget_needed"] <= budget * gpus else "does not fit"
        vision = f", vision tower and projector {human(e['vision'])} (16-bit)" if e["vision"] else ""
        lines.append(
            f"{label} w4 with vLLM, {kv} KV cache (estimate): needs about {human(e['budget_needed'])} at "
            f"gpu_memory_utilization 0.9, {fits}: language model {human(e['weights'])}{vision}, KV cache "
            f"{human(e['cache'])} for {ctx} tokens"
        )
    return MemoryPlan(estimates, lines=lines)


def fits_table(shape: Shape, weights: int, budgets=FIT_BUDGETS) -> list[dict]:
    """For a finished quant whose files hold `weights` bytes: the longest context (2k, 4k, 8k, ... up to the model's
    maximum) vLLM holds on each card size with an fp16 and an fp8 KV cache, by `vllm_awq`'s estimate of the rest,
    with HEADROOM left and vLLM's 0.9 of the card."""
    contexts = [c for c in (2048, 4096, 8192, 16384, 32768, 65536, 131072) if c <= shape.max_positions]
    if shape.max_positions not in contexts:
        contexts.append(shape.max_positions)
    none = Params(embed=0, head=0, linear=0, other=0)
    rows = []
    for budget in budgets:
        row = {"budget": budget}
        for kv in ("fp16", "fp8"):
            rest = {c: vllm_awq(shape, none, c, kv)["total"] for c in contexts}  # all but the weights
            row[kv] = max((c for c in contexts if (weights + rest[c]) / 0.9 <= budget - HEADROOM), default=None)
        rows.append(row)
    return rows


class VllmMemory(Memory):
    """The memory part of an engine whose quants vLLM serves as AWQ w4 (AutoAWQ's, AWQ-CT's): `qf plan` as above,
    and the card's "fits on" table of a finished quant (its config and the bytes of its weight files)."""

    runtimes = ("vllm", "transformers")  # the estimate is vLLM's

    def need(self, shape, params, spec, ctx: int, cache: str) -> tuple[int, int]:
        """vLLM's KV cache is fp16 or fp8: any quantized cache asked for counts as fp8."""
        e = vllm_awq(shape, params, ctx, "fp16" if cache == "fp16" else "fp8", spec.group_size or 128)
        return e["weights"] + e["vision"], e["budget_needed"]

    def plan(self, shape, params, budget: int, ctx: int | None, cache: str, gpus: int) -> MemoryPlan:
        return plan(self.engine.label, shape, params, budget, ctx, gpus)  # the module's plan, above

    def fits(self, folder: Path) -> list[dict] | None:
        weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        if not weights or not (folder / "config.json").is_file():
            return None
        return fits_table(Shape.of(read_config(folder / "config.json")), weights)


class AwqMemory(VllmMemory):
    # w4 g128 with clipping, 128 x 512 on an H100, beside the other units of benchmarks/cost_growth.py (sitting 4,
    # 2026-12-06): 365 s at the random 1.1B, 574 s at the 3B (620 s in sitting 5, beside three other jobs), 780 s at
    # the 8B (7.24B; 20 to 24 s a layer at every size, its SMs 1-17% busy: the grid search is bound by its launches
    # and the CPU, not by the card). Alone on an H200 the 1.1B took 113 s (2026-12-01), SmolLM2-135M 68 s. 310 s at
    # one billion, growing as the square root: -11% at 1.1B, -6% and -13% at 3B, +7% at 8B; SmolLM2 114 s.
    UNIT_SECONDS = {"quantize": (0.0, 310.0)}
    GROWTH = 0.5
