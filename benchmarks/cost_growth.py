"""How a job's cost grows with the model (CUDA): the EXL2 measurement and one quant pass of the random 1.1B
Llama, then of the same Llama scaled to a 3B shape (hidden 3072, 28 layers, 24 heads), in one FACTORY_HOME one
after the other. A shape within jobs/eta.py's BUCKET (2x in parameters) of an earlier one would be predicted from its
history, as a fleet's would; the 3B has 2.73x the 1.1B's parameters, so each shape's expected seconds are the
engine's first-principles estimate (Engine.memory.unit_seconds), and this checks that estimate at two sizes. The shapes
can therefore run in different sittings (`--shapes 3b`) without changing what is predicted.

    python benchmarks/cost_growth.py DIR [--bpw 4.0] [--windows 8] [--shapes 1.1b,3b] [--out OUT.json]

Records for each shape: its parameters, each step's seconds, peak GPU memory and what the ETA expected of it
(`expected_seconds`, from the step's running event), and the ratio of actual to expected for the measurement and
the pass. A shape already in OUT from an earlier sitting is kept (a run replaces only the shapes it runs).
Results in the shape of docs/measured.md (default benchmarks/results/cost_growth.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.packing import side  # noqa: E402
from tests.tiny_model import LLAMA_1B  # noqa: E402

SHAPES = {"1.1b": LLAMA_1B, "3b": {**LLAMA_1B, "hidden": 3072, "layers": 28, "heads": 24}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path)
    parser.add_argument("--bpw", default="4.0")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--shapes", default="1.1b,3b")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cost_growth.json")
    args = parser.parse_args()
    import torch

    from factory.checkpoints import sources
    from factory.vram import Params, Shape
    from tests.tiny_model import make_tiny_llama

    sitting = {
        "gpu": torch.cuda.get_device_name(0),
        "versions": {"torch": torch.__version__},
        "command": f"python benchmarks/cost_growth.py DIR --bpw {args.bpw} --windows {args.windows} "
        f"--shapes {args.shapes}",
        "commit": os.environ.get("QF_COMMIT")
        or subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
    }
    # shapes measured in an earlier sitting stay (each says its own sitting)
    results = json.loads(args.out.read_text()) if args.out.is_file() else {"shapes": {}}
    for name in args.shapes.split(","):
        model = args.dir / f"llama-{name}"
        if not (model / "config.json").is_file():
            make_tiny_llama(model, device="cuda", **SHAPES[name])
            torch.cuda.empty_cache()
        config, tensors = sources.layout(str(model))
        shape = Shape.of(config)
        ran = side(model, args.dir / "home", args.bpw, args.windows, None)  # one home: history carries over
        ratios = {
            step: round(s["seconds"] / s["expected_seconds"], 3)
            for step, s in ran["steps"].items()
            if s.get("expected_seconds") and step.split(":")[0] in ("measure", "quantize")
        }
        results["shapes"][name] = {
            "shape": SHAPES[name],
            "parameters": Params.of(tensors, shape).total,
            **ran,
            "actual_over_expected": ratios,
            **sitting,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")  # what is measured survives a later failure
        print(name, ran["wall_seconds"], "s", json.dumps(ratios), flush=True)


if __name__ == "__main__":
    main()
