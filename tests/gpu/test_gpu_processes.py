"""On a CUDA machine: a worker's job processes, forked from its fork server (workers/tasks.py: the server imported
torch, transformers and the factory and never touched CUDA), each use the card, and so do the warm engine children
they start (factory/engines/warm.py: forked from a starter that imported torch). Results: $QF_GPU_RESULTS."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from factory.engines import child
from tests.support.gpu_results import RESULTS, save

pytestmark = pytest.mark.gpu


def _job(conn) -> None:
    """In a job process: CUDA untouched at its start, then a matmul on the card, then a warm engine child's."""
    import torch

    started = torch.cuda.is_initialized()
    x = torch.ones(256, 256, device="cuda")
    ours = float((x @ x).sum())
    events: list[dict] = []
    log = Path(os.environ["QF_PROBE_LOG"]) / f"{os.getpid()}.log"
    child.run_command([sys.executable, "-m", "tests.support.cuda_probe"], log, events.append, "probe")
    conn.send({"initialized_at_start": started, "sum": ours, "engine": events[-1]})


def test_job_processes_and_their_warm_engines_use_the_card(tmp_path, monkeypatch):
    from workers import tasks

    monkeypatch.setenv("QF_PROBE_LOG", str(tmp_path))
    found = []
    for _ in range(2):  # the second from the same server
        ours, theirs = tasks._JOBS.Pipe()
        proc = tasks._JOBS.Process(target=_job, args=(theirs,), daemon=True)
        proc.start()
        theirs.close()
        found.append(ours.recv() if ours.poll(300) else None)
        proc.join(60)
        assert proc.exitcode == 0, found
    expected = {"initialized_at_start": False, "sum": 256.0**3}
    for result in found:
        assert {k: result[k] for k in expected} == expected, found
        engine = result["engine"]
        assert (engine["initialized_before"], engine["sum"], engine["warm"]) == (False, 256.0**3, True), found
    RESULTS["checks"]["job_processes_forked_from_the_fork_server"] = found
    save()
