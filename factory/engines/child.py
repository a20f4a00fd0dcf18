"""Run an engine's tool in a child process and turn its event lines into progress events.

Parent: `run(module, request, work_dir, emit)` starts `python -m module request.json`, reads JSON event
lines from the child's stdout, keeps everything else the child prints in work_dir/engine.log, and raises
JobFailed with the log's last line when the child fails (or says which signal killed it).
Child: `events()` claims the real stdout for events and points fd 1 at stderr, so libraries that print
cannot corrupt the event stream.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from factory.errors import JobFailed

LOG_NAME = "engine.log"


def run(module: str, request: dict, work_dir: Path, emit, what: str) -> None:
    work_dir.mkdir(parents=True, exist_ok=True)
    request_path = work_dir / "request.json"
    request_path.write_text(json.dumps(request))
    log_path = work_dir / LOG_NAME
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, str(request_path)],
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env=os.environ.copy(),
        )
        try:
            for line in proc.stdout:
                try:
                    event = json.loads(line)
                except ValueError:
                    log.write(line)
                    continue
                emit(event)
        finally:
            proc.stdout.close()
            rc = proc.wait()
    if rc != 0:
        raise JobFailed(f"{what} failed: {_reason(rc, log_path)}")


def _reason(rc: int, log_path: Path) -> str:
    if rc < 0:
        name = signal.Signals(-rc).name
        hint = " (out of memory?)" if rc == -signal.SIGKILL else ""
        return f"the engine process was killed by {name}{hint}; log: {log_path}"
    lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    last = lines[-1] if lines else "no output"
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


def read_request() -> dict:
    return json.loads(Path(sys.argv[1]).read_text())
