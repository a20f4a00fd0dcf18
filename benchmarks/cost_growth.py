"""How a job's cost grows with the model (CUDA): one `qf run` of a random Llama of a named shape (1.1B, 3B, 8B), its
units packed as the factory packs them, each step's seconds against what the ETA expected of it when it started,
its peak GPU memory (the factory's own reading), the peak host memory of the job's processes while it ran, and the
disk the job's home takes (work folders, the published quants, the FP16 reference).

    python benchmarks/cost_growth.py DIR --shape 8b --make            # the model only (GPU, seconds)
    python benchmarks/cost_growth.py DIR --shape 8b --headers         # its headers over a hole (`qf plan`, any machine)
    python benchmarks/cost_growth.py DIR --shape 8b --label awq -- --awq --awqct
    python benchmarks/cost_growth.py DIR --shape 8b --label exl3 -- --exl3 4.0
    python benchmarks/cost_growth.py - --shape 8b --label awq --events LOG --gpu "NVIDIA H200" -- --awq

Everything after `--` goes to `qf run`. Jobs of one shape share DIR/home-<shape> (as a fleet shares a catalog: the
FP16 reference is made once), so two of them may run at once; each appends its events to DIR/<shape>-<label>.jsonl
as they come (what a sitting cut short has measured survives) and, when it ends, its summary to OUT under
shapes.<shape>.jobs.<label> (default benchmarks/results/cost_growth.json; other shapes and jobs already there stay:
each says its own sitting). Host memory and disk are sampled every 2 s; units of one job overlap, so a step's
peak host memory is the job's while that step ran.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.tiny_model import LLAMA_1B  # noqa: E402

SHAPES = {
    "1.1b": LLAMA_1B,
    "3b": {**LLAMA_1B, "hidden": 3072, "layers": 28, "heads": 24},
    "8b": {**LLAMA_1B, "hidden": 4096, "layers": 32, "heads": 32, "intermediate": 14336},
}


def _du(path: Path) -> int:
    """Bytes on disk under `path`, each inode once (a job's staging folder links the source's weights)."""
    seen, total = set(), 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


class Sampler(threading.Thread):
    """Every 2 s: the RSS of a process and its descendants, and the disk under a folder."""

    def __init__(self, pid: int, home: Path):
        super().__init__(daemon=True)
        self.pid, self.home, self.samples, self.done = pid, home, [], threading.Event()

    def run(self) -> None:
        import psutil

        start = time.monotonic()
        while not self.done.wait(2.0):
            try:
                root = psutil.Process(self.pid)
                rss = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)] if p.is_running())
            except psutil.Error:
                rss = 0
            self.samples.append((round(time.monotonic() - start, 1), rss, _du(self.home)))

    def peak(self, start: float, end: float, column: int) -> int | None:
        inside = [s[column] for s in self.samples if start - 2 <= s[0] <= end + 2]
        return max(inside, default=None)


def make(directory: Path, shape: str, device: str = "cuda") -> Path:
    model = directory / f"llama-{shape}"
    if not (model / "config.json").is_file():
        import torch

        from tests.support.tiny_model import make_tiny_llama

        started = time.monotonic()
        make_tiny_llama(model, device=device, **SHAPES[shape])
        torch.cuda.empty_cache()
        print(f"made {model} in {time.monotonic() - started:.0f} s", flush=True)
    return model


def run_job(model: Path, home: Path, label: str, qf_args: list[str], events_log: Path) -> dict:
    env = {**os.environ, "FACTORY_HOME": str(home), "FACTORY_DB_URL": ""}
    cmd = [sys.executable, "-m", "factory.cli", "run", str(model), "--name", model.name, "--json", *qf_args]
    home.mkdir(parents=True, exist_ok=True)
    events = []
    start = time.monotonic()
    with open(events_log, "a") as log, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True) as p:
        sampler = Sampler(p.pid, home)
        sampler.start()
        for line in p.stdout:
            event = {**json.loads(line), "at": round(time.monotonic() - start, 1)}
            events.append(event)
            log.write(json.dumps(event) + "\n")
            log.flush()
    sampler.done.set()
    return {
        "command": " ".join(["qf run", model.name, *qf_args]),
        "returncode": p.returncode,
        "wall_seconds": round(time.monotonic() - start, 1),
        **summary(events, sampler),
        "peak_host_bytes": max((s[1] for s in sampler.samples), default=None),
        "peak_home_disk_bytes": max((s[2] for s in sampler.samples), default=None),
        "home_disk_bytes_at_end": _du(home),
    }


def summary(events: list[dict], sampler: Sampler | None = None) -> dict:
    """Each step's seconds against what was expected when it started, its peak GPU memory, and (sampled while it
    ran) the job's peak host memory; the quants, notes and evaluations. From a run's events as they came, or from a
    sitting's events log (`--events`: a sitting cut short before its job ended; no host samples then)."""
    starts = {e["step"]: e for e in events if e["event"] == "step" and e["state"] == "running"}
    steps = {}
    for e in events:
        if e["event"] != "step" or e["state"] not in ("succeeded", "failed"):
            continue
        began = starts.get(e["step"], {})
        steps[e["step"]] = {
            "state": e["state"],
            "seconds": e.get("seconds"),
            "expected_seconds": began.get("expected_seconds"),
            "peak_gpu_bytes": e.get("peak_gpu_bytes"),
            "peak_host_bytes": sampler.peak(began.get("at", 0), e["at"], 1) if sampler else None,
            "started_at": began.get("at"),
            "ended_at": e["at"],
            **({"error": e["error"]} if e.get("error") else {}),
        }
    result = next((e for e in reversed(events) if e["event"] == "result"), {})
    return {
        "steps": steps,
        "actual_over_expected": {
            name: round(s["seconds"] / s["expected_seconds"], 2)
            for name, s in steps.items()
            if s["seconds"] and s["expected_seconds"] and s["state"] == "succeeded"
        },
        "quants": result.get("quants", []),
        "notes": [e["message"] for e in events if e["event"] == "note"],
        "evaluations": [e for e in events if e["event"] == "evaluation"],
        "error": result.get("error"),
        "ended": bool(result),
    }


def record(out: Path, shape: str, label: str, entry: dict) -> None:
    """Read-modify-write OUT under a lock: two jobs of a sitting may end at once."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = json.loads(out.read_text()) if out.is_file() else {"shapes": {}}
        slot = results["shapes"].setdefault(shape, {"shape": SHAPES[shape], "jobs": {}})
        slot.setdefault("jobs", {})[label] = entry
        out.write_text(json.dumps(results, indent=2) + "\n")


def main() -> None:
    argv = sys.argv[1:]
    qf_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--make", action="store_true", help="make the model and stop")
    parser.add_argument("--headers", action="store_true", help="make its config, tokenizer and headers and stop")
    parser.add_argument("--label", default="job")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cost_growth.json")
    parser.add_argument("--events", type=Path, help="record a sitting's events log (DIR is then not read)")
    parser.add_argument("--gpu", help="with --events: the card it ran on")
    args = parser.parse_args(argv)
    if args.events:
        events = [json.loads(line) for line in args.events.read_text().splitlines()]
        entry = {**summary(events), "command": "qf run " + " ".join(qf_args), "events": str(args.events.name)}
        record(args.out, args.shape, args.label, {**entry, "gpu": args.gpu, "commit": os.environ.get("QF_COMMIT")})
        return
    model = make(args.dir, args.shape, "meta" if args.headers else "cuda")
    if args.make or args.headers:
        return
    import torch

    from factory.checkpoints import sources
    from factory.vram import Params, Shape

    config, tensors = sources.layout(str(model))
    ran = run_job(
        model, args.dir / f"home-{args.shape}", args.label, qf_args, args.dir / f"{args.shape}-{args.label}.jsonl"
    )
    record(
        args.out,
        args.shape,
        args.label,
        {
            "parameters": Params.of(tensors, Shape.of(config)).total,
            **ran,
            "gpu": torch.cuda.get_device_name(0),
            "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
            "versions": {"torch": torch.__version__},
            "commit": os.environ.get("QF_COMMIT")
            or subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        },
    )
    print(args.shape, args.label, ran["wall_seconds"], "s", ran["returncode"], flush=True)


if __name__ == "__main__":
    main()
