"""What packing a job's units onto one GPU buys (CUDA only): the same job, `qf run` of the random 1.1B Llama at
EXL2 sizes, once with `--max-units 1` (one unit after another, as before packing) and once with the default (as
many units at once as fit), in fresh homes on the same card, one after the other.

    python benchmarks/packing.py DIR [--bpw 2.5,3.0,4.0,5.0] [--windows 8] [--gpu N] [--out OUT.json]

Records for each side: wall seconds, each step's seconds against what the job expected of it (and a summary:
`predicted`), its peak GPU memory, the card's SM use and memory (nvidia-smi dmon every 2 s on GPU N: mean and max),
and the quants' sizes and perplexities (random weights: only their agreement between the sides means something).
speed.packing_ratio = one-at-a-time wall / packed wall (target >= 2.5 at 4 sizes); speed.conversion_ratio the same
for the conversions alone, from the first quantize unit's start to the last one's end. Packed, EXL2's measurement
runs its layer ranges at once (factory/engines/exl2/ranges.py) beside the FP16 evaluation; one unit at a time, it
measures one range after another, as before packing. Results in the shape of docs/measured.md (default
benchmarks/results/packing.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def dmon(log: Path, gpu: int) -> subprocess.Popen:
    """nvidia-smi's SM and memory trace of GPU `gpu` (its index on the machine) every 2 s into `log`."""
    return subprocess.Popen(
        ["nvidia-smi", "dmon", "-i", str(gpu), "-s", "um", "-d", "2"], stdout=open(log, "w"), stderr=subprocess.DEVNULL
    )


def predicted(steps: dict[str, dict]) -> dict:
    """What the job expected of its steps against what they took: the median and the range of actual / expected,
    over the steps that ran for at least a second with an expectation."""
    ratios = sorted(
        s["seconds"] / s["expected_seconds"]
        for s in steps.values()
        if s.get("expected_seconds") and s.get("seconds") and s["seconds"] >= 1
    )
    if not ratios:
        return {"steps": 0}
    return {
        "steps": len(ratios),
        "median_actual_over_expected": round(ratios[len(ratios) // 2], 3),
        "lowest": round(ratios[0], 3),
        "highest": round(ratios[-1], 3),
    }


def gpu_use(log: Path) -> dict:
    """Mean and max SM % and memory used (MiB) from a dmon log (columns: gpu sm mem enc dec ... fb ...)."""
    header, rows = None, []
    for line in log.read_text().splitlines():
        if line.startswith("#") and header is None:
            header = line.lstrip("#").split()
        elif not line.startswith("#") and header:
            values = line.split()
            if len(values) == len(header):
                rows.append(dict(zip(header, values, strict=True)))
    sm = [float(r["sm"]) for r in rows if r.get("sm", "-") != "-"]
    fb = [float(r["fb"]) for r in rows if r.get("fb", "-") != "-"]
    return {
        "samples": len(rows),
        "sm_mean": round(sum(sm) / len(sm), 1) if sm else None,
        "sm_max": max(sm, default=None),
        "fb_max_mib": max(fb, default=None),
    }


def side(model: Path, home: Path, bpw: str, windows: int, max_units: int | None, gpu: int) -> dict:
    env = {**os.environ, "FACTORY_HOME": str(home), "FACTORY_DB_URL": "", "CUDA_VISIBLE_DEVICES": str(gpu)}
    cmd = [
        sys.executable,
        "-m",
        "factory.cli",
        "run",
        str(model),
        "--exl2",
        bpw,
        "--calibration",
        "builtin:mix",
        "--eval-windows",
        str(windows),
        "--json",
        *(["--max-units", str(max_units)] if max_units else []),
    ]
    home.mkdir(parents=True, exist_ok=True)
    monitor = dmon(home / "dmon.log", gpu)
    start = time.monotonic()
    events = []  # each with "at": seconds since the start, when this process read it
    try:
        with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True) as run:
            for line in run.stdout:
                events.append({**json.loads(line), "at": round(time.monotonic() - start, 1)})
        if run.returncode:
            raise SystemExit(f"qf run failed ({run.returncode}): {events[-1] if events else 'no events'}")
    finally:
        monitor.terminate()
        monitor.wait()
    wall = time.monotonic() - start
    converting = [
        e["at"]
        for e in events
        if e["event"] == "step" and e["step"].startswith("quantize:") and e["state"] in ("running", "succeeded")
    ]
    expected = {
        e["step"]: e.get("expected_seconds") for e in events if e["event"] == "step" and e["state"] == "running"
    }
    steps = {
        e["step"]: {
            "seconds": e["seconds"],
            "peak_gpu_bytes": e["peak_gpu_bytes"],
            "expected_seconds": expected.get(e["step"]),
        }
        for e in events
        if e["event"] == "step" and e["state"] == "succeeded"
    }
    quants = [
        {
            "tag": q["name"].split(":", 1)[1],
            "bits": q["bits"],
            "bytes": q["bytes"],
            "ppl": q["ppl"],
            "fp16_ppl": q["fp16_ppl"],
        }
        for q in events[-1]["quants"]
    ]
    notes = [e["message"] for e in events if e["event"] == "note"]
    return {
        "max_units": max_units or "default",
        "wall_seconds": round(wall, 1),
        "conversion_seconds": round(max(converting) - min(converting), 1),  # first quantize start to last end
        "steps": steps,
        "predicted": predicted(steps),
        "quants": quants,
        "gpu": gpu_use(home / "dmon.log"),
        "notes": notes,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path)
    parser.add_argument("--bpw", default="2.5,3.0,4.0,5.0")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--gpu", type=int, default=0, help="the GPU's index on the machine")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "packing.json")
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = str(args.gpu)  # the model is made there too
    import torch

    from tests.support.tiny_model import LLAMA_1B, make_tiny_llama

    model = args.dir / "llama-1.1b"
    if not (model / "config.json").is_file():
        make_tiny_llama(model, device="cuda", **LLAMA_1B)
    results = {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "cores": os.cpu_count(),
        "versions": {"torch": torch.__version__},
        "command": f"python benchmarks/packing.py DIR --bpw {args.bpw} --windows {args.windows}",
        "commit": os.environ.get("QF_COMMIT")
        or subprocess.run(  # a copy's .git may be another commit's
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        or "unknown",
        "sides": {},
    }
    for name, max_units in (("packed", None), ("one_at_a_time", 1)):  # packed first: the newer path fails early
        results["sides"][name] = side(model, args.dir / name, args.bpw, args.windows, max_units, args.gpu)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")  # what is measured survives a later failure
        print(name, results["sides"][name]["wall_seconds"], "s", flush=True)
    one, packed = results["sides"]["one_at_a_time"], results["sides"]["packed"]
    results["speed"] = {
        "packing_ratio": round(one["wall_seconds"] / packed["wall_seconds"], 3),
        "conversion_ratio": round(one["conversion_seconds"] / packed["conversion_seconds"], 3),
        "sizes": len(args.bpw.split(",")),
    }
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["speed"]))


if __name__ == "__main__":
    main()
