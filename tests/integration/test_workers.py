"""The distributed factory against the real Redis and a real worker process (tiny model, AWQ on the CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import psutil
import pytest
import redis

from tests.support import ROOT, processes
from tests.support.fleet import BROKER, follow_while_a_worker_runs, start_worker
from tests.support.processes import qf, qf_here, send, tree


@pytest.fixture
def env(tmp_path, db_url):
    """The factory's variables for a test's own catalog; a worker the test left running fails it, killed (it
    would take the next tests' messages from the broker and look for their jobs in this catalog)."""
    redis.Redis.from_url(BROKER).flushdb()
    yield {
        **os.environ,
        "FACTORY_HOME": str(tmp_path / "home"),
        "FACTORY_DB_URL": db_url,
        "FACTORY_BROKER_URL": BROKER,
        "FACTORY_WORKER_DEVICE": "cpu",
    }
    left = [p for p in psutil.Process().children() if _is_worker(p)]
    for proc in left:
        send(tree(proc.pid), signal.SIGKILL)
    assert not left, f"workers left running by the test: {[p.pid for p in left]}"


def _is_worker(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE and "workers.app" in proc.cmdline()  # `qf worker` execs celery
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def worker(env, tmp_path):
    proc = start_worker(env, tmp_path / "worker.log")
    yield proc
    proc.terminate()
    proc.wait(timeout=30)


def status_of(env, job_id: str) -> dict:
    """`qf status JOB --json` in this process: polled five times a second, a child interpreter each time (0.6 s of
    CPU) kept a core busy while the worker it waited on needed it."""
    result = qf_here(env, "status", job_id, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def wait_until(env, job_id: str, done, timeout: float = 240, what: str = "done") -> dict:
    """Poll `qf status JOB --json` until `done(status)`; the last status."""
    deadline = time.monotonic() + timeout
    while not done(status := status_of(env, job_id)):
        assert time.monotonic() < deadline, f"job {job_id} not {what} after {timeout} s: {status}"
        time.sleep(0.2)
    return status


def wait_for(env, job_id: str, timeout: float = 240) -> dict:
    return wait_until(env, job_id, lambda s: s["state"] in ("succeeded", "failed", "cancelled"), timeout, "ended")


def quantizing(status: dict) -> bool:
    return any(s["name"].startswith("quantize:") and s["state"] == "running" for s in status["steps"])


def running_job_process(worker: subprocess.Popen):
    """The worker's job process that runs its job (a child of the worker's fork server): the one with an engine
    (the other one waits for the next job). A step shows `running` a moment before its engine starts: wait for
    that."""

    def found():
        return [p for p in processes.job_processes(worker.pid) if processes.engines(p.pid)]

    [job_process] = processes.wait_until(found, 60)
    return job_process


def run_worker_until_done(env, job_id: str, log_path: Path, queues: str = "gpu,cpu") -> dict:
    """Start a worker, wait for the job to end, stop the worker; the job's last status."""
    worker = start_worker(env, log_path, queues)
    try:
        return wait_for(env, job_id)
    finally:
        worker.terminate()
        worker.wait(timeout=30)


def test_submit_runs_on_a_worker(env, worker, tiny):
    submitted = qf(env, "submit", tiny, "--awq", "--eval-windows", 1, check=True)
    job_id = submitted.stdout.strip()
    assert len(job_id) == 12 and submitted.stdout == job_id + "\n"
    assert qf(env, "submit", tiny, "--awq", "--eval-windows", 1, check=True).stdout.strip() == job_id
    status = wait_for(env, job_id)
    assert status["state"] == "succeeded", status
    assert [s["name"] for s in status["steps"]][-1] == "publish:awq-w4g128"
    [row] = json.loads(qf(env, "ls", "--json", check=True).stdout)
    assert row["name"] == "tiny:awq-w4g128" and row["job"] == job_id


def test_status_of_an_unknown_job(env):
    result = qf(env, "status", "nosuchjob")
    assert result.returncode == 4
    assert result.stderr.strip() == "error: no job 'nosuchjob'; `qf status` lists the recent ones"


def test_broker_unreachable(env, tiny):
    down = {**env, "FACTORY_BROKER_URL": "redis://:s3cret@127.0.0.1:1/0"}
    result = qf(down, "submit", tiny, "--awq")
    assert result.returncode == 5, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "error: the broker at redis://:***@127.0.0.1:1/0 cannot be reached"
    assert result.stdout == "" and "s3cret" not in result.stderr
    assert json.loads(qf(env, "jobs", "--json", check=True).stdout) == []  # nothing left behind for each attempt


def test_submit_exl2_for_cpu_workers(env, tiny):
    result = qf(env, "submit", tiny, "--exl2", "4.0")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: EXL2 (--exl2, --fit) needs a CUDA GPU and the workers "
        "(FACTORY_WORKER_DEVICE) have none; AWQ runs without one (--awq), AWQ-CT "
        "runs without one (--awqct), GGUF runs without one (--gguf)"
    )


def test_cancel_a_queued_job(env, tiny, tmp_path):
    job_id = qf(env, "submit", tiny, "--awq", "--eval-windows", 1, check=True).stdout.strip()
    assert qf(env, "cancel", job_id, check=True).stderr.strip() == f"job {job_id}: cancelled"
    # a worker that starts afterwards takes the message and leaves the job alone
    proc = start_worker(env, tmp_path / "late-worker.log", args=["worker", "--slots", "1"])  # every queue
    try:
        deadline = time.monotonic() + 60
        while "succeeded in" not in (tmp_path / "late-worker.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "late-worker.log").read_text()
            time.sleep(0.3)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    status = json.loads(qf(env, "status", job_id, "--json", check=True).stdout)
    assert (status["state"], status["steps"]) == ("cancelled", [])
    assert json.loads(qf(env, "ls", "--json", check=True).stdout) == []


def test_cancel_a_running_job_then_retry(env, worker, tiny):
    job_id = qf(env, "submit", tiny, "--awq", "--eval-windows", 1, check=True).stdout.strip()
    wait_until(env, job_id, quantizing, 120, "quantizing")
    qf(env, "cancel", job_id, check=True)
    deadline = time.monotonic() + 60
    status = wait_for(env, job_id)
    while any(s["state"] == "running" for s in status["steps"]):  # the worker stops them at their next event
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
        status = wait_for(env, job_id)
    assert status["state"] == "cancelled"
    # every unit running at the cancel (several at once on two cores) says so, whichever saw it first
    stopped = [(s["name"], s["state"], s["error"]) for s in status["steps"] if s["state"] != "succeeded"]
    assert stopped and all(s[1:] == ("failed", f"job {job_id} was cancelled") for s in stopped), stopped
    assert json.loads(qf(env, "ls", "--json", check=True).stdout) == []
    time.sleep(1)  # the work folder goes right after the step is marked failed
    assert not (Path(env["FACTORY_HOME"]) / "work" / job_id).exists()

    assert qf(env, "retry", job_id, check=True).stdout.strip() == job_id
    assert wait_for(env, job_id)["state"] == "succeeded"
    assert [r["job"] for r in json.loads(qf(env, "ls", "--json", check=True).stdout)] == [job_id]
    again = qf(env, "retry", job_id)
    assert (again.returncode, again.stderr.strip()) == (
        2,
        f"error: job {job_id} is succeeded; only failed or cancelled jobs can be retried",
    )
    unknown = qf(env, "retry", "0123456789ab")
    assert (unknown.returncode, unknown.stderr.strip()) == (
        4,
        "error: no job '0123456789ab'; `qf status` lists the recent ones",
    )


def test_a_dead_job_process_fails_the_job_and_the_worker_goes_on(env, tiny, tmp_path):
    """Each job runs in a process of its own; killed (as the OOM killer would), the job fails with the
    reason, its engine goes with it, and the same worker runs the retry. The worker started as its users start it
    (no starter of warm engine children shared with it: tests/conftest.py shares this process's with the others)
    has one of its own for all its job processes (workers/tasks.py), which goes on after one of them is killed."""

    from factory.engines import warm

    env = {k: v for k, v in env.items() if k != warm.SHARED}
    worker = start_worker(env, tmp_path / "worker.log")
    try:
        job_id = qf(env, "submit", tiny, "--awq", "--eval-windows", 1, check=True).stdout.strip()
        wait_until(env, job_id, quantizing, 120, "quantizing")
        job_process = running_job_process(worker)
        engines = [psutil.Process(pid) for pid in tree(job_process.pid)[1:]]  # its engine and its watchdog
        [starter] = {p.parent() for p in engines if p.ppid() != job_process.pid}
        assert warm.STARTER in starter.cmdline() and starter.ppid() == worker.pid
        job_process.kill()
        status = wait_for(env, job_id, 60)
        assert (status["state"], status["error"]) == ("failed", "the job's process died (killed by SIGKILL)")
        stopped = [(s["state"], s["error"]) for s in status["steps"] if s["state"] != "succeeded"]  # one or two
        assert stopped and all(s == ("failed", status["error"]) for s in stopped), stopped
        gone, alive = psutil.wait_procs(engines, timeout=15)
        assert alive == [] and worker.poll() is None and starter.is_running()

        assert qf(env, "retry", job_id, check=True).stdout.strip() == job_id
        assert wait_for(env, job_id)["state"] == "succeeded"
    finally:
        worker.terminate()
        worker.wait(timeout=30)


SUBMITTER = """
import sys
from typer.testing import CliRunner
from factory.cli import app
source, windows = sys.argv[1], sys.argv[2:]
for w in windows:
    result = CliRunner().invoke(app, ["submit", source, "--awq", "--eval-windows", w])
    if result.exit_code != 0:
        import traceback
        traceback.print_exception(result.exception)
        sys.exit(f"submission {w} failed: {result.output}")
    print(result.stdout.strip(), w, flush=True)
"""


def test_concurrent_submissions(env, tiny):
    """50 submissions from 5 processes at once, 10 of them repeats: 40 jobs, 40 queued messages, none lost."""
    windows = [str(i) for i in range(1, 41)] + [str(i) for i in range(1, 41, 4)]  # eval windows make jobs distinct
    batches = [windows[i::5] for i in range(5)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SUBMITTER, str(tiny), *batch],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for batch in batches
    ]
    lines = []
    for proc in procs:
        out, errors = proc.communicate(timeout=300)
        assert proc.returncode == 0, errors
        lines += out.splitlines()
    ids = {}
    for line in lines:
        job_id, w = line.split()
        assert ids.setdefault(w, job_id) == job_id  # the same submission always gets the same job
    assert len(lines) == 50 and len(ids) == 40 and len(set(ids.values())) == 40
    jobs = json.loads(qf(env, "jobs", "--json", "--limit", 100, check=True).stdout)
    assert len(jobs) == 40 and {j["state"] for j in jobs} == {"queued"}
    assert redis.Redis.from_url(BROKER).llen("cpu") == 40


class OwnRedis:
    """A redis-server of the test's own (appendonly, a free port, a temp dir) that can be restarted for real."""

    def __init__(self, folder: Path):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.folder, self.url, self.proc = folder, f"redis://127.0.0.1:{self.port}/0", None
        folder.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--appendonly",
                "yes",
                "--dir",
                str(self.folder),
                "--save",
                "",
            ],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def test_queued_jobs_survive_a_redis_restart(env, tiny, tmp_path):
    server = OwnRedis(tmp_path / "redis")
    server.start()
    try:
        env = {**env, "FACTORY_BROKER_URL": server.url}
        # two jobs (three until 2026-12-07: 51 CPU-s, the suite's third costliest test, for the same proof)
        ids = [qf(env, "submit", tiny, "--awq", "--eval-windows", w, check=True).stdout.strip() for w in (1, 2)]
        server.stop()
        server.start()
        assert redis.Redis.from_url(server.url).llen("cpu") == 2
        worker = start_worker(env, tmp_path / "worker.log", args=["worker", "--slots", "1"])  # every queue
        try:
            assert [wait_for(env, job_id)["state"] for job_id in ids] == ["succeeded"] * 2
        finally:
            worker.terminate()
            worker.wait(timeout=30)
    finally:
        server.stop()


def test_killed_worker_the_job_finishes_elsewhere_once(env, tiny, tmp_path):
    """SIGKILL of a worker in the middle of a quantize step: its job processes (the running one, its engine and the
    spare) end with it, its lease expires, the reconciler re-enqueues the job, a second worker finishes it; one
    quant, published once; the history shows the lost attempt."""

    env = {**env, "FACTORY_LEASE_SECONDS": "3"}
    first = start_worker(env, tmp_path / "first.log")
    job_id = qf(env, "submit", tiny, "--awq", "--eval-windows", 1, check=True).stdout.strip()
    wait_until(env, job_id, quantizing, 120, "quantizing")
    running = running_job_process(first)
    left = [*processes.job_processes(first.pid), *(psutil.Process(pid) for pid in tree(running.pid)[1:])]
    assert len(left) >= 3  # the running job process, the spare, the engine
    first.kill()
    first.wait()
    assert psutil.wait_procs(left, timeout=15)[1] == []
    time.sleep(4)  # the lease runs out
    assert qf(env, "reconcile", check=True).stdout.split() == [job_id]
    status = run_worker_until_done(env, job_id, tmp_path / "second.log")
    assert status["state"] == "succeeded"
    quantize = [(s["state"], s["error"]) for s in status["steps"] if s["name"].startswith("quantize:")]
    assert quantize == [("interrupted", "interrupted"), ("succeeded", None)]  # marked by the next holder
    assert [s["name"] for s in status["steps"]].count("publish:awq-w4g128") == 1
    [row] = json.loads(qf(env, "ls", "--json", check=True).stdout)
    assert row["job"] == job_id
    assert len(list((Path(env["FACTORY_HOME"]) / "registry" / "tiny").iterdir())) == 1


def _queued_long_ago(env, job_id: str) -> None:
    """The job was queued long enough ago for the reconciler to look for its message."""
    from sqlalchemy import create_engine, text

    url = env["FACTORY_DB_URL"] or f"sqlite:///{env['FACTORY_HOME']}/catalog.db"
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg2://", 1))
    with engine.begin() as conn:
        conn.execute(text("UPDATE jobs SET updated_at = '2000-01-01 00:00:00' WHERE id = :id"), {"id": job_id})
    engine.dispose()


def test_reconcile_requeues_a_job_the_broker_lost(env, tiny):
    job_id = qf(env, "submit", tiny, "--awq", "--eval-windows", 1, check=True).stdout.strip()
    redis.Redis.from_url(BROKER).delete("cpu")  # the message is gone
    _queued_long_ago(env, job_id)
    assert qf(env, "reconcile", check=True).stdout.split() == [job_id]
    assert redis.Redis.from_url(BROKER).llen("cpu") == 1
    assert qf(env, "reconcile", check=True).stdout.split() == []  # now the broker holds it


def test_status_follow_streams_the_workers_events(env, tiny, tmp_path):
    job_id = qf(env, "submit", tiny, "--awq", "--eval-windows", 1, check=True).stdout.strip()
    events = follow_while_a_worker_runs(env, env, job_id, tmp_path / "worker.log")
    assert events[-1]["event"] == "result" and events[-1]["state"] == "succeeded"
    assert any(e["event"] == "progress" and e.get("unit") == "layer" for e in events)
    assert [e["step"] for e in events if e["event"] == "step" and e["state"] == "succeeded"][0] == "inspect"


def test_a_gpu_worker_leaves_a_cpu_job_to_the_cpu_worker(env, tiny, tmp_path):
    """A job planned for the CPU (FACTORY_WORKER_DEVICE=cpu) goes to the cpu queue: a worker of the gpu queue takes
    none of it, and a cpu worker runs it through publishing. (Quantizing on the gpu queue and publishing on the cpu
    queue is a CUDA job's way, which needs a GPU: tests/integration/test_fleet_cpu.py checks the routing of one.)"""
    job_id = qf(env, "submit", tiny, "--awq", "--eval-windows", 1, check=True).stdout.strip()
    gpu = start_worker(env, tmp_path / "gpu.log", "gpu")
    try:
        time.sleep(2)
        status = json.loads(qf(env, "status", job_id, "--json", check=True).stdout)
    finally:
        gpu.terminate()
        gpu.wait(timeout=30)
    assert (status["state"], status["steps"]) == ("queued", [])
    assert redis.Redis.from_url(BROKER).llen("cpu") == 1
    status = run_worker_until_done(env, job_id, tmp_path / "cpu.log", "cpu")
    assert status["state"] == "succeeded"
    names = [s["name"] for s in status["steps"]]
    assert names.count("quantize:awq-w4g128") == 1 and names[-1] == "publish:awq-w4g128"


def test_a_job_that_keeps_losing_workers_fails_instead_of_looping(env, tiny, monkeypatch):
    """Each lost worker leaves an expired lease; past FACTORY_MAX_ATTEMPTS the next delivery fails the job."""
    for key, value in {**env, "FACTORY_MAX_ATTEMPTS": "2", "FACTORY_LEASE_SECONDS": "0.01"}.items():
        monkeypatch.setenv(key, value)
    from factory import settings
    from factory.factory import Factory
    from workers import tasks

    job_id = qf(env, "submit", tiny, "--awq", "--eval-windows", 1, check=True).stdout.strip()
    catalog = Factory(settings.load()).catalog
    for lost in ("host:1", "host:2"):  # two workers took it and died
        assert catalog.leases.take(job_id, lost, 0.01) is not None
        time.sleep(0.05)
    tasks.run_job(job_id)  # the third delivery
    job = catalog.jobs.get(job_id)
    assert (job.state, job.error) == ("failed", "job lost its worker 2 times; giving up (FACTORY_MAX_ATTEMPTS=2)")
    assert job.steps == []


def _catalog(env):
    from factory.catalog import Catalog

    return Catalog(env["FACTORY_DB_URL"] or f"sqlite:///{env['FACTORY_HOME']}/catalog.db")


def _published(env, job_id: str) -> tuple:
    """What the job published: its quant rows' ids and the registry folders with their manifests."""
    folders = sorted((Path(env["FACTORY_HOME"]) / "registry" / "tiny").iterdir())
    return (
        [q.id for q in _catalog(env).quants.live(job_id=job_id)],
        [(f.name, (f / "manifest.json").read_text()) for f in folders],
    )


def _wait_in_log(path: Path, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert time.monotonic() < deadline, f"{text!r} not in {path}: {path.read_text()[-3000:]}"
        time.sleep(0.2)


def test_a_stopped_worker_that_comes_back_changes_nothing(env, tiny, tmp_path):
    """SIGSTOP a worker and everything under it past its lease while it quantizes; a second worker takes the job
    over and publishes it; SIGCONT: the first finds its lease lost, kills its job process, writes nothing. One
    publish, the job succeeded with attempts 2."""
    env = {**env, "FACTORY_LEASE_SECONDS": "3"}
    first = start_worker(env, tmp_path / "first.log")
    second = None
    try:
        job_id = qf(env, "submit", tiny, "--awq", "--eval-windows", 1, check=True).stdout.strip()
        wait_until(env, job_id, quantizing, 120, "quantizing")
        stopped = tree(first.pid)
        send(stopped, signal.SIGSTOP)
        time.sleep(4)  # the lease runs out
        assert qf(env, "reconcile", check=True).stdout.split() == [job_id]
        second = start_worker(env, tmp_path / "second.log")
        assert wait_for(env, job_id)["state"] == "succeeded"
        before = _published(env, job_id)
        send(stopped, signal.SIGCONT)
        _wait_in_log(tmp_path / "first.log", f"job {job_id}: lease lost to ")
        time.sleep(3)  # time for the stale job process to try anything it still would
        status = wait_for(env, job_id)
        assert status["state"] == "succeeded" and _published(env, job_id) == before
        assert len(before[0]) == 1 and len(before[1]) == 1
        assert [s["name"] for s in status["steps"]].count("publish:awq-w4g128") == 1
        assert not any(s["state"] == "running" for s in status["steps"])
        assert _catalog(env).jobs.get(job_id).attempts == 2
        assert first.poll() is None  # the worker goes on; only its job process was killed
    finally:
        for worker in (first, second):
            if worker is not None:
                worker.terminate()
                worker.wait(timeout=30)


def test_a_stalled_job_process_is_killed_by_its_worker_and_continues(env, tiny, tmp_path):
    """Only the job process stops (SIGSTOP): past FACTORY_STALL_SECONDS without progress its worker stops renewing
    the lease and kills it; after the lease, the reconciler queues the job again and it finishes. The stall limit
    is longer than the job's longest silence on a busy 2-core machine (its AWQ child importing autoawq): CI once
    saw the second attempt killed as stalled too at 15 s, and nothing queued it again."""

    env = {**env, "FACTORY_LEASE_SECONDS": "3", "FACTORY_STALL_SECONDS": "40"}
    worker = start_worker(env, tmp_path / "worker.log")
    try:
        job_id = qf(env, "submit", tiny, "--awq", "--eval-windows", 1, check=True).stdout.strip()
        wait_until(env, job_id, quantizing, 120, "quantizing")
        job_process = running_job_process(worker)
        job_process.suspend()
        _wait_in_log(tmp_path / "worker.log", f"job {job_id}: no progress for 40 s (FACTORY_STALL_SECONDS)")
        assert psutil.wait_procs([job_process], timeout=15)[1] == []  # killed
        time.sleep(4)  # the lease runs out
        assert qf(env, "reconcile", check=True).stdout.split() == [job_id]
        status = wait_for(env, job_id)
        assert status["state"] == "succeeded" and _catalog(env).jobs.get(job_id).attempts == 2
        assert len(_published(env, job_id)[0]) == 1
    finally:
        worker.terminate()
        worker.wait(timeout=30)


def test_a_worker_that_cannot_reach_its_services_exits_5(env):
    broker = qf({**env, "FACTORY_BROKER_URL": "redis://:secret@127.0.0.1:1/0"}, "worker")
    assert broker.returncode == 5
    assert broker.stderr.strip().splitlines()[-1] == "error: the broker at redis://:***@127.0.0.1:1/0 cannot be reached"
    catalog = qf({**env, "FACTORY_DB_URL": "postgresql://qf:secret@127.0.0.1:1/qf"}, "worker")
    assert catalog.returncode == 5
    assert catalog.stderr.strip().splitlines()[-1] == (
        "error: the catalog database at postgresql://qf:***@127.0.0.1:1/qf cannot be reached"
    )


def test_reconcile_skips_a_malformed_message(env, tiny):
    """Poison in the queues and in `unacked` (delivered, not acknowledged): each entry is skipped with a log line,
    and a job the broker lost is queued again all the same."""
    job_id = qf(env, "submit", tiny, "--awq", "--eval-windows", 1, check=True).stdout.strip()
    client = redis.Redis.from_url(BROKER)
    client.delete("cpu")  # the job's message is lost
    client.lpush(
        "cpu", b"not a message", json.dumps({"headers": {"task": "quantfactory.run_job", "argsrepr": "(oops"}})
    )
    client.hset(
        "unacked",
        mapping={
            "t1": "not json",
            "t2": json.dumps({"a": 1}),
            "t3": "[]",
            "t4": "[1, 2]",
            "t5": json.dumps([{"headers": {"task": "quantfactory.run_job", "argsrepr": "(oops"}}, "", "cpu"]),
            "t6": "[" * 100_000 + "]" * 100_000,  # json.loads: RecursionError (issue 43)
            "t7": json.dumps([{"headers": {"task": "quantfactory.run_job", "argsrepr": "(" * 100_000}}, "", "cpu"]),
        },
    )
    _queued_long_ago(env, job_id)
    result = qf(env, "reconcile")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert result.stdout.split() == [job_id] and result.stderr.count("skipped a malformed message") == 8
    assert client.llen("cpu") == 3


# One job's conversions on two workers (the round engine of tests/support/round_engine.py, in every process through
# FACTORY_ENGINES; one unit at a time per worker, so that the job's holder leaves sizes for a helper).
ROUND = {"FACTORY_ENGINES": "tests.support.round_engine:ENGINE", "FACTORY_MAX_UNITS": "1", "QF_TEST_ROUND_SECONDS": "6"}


def _round_job(env, tiny, tmp_path) -> str:
    recipe = tmp_path / "round.yaml"
    recipe.write_text("round: {mantissa: [3, 5, 7]}\nmax_ppl_ratio: 100.0\n")
    return qf(env, "submit", tiny, "--recipe", recipe, "--eval-windows", 1, check=True).stdout.strip()


def _conversions(status: dict) -> list[dict]:
    return [s for s in status["steps"] if s["name"].startswith("quantize:")]


def _helped(status: dict, holder: str) -> list[dict]:
    """The conversions running in another process than `holder`'s."""
    return [s for s in _conversions(status) if s["state"] == "running" and s["holder"] != holder]


def _holder_of(status: dict) -> str:
    return next(s["holder"] for s in status["steps"] if s["name"] == "inspect")


def _worker_of(workers: list[subprocess.Popen], pid: int) -> subprocess.Popen:
    return next(w for w in workers if pid in tree(w.pid))


def test_two_workers_share_the_conversions_of_one_job(env, tiny, tmp_path):
    """A job of three sizes on two workers: the worker holding the job calls for help, the other converts some of
    its sizes at the same time (each claimed, made in a folder of its own, handed to the job as its step
    succeeds); the holder evaluates and publishes all three, each once."""
    env = {**env, **ROUND}
    workers = [start_worker(env, tmp_path / f"worker{i}.log") for i in (1, 2)]
    try:
        job_id = _round_job(env, tiny, tmp_path)
        status = wait_for(env, job_id)
    finally:
        for worker in workers:
            worker.terminate()
            worker.wait(timeout=30)
    assert status["state"] == "succeeded", status
    steps = _conversions(status)
    assert [s["state"] for s in steps] == ["succeeded"] * 3
    assert len({s["holder"] for s in steps}) == 2  # both workers' job processes converted
    spans = {s["holder"]: [] for s in steps}
    for s in steps:
        start = datetime.fromisoformat(s["started_at"])
        spans[s["holder"]].append((start, start + timedelta(seconds=s["seconds"])))
    mine, theirs = spans.values()
    assert any(a < d and c < b for a, b in mine for c, d in theirs)  # at the same time
    ids, folders = _published(env, job_id)
    assert len(ids) == len(folders) == 3
    assert not (Path(env["FACTORY_HOME"]) / "work" / job_id).exists()


def _ready_workers(env, tmp_path) -> list[subprocess.Popen]:
    """Two workers, each once its spare job process is ready: the job submitted next finds its helper waiting. (A
    helper started while the job ran came, on a busy machine, after the holder had made all three sizes.)"""
    workers = []
    try:
        for i in range(2):
            workers.append(start_worker(env, tmp_path / f"worker{i}.log"))
            _wait_in_log(tmp_path / f"worker{i}.log", "ready for the next job")
    except BaseException:
        _stop(workers)
        raise
    return workers


def _stop(workers: list[subprocess.Popen]) -> None:
    for worker in workers:
        if worker.poll() is None:
            worker.terminate()
            worker.wait(timeout=30)


def _helper_and_step(env, job_id: str, workers: list[subprocess.Popen]) -> tuple[subprocess.Popen, dict]:
    """The worker that helps the job, once it converts a size, and its step; it is not the job's holder's."""
    holder = _holder_of(wait_until(env, job_id, quantizing, 120, "quantizing"))
    [step] = _helped(wait_until(env, job_id, lambda st: _helped(st, holder), 120, "helped"), holder)
    helper = _worker_of(workers, int(step["holder"].rpartition(":")[2]))
    assert helper is not _worker_of(workers, int(holder.rpartition(":")[2]))
    return helper, step


def test_a_killed_helper_leaves_its_conversion_to_the_jobs_holder(env, tiny, tmp_path):
    """SIGKILL of the helping worker in the middle of a conversion: its claim runs out, the job's holder marks
    that step interrupted, makes the size itself; the job succeeds with each quant published once."""
    env = {**env, **ROUND, "FACTORY_LEASE_SECONDS": "3"}
    workers = _ready_workers(env, tmp_path)
    try:
        job_id = _round_job(env, tiny, tmp_path)
        helper, step = _helper_and_step(env, job_id, workers)
        send(tree(helper.pid), signal.SIGKILL)
        helper.wait()
        status = wait_for(env, job_id)
    finally:
        _stop(workers)
    assert status["state"] == "succeeded", status
    holder = _holder_of(status)
    again = [(s["state"], s["holder"] == holder) for s in _conversions(status) if s["name"] == step["name"]]
    assert again == [("interrupted", False), ("succeeded", True)]
    assert [s["state"] for s in _conversions(status)].count("succeeded") == 3
    ids, folders = _published(env, job_id)
    assert len(ids) == len(folders) == 3


def test_a_stopped_helper_that_comes_back_writes_nothing(env, tiny, tmp_path):
    """SIGSTOP of the helping worker and everything under it past its claim: the job's holder takes the size over
    and finishes the job; SIGCONT: the helper finds its claim gone and stops without a write (its step stays as
    the holder marked it, nothing more is published, nothing is left running)."""
    env = {**env, **ROUND, "FACTORY_LEASE_SECONDS": "3"}
    workers = _ready_workers(env, tmp_path)
    stopped = None
    try:
        job_id = _round_job(env, tiny, tmp_path)
        helper, step = _helper_and_step(env, job_id, workers)
        stopped = tree(helper.pid)
        send(stopped, signal.SIGSTOP)
        status = wait_for(env, job_id)
        assert status["state"] == "succeeded", status
        before = _published(env, job_id)
        send(stopped, signal.SIGCONT)
        stopped = None
        _wait_in_log(tmp_path / f"worker{workers.index(helper)}.log", f"job {job_id}: a helper stops: ")
        time.sleep(3)  # time for anything it still would do
        after = wait_for(env, job_id)
    finally:
        if stopped:
            send(stopped, signal.SIGCONT)
        _stop(workers)
    assert _published(env, job_id) == before and len(before[0]) == len(before[1]) == 3
    assert [(s["name"], s["state"]) for s in after["steps"]] == [(s["name"], s["state"]) for s in status["steps"]]
    assert [s["state"] for s in _conversions(after) if s["name"] == step["name"]] == ["interrupted", "succeeded"]
    assert not any(s["state"] == "running" for s in after["steps"])


def test_a_gpu_worker_with_two_slots_runs_two_jobs_at_once(env, tiny, tmp_path):
    """`qf worker --slots 2`: two jobs of one size each (nothing to help with) run side by side on one worker, each
    in a job process of its own slot; SIGKILL of the worker takes both slots with it."""

    env = {**env, **ROUND, "QF_TEST_ROUND_SECONDS": "15"}  # long enough for the second slot to start its job
    jobs = []
    for mantissa in (3, 5):
        recipe = tmp_path / f"round{mantissa}.yaml"
        recipe.write_text(f"round: {{mantissa: [{mantissa}]}}\nmax_ppl_ratio: 100.0\n")
        jobs.append(qf(env, "submit", tiny, "--recipe", recipe, "--eval-windows", 1, check=True).stdout.strip())
    log = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "factory.cli", "worker", "--slots", "2"],
        env=env,
        cwd=ROOT,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        statuses = [wait_for(env, job_id) for job_id in jobs]
        slots = psutil.Process(worker.pid).children()
        assert len(slots) == 2 and all("celery" in " ".join(s.cmdline()) for s in slots)
    finally:
        worker.kill()
        worker.wait(timeout=30)
    assert [s["state"] for s in statuses] == ["succeeded", "succeeded"], statuses
    [first], [second] = (_conversions(s) for s in statuses)
    assert first["holder"] != second["holder"]  # two job processes
    spans = []
    for step in (first, second):
        start = datetime.fromisoformat(step["started_at"])
        spans.append((start, start + timedelta(seconds=step["seconds"])))
    (a, b), (c, d) = spans
    assert a < d and c < b  # at the same time
    assert "qf-worker-1@" in log.read_text() and "qf-worker-2@" in log.read_text()
    assert psutil.wait_procs(slots, timeout=15)[1] == []  # killed with the worker
