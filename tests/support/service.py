"""`qf serve` in a child process for the tests (`Server`; tests/conftest.py's `factory_env` and `server` are the
factory's side of it), a user's machine that reaches only the server (`user_env`), and submissions racing one
another (`race`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support import ROOT
from tests.support.processes import free_port, qf_here

NOWHERE = {"FACTORY_DB_URL": "postgresql://nobody@127.0.0.1:1/none", "FACTORY_BROKER_URL": "redis://127.0.0.1:1/0"}


class Server:
    """`qf serve` in a child process, with the factory's own environment (catalog, broker, registry)."""

    def __init__(self, env: dict, log: Path, *args: str, cwd: Path = ROOT):
        self.env, self.port = env, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "factory.cli", "serve", "--port", str(self.port), *args],
            env=env,
            cwd=cwd,
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(self.url + "/openapi.json", timeout=2)
                break
            except httpx.TransportError:
                assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=30)

    def token(self, user: str, *args: str) -> str:
        """`qf token create --user USER ARGS` as the server's admin runs it, in this process (a test's setup, not
        what it tests: a child interpreter for each token was 1.4 CPU-seconds, 58 of them in a CI run)."""
        made = qf_here(self.env, "token", "create", "--user", user, *args)
        assert made.returncode == 0, made.stderr
        return made.stdout.strip()


def user_env(server: Server, token: str | None, home: Path) -> dict:
    """A user's machine: its own FACTORY_HOME, the server and a token, and no catalog or broker it could reach."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FACTORY_")}
    return {
        **env,
        **NOWHERE,
        "FACTORY_HOME": str(home),
        "FACTORY_SERVER": server.url,
        **({"FACTORY_TOKEN": token} if token else {}),
    }


_RACER = """
import sys, time
import httpx
url, token, windows, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
body = {"source": sys.argv[5], "flags": {"awq": True}, "eval_windows": windows}
with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
    http.get(url + "/api/me").raise_for_status()  # connected and warm before the start
    time.sleep(max(0.0, start - time.time()))
    answer = http.post(url + "/api/jobs", json=body)
print(answer.status_code, answer.json().get("id") or answer.json()["error"])
"""


def race(server: Server, token: str, model: str, n: int) -> list[tuple[int, str]]:
    """`n` processes, each with a different job (its eval windows), submit at the same instant: their (status, job
    id or error)."""
    start = time.time() + 4
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, server.url, token, str(w), str(start), model],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(1, n + 1)
    ]
    answers = [r.communicate(timeout=120) for r in racers]
    assert all(r.returncode == 0 for r in racers), answers
    return [(int(out.split()[0]), out.split(" ", 1)[1].strip()) for out, _ in answers]
