"""The README's "A service and a CPU worker on one machine", run as written (issue 45, item 4): its two bash blocks
in one shell, with nothing of the factory's set but what they set (FACTORY_WORKER_DEVICE at its default), HOME a
folder of the test's (so FACTORY_HOME and the SQLite catalog are the defaults under it), the test's Redis database in
place of the README's and a free port in place of 8750. Between the blocks, what the README says to wait for: the
service saying it is up. The AWQ job it submits runs on the CPU worker and is published.
The recipe's catalog is SQLite, so the SQLite pass runs it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from tests.support import ROOT
from tests.support.fleet import BROKER
from tests.support.processes import free_port

HEADING = "### A service and a CPU worker on one machine\n"


def recipe() -> tuple[str, str]:
    """The section's two bash blocks: the factory's side, then the user's."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(HEADING) :].split("\n### ", 1)[0]
    factory_side, user_side = re.findall(r"```bash\n(.*?)```", section, re.S)
    return factory_side, user_side


def test_the_readme_names_every_process_and_variable_the_fleet_needs():
    factory_side, user_side = recipe()
    for needed in ("qf serve", "qf worker --queues cpu", "qf beat", "FACTORY_BROKER_URL=", "FACTORY_SERVE_SOURCES="):
        assert needed in factory_side
    assert "FACTORY_WORKER_DEVICE" not in factory_side  # its default takes an AWQ job to the CPU worker
    assert "qf submit $HOME/models/" in user_side and "FACTORY_SERVER=" in user_side and "FACTORY_TOKEN=" in user_side


def test_the_readme_recipe_runs_an_awq_job_on_a_cpu_worker_as_written(tiny, tmp_path):
    redis.Redis.from_url(BROKER).flushdb()
    home, port = tmp_path / "user", free_port()
    shutil.copytree(tiny, home / "models" / "my-model")
    factory_side, user_side = (
        block.replace("redis://127.0.0.1:6379/0", BROKER).replace("8750", str(port)) for block in recipe()
    )
    log = tmp_path / "shell.log"
    wait = f"until grep -q 'Uvicorn running on' {log}; do sleep 0.3; done\n"  # "once the service is up"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FACTORY_")}
    env.update(HOME=str(home), PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
    shell = subprocess.Popen(
        ["bash", "-c", factory_side + wait + user_side],
        env=env,
        cwd=home,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the shell and the processes it starts in the background: one group to stop
    )
    try:
        shell.wait(timeout=400)
        out = log.read_text()
        job = re.search(r"^job ([0-9a-f]{12}) \(my-model\): succeeded$", out, re.M)  # where --follow ended
        assert job, out
        assert re.search(r"^my-model:awq-w4g128@\w+ +awq +4 ", out, re.M), out
        status = subprocess.run(
            ["qf", "status", job[1], "--json"],
            env={**env, "FACTORY_BROKER_URL": BROKER},
            cwd=home,
            capture_output=True,
            text=True,
            timeout=60,
        )
        row = json.loads(status.stdout)
        assert (row["state"], row["device"], row["error"]) == ("succeeded", "cpu", None), row
        assert row["steps"][-1]["name"] == "publish:awq-w4g128"
    finally:
        _stop_group(shell.pid)


def _stop_group(pgid: int) -> None:
    """SIGTERM to the shell's group (the service, the worker and its job processes, beat), SIGKILL after 30 s."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.3)
    os.killpg(pgid, signal.SIGKILL)
