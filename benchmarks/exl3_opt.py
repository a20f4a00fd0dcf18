"""EXL3 at one size, uniform against the same size with its bits chosen per tensor (issue 49, item 4), on one model in
one job: `qf run SOURCE --exl3 <BPW>opt` (which makes the uniform sizes a bit below, at and above it too), then from
the job's JSON events each quant's perplexity, KL divergence from FP16, top-1 and tensor bytes, the gate's decision
on the optimized size (kept only where its KLD is lower at no more bytes), and the seconds of the measurement and of
the optimization beside the uniform conversions'.

    python benchmarks/exl3_opt.py SOURCE --out RESULTS.json [--bpw 4.0] [--eval-windows 48] [--home DIR]

RESULTS.json holds one row per model (`model`), merged into what is there; the job's events are kept beside it
(`<model>.events.jsonl`). benchmarks/exl3_opt_sitting.sh runs it on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from factory.engines.exl3.spec import MEASURE_KLD, Exl3Spec, sources  # noqa: E402  (the repo's, however started)

BYTES = re.compile(r"([\d,]+) bytes of tensors against ([\d,]+)$")


def summarize(events: list[dict], uniform: str, opt: str, made_from: list[str], stage: str = MEASURE_KLD) -> dict:
    """What a job's events say about the uniform size (`uniform`), the optimized one (`opt`), what it was made from
    and the job's measurements (shared units `<stage>:<key>`): the events of `qf run --json`, the last the result."""
    scores = {e["subject"]: e for e in events if e["event"] == "evaluation"}
    steps = {e["step"]: e for e in events if e["event"] == "step" and e["state"] == "succeeded"}
    gate = next((e["message"] for e in events if e["event"] == "note" and e["message"].startswith(f"gate: {opt} ")), "")
    sizes = BYTES.search(gate)
    if sizes is None:
        raise SystemExit(f"the job's gate said nothing about {opt}: {gate!r}")
    tensor_bytes = dict(zip((opt, uniform), (int(n.replace(",", "")) for n in sizes.groups()), strict=True))
    published = {q["name"].partition(":")[2]: q for q in events[-1].get("quants", [])}

    def row(tag: str) -> dict:
        score = scores.get(tag, {})
        return {
            "tag": tag,
            "ppl": score.get("ppl"),
            "kld": score.get("kld"),
            "kld_p99": score.get("kld_p99"),
            "top1": score.get("top1"),
            "tensor_bytes": tensor_bytes[tag],
            "published_bytes": published.get(tag, {}).get("bytes"),
            "quantize_seconds": steps.get(f"quantize:{tag}", {}).get("seconds"),
        }

    return {
        "state": events[-1].get("state"),
        "fp16_ppl": scores.get("fp16", {}).get("ppl"),
        "uniform": row(uniform),
        "optimized": row(opt),
        "kept": gate.startswith(f"gate: {opt} kept:"),
        "gate": gate.removeprefix("gate: "),
        "measurements": [
            {"step": name, "seconds": e["seconds"], "peak_gpu_bytes": e["peak_gpu_bytes"]}
            for name, e in steps.items()
            if name.partition(":")[0] == stage
        ],
        "made_from": {
            tag: {"kld": scores.get(tag, {}).get("kld"), "quantize_seconds": steps[f"quantize:{tag}"]["seconds"]}
            for tag in made_from
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bpw", type=float, default=4.0)
    parser.add_argument("--eval-windows", type=int, default=48)
    parser.add_argument("--home", type=Path, default=None, help="FACTORY_HOME (default: a folder beside --out)")
    parser.add_argument("--model", default=None, help="the row's name (default: the source folder's)")
    args = parser.parse_args()
    model = args.model or Path(args.source).name
    home = args.home or args.out.parent / f"home-{model}"
    env = {**os.environ, "FACTORY_HOME": str(home), "FACTORY_DB_URL": ""}
    cmd = [sys.executable, "-m", "factory.cli", "run", args.source, "--exl3", f"{args.bpw}opt"]
    cmd += ["--eval-windows", str(args.eval_windows), "--json"]
    start = time.monotonic()
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    (args.out.parent / f"{model}.events.jsonl").write_text(done.stdout)
    row = {"model": model, "source": args.source, "exit_code": done.returncode, "seconds": time.monotonic() - start}
    if done.returncode == 0:
        opt = Exl3Spec(bpw=args.bpw, opt=True)
        row |= summarize(events, opt.uniform().tag, opt.tag, [opt.uniform(b).tag for b in sources(args.bpw)])
    else:
        row["error"] = done.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
    rows = json.loads(args.out.read_text())["rows"] if args.out.is_file() else []
    rows = [r for r in rows if r["model"] != model] + [row]
    args.out.write_text(json.dumps({"command": " ".join(cmd[1:]), "rows": rows}, indent=2) + "\n")
    print(json.dumps(row, indent=2))
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
