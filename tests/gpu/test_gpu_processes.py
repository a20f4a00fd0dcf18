"""On a CUDA machine: a worker's job processes, forked from its fork server (workers/tasks.py: the server imported
torch, transformers and the factory and never touched CUDA), each use the card, and so do the engine children they
start, warm ones among them (factory/engines/warm.py: forked from a starter that imported torch). Results:
$QF_GPU_RESULTS.

A starter forks only if its imports started no thread but OpenBLAS's (which stop themselves at a fork): with
OMP_NUM_THREADS unset, they start a BLAS thread pool (on an H100 machine's 16 cores, 15 threads at `import torch` and
15 more at `transformers.modeling_utils`, 2026-12-07: benchmarks/results/h100-2026-12-07c), and before the starter
told OpenBLAS's apart, those children started cold there. Each job process starts an engine child as the machine
runs and one with OMP_NUM_THREADS=1 (as CI runs); both must start warm."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from factory.engines import child
from tests.support.gpu_results import RESULTS, save

pytestmark = pytest.mark.gpu


def _job(conn) -> None:
    """In a job process: CUDA untouched at its start, then a matmul on the card, then an engine child's as the
    machine runs and one with OMP_NUM_THREADS=1."""
    import torch

    started = torch.cuda.is_initialized()
    x = torch.ones(256, 256, device="cuda")
    ours = float((x @ x).sum())
    engines = {}
    for threads in (os.environ.get("OMP_NUM_THREADS"), "1"):  # as this machine runs, then as CI runs
        if threads is not None:
            os.environ["OMP_NUM_THREADS"] = threads
        events: list[dict] = []
        log = Path(os.environ["QF_PROBE_LOG"]) / f"{os.getpid()}-{threads}.log"
        child.run_command([sys.executable, "-m", "tests.support.cuda_probe"], log, events.append, "probe")
        engines[f"OMP_NUM_THREADS={threads or ''}"] = events[-1]
    conn.send({"initialized_at_start": started, "sum": ours, "engines": engines})


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
        for engine in result["engines"].values():
            assert (engine["initialized_before"], engine["sum"]) == (False, 256.0**3), found
        assert all(engine["warm"] for engine in result["engines"].values()), found
    RESULTS["checks"]["job_processes_forked_from_the_fork_server"] = found
    save()
