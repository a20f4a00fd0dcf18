"""The GPU suite's results file (benchmarks/results/gpu_suite.json, or $QF_GPU_RESULTS): each job's rows as they
are recorded, so an interrupted suite still leaves what it measured."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
from pathlib import Path

import torch

from factory import engines
from tests.support import ROOT

RESULTS: dict = {"rows": [], "checks": {}}


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def save() -> None:
    """Rewrite the results file after every recorded row, so an interrupted suite still leaves what it measured."""
    out = Path(os.environ.get("QF_GPU_RESULTS", ROOT / "benchmarks" / "results" / "gpu_suite.json"))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "commit": os.environ.get("QF_COMMIT") or commit or "unknown",
                "gpu": torch.cuda.get_device_name(0),
                "versions": {
                    "torch": torch.__version__,
                    "transformers": _version("transformers"),
                    "exllamav2": _version("exllamav2"),
                    "exllamav3": _version("exllamav3"),
                    "autoawq": _version("autoawq"),
                },
                "command": "scripts/gpu_suite (pytest -m gpu)",
                **RESULTS,
            },
            indent=2,
        )
        + "\n"
    )


def run_events(result) -> list[dict]:
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines()]


def rows(model: str, events: list[dict]) -> None:
    steps = {e["step"]: e for e in events if e["event"] == "step" and e["state"] == "succeeded"}
    measure = next((e for name, e in steps.items() if name.startswith("measure:")), None)
    fp16 = next((e["ppl"] for e in events if e["event"] == "evaluation" and e["subject"] == "fp16"), None)
    result = events[-1]
    if fp16 is not None:
        RESULTS["rows"].append(
            {
                "model": model,
                "method": "fp16",
                "evaluator": "transformers",
                "bits": 16,
                "ppl": fp16,
                "eval_windows": result["quants"][0]["eval"]["windows"],
                "seconds": {"evaluate": steps["evaluate:fp16"]["seconds"]},
                "peak_gpu_bytes": steps["evaluate:fp16"]["peak_gpu_bytes"],
            }
        )
    for q in result["quants"]:
        tag = q["name"].split(":", 1)[1]
        quantize = steps[f"quantize:{tag}"]
        seconds = {"quantize": quantize["seconds"], "evaluate": steps[f"evaluate:{tag}"]["seconds"]}
        if q["method"] == "exl2" and measure is not None:
            seconds["measure"] = measure["seconds"]
        RESULTS["rows"].append(
            {
                "model": model,
                "method": q["method"],
                "tag": tag,
                "evaluator": engines.get(q["method"]).evaluator,
                "bits": q["bits"],
                "bytes": q["bytes"],
                "ppl": q["ppl"],
                "fp16_ppl": q["fp16_ppl"],
                "change": q["change"],
                "kld": q["kld"],
                "kld_p99": q["kld_p99"],
                "top1": q["top1"],
                "eval_windows": q["eval"]["windows"],
                "seconds": seconds,
                "peak_gpu_bytes": {
                    "quantize": quantize["peak_gpu_bytes"],
                    "evaluate": steps[f"evaluate:{tag}"]["peak_gpu_bytes"],
                    **({"measure": measure["peak_gpu_bytes"]} if q["method"] == "exl2" and measure else {}),
                },
            }
        )
    save()
