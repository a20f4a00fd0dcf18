"""Exactly once under chaos: rounds of a tiny AWQ job on two CPU workers and a beat, each round killing (SIGKILL)
or stopping (SIGSTOP, then SIGCONT once another holder has the job) the job's holder at a random moment: while it
quantizes, evaluates, publishes or pushes to the stand-in Hub (tests/support/hub_server.py).

    python benchmarks/chaos.py [ROUNDS] [SEED]      (default 20 rounds, seed 0)

Needs Redis on 127.0.0.1:6379 (db 8 is flushed) and PostgreSQL ($QF_TEST_PG, default
postgresql://root@127.0.0.1:5432/test; each round makes and drops its own database). After each round: the job
succeeded, exactly one quant row, one registry folder whose files match its manifest, one commit on the quant's
Hub branch, no step left `running`. A moment the job had already passed when the holder was looked for is recorded
as `hit: false` (the checks still run). Results: benchmarks/results/chaos.json.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("QF_TEST_PG", "postgresql://root@127.0.0.1:5432/test")

import redis  # noqa: E402
from huggingface_hub import constants  # noqa: E402

from factory.catalog import Catalog  # noqa: E402
from factory.publish import folder as registry  # noqa: E402
from tests.support.fleet import start_worker  # noqa: E402
from tests.support.hub_server import HubServer  # noqa: E402
from tests.support.processes import qf, send  # noqa: E402
from tests.support.processes import tree as descendants  # noqa: E402
from tests.support.qf import fresh_database  # noqa: E402
from tests.support.tiny_model import make_tiny_llama  # noqa: E402

BROKER = "redis://127.0.0.1:6379/8"
MOMENTS = ("quantize", "evaluate", "publish", "push")
ACTIONS = ("kill", "stop")
LEASE = 3
RESULTS = ROOT / "benchmarks" / "results" / "chaos.json"


def start_beat(env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "factory.cli", "beat"],
        env=env,
        cwd=ROOT,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def one_round(n: int, rng: random.Random, model: Path, base: Path) -> dict:
    """One round on a fresh catalog database, broker db and stand-in Hub."""
    moment, action = rng.choice(MOMENTS), rng.choice(ACTIONS)
    home = base / f"round-{n}"
    home.mkdir()
    redis.Redis.from_url(BROKER).flushdb()
    procs: list[subprocess.Popen] = []
    hub = HubServer().start()
    with fresh_database() as url:
        env = {
            **os.environ,
            "FACTORY_HOME": str(home / "home"),
            "FACTORY_DB_URL": url,
            "FACTORY_BROKER_URL": BROKER,
            "FACTORY_WORKER_DEVICE": "cpu",
            "FACTORY_LEASE_SECONDS": str(LEASE),
            "FACTORY_RECONCILE_SECONDS": "2",
            "FACTORY_HUB_OWNER": "alice",
            "HF_TOKEN": "hf_alice_write",
            "HF_ENDPOINT": hub.url,
            "HF_HUB_DISABLE_XET": "1",
            "HF_HOME": str(home / "hf"),
            "HF_HUB_OFFLINE": "0",
        }
        catalog = None
        try:
            procs += [start_worker(env, home / f"worker-{i}.log") for i in range(2)]
            procs.append(start_beat(env, home / "beat.log"))
            started = time.monotonic()
            job_id = qf(env, "submit", model, "--awq", "--eval-windows", 1).stdout.strip()
            catalog = Catalog(url)
            holder, step, name = None, None, None
            while time.monotonic() - started < 240:
                job = catalog.jobs.get(job_id)
                running = [s.name for s in job.steps if s.state == "running" and s.name.startswith(moment)]
                if running and job.worker:
                    holder, step, name = int(job.worker.rsplit(":", 1)[1]), running[0], job.worker
                    break
                if job.state in ("succeeded", "failed", "cancelled"):
                    break
                time.sleep(0.02)
            victim = next((p for p in procs if p.pid == holder), None)
            if victim is not None and action == "kill":
                send(descendants(victim.pid), signal.SIGKILL)
                procs.append(start_worker(env, home / "worker-replacement.log"))
            elif victim is not None:
                stopped = descendants(victim.pid)
                send(stopped, signal.SIGSTOP)
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:  # until another holder has it (or it ended without this one)
                    job = catalog.jobs.get(job_id)
                    if job.worker != name or job.state == "succeeded":
                        break
                    time.sleep(0.2)
                send(stopped, signal.SIGCONT)
            deadline = time.monotonic() + 300
            while catalog.jobs.get(job_id).state not in ("succeeded", "failed", "cancelled"):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            time.sleep(LEASE + 1)  # what a stopped holder that came back still tries, it tries now
            return {
                "round": n,
                "moment": moment,
                "action": action,
                "hit": victim is not None,
                "step": step,
                "seconds": round(time.monotonic() - started, 1),
                **check(env, catalog, job_id, hub),
            }
        finally:
            for proc in procs:
                send(descendants(proc.pid), signal.SIGKILL)
                proc.wait()
            if catalog is not None:
                catalog.db.engine.dispose()  # before its database is dropped
            hub.stop()


def check(env: dict, catalog: Catalog, job_id: str, hub: HubServer) -> dict:
    problems = []
    job = catalog.jobs.get(job_id)
    if job.state != "succeeded":
        problems.append(f"job {job.state}: {job.error}")
    quants = catalog.quants.live(job_id=job_id)
    if len(quants) != 1:
        problems.append(f"{len(quants)} quant rows")
    folders = sorted((Path(env["FACTORY_HOME"]) / "registry" / "tiny").glob("awq-*"))
    if len(folders) != 1:
        problems.append(f"{len(folders)} registry folders")
    for folder in folders:
        try:
            registry.verify(folder)
        except Exception as e:  # noqa: BLE001 - reported, not raised
            problems.append(str(e))
    repo = hub.repos.get("alice/tiny-AWQ")
    commits = 0
    if repo is not None and quants:
        branch = next((b for b in repo.branches if b != "main"), None)
        sha = repo.branches.get(branch)
        while sha is not None:
            commit = repo.commits[sha]
            commits += commit.title.startswith(f"tiny:{quants[0].tag}@")
            sha = commit.parent
    if commits != 1:
        problems.append(f"{commits} commits of the quant on its Hub branch")
    if any(s.state == "running" for s in job.steps):
        problems.append("a step left running")
    return {
        "attempts": job.attempts,
        "quant_rows": len(quants),
        "registry_folders": len(folders),
        "hub_commits": commits,
        "ok": not problems,
        "problems": problems,
    }


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="qf-chaos-") as tmp:
        base = Path(tmp)
        model = make_tiny_llama(base / "tiny")
        constants.HF_HUB_DISABLE_XET = True
        rows = []
        for n in range(1, rounds + 1):
            row = one_round(n, rng, model, base)
            rows.append(row)
            print(json.dumps(row), flush=True)
    ok = sum(r["ok"] for r in rows)
    result = {
        "command": f"python benchmarks/chaos.py {rounds} {seed}",
        "lease_seconds": LEASE,
        "summary": f"{ok}/{rounds} rounds exactly once ({sum(r['hit'] for r in rows)} hit their moment)",
        "rows": rows,
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(result["summary"])


if __name__ == "__main__":
    main()
