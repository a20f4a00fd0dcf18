"""`qf` as its users run it (a child process; a service's user's command in this process), and waiting on one."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import traceback

import psutil
from typer.testing import CliRunner

from factory.cli import app
from factory.engines import warm
from factory.errors import SpecError
from factory.publish.publishing import STOP_AT
from tests.support import ROOT
from tests.support.qf import Qf


def qf(env, *args, check=False) -> subprocess.CompletedProcess:
    """`qf ARGS` to its end with the environment `env` (a whole one: os.environ and the factory's variables). A
    user's command to a service (FACTORY_SERVER in `env`) runs in this process (`qf_here`) but a `--follow`, which
    lasts as long as its job (a child is stopped by its timeout); any other in a child."""
    if env.get("FACTORY_SERVER") and "--follow" not in args:
        return qf_here(env, *args, check=check)
    return subprocess.run(
        [sys.executable, "-m", "factory.cli", *map(str, args)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=check,
        timeout=180,
    )


def qf_here(env, *args, check=False) -> subprocess.CompletedProcess:
    """`qf ARGS` in this process through typer's runner, with exactly the environment `env`, for a command whose child
    interpreter is not what a test tests: a service user's (an HTTP client that reads its settings when it runs), a
    token made as a test's setup, a status polled. A child's imports were most of what such a command cost (1.2
    CPU-s; 99 service users' commands in test_service, test_service_races, test_fleet_cpu and test_readme_fleet,
    2026-12-08). What escapes the command's handling is written to stderr as a traceback, as a child's would be; a
    SpecError typer raises while it parses options, as factory.cli.main says it."""
    argv = [str(a) for a in args]
    gone = {k: None for k in os.environ if k not in env}  # unset while it runs, as in a child of `env`
    result = CliRunner().invoke(app, argv, env={**gone, **env}, prog_name="qf")
    code, stderr = result.exit_code, result.stderr
    if isinstance(result.exception, SpecError):
        code, stderr = result.exception.exit_code, stderr + f"error: {result.exception.message}\n"
    elif result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    done = subprocess.CompletedProcess(["qf", *argv], code, result.stdout, stderr)
    if check:
        done.check_returncode()
    return done


def qf_process(qf: Qf, *args, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """`qf ARGS` started with the home and catalog of `qf` (and `env` over them)."""
    return subprocess.Popen(
        [sys.executable, "-m", "factory.cli", *map(str, args)],
        env={**os.environ, **qf.env, **(env or {})},
        cwd=ROOT,
        text=True,
        **popen,
    )


def wait_until(check, seconds: float = 60.0):
    """What `check()` returns once it is true; an AssertionError after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {check}")


def events_until(proc: subprocess.Popen, step: str) -> None:
    """Read a `qf run --json` child's events until `step` is running."""
    for line in proc.stdout:
        event = json.loads(line)
        if event["event"] == "step" and event["step"] == step and event["state"] == "running":
            return
    raise AssertionError(f"{step} never started")


def stopped_at(qf: Qf, moment: str, *args, **env: str) -> subprocess.Popen:
    """`qf run` stopped at `moment` of publishing (publishing.moment: a SIGSTOP to itself)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "factory.cli", "run", *map(str, args)],
        cwd=ROOT,
        env={**os.environ, **qf.env, STOP_AT: moment, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, 120)
    except BaseException:
        proc.kill()
        raise
    return proc


def tree(pid: int) -> list[int]:
    """The process and all its descendants, with the engines a starter it shares with others forked for any of
    them (`shared_engines`) and theirs ([] once it is gone)."""
    forked, pids, todo = _forked_by_starters(), [], [pid]
    while todo:
        try:
            top = psutil.Process(todo.pop())
            members = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in members:
            if proc.pid not in pids:
                pids.append(proc.pid)
                todo.extend(p.pid for p in shared_engines(proc.pid, forked))
    return pids


def engines(pid: int) -> list[psutil.Process]:
    """The processes `pid` started for its engines (their watchdogs too): its children, with a warm starter's
    children in place of the starter (factory/engines/warm.py: it forks a process's Python engines), and those a
    starter an ancestor shares forked for it."""
    found = []
    for proc in psutil.Process(pid).children():
        try:
            found.extend(proc.children() if warm.STARTER in proc.cmdline() else [proc])
        except psutil.NoSuchProcess:
            pass
    return found + [p for p in shared_engines(pid, _forked_by_starters()) if p not in found]


def shared_engines(pid: int, forked: list[psutil.Process]) -> list[psutil.Process]:
    """Of `forked` (every starter's children), those a starter that `pid` does not own forked for it (warm.share: a
    worker's, this test process's): no process links them to `pid` but their output, so they are the ones that hold
    the write end of a pipe `pid` reads (warm.start gives each child a stdout pipe of its own and keeps its read end;
    an engine may move it off fd 1, as the round engine does)."""
    reads = _pipes(pid, os.O_RDONLY)
    return [p for p in forked if _pipes(p.pid, os.O_WRONLY) & reads] if reads else []


def _forked_by_starters() -> list[psutil.Process]:
    """The children of every warm starter on the machine."""
    found = []
    for starter in psutil.process_iter(["cmdline"]):
        if warm.STARTER in (starter.info["cmdline"] or ()):
            with contextlib.suppress(psutil.NoSuchProcess):
                found.extend(starter.children())
    return found


def _pipes(pid: int, mode: int) -> set[str]:
    """The pipes (`pipe:[INODE]`) `pid` holds an end of open for `mode` (os.O_RDONLY, os.O_WRONLY)."""
    found = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError, StopIteration):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("pipe:"):
                    with open(f"/proc/{pid}/fdinfo/{fd}") as info:
                        flags = next(int(line.split()[1], 8) for line in info if line.startswith("flags:"))
                    if flags & os.O_ACCMODE == mode:
                        found.add(target)
    return found


def job_processes(worker: int) -> list[psutil.Process]:
    """A worker's job processes: the children of its fork server (workers/tasks.py), the running one and the spare."""
    found = []
    for proc in psutil.Process(worker).children():
        try:
            if "multiprocessing.forkserver" in " ".join(proc.cmdline()):
                found.extend(proc.children())
        except psutil.NoSuchProcess:
            pass
    return found


def send(pids: list[int], sig: int) -> None:
    """`sig` to each of `pids` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
