"""The fleet as compose.yaml runs it (issue 31, items 1 and 6): `qf serve` and the CPU worker with compose's own
commands and environment (the test's catalog, broker and folders in place of the containers'), driven through the
HTTP API. An AWQ job is planned for the CPU and runs on the CPU worker; an EXL2 job waits on the gpu queue and says
why; one that reaches a worker without CUDA fails with one sentence; `qf status JOB` exits 1 for a failed job and 6
for a cancelled one, and lists each step of a worker's job once.

The PostgreSQL pass only (compose's catalog is PostgreSQL; a server and two workers take about a minute)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support import ROOT
from tests.support.fleet import start_worker
from tests.support.processes import qf
from tests.support.qf import PG
from tests.support.service import Server, user_env

pytestmark = pytest.mark.skipif(not PG, reason="compose's catalog is PostgreSQL: runs in the PostgreSQL pass")
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
PLACES = ("FACTORY_HOME", "FACTORY_DB_URL", "FACTORY_BROKER_URL", "FACTORY_SERVE_SOURCES")  # the test's, not compose's


def _as_compose_runs(service: str, places: dict) -> tuple[dict, list[str]]:
    """(environment, qf arguments) of a compose service: its variables as compose sets them with nothing in the host's
    environment (`${X:-}` is empty), and the test's catalog, broker and folders."""
    config = COMPOSE[service]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FACTORY_")}
    for name, value in config["environment"].items():
        env[name] = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))
    env.update({name: places[name] for name in PLACES if name in places})
    command = config["command"].split()
    assert command[0] == "qf"
    return env, command[1:]


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=30)


def _until(api: httpx.Client, job_id: str, done, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while not done(job := api.get(f"/api/jobs/{job_id}").json()):
        assert time.monotonic() < deadline, job
        time.sleep(0.3)
    return job


def test_the_service_and_cpu_worker_of_compose_run_what_they_can(factory_env, tmp_path):  # noqa: F811
    service_env, serve_args = _as_compose_runs("service", factory_env)
    assert service_env["FACTORY_WORKER_DEVICE"] == COMPOSE["worker-cpu"]["environment"]["FACTORY_WORKER_DEVICE"]
    assert serve_args[0] == "serve"
    port = serve_args.index("--port")  # Server picks a free one
    server = Server(service_env, tmp_path / "server.log", *serve_args[1:port], *serve_args[port + 2 :])
    workers = []
    try:
        alice = user_env(server, server.token("alice"), tmp_path / "alice")
        api = httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {alice['FACTORY_TOKEN']}"}, timeout=60
        )
        model = str(Path(factory_env["FACTORY_SERVE_SOURCES"]) / "tiny")

        def submit(flags: dict) -> str:
            answer = api.post("/api/jobs", json={"source": model, "flags": flags, "eval_windows": 1})
            assert answer.status_code == 201, answer.text
            return answer.json()["id"]

        awq, exl2, dropped = submit({"awq": True}), submit({"exl2": "4.0"}), submit({"exl2": "5.0"})
        assert api.get(f"/api/jobs/{awq}").json()["waiting"] == "no worker on the cpu queue is up"
        assert api.post(f"/api/jobs/{dropped}/cancel").json()["state"] == "cancelled"
        cancelled = qf(alice, "status", dropped)
        assert cancelled.returncode == 6, cancelled.stdout + cancelled.stderr

        worker_env, worker_args = _as_compose_runs("worker-cpu", factory_env)
        workers.append(start_worker(worker_env, tmp_path / "worker-cpu.log", args=worker_args))
        done = _until(api, awq, lambda j: j["state"] in ("succeeded", "failed", "cancelled"))
        assert (done["state"], done["device"], done["error"]) == ("succeeded", "cpu", None)
        names = list(dict.fromkeys(s["name"] for s in done["steps"]))  # the history has every attempt
        assert names[0] == "inspect" and names[-1] == "publish:awq-w4g128" and "gate" in names
        shown = qf(alice, "status", awq)
        assert shown.returncode == 0, shown.stderr
        listed = [line.split()[0] for line in shown.stdout.splitlines() if line.split()[:1] in ([n] for n in names)]
        assert listed == names, shown.stdout  # each step once, inspect and gate too: their latest records
        assert all(line.split()[1] == "succeeded" for line in shown.stdout.splitlines() if line.split()[:1] == ["gate"])

        waiting = api.get(f"/api/jobs/{exl2}").json()
        assert (waiting["state"], waiting["device"]) == ("queued", "cuda")
        assert waiting["waiting"] == "no worker on the gpu queue is up"
        status = qf(alice, "status", exl2)
        assert status.returncode == 0 and "queued: no worker on the gpu queue is up\n" in status.stdout, status

        gpu_env, gpu_args = _as_compose_runs("worker-gpu0", factory_env)  # here, a machine without CUDA
        workers.append(start_worker(gpu_env, tmp_path / "worker-gpu.log", args=gpu_args))
        failed = _until(api, exl2, lambda j: j["state"] != "queued", 60)
        host = failed["error"].split(" on ", 1)[1].split()[0]
        assert failed["error"] == (
            f"job {exl2} needs a CUDA GPU and the worker on {host} that took it from the gpu "
            f"queue has none; start workers without one with `qf worker --queues cpu`, then "
            f"`qf retry {exl2}`"
        )
        assert (failed["state"], failed["exit_code"], failed["steps"]) == ("failed", 2, [])
        status = qf(alice, "status", exl2)
        assert status.returncode == 1 and f"error: {failed['error']}\n" in status.stdout, status
        jobs = qf(alice, "jobs")
        assert re.search(rf"{exl2} +tiny +failed +failed after 0 steps", jobs.stdout), jobs.stdout
        assert re.search(rf"{awq} +tiny +succeeded +{len(names)}/{len(names)} done", jobs.stdout), jobs.stdout
    finally:
        for worker in workers:
            _stop(worker)
        server.stop()
