"""The fleet's processes: the broker the tests use (QF_TEST_BROKER, a Redis database of their own) and a worker."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

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
