"""Seconds against parameters for each unit kind (issue 44): every finished step of `cost_growth.json` (one point per
step and size), and the line the ETA's cost model draws for it (factory/engines/*/memory.py's first-principles
estimates, before the catalog has history: what `qf plan` says for a model it has not seen).

    python benchmarks/cost_plot.py [--json benchmarks/results/cost_growth.json] [--out docs/cost-growth.svg]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from factory import engines  # noqa: E402
from factory.jobs import eta  # noqa: E402

# unit family -> (engine, its unit kind): the conversions the cost model predicts
KINDS = {
    "measure": ("exl2", "measure"),
    "quantize:exl2": ("exl2", "quantize"),
    "quantize:exl3": ("exl3", "quantize"),
    "quantize:awq": ("awq", "quantize"),
    "quantize:awqct": ("awqct", "quantize"),
}


def parameters(shape: dict) -> int:
    """A random Llama's parameters from its shape (cost_growth.py's SHAPES): untied embedding and head, the
    decoder layers' projections and norms."""
    hidden, kv = shape["hidden"], shape["kv_heads"] * shape["hidden"] // shape["heads"]
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * shape["intermediate"] + 2 * hidden
    return 2 * shape["vocab"] * hidden + shape["layers"] * layer + hidden


def points(results: dict) -> dict[str, list[tuple[float, float]]]:
    """family -> [(billions of parameters, seconds)] of every finished step of that family."""
    out: dict[str, list[tuple[float, float]]] = {}
    for shape in results["shapes"].values():
        billions = parameters(shape["shape"]) / 1e9
        for job in shape["jobs"].values():
            for name, step in job["steps"].items():
                family = eta.family(name)
                if family in KINDS and step["state"] == "succeeded" and step["seconds"] and billions:
                    out.setdefault(family, []).append((billions, step["seconds"]))
    return out


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = points(results)
    fig, ax = plt.subplots(figsize=(8, 5))
    grid = [0.1 * 1.1**i for i in range(60)]
    for i, (family, (engine, kind)) in enumerate(KINDS.items()):
        colour = f"C{i}"
        memory = engines.get(engine).memory
        cores = memory.unit_cores(kind, "cuda")
        ax.plot(grid, [memory.unit_seconds(kind, int(b * 1e9), "cuda", cores) for b in grid], color=colour, lw=1)
        xs, ys = zip(*measured[family], strict=True) if family in measured else ((), ())
        ax.scatter(xs, ys, color=colour, label=f"{family} ({len(xs)} measured)", zorder=3)
    ax.set(xscale="log", yscale="log", xlabel="parameters (billions)", ylabel="seconds on one GPU")
    ax.set_title("Each unit's seconds against the model's size: measured (points), the cost model (lines)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, format="svg", metadata={"Date": None})
    print(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "cost_growth.json")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "cost-growth.svg")
    args = parser.parse_args()
    plot(json.loads(args.json.read_text()), args.out)


if __name__ == "__main__":
    main()
