"""What the factory costs over calling AutoAWQ by hand: the quantize step only, same model, same settings.

    .venv/bin/python benchmarks/awq_overhead.py [--model DIR] [--repeats 7]

qf side: `qf run MODEL --awq` in a fresh process (fresh FACTORY_HOME each time); its quantize step's seconds
(child process start, imports, load, AutoAWQ, save, output checks). Direct side: a fresh Python process that
imports AutoAWQ, loads the model, quantizes with the same calibration tokens and settings, and saves; its wall
time. Runs alternate between the sides; the ratio of the medians is the overhead (target <= 1.05).
Writes benchmarks/results/awq_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DIRECT = """
import json, sys
from awq import AutoAWQForCausalLM
from transformers import AutoTokenizer
model_dir, tokens, out, spec = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3], json.loads(sys.argv[4])
model = AutoAWQForCausalLM.from_pretrained(model_dir, trust_remote_code=False)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model.quantize(tokenizer, quant_config={"w_bit": spec["w_bit"], "q_group_size": spec["group_size"],
               "zero_point": spec["zero_point"], "version": "GEMM"}, calib_data=tokens,
               max_calib_samples=len(tokens), max_calib_seq_len=len(tokens[0]), apply_clip=spec["clip"])
model.save_quantized(out)
"""


def qf_side(model: Path, work: Path) -> tuple[float, dict]:
    env = {**os.environ, "FACTORY_HOME": str(work / "home"), "FACTORY_DB_URL": ""}
    qf = Path(sys.executable).parent / "qf"
    result = subprocess.run(
        [str(qf), "run", str(model), "--awq", "--eval-windows", "1", "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    events = [json.loads(line) for line in result.stdout.splitlines()]
    [step] = [e for e in events if e["event"] == "step" and e["step"].startswith("quantize:") and "seconds" in e]
    spec = json.loads((work / "home" / "registry").glob("*/*/manifest.json").__next__().read_text())["spec"]
    return step["seconds"], spec


def direct_side(model: Path, tokens: Path, spec: dict, work: Path) -> float:
    start = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", DIRECT, str(model), str(tokens), str(work / "direct"), json.dumps(spec)],
        capture_output=True,
        check=True,
    )
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="an FP16 folder (default: a 4-layer 256-wide tiny Llama)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "awq_overhead.json")
    args = parser.parse_args()

    import calibration
    from factory.evaluation import evaluate
    from tests.support.tiny_model import make_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = args.model or make_tiny_llama(tmp / "tiny-llama", hidden=256, layers=4)
        qf_seconds, direct_seconds = [], []
        for i in range(args.repeats):
            seconds, spec = qf_side(model, tmp / f"qf{i}")
            qf_seconds.append(seconds)
            ids = evaluate.tokenize(model, calibration.resolve("builtin:c4").text)
            tokens = tmp / "tokens.json"
            tokens.write_text(
                json.dumps(calibration.token_windows(ids, spec["calib_rows"], spec["calib_length"], "c4"))
            )
            direct_seconds.append(direct_side(model, tokens, spec, tmp / f"direct{i}"))
            print(f"run {i + 1}: qf {qf_seconds[-1]:.2f} s, direct {direct_seconds[-1]:.2f} s", file=sys.stderr)

    import importlib.metadata as md

    ratio = statistics.median(qf_seconds) / statistics.median(direct_seconds)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {
        "commit": commit,
        "gpu": None,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only",
        "versions": {p: md.version(p) for p in ("torch", "transformers", "autoawq")},
        "command": "python benchmarks/awq_overhead.py" + (f" --model {args.model}" if args.model else ""),
        "model": str(args.model or "tiny-llama (hidden 256, 4 layers, seeded)"),
        "spec": spec,
        "seconds": {"qf_quantize_step": qf_seconds, "autoawq_direct": direct_seconds},
        "speed": {"awq_overhead_ratio": round(ratio, 4)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["speed"]))


if __name__ == "__main__":
    main()
