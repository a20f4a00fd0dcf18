"""What the factory costs over running convert_exl2 by hand, and what reusing one measurement saves (CUDA only).

    python benchmarks/exl2_speed.py model DIR           # makes the random 1.1B Llama in DIR (seconds)
    python benchmarks/exl2_speed.py raw-measure DIR     # convert_exl2 -om: the raw measurement M
    python benchmarks/exl2_speed.py raw-quant DIR       # convert_exl2 -m M.json -b 4.0 -cf: one raw pass Q
    python benchmarks/exl2_speed.py factory DIR         # qf run --exl2 3.0,4.0,5.0: one measurement, three passes

Each part is a fresh process (two may run at once, each on its own GPU: scripts/gpu_bench does so), runs in
under 10 minutes on an H200, and merges its numbers into benchmarks/results/exl2_speed.json (docs/measured.md's shape).
Only quantize work counts: for the factory, its measure and quantize steps (its evaluation and publishing are
left out). Once all three parts are in:
    speed.exl2_overhead_ratio      = factory (measure + first pass) / (M + Q)      target <= 1.03
    speed.exl2_overhead_ratio_4bpw = the same with the factory's 4.0 bpw pass, Q's size
    speed.exl2_reuse_speedup_3bpw  = 3 (M + Q) / factory (measure + three passes)  expected about 1.6
Every part records the peak GPU memory its steps allocated. Same calibration text everywhere (builtin:mix).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "exl2_speed.json"


def _merge(part: str, data: dict) -> None:
    import torch

    from factory.engines.exl2 import engine as exl2

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS.with_suffix(".lock"), "w") as lock:  # parts may run side by side
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"parts": {}}
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        results.update(
            gpu=torch.cuda.get_device_name(0),
            commit=os.environ.get("QF_COMMIT") or commit,
            versions={"torch": torch.__version__, "exllamav2": exl2.ENGINE.version()},
            command="python benchmarks/exl2_speed.py {model,raw-measure,raw-quant,factory} DIR",
        )
        results["parts"][part] = {**data, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
        parts = results["parts"]
        if {"raw-measure", "raw-quant", "factory"} <= set(parts):
            raw = parts["raw-measure"]["seconds"] + parts["raw-quant"]["seconds"]
            f = parts["factory"]["seconds"]
            results["speed"] = {
                "exl2_overhead_ratio": round((f["measure"] + f["quantize"][0]) / raw, 4),
                "exl2_reuse_speedup_3bpw": round(3 * raw / (f["measure"] + sum(f["quantize"])), 4),
                # the raw pass is 4.0 bpw: the factory's own 4.0 pass (its second) against it, like for like
                "exl2_overhead_ratio_4bpw": round((f["measure"] + f["quantize"][1]) / raw, 4),
            }
        staged = RESULTS.with_suffix(".tmp")
        staged.write_text(json.dumps(results, indent=2) + "\n")
        staged.replace(RESULTS)  # whole or not at all, for a reader that takes no lock (scripts/gpu_bench)
    print(json.dumps({part: data, **({"speed": results["speed"]} if "speed" in results else {})}))


def _raw(args: list[str], log: Path) -> tuple[float, int | None]:
    """One fresh convert_exl2 process (through our child wrapper only to read its peak GPU memory)."""
    from factory.engines import child
    from factory.engines.exl2 import engine as exl2

    peak: list[int] = []
    start = time.monotonic()
    child.run_command(
        [sys.executable, "-m", "factory.engines.script", exl2.SCRIPT, *args],
        log,
        lambda e: peak.append(e["peak_gpu_bytes"]) if "peak_gpu_bytes" in e else None,
        "raw convert_exl2",
        parse=exl2.parse_status,
        env=exl2.ENV,
    )
    return round(time.monotonic() - start, 2), max(peak, default=None)


def main() -> None:
    part, folder = sys.argv[1], Path(sys.argv[2])
    model, cal, measurement = folder / "llama-1.1b", folder / "cal.parquet", folder / "measurement.json"
    if part == "model":
        import calibration
        from tests.support.tiny_model import LLAMA_1B, make_tiny_llama

        make_tiny_llama(model, device="cuda", **LLAMA_1B)
        calibration.write_parquet(calibration.resolve("builtin:mix"), cal)
        return
    from factory.engines.exl2.engine import _flags

    if part == "raw-measure":
        seconds, peak = _raw(["-so", *_flags(i=model, o=folder / "raw-m", c=cal, om=measurement)], folder / "m.log")
        _merge(part, {"seconds": seconds, "peak_gpu_bytes": peak})
    elif part == "raw-quant":
        args = _flags(i=model, o=folder / "raw-q", c=cal, m=measurement, b=4.0, cf=folder / "raw-q-out")
        seconds, peak = _raw(["-so", *args], folder / "q.log")
        _merge(part, {"seconds": seconds, "peak_gpu_bytes": peak, "bpw": 4.0})
    elif part == "factory":
        env = {**os.environ, "FACTORY_HOME": str(folder / "home"), "FACTORY_DB_URL": ""}
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "factory.cli",
                "run",
                str(model),
                "--exl2",
                "3.0,4.0,5.0",
                "--calibration",
                "builtin:mix",
                "--eval-windows",
                "1",
                "--json",
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            check=True,
        )
        steps = [json.loads(line) for line in out.stdout.splitlines()]
        done = [e for e in steps if e["event"] == "step" and e["state"] == "succeeded"]
        measure = [e for e in done if e["step"].startswith("measure:")]
        quant = [e for e in done if e["step"].startswith("quantize:")]
        _merge(
            part,
            {
                "seconds": {"measure": measure[0]["seconds"], "quantize": [e["seconds"] for e in quant]},
                "peak_gpu_bytes": {e["step"]: e["peak_gpu_bytes"] for e in measure + quant},
            },
        )
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
