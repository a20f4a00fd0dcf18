"""The distributed factory's own costs, on this machine's Redis and PostgreSQL.

    .venv/bin/python benchmarks/queue_costs.py [--db postgresql://root@127.0.0.1:5432/test] [--broker redis://...]

- accept: 500 distinct submissions through the `qf submit` code path in one process (catalog row + message);
- status: `qf status JOB` and `qf status` as fresh processes with 10,000 jobs in the catalog (target < 0.5 s);
- api: the service (`qf serve`): 500 distinct submissions over HTTP from 5 clients at once (target < 10 s), and
  `GET /api/jobs` and the dashboard's page with 10,000 jobs in the catalog (target < 0.3 s);
- overhead: one tiny AWQ job end to end through a worker that is up (its next job process has done its imports)
  (submit -> succeeded) against `qf run` (target < 2 s).
Uses a fresh database on the server and its own Redis database; writes benchmarks/results/queue_costs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _qf(env: dict, *args: str) -> float:
    start = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "factory.cli", *args], env=env, cwd=ROOT, check=True, capture_output=True, text=True
    )
    return time.monotonic() - start


def _api(env: dict, model: Path, clients: int = 5, each: int = 100) -> dict:
    """The service in front of this catalog: submissions over HTTP from `clients` threads, then reads."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**env, "FACTORY_SERVE_SOURCES": str(model.parent)}
    token = subprocess.run(
        [sys.executable, "-m", "factory.cli", "token", "create", "--user", "bench", "--scope", "admin"],
        env=env,
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    server = subprocess.Popen(
        [sys.executable, "-m", "factory.cli", "serve", "--port", str(port)],
        env=env,
        cwd=ROOT,
        stdout=open(env["FACTORY_HOME"] + ".server.log", "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/openapi.json")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and server.poll() is None
                time.sleep(0.2)
        headers = {"Authorization": f"Bearer {token}"}

        def submit_many(client: int) -> list[str]:
            with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
                return [
                    http.post(
                        "/api/jobs",
                        json={"source": str(model), "flags": {"awq": True}, "eval_windows": 1000 + client * each + i},
                    )
                    .raise_for_status()
                    .json()["id"]
                    for i in range(each)
                ]

        start = time.monotonic()
        with ThreadPoolExecutor(clients) as pool:
            ids = [i for batch in pool.map(submit_many, range(clients)) for i in batch]
        accept = time.monotonic() - start
        assert len(set(ids)) == clients * each
        with httpx.Client(base_url=url, headers=headers) as http:
            jobs_seconds, page_seconds = [], []
            for _ in range(5):
                start = time.monotonic()
                assert len(http.get("/api/jobs", params={"limit": 50}).raise_for_status().json()) == 50
                jobs_seconds.append(time.monotonic() - start)
                start = time.monotonic()
                http.get("/", cookies={"qf_token": token}).raise_for_status()
                page_seconds.append(time.monotonic() - start)
        accepted = {"seconds": round(accept, 2), "per_submission_ms": round(accept * 1000 / len(ids), 2)}
        return {
            f"accept_{clients * each}_from_{clients}_clients": accepted,
            "jobs_in_catalog": 10_000 + len(ids),
            "get_api_jobs_50_seconds_median": round(statistics.median(jobs_seconds), 3),
            "dashboard_page_seconds_median": round(statistics.median(page_seconds), 3),
        }
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="postgresql://root@127.0.0.1:5432/test")
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/9")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "queue_costs.json")
    args = parser.parse_args()

    import redis
    from sqlalchemy import create_engine, insert, text

    from factory import settings
    from factory.catalog import Job
    from factory.factory import Factory
    from factory.recipes import build_recipe
    from tests.support.tiny_model import make_tiny_llama

    name = f"qf_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(args.db.replace("postgresql://", "postgresql+psycopg2://", 1), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    db_url = args.db.rsplit("/", 1)[0] + "/" + name
    redis.Redis.from_url(args.broker).flushdb()
    result: dict = {
        "machine": f"{os.cpu_count()} cores, CPU only",
        "catalog": "PostgreSQL (local)",
        "broker": "Redis (local)",
    }
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            env = {
                **os.environ,
                "FACTORY_HOME": str(tmp / "home"),
                "FACTORY_DB_URL": db_url,
                "FACTORY_BROKER_URL": args.broker,
                "FACTORY_WORKER_DEVICE": "cpu",
            }
            os.environ.update(env)
            model = make_tiny_llama(tmp / "tiny")

            # accept: 500 submissions, in process (what a long-lived submitter or an API would pay)
            from factory.jobs.planning import Request
            from workers.tasks import enqueue

            factory = Factory(settings.load())
            start = time.monotonic()
            for i in range(1, 501):
                job, created = factory.submit(
                    Request(source=str(model), recipe=build_recipe(awq=True, eval_windows=i), device="cpu")
                )
                enqueue(factory, job.id)
            accept = time.monotonic() - start
            result["accept_500"] = {"seconds": round(accept, 2), "per_submission_ms": round(accept * 2, 2)}
            one_cli = _qf(env, "submit", str(model), "--awq", "--eval-windows", "1")
            result["accept_500"]["one_qf_submit_process_seconds"] = round(one_cli, 2)

            # status with 10,000 jobs
            rows = [
                {
                    "id": uuid.uuid4().hex[:12],
                    "key": uuid.uuid4().hex * 2,
                    "name": job.name,
                    "source": job.source,
                    "source_identity": job.source_identity,
                    "base_model": "tiny",
                    "specs": job.specs,
                    "calibration": job.calibration,
                    "calibration_sha": job.calibration_sha,
                    "eval": job.eval,
                    "eval_sha": job.eval_sha,
                    "eval_windows": 1,
                    "max_ppl_ratio": 1.5,
                    "versions": job.versions,
                    "device": "cpu",
                    "state": "succeeded",
                    "attempts": 1,
                }
                for _ in range(10_000 - 500)
            ]
            with factory.catalog.db.engine.begin() as conn:
                conn.execute(insert(Job), rows)
            one = [_qf(env, "status", job.id) for _ in range(5)]
            listing = [_qf(env, "status") for _ in range(5)]
            result["status_10000_jobs"] = {
                "qf_status_job_seconds_median": round(statistics.median(one), 3),
                "qf_status_list_seconds_median": round(statistics.median(listing), 3),
                "python_startup_and_imports_included": True,
            }
            result["api"] = _api(env, model)
            redis.Redis.from_url(args.broker).flushdb()

            # overhead: one job through a worker vs qf run
            job_args = ["--awq", "--eval-windows", "2", "--calibration", "builtin:code"]  # not one of the 500
            run_seconds = _qf(
                {**env, "FACTORY_HOME": str(tmp / "run-home"), "FACTORY_DB_URL": ""}, "run", str(model), *job_args
            )
            log = open(tmp / "worker.log", "w")
            worker = subprocess.Popen(
                [sys.executable, "-m", "factory.cli", "worker"], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
            )
            deadline = time.monotonic() + 60
            while "ready for the next job" not in (tmp / "worker.log").read_text():  # a worker that is up
                assert time.monotonic() < deadline, (tmp / "worker.log").read_text()
                time.sleep(0.2)
            start = time.monotonic()
            job_id = subprocess.run(
                [sys.executable, "-m", "factory.cli", "submit", str(model), *job_args],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            deadline = time.monotonic() + 300
            while (state := factory.catalog.jobs.get(job_id).state) not in ("succeeded", "failed"):
                assert time.monotonic() < deadline, f"job {job_id} still {state}"
                time.sleep(0.1)
            queued_seconds = time.monotonic() - start
            worker.terminate()
            worker.wait(timeout=30)
            result["overhead_per_job"] = {
                "qf_run_seconds": round(run_seconds, 2),
                "submit_to_succeeded_seconds": round(queued_seconds, 2),
                "overhead_seconds": round(queued_seconds - run_seconds, 2),
                "state": state,
            }
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        redis.Redis.from_url(args.broker).flushdb()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"commit": commit, "command": "python benchmarks/queue_costs.py", **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
