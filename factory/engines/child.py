"""Run an engine's tool in a child process and turn its output lines into progress events.

Parent: `run_command(cmd, log_path, emit, what, parse)` starts the tool, turns each stdout line that `parse`
recognizes into an event, keeps a transcript of everything it prints in `log_path`, and raises JobFailed
with the log's last line when the tool fails, or names the signal that killed it. The child gets SIGTERM when
its parent dies, so a killed `qf` leaves no conversion running on behind it; `stop_running()` sends it SIGTERM when
its job stops (factory/jobs/packing.py), whichever thread waits on it. `run(module, request, ...)` is
the same for our own child modules (`python -m module request.json`), which speak JSON event lines.
Child: `events()` claims the real stdout for events and points fd 1 at stderr, so libraries that print
cannot corrupt the event stream.
Inside `fenced(path, mark)`, a child started by this thread has a watchdog process beside it
(`python -I -S factory/engines/fence.py`: the standard library alone, 0.01 s of CPU to start where `-m` spent 0.18
importing the factory's engines) that SIGKILLs it once `path` no longer holds `mark`: whoever holds the unit
writes its own mark there, and a parent that was stopped past its claim cannot stop its child itself.
A Python child of ours (`python -m MODULE`, this interpreter) starts warm: forked from a process that imported
torch and transformers once (factory/engines/warm.py: same environment, same behaviour, seconds of CPU less); its
Popen-like handle serves all of the above alike. FACTORY_WARM_START=0 starts every child cold.
The child's environment is an allowlist (`environment`): the locale, paths, CUDA, torch and thread settings a tool
needs, HF_HUB_OFFLINE=1, and nothing else: no HF_TOKEN, no catalog or broker URL with its password.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from factory.engines import warm
from factory.errors import JobFailed

LOG_NAME = "engine.log"
PEAK = "[PEAK_GPU_BYTES]"  # what factory/engines/script.py prints after a tool's script, before it exits
_PR_SET_PDEATHSIG = 1
# What a tool may need: locale and paths, the compiler for JIT-built kernels (exllamav2 and exllamav3 build their
# extensions on first import; a compiler setting that differs from the build's, e.g. CUDAHOSTCXX, which exllamav3
# passes to nvcc as -ccbin, makes torch rebuild it: 250 s on an H200 box), CUDA, torch and thread settings.
PASSED_ON = {
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "TERM",
    "TMPDIR",
    "TZ",
    "VIRTUAL_ENV",
    "PYTHONPATH",
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
    "LD_LIBRARY_PATH",
    "LIBRARY_PATH",
    "CPATH",
    "C_INCLUDE_PATH",
    "CPLUS_INCLUDE_PATH",
    "CC",
    "CXX",
    "CUDAHOSTCXX",
    "MAX_JOBS",
    "XDG_CACHE_HOME",
    "HF_HOME",
    "HF_HUB_CACHE",
    "TOKENIZERS_PARALLELISM",
}
PASSED_ON_PREFIXES = (
    "LC_",
    "CUDA_",
    "NVIDIA_",
    "NVCC_",
    "TORCH_",
    "PYTORCH_",
    "EXLLAMA_",
    "TRITON_",
    "NCCL_",
    "OMP_",
    "MKL_",
    "KMP_",
    "OPENBLAS_",
    "NVPL_",
    "GOMP_",
    "MALLOC_",
)  # BLAS and threading too


def json_event(line: str) -> dict | None:
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """This process gets `sig` when its parent dies (Linux), so no engine outlives a killed factory."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):  # not Linux: the child may outlive a killed parent
        pass


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """What an engine's child may see of this process's environment (PASSED_ON), offline, plus `extra`."""
    kept = {k: v for k, v in os.environ.items() if k in PASSED_ON or k.startswith(PASSED_ON_PREFIXES)}
    return {**kept, "HF_HUB_OFFLINE": "1", **(extra or {})}


_running: set[subprocess.Popen | warm.Started] = set()  # this process's engine children, whichever thread started
_fences = threading.local()  # (path, mark) of the unit this thread runs, while `fenced`


@contextmanager
def fenced(path: Path, mark: str) -> Iterator[None]:
    """The engine children this thread starts in the block are killed by a watchdog once `path` does not hold
    `mark` (the caller wrote it there; another holder of the unit writes its own)."""
    _fences.value = (path, mark)
    try:
        yield
    finally:
        _fences.value = None


def _watchdog(proc: subprocess.Popen) -> subprocess.Popen | None:
    fence = getattr(_fences, "value", None)
    if fence is None:
        return None
    return subprocess.Popen(
        [sys.executable, "-I", "-S", str(Path(__file__).with_name("fence.py")), str(fence[0]), fence[1], str(proc.pid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        env=environment(),
        preexec_fn=die_with_parent,
    )


def stop_running() -> None:
    """SIGTERM to every engine child of this process: its job stops (a unit beside them failed, Ctrl-C, SIGTERM).
    A unit that runs in a thread waits on its child's next line, which can be minutes away (a layer on a CPU)."""
    for proc in list(_running):
        proc.terminate()


@contextmanager
def stoppable(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """`proc` is one of the children `stop_running()` stops while the block runs (an engine's installer, say)."""
    _running.add(proc)
    try:
        yield proc
    finally:
        _running.discard(proc)


def run_command(
    cmd: list[str],
    log_path: Path,
    emit,
    what: str,
    parse: Callable[[str], dict | None] = json_event,
    env: dict[str, str] | None = None,
    merge: bool = False,
) -> None:
    """`merge`: the tool's stderr is read for progress too (a C++ tool that logs there), not only kept in the log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    child_env = environment(env)
    with open(log_path, "a", encoding="utf-8", errors="replace") as log:
        proc = warm.start(cmd, child_env, None if merge else log.fileno())
        if proc is None:
            # PDEATHSIG fires when the thread that started the child ends: start engines from the main thread.
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT if merge else log,
                stdin=subprocess.DEVNULL,
                text=True,
                errors="replace",
                env=child_env,
                preexec_fn=die_with_parent,
            )
        _running.add(proc)
        watchdog = _watchdog(proc)
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                event = parse(line)
                if event is not None:
                    emit(event)
        except BaseException:
            proc.terminate()
            raise
        finally:
            proc.stdout.close()
            rc = proc.wait()
            _running.discard(proc)
            if watchdog is not None:
                watchdog.kill()
                watchdog.wait()
    if rc != 0:
        raise JobFailed(f"{what} failed: {_reason(rc, log_path)}")


def run(module: str, request: dict, work_dir: Path, emit, what: str) -> None:
    work_dir.mkdir(parents=True, exist_ok=True)
    request_path = work_dir / "request.json"
    request_path.write_text(json.dumps(request))
    run_command([sys.executable, "-m", module, str(request_path)], work_dir / LOG_NAME, emit, what)


def _reason(rc: int, log_path: Path) -> str:
    if rc < 0:
        name = signal.Signals(-rc).name
        hint = " (out of memory?)" if rc == -signal.SIGKILL else ""
        return f"the engine process was killed by {name}{hint}; log: {log_path}"
    lines = [
        ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip() and not ln.startswith(PEAK)
    ]
    said = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception)\b", ln)]  # a traceback's last line
    last = (said or lines or ["no output"])[-1]
    return f"{last[:300]} (exit {rc}; log: {log_path})"


class _Events:
    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        sys.stdout.flush()
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def __call__(self, **event: object) -> None:
        self._out.write(json.dumps(event) + "\n")


def events() -> _Events:
    """In the child: a callable that sends one event to the parent."""
    return _Events()


def report_peak(emit: _Events) -> None:
    """In the child, when it is done: the most GPU memory torch allocated in it (what packing predicts the next
    unit of the same source by, and what `qf status` shows), where it used a GPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        emit(event="progress", peak_gpu_bytes=torch.cuda.max_memory_allocated())


def read_request() -> dict:
    return json.loads(Path(sys.argv[1]).read_text())


def saved_dtype(config: dict) -> str:
    """In the child: the source's dtype, the one a quant is saved in (config.json's `torch_dtype`, `dtype` in newer
    transformers; float16 when it names none)."""
    return config.get("torch_dtype") or config.get("dtype") or "float16"
