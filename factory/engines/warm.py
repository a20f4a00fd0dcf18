"""Engine children started warm: forked from a process of ours that has imported torch and transformers already.

Nearly every engine child is `python -m factory.engines.… ARGS` of this interpreter, and each one used to spend its
first seconds of CPU importing the same libraries (torch, transformers and its model machinery: 3 to 4 s on a CPU
core, more than the tiny model's whole AWQ conversion) and its last second tearing them down. The first such child
a process starts, it starts a starter first (factory/engines/starter.py, which says what a forked child gets and how
it ends), its own child, from a thread that lasts as long as the process (a child's PDEATHSIG belongs to the thread
that started it), and hands it each child's command, environment, working folder, umask and stdio. `start` returns
a `Started`, which child.run_command uses as it uses a Popen: pid, stdout, poll, wait, send_signal/terminate/kill
(through a pidfd: never a reused pid), returncode negative for a signal. A killed parent leaves nothing: the
starter gets SIGKILL when its parent dies, and each child SIGTERM when its starter dies, as a cold child did when
its parent died.

What starts warm: `[sys.executable, ("-u",) "-m", MODULE, ARGS...]` whose PYTHONPATH is this process's. Cold, as
before: any other command (C++ tools), a child with a PYTHONPATH of its own (AWQ-CT runs other versions of
transformers from its packages folder), FACTORY_WARM_START=0 (factory/settings.py), and any child whose starter
cannot be had: it failed to start, or its imports started a thread or touched CUDA (forking either is unsafe; this
process then asks no starter for that environment again), or it did not answer a request (it is stopped, and one
new starter gets one try before the child goes cold). A starter that died is replaced at the next request; its
children got SIGTERM, and their `wait()` says -SIGTERM once they are gone. Every starter is stopped and waited for
at exit, so its CPU and its children's count as this process's children's.

One starter for many processes: `share(env)` offers this process's starter for `env` to its descendants
(FACTORY_WARM_STARTER in its environment names the starter's socket, and the environment it serves by a digest of its
key). A descendant that needs a starter for that environment connects to it instead of starting its own (a worker
shares its starter with its job processes; the tests' pytest processes with every `qf`, worker and server they
start): each of its children is then the shared starter's child, not its own, and gets SIGTERM once its connection
closes (it ended, or was killed), as a cold child's PDEATHSIG. A shared starter is never stopped as idle, and one
that is gone (its owner ended), stopped (no connection in CONNECT_SECONDS, no answer in REPLY_SECONDS) or unable to
fork is not asked again: the process starts one of its own. The environment's key names the interpreter, so a
descendant of another virtual environment never uses it. The starter serves only its own uid, and a
process uses a shared starter only if it runs as that uid (SO_PEERCRED, both ways).

What the starter reads at import, and why a child may use it: a starter serves one environment, keyed by the
working folder (sys.path[0] for `-m`) and every variable of the child's environment but KEYLESS. Its libraries read
the keyed ones at load (OMP_*, GOMP_*, OPENBLAS_*, TORCH_*, PYTORCH_*, TRITON_*, PYTHON*, LANG, HOME, PATH: a getenv
trace of the imports, 2026-12-06), so a child gets a starter whose libraries read what its cold start would have.
KEYLESS are read at import only to name cache folders that engine children never use: TMPDIR (tempfile's default,
reset in the child; dill's session folder and torch.compile's cache folder), HF_HOME, HF_HUB_CACHE and
XDG_CACHE_HOME (huggingface_hub's and accelerate's cache and config paths: engine children run with HF_HUB_OFFLINE=1
and read local folders only), and EXLLAMA_* (read by exllamav2's import, which the child makes: exllamav2 and
exllamav3 are never imported by the starter, nor is CUDA initialized). They vary between the tests of one process; a
key that changes stops the starters that run nothing. Not carried over: what the imports printed (a cold child's log
had their warnings), Python's hash seed (one per starter), /proc/PID/environ (the starter's, allowlisted as any
child's; os.environ is the child's own), and the nice value, limits and CPU affinity, which are the starter's (this
process's when it started it).
"""

from __future__ import annotations

import atexit
import hashlib
import io
import json
import os
import queue
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future

from factory.settings import warm_start

STARTER = "factory.engines.starter"  # the module the starter runs
SHARED = "FACTORY_WARM_STARTER"  # the socket of a starter this process's ancestor shares (`share`)
KEYLESS = {"TMPDIR", "HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME"}
KEYLESS_PREFIXES = ("EXLLAMA_",)
TITLE_ROOM = 4096  # bytes of command line a child's title may take (`ps`; a longer one is cut)
REPLY_SECONDS = 60.0  # a starter forks at once: one that does not answer in this time is killed
READY_SECONDS = 300.0  # a starter's imports (3 to 6 CPU-seconds): one not ready in this time is killed
CONNECT_SECONDS = 5.0  # a shared starter accepts at once: one whose queue stays full (it is stopped) is not used


class Started:
    """A warm-started child, used as child.run_command uses a subprocess.Popen."""

    def __init__(self, args: list[str], pid: int, pidfd: int, reply: socket.socket, stdout: io.TextIOWrapper):
        self.args, self.pid, self.stdout, self.returncode = args, pid, stdout, None
        self._pidfd, self._reply, self._orphaned = pidfd, reply, False
        self._waiting = threading.Lock()
        self._signalling = threading.Lock()  # the pidfd is not closed while a signal goes through it

    def poll(self) -> int | None:
        if not self._waiting.acquire(blocking=False):
            return self.returncode
        try:
            return self._wait(0)
        finally:
            self._waiting.release()

    def wait(self, timeout: float | None = None) -> int:
        with self._waiting:
            if (rc := self._wait(timeout)) is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            return rc

    def send_signal(self, sig: int) -> None:
        with self._signalling:
            if self.returncode is None and self._pidfd >= 0:
                try:
                    signal.pidfd_send_signal(self._pidfd, sig)
                except ProcessLookupError:  # it has ended; its starter tells its status
                    pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _wait(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if not self._orphaned:
            if not select.select([self._reply], [], [], timeout)[0]:
                return None
            status = self._reply.recv(4096)
            if status:
                return self._end(json.loads(status)["returncode"])
            self._orphaned = True  # the starter died: this child got SIGTERM (PDEATHSIG); wait until it is gone
        if not select.select([self._pidfd], [], [], timeout)[0]:
            return None
        return self._end(-signal.SIGTERM)

    def _end(self, returncode: int) -> int:
        with self._signalling:
            self.returncode = returncode
            os.close(self._pidfd)
            self._pidfd = -1
        self._reply.close()
        return returncode

    def __del__(self) -> None:
        if getattr(self, "_pidfd", -1) >= 0:
            os.close(self._pidfd)


def start(cmd: list[str], env: dict[str, str], stderr: int | None) -> Started | None:
    """`cmd` started warm with the environment `env`, stdin /dev/null, stdout a pipe the caller reads and stderr
    the file descriptor `stderr` (None: stdout); None where it is to start cold (the module's docstring)."""
    command = _module_command(cmd)
    if command is None or env.get("PYTHONPATH") != os.environ.get("PYTHONPATH") or not warm_start():
        return None
    cwd = os.getcwd()
    key = _key(env, cwd)
    for _ in range(2):
        starter = _starter_for(key, env, cwd)
        if starter is None:
            return None
        started = starter.start(cmd, command, env, cwd, stderr)
        if started is not None:
            return started
    return None


def _module_command(cmd: list[str]) -> dict | None:
    """{"module", "args", "unbuffered"} of `python [-u] -m MODULE ARGS...` run by this interpreter, else None."""
    at = cmd.index("-m") if "-m" in cmd else 0
    if not at or cmd[0] != sys.executable or set(cmd[1:at]) - {"-u"} or at + 1 == len(cmd):
        return None
    return {"module": cmd[at + 1], "args": cmd[at + 2 :], "unbuffered": "-u" in cmd[1:at]}


def _key(env: dict[str, str], cwd: str) -> tuple:
    kept = (kv for kv in env.items() if kv[0] not in KEYLESS and not kv[0].startswith(KEYLESS_PREFIXES))
    return (cwd, sys.executable, *sorted(kept))  # the interpreter: a descendant in another venv has its own


def _socket_prefix(key: tuple) -> str:
    """The start of the socket name of this user's starters for `key` (a random part follows)."""
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
    return f"quantfactory-warm-{os.getuid()}-{digest}-"


def share(env: dict[str, str]) -> None:
    """This process's starter for its engines' environment `env` (started now if need be) offered to its
    descendants (the module's docstring); nothing where warm starts are off or none can be had, or where this
    process uses an ancestor's already."""
    if not warm_start():
        return
    cwd = os.getcwd()
    starter = _starter_for(_key(env, cwd), env, cwd)
    if starter is not None and starter.proc is not None:
        starter.shared = True
        os.environ[SHARED] = starter.name


# -- this process's starters ---------------------------------------------------------------------------------------


class _Starter:
    """A starter this process asks for children: its own (`proc`, its child) or one an ancestor shares (`proc`
    None: `control` is this process's connection to it)."""

    def __init__(self, proc: subprocess.Popen | None, control: socket.socket, name: str):
        self.proc, self.control, self.name = proc, control, name
        self.shared = False  # offered to this process's descendants: never stopped as idle
        self.children: list[Started] = []
        self._sending = threading.Lock()

    def alive(self) -> bool:
        return self.control.fileno() >= 0 and (self.proc is None or self.proc.poll() is None)

    def idle(self) -> bool:
        self.children = [c for c in self.children if c.poll() is None]
        return not self.children and not self.shared

    def start(self, cmd: list[str], command: dict, env: dict, cwd: str, stderr: int | None) -> Started | None:
        """The child, or None when the starter did not start it (it is then stopped)."""
        request = {**command, "argv": cmd, "env": env, "cwd": cwd, "umask": _umask()}
        out_r, out_w = os.pipe()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        stdin = os.open(os.devnull, os.O_RDONLY)
        try:
            with self._sending:
                socket.send_fds(
                    self.control,
                    [json.dumps(request).encode()],
                    [theirs.fileno(), stdin, out_w, out_w if stderr is None else stderr],
                )
            theirs.close()  # the starter holds it now: its closing it unanswered is read at once, not after the wait
            mine.settimeout(REPLY_SECONDS)
            answer, fds, _, _ = socket.recv_fds(mine, 4096, 1)
        except OSError:  # it died, or did not answer in time
            answer, fds = b"", []
        finally:
            theirs.close()
            os.close(stdin)
            os.close(out_w)
        if not answer or len(fds) != 1:
            for fd in (out_r, *fds):
                os.close(fd)
            mine.close()
            self.stop()
            if self.proc is None and os.environ.get(SHARED) == self.name:
                del os.environ[SHARED]  # it failed (stopped, or could not fork): the next try starts one of our own
            return None
        mine.settimeout(None)
        stdout = open(out_r, errors="replace")  # as Popen(text=True, errors="replace") reads it
        started = Started(cmd, json.loads(answer)["pid"], fds[0], mine, stdout)
        self.children = [*(c for c in self.children if c.returncode is None), started]
        return started

    def stop(self) -> None:
        """Its children, if any, get SIGTERM as it dies (or, a shared one's, as this process's connection closes)."""
        self.control.close()
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


_lock = threading.Lock()  # the starters, and starting one
_starters: dict[tuple, _Starter] = {}
_refused: set[tuple] = set()  # environments whose starter failed to start: their children start cold
_calls: queue.SimpleQueue = queue.SimpleQueue()
_thread: threading.Thread | None = None


def _starter_for(key: tuple, env: dict[str, str], cwd: str) -> _Starter | None:
    with _lock:
        for other in [k for k, s in _starters.items() if k != key and s.idle()]:
            _starters.pop(other).stop()
        starter = _starters.get(key)
        if starter is not None and starter.alive():
            return starter
        _starters.pop(key, None)
        if key in _refused:
            return None
        starter = _connect(key) or _spawn(env, cwd, key)
        if starter is None:
            _refused.add(key)
        else:
            _starters[key] = starter
        return starter


def _connect(key: tuple) -> _Starter | None:
    """The starter an ancestor shares (FACTORY_WARM_STARTER), if it serves `key`, is this user's and is there."""
    name = os.environ.get(SHARED, "")
    if not name.startswith(_socket_prefix(key)):
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(CONNECT_SECONDS)
    try:
        conn.connect("\0" + name)
        ours = peer_uid(conn) == os.getuid()
    except OSError:  # its owner ended, or it is stopped with its queue full (TimeoutError)
        ours = False
    if not ours:
        conn.close()
        return None
    conn.settimeout(None)
    return _Starter(None, conn, name)


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED: the kernel's, not what it says)."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def _spawn(env: dict[str, str], cwd: str, key: tuple) -> _Starter | None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    name = _socket_prefix(key) + secrets.token_hex(8)
    room = "-" * TITLE_ROOM  # argv space its children write their own command lines into

    def popen() -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", STARTER, str(theirs.fileno()), str(os.getpid()), name, room],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
        )

    try:
        proc = _in_lasting_thread(popen)
    except OSError:  # no process to be had: this child and the next start cold
        return None
    finally:
        theirs.close()
    ours.settimeout(READY_SECONDS)
    try:
        ready = ours.recv(4096) == b"ready"  # after its imports; b"" if it died, else what stopped it
    except OSError:  # not ready in time (stopped, or a machine that busy)
        ready = False
    if ready:
        ours.settimeout(None)
        return _Starter(proc, ours, name)
    ours.close()
    proc.kill()
    proc.wait()
    return None


def _in_lasting_thread(call):
    """`call()` in a thread that lasts as long as this process (a child's PDEATHSIG fires when its starting thread
    ends)."""
    global _thread
    if _thread is None or not _thread.is_alive():
        _thread = threading.Thread(target=_serve_calls, name="warm-starter", daemon=True)
        _thread.start()
    done: Future = Future()
    _calls.put((call, done))
    return done.result()


def _serve_calls() -> None:
    while True:
        call, done = _calls.get()
        try:
            done.set_result(call())
        except BaseException as e:
            done.set_exception(e)


def _forget() -> None:
    """In a forked child of this process: the starters are its parent's, not its own (its copies of their sockets
    closed: a shared starter stops its parent's children once its parent's connection closes)."""
    global _lock, _starters, _calls, _thread
    for starter in _starters.values():
        starter.control.close()
    _lock, _starters, _calls, _thread = threading.Lock(), {}, queue.SimpleQueue(), None


def _stop_all() -> None:
    """At exit: every starter stopped and waited for (its CPU, and its children's, is then this process's
    children's, as a cold child's is), every connection to a shared one closed."""
    for starter in _starters.values():
        starter.stop()


os.register_at_fork(after_in_child=_forget)
atexit.register(_stop_all)


def _umask() -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        return None
