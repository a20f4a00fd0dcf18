"""Engine children started warm (factory/engines/warm.py): forked from this process's starter, a child runs its module
as `python -m` would, with exactly the environment it was given, and ends as it would; a killed parent or starter
leaves no engine running; what cannot start warm starts cold."""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from factory.engines import child, warm
from factory.errors import JobFailed
from tests.support import ROOT, hostile_user, processes
from tests.support.processes import wait_until

PROBE = "tests.support.warm_probe"


def _probe(log: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    """The probe run as engines run their children (child.run_command): the event it sent."""
    events = []
    child.run_command([sys.executable, "-m", PROBE, *args], log, events.append, "the probe", env=env)
    [event] = events
    return event


def _started(*args: str, flags: tuple[str, ...] = ()) -> tuple[warm.Started, dict]:
    """The probe started warm, its stderr in /dev/null, and the event it sent."""
    with open(os.devnull, "w") as devnull:
        proc = warm.start([sys.executable, *flags, "-m", PROBE, *args], child.environment(), devnull.fileno())
    assert proc is not None
    return proc, json.loads(proc.stdout.readline())


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_warm_child_runs_its_module_as_python_would(tmp_path, monkeypatch):
    monkeypatch.setenv("QF_TEST_NOT_PASSED_ON", "1")  # this process has it; an engine's allowlist does not
    umask = os.umask(0o027)
    try:
        event = _probe(tmp_path / "engine.log", "report", "two words", env={"QF_TEST_ASKED": "yes"})
    finally:
        os.umask(umask)
    assert event["preloaded"] and event["ppid"] != os.getpid()
    assert warm.STARTER in psutil.Process(event["ppid"]).cmdline()  # its parent is this process's starter
    assert event["argv"] == [str(ROOT / "tests" / "support" / "warm_probe.py"), "report", "two words"]
    assert (event["cwd"], event["umask"]) == (os.getcwd(), 0o027)
    assert event["env"] == child.environment({"QF_TEST_ASKED": "yes"})
    assert "the probe's stderr" in (tmp_path / "engine.log").read_text()


@pytest.mark.parametrize(
    ("args", "returncode", "reason"),
    [
        (("report",), 0, None),
        (("exit", "3"), 3, r".* \(exit 3; log: {log}\)"),  # the log's last line: stderr's or stdout's
        (("raise",), 1, r"ValueError: the probe raised \(exit 1; log: {log}\)"),
        (("kill", "SIGTERM"), -signal.SIGTERM, r"the engine process was killed by SIGTERM; log: {log}"),
        (
            ("kill", "SIGKILL"),
            -signal.SIGKILL,
            r"the engine process was killed by SIGKILL \(out of memory\?\); log: {log}",
        ),
    ],
)
def test_a_warm_child_ends_as_a_cold_one_does(tmp_path, monkeypatch, args, returncode, reason):
    """The same exit status and the same failure, started warm and started cold (FACTORY_WARM_START=0)."""
    for start in ("cold", "warm"):
        monkeypatch.setenv("FACTORY_WARM_START", "1" if start == "warm" else "0")
        log = tmp_path / start / "engine.log"
        if reason is None:
            _probe(log, *args)
        else:
            with pytest.raises(JobFailed) as failed:
                _probe(log, *args)
            assert re.fullmatch("the probe failed: " + reason.format(log=re.escape(str(log))), failed.value.message)
    proc, _ = _started(*args)
    assert (proc.wait(30), proc.poll(), proc.returncode) == (returncode,) * 3


def test_a_warm_child_finds_torch_imported(tmp_path, monkeypatch):
    """What the starter is for: the child's own imports of torch and transformers cost next to nothing."""
    _probe(tmp_path / "engine.log", "report")  # this process's starter, started if there was none
    warm_event = _probe(tmp_path / "engine.log", "report")
    monkeypatch.setenv("FACTORY_WARM_START", "0")
    cold = _probe(tmp_path / "engine.log", "report")
    assert warm_event["preloaded"] and warm_event["import_seconds"] < 0.5, warm_event["import_seconds"]
    assert not cold["preloaded"] and cold["ppid"] == os.getpid()
    assert cold["import_seconds"] > warm_event["import_seconds"] + 1.0, cold["import_seconds"]


def test_a_child_starts_warm_where_blas_threads_started_at_import(tmp_path, monkeypatch):
    """Without OMP_NUM_THREADS (a user's machine, a GPU worker), the starter's imports start OpenBLAS's threads, which
    leave forking safe (factory/engines/starter.py): its children still start warm, and their BLAS works."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    event = _probe(tmp_path / "engine.log", "report")
    assert event["preloaded"] and event["ppid"] != os.getpid(), event
    assert "OMP_NUM_THREADS" not in event["env"] and event["blas"] == 512.0**3


def test_terminate_kill_and_minus_u_reach_a_warm_child():
    for stop, sig in ((warm.Started.terminate, signal.SIGTERM), (warm.Started.kill, signal.SIGKILL)):
        proc, event = _started("sleep")
        assert "tests.support.warm_probe" in psutil.Process(event["pid"]).cmdline()  # `ps` shows its command
        stop(proc)
        assert proc.wait(30) == -sig and _gone(event["pid"])
    proc, _ = _started("unflushed", flags=("-u",))
    timer = threading.Timer(30, proc.kill)  # a buffered line would never come: fail, do not hang
    timer.start()
    try:
        assert proc.stdout.readline() == "unflushed\n"
    finally:
        timer.cancel()
        proc.kill()
        proc.wait(30)


def test_a_killed_starter_takes_its_engine_and_the_next_child_gets_a_new_one(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # a starter of its own, not the one this process shares
    proc, event = _started("sleep")
    os.kill(event["ppid"], signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGTERM  # its PDEATHSIG
    assert _gone(event["pid"])
    again = _probe(tmp_path / "engine.log", "report")
    assert again["preloaded"] and again["ppid"] not in (event["ppid"], os.getpid())


PARENT = """
import json, sys
from pathlib import Path
from factory.engines import child
emit = lambda event: print(json.dumps(event), flush=True)
child.run_command([sys.executable, "-m", "tests.support.warm_probe", "sleep"], Path(sys.argv[1]), emit, "the probe")
"""


def _parent(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen, dict]:
    """A process that runs the probe as an engine (PARENT), and the probe's event."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "engine.log")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    return parent, json.loads(parent.stdout.readline())


def test_a_killed_parent_takes_its_starter_and_its_engine_with_it(tmp_path):
    own = {k: v for k, v in os.environ.items() if k != warm.SHARED}  # no ancestor's starter to use
    parent, event = _parent(tmp_path, own)
    try:
        engine, starter = event["pid"], event["ppid"]
        assert psutil.Process(starter).ppid() == parent.pid
        parent.kill()
        wait_until(lambda: _gone(starter) and _gone(engine), 15)
    finally:
        parent.kill()
        parent.wait()


def test_a_descendant_uses_the_starter_its_ancestor_shares_and_a_killed_one_takes_its_engine_with_it(tmp_path):
    """This test process shares its starter (tests/conftest.py one_warm_starter): a process it starts forks its
    engines from it, not from a starter of its own; killed, its engine gets SIGTERM (its connection closed) and the
    starter goes on serving."""
    shared = _probe(tmp_path / "engine.log", "report")["ppid"]
    assert psutil.Process(shared).ppid() == os.getpid() and os.environ[warm.SHARED]
    parent, event = _parent(tmp_path, dict(os.environ))
    try:
        assert event["ppid"] == shared and [p.pid for p in processes.engines(parent.pid)] == [event["pid"]]
        assert event["pid"] in processes.tree(parent.pid)
        parent.kill()
        wait_until(lambda: _gone(event["pid"]), 15)
    finally:
        parent.kill()
        parent.wait()
    assert not _gone(shared) and _probe(tmp_path / "engine.log", "report")["ppid"] == shared


GIVES_UP = """
import json, os, sys
from pathlib import Path
from factory.engines import child, warm
warm.REPLY_SECONDS = warm.CONNECT_SECONDS = 2.0
events = []
child.run_command([sys.executable, "-m", "tests.support.warm_probe", "report"], Path(sys.argv[1]), events.append, "")
print(json.dumps({**events[0], "still_shared": warm.SHARED in os.environ}))
"""


def test_a_stopped_shared_starter_is_given_up_for_one_of_its_own(tmp_path):
    """A descendant whose ancestor's starter is stopped (SIGSTOP) waits REPLY_SECONDS for its answer, not for ever:
    it gives that starter up (its descendants are not offered it) and forks its engine from a starter of its own.
    The shared one, resumed, serves this process again."""
    shared = _probe(tmp_path / "engine.log", "report")["ppid"]
    os.kill(shared, signal.SIGSTOP)
    try:
        done = subprocess.run(
            [sys.executable, "-c", GIVES_UP, str(tmp_path / "engine.log")],
            cwd=ROOT,
            env=dict(os.environ),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        os.kill(shared, signal.SIGCONT)
    assert done.returncode == 0, done.stderr
    event = json.loads(done.stdout)
    assert event["preloaded"] and event["ppid"] != shared and not event["still_shared"]
    assert _probe(tmp_path / "engine.log", "report")["ppid"] == shared


ATTACKER = """
import json, os, socket, sys
conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
conn.connect("\\0" + sys.argv[1])
mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
out_r, out_w = os.pipe()
request = {"module": "tests.support.warm_probe", "args": ["report"], "unbuffered": False, "argv": ["x"],
           "env": {}, "cwd": sys.argv[2], "umask": None}
try:
    socket.send_fds(conn, [json.dumps(request).encode()], [theirs.fileno(), 0, out_w, out_w])
except OSError:
    pass
theirs.close()
os.close(out_w)
mine.settimeout(10)
try:
    answer = mine.recv(4096)
except OSError:
    answer = b""
print(json.dumps({"answer": answer.decode(), "out": os.read(out_r, 4096).decode()}))
"""


def test_a_shared_starter_runs_nothing_for_another_user(tmp_path):
    """A request runs a module as the starter's user: one from another uid's connection is never read."""
    shared = _probe(tmp_path / "engine.log", "report")["ppid"]
    before = {p.pid for p in psutil.Process(shared).children()}
    attacker = hostile_user.uid()
    done = subprocess.run(
        ["/usr/bin/python3", "-c", ATTACKER, os.environ[warm.SHARED], str(ROOT)],
        user=attacker,
        group=pwd.getpwuid(attacker).pw_gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"answer": "", "out": ""}
    assert {p.pid for p in psutil.Process(shared).children()} <= before and not _gone(shared)


def test_what_starts_cold(monkeypatch):
    env = child.environment()
    probe = [sys.executable, "-m", PROBE, "report"]
    assert warm.start(probe, {**env, "PYTHONPATH": "/elsewhere"}, None) is None  # other packages (AWQ-CT's)
    assert warm.start(["/bin/true"], env, None) is None  # a C++ tool
    assert warm.start([sys.executable, "-c", "pass"], env, None) is None
    monkeypatch.setenv("FACTORY_WARM_START", "0")
    assert warm.start(probe, env, None) is None


def test_a_starter_serves_one_environment(tmp_path, monkeypatch):
    """Where libraries read the environment at import, a child gets a starter started with what it was given; a
    cache folder they name is not one of those (the module's docstring). (OMP_NUM_THREADS=3: not the environment of
    the starter this process shares, which is never stopped as idle.)"""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    first = _probe(tmp_path / "engine.log", "report")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    same = _probe(tmp_path / "engine.log", "report")
    assert same["ppid"] == first["ppid"] and same["env"]["HF_HOME"] == str(tmp_path / "hf")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    other = _probe(tmp_path / "engine.log", "report")
    assert other["ppid"] != first["ppid"] and other["env"]["OMP_NUM_THREADS"] == "2"
    assert _gone(first["ppid"])  # the idle starter of the other environment was stopped
