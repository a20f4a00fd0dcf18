"""The starter of warm engine children (factory/engines/warm.py starts it: `python -m factory.engines.starter FD
PARENT NAME ROOM`): a process that imports PRELOADED once, then forks a child for each request on the socket FD, and
for each request of a client: another process of the same user that connected to the abstract Unix socket NAME
(warm.share offers it to the parent's descendants: a worker's job processes, the `qf` processes a test starts).

It dies with its parent PARENT (PDEATHSIG SIGKILL, set here; it exits at once if PARENT died before), ends when
that socket closes, ignores Ctrl-C (it reaches the children and the parent, which stop them) and first checks that
forking it is safe: its imports started no thread (but OpenBLAS's, which stop themselves at a fork) and touched no
CUDA (`torch.cuda.is_initialized()`, no `/dev/nvidia*` open), else it says why and ends, and its parent starts those
children cold. A connection whose peer is another uid (SO_PEERCRED) is closed unread: a request runs code as this
user. When a client's connection closes (it ended, or was killed), its children that still run get SIGTERM, as a
cold child gets when its parent dies.

A request is JSON (module, args, whether `-u`, argv, env, cwd, umask) with four descriptors: where to answer, the
child's stdin, stdout and stderr. It forks, answers with the child's pid and a pidfd of it, and once the child has
ended, with its exit status (os.waitstatus_to_exitcode: negative for a signal). The forked child gets PDEATHSIG
SIGTERM (it dies with the starter as a cold child died with its parent), the requested environment exactly,
`tempfile.tempdir` unset, SIGINT back to Python's handler, torch's threads from OMP_NUM_THREADS, a fresh numpy seed,
its command line as `ps` shows it (written over the starter's, which ROOM made long enough), its stdio on fds 0-2
and nothing else open, and runs the module with runpy as `__main__`. It ends as Python would (the exit status of a
SystemExit; an uncaught exception's traceback and exit 1; death by SIGINT after an uncaught KeyboardInterrupt;
threads joined, atexit's functions run, open files flushed, libc's exit) but without Python's teardown of every
module and object: 1 s of CPU per child with torch loaded, 0.05 s without.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import NoReturn

from factory.engines import child, warm

FUTEX = {"x86_64": 202, "aarch64": 98}  # the futex system call's number, as /proc/PID/task/TID/syscall says it
PRELOADED = ("torch", "transformers", "transformers.modeling_utils", "transformers.models.auto.modeling_auto")
WRITERS = (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)  # the open files a child's exit flushes


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    child.die_with_parent(signal.SIGKILL)
    if os.getppid() != int(sys.argv[2]):  # it died before the line above
        return
    _retitle(sys.orig_argv[:-1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches its children and its parent, which stop them
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    problem = _preload() or _listen(listener, sys.argv[3])
    control.send((problem or "ready").encode())
    if problem is None and (request := _serve(control, listener)) is not None:
        _become(request)


def _listen(listener: socket.socket, name: str) -> str | None:
    try:
        listener.bind("\0" + name)
        listener.listen()
    except OSError as e:
        return f"its socket: {e}"
    listener.setblocking(False)  # a client gone before it was accepted is not waited for
    return None


def _preload() -> str | None:
    """What makes forking this process unsafe after its imports, if anything."""
    try:
        for name in PRELOADED:
            importlib.import_module(name)
        os.close(os.pidfd_open(os.getpid()))
    except Exception as e:  # whatever it is, its children start cold
        return f"{type(e).__name__}: {e}"
    if _unsafe_threads():
        return "its imports started a thread"
    if sys.modules["torch"].cuda.is_initialized() or any(path.startswith("/dev/nvidia") for path in _open_files()):
        return "its imports initialized CUDA"
    return None


def _unsafe_threads() -> list[str]:
    """This process's threads but its own and OpenBLAS's (numpy's starts one a core at import unless
    OMP_NUM_THREADS or OPENBLAS_NUM_THREADS says fewer; a 16-core GPU machine had 30 threads after these imports,
    2026-12-07). OpenBLAS stops its threads itself before a fork (its pthread_atfork handler) and a child starts its
    own, so they leave forking safe. An OpenBLAS server is known by where it sleeps: a futex in its library's memory
    (its thread_status table, in the anonymous mapping of the library's bss right after its file's). One that has not
    gone to sleep yet is looked at again for a moment."""
    unsafe = [tid for tid in os.listdir("/proc/self/task") if int(tid) != threading.get_native_id()]
    futex = FUTEX.get(os.uname().machine)
    for attempt in range(50 if futex else 0):
        if not unsafe:
            break
        if attempt:
            time.sleep(0.01)
        owners = _mapping_owners()
        unsafe = [tid for tid in unsafe if not _sleeps_in(tid, futex, owners, "openblas")]
    return unsafe


def _mapping_owners() -> list[tuple[int, int, str]]:
    """(start, end, file) of each mapping of this process; an anonymous one right after a file's (its bss) takes
    that file's name."""
    owners: list[tuple[int, int, str]] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if len(fields) > 5:
                file = fields[5].strip()
            else:
                file = owners[-1][2] if owners and owners[-1][1] == start else ""
            owners.append((start, end, file))
    return owners


def _sleeps_in(tid: str, futex: int, owners: list[tuple[int, int, str]], library: str) -> bool:
    """Whether thread `tid` waits on a futex in the memory of a file whose name has `library` in it."""
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            call = f.read().split()
    except OSError:  # it ended
        return True
    if not call or call[0] != str(futex):
        return False
    address = int(call[1], 16)
    return any(start <= address < end and library in os.path.basename(file) for start, end, file in owners)


def _open_files() -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed since
            pass
    return found


def _serve(owner: socket.socket, listener: socket.socket) -> dict | None:
    """Forks a child per request of its owner (the parent) or of a client until the owner closes its socket; a
    client's children get SIGTERM once its connection closes. Returns in each forked child."""
    clients: dict[socket.socket, set[int]] = {owner: set()}  # connection -> pidfds of its children still running
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, where its status goes)
    while True:
        ready = select.select([listener, *clients, *children], [], [])[0]
        for pidfd in (fd for fd in ready if isinstance(fd, int)):
            pid, reply = children.pop(pidfd)
            _, status = os.waitpid(pid, 0)
            try:
                reply.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:  # nobody waits for it any more
                pass
            reply.close()
            for running in clients.values():
                running.discard(pidfd)
            os.close(pidfd)
        if listener in ready:
            _accept(listener, clients)
        for conn in (fd for fd in ready if isinstance(fd, socket.socket) and fd in clients):
            try:
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)
            except OSError:
                message, fds = b"", []
            if message:
                request = _fork(json.loads(message), fds, [listener, *clients], children, clients[conn])
                if request is not None:
                    return request
            elif conn is owner:
                return None
            else:
                for pidfd in clients.pop(conn):
                    with contextlib.suppress(ProcessLookupError):  # it ended; its pidfd says so next
                        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
                conn.close()


def _accept(listener: socket.socket, clients: dict[socket.socket, set[int]]) -> None:
    try:
        conn, _ = listener.accept()
    except OSError:  # it gave up before it was accepted
        return
    conn.setblocking(True)
    if warm.peer_uid(conn) != os.getuid():
        conn.close()
        return
    clients[conn] = set()


def _fork(
    request: dict, fds: list[int], sockets: list[socket.socket], children: dict, running: set[int]
) -> dict | None:
    reply_fd, *stdio = fds
    reply = socket.socket(fileno=reply_fd)
    if _unsafe_threads():  # never: no thread of its own, none its imports started but OpenBLAS's
        for fd in stdio:
            os.close(fd)
        reply.close()  # its parent stops it and asks a new one
        return None
    starter = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError:  # no process to be had (a limit, memory): this request fails, the others' children go on
        for fd in stdio:
            os.close(fd)
        reply.close()
        return None
    if pid == 0:
        child.die_with_parent(signal.SIGTERM)
        if os.getppid() != starter:  # it died before the line above
            os._exit(1)
        for sock in (*sockets, reply, *(r for _, r in children.values())):
            sock.detach()  # closed below, with every other descriptor
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        return request
    for fd in stdio:
        os.close(fd)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # no descriptor to be had: the child is not kept without one
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        reply.close()
        return None
    try:
        socket.send_fds(reply, [json.dumps({"pid": pid}).encode()], [pidfd])
    except OSError:  # the parent gave up on it
        os.kill(pid, signal.SIGKILL)
    children[pidfd] = (pid, reply)
    running.add(pidfd)
    return None


def _become(request: dict) -> None:
    """In the forked child: what `python [-u] -m MODULE ARGS` would have been, then the module."""
    os.chdir(request["cwd"])
    if request["umask"] is not None:
        os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threads = request["env"].get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        sys.modules["torch"].set_num_threads(int(threads))
    if "numpy.random" in sys.modules:  # a fresh process seeds it from the OS; its siblings must not share a seed
        sys.modules["numpy.random"].seed()
    if request["unbuffered"]:
        sys.stdout, sys.stderr = (_unbuffered(1, sys.stdout), _unbuffered(2, sys.stderr))
    _retitle(request["argv"])
    sys.argv = [request["module"], *request["args"]]
    interrupted = False
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException as e:  # what Python does with an uncaught exception: its traceback, exit 1
        sys.excepthook(type(e), e, e.__traceback__)
        interrupted, code = isinstance(e, KeyboardInterrupt), 1
    _exit(code, interrupted)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _exit(code: int, interrupted: bool) -> NoReturn:
    """Python's exit without its teardown of every module and object (1 s of CPU with torch loaded, 0.05 s
    without): the threads joined, atexit's functions run, every open file flushed, then libc's exit (C's stdio
    flushed, C++ destructors run). An uncaught KeyboardInterrupt ends it by SIGINT, as it ends Python."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in gc.get_objects():  # a file left open would have been flushed as it was destroyed
        if issubclass(type(stream), WRITERS):  # type(), not isinstance: a lazy module's proxy warns on __class__
            with contextlib.suppress(Exception):  # closed, detached, or its disk full: as at teardown, ignored
                if not stream.closed and stream.writable():
                    stream.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    ctypes.CDLL(None).exit(code)
    os._exit(code)  # not reached


def _unbuffered(fd: int, like: io.TextIOWrapper) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw, encoding=like.encoding, errors=like.errors, write_through=True)


def _retitle(argv: list[str]) -> None:
    """`argv` as this process's command line (/proc/PID/cmdline, `ps`), written over the one it started with and
    cut to its length, as PostgreSQL's ps_status.c does."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start and arg_end, fields 48 and 49 of stat(5)
    except (OSError, ValueError, IndexError):
        return
    title = b"\0".join(os.fsencode(a) for a in argv)[: end - start - 1]
    ctypes.memmove(start, title.ljust(end - start, b"\0"), end - start)


if __name__ == "__main__":
    main()
