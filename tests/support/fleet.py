"""The fleet's processes: the broker the tests use (QF_TEST_BROKER, a Redis database of their own) and a worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import redis

from tests.support import ROOT

BROKER = os.environ.get("QF_TEST_BROKER", "redis://127.0.0.1:6379/7")


def start_worker(env, log_path: Path, queues: str = "gpu,cpu", args: list[str] | None = None) -> subprocess.Popen:
    """`qf worker --queues QUEUES` (or `qf ARGS`: compose.yaml's command) in a session of its own, once it says it is
    ready."""
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "factory.cli",
            *(args or ["worker", "--queues", queues, "--slots", "1"]),
        ],  # a job at a time
        env=env,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while "ready." not in log_path.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.3)
    return proc


def follow_while_a_worker_runs(env, worker_env, job_id: str, log_path: Path) -> list[dict]:
    """`qf status JOB --follow --json` in `env` (a user's, or the factory's), subscribed to the job's events before
    a worker (in `worker_env`, logging to `log_path`) starts and runs the job: the events it printed until the job
    ended. The worker is stopped then."""
    follower = subprocess.Popen(
        [sys.executable, "-m", "factory.cli", "status", job_id, "--follow", "--json"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    broker, channel = redis.Redis.from_url(BROKER), f"quantfactory:events:{job_id}"  # workers/tasks.py EVENTS
    deadline = time.monotonic() + 60
    while broker.pubsub_numsub(channel) != [(channel.encode(), 1)]:
        assert follower.poll() is None and time.monotonic() < deadline, follower.communicate()
        time.sleep(0.1)
    worker = start_worker(worker_env, log_path)
    try:
        out, errors = follower.communicate(timeout=240)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    assert follower.returncode == 0, errors
    return [json.loads(line) for line in out.splitlines()]
