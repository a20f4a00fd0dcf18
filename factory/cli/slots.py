"""Several jobs at once on one GPU (`qf worker --gpu N --slots K|auto`): K Celery workers, each running one job at a
time in a job process of its own as a single worker does, so that the units of several jobs share the card. Their
units pack together into the card's memory and the machine's cores, each admitted by what it is predicted to need
beside every slot's running units (the ledger FACTORY_GPU_LEDGER names: factory/jobs/ledger.py); a slot with no job
of its own helps a running job with its conversions (help_job), as another worker would. `auto` (the default) is a
job for every CORES_PER_SLOT cores, at most MOST_SLOTS: the ledger decides what runs beside what, the slots only keep
enough jobs at hand that one job's serial part (a measurement, its evaluations) leaves the card to the others.

This process only starts and stops them. SIGTERM or Ctrl-C stop them the way one worker stops (a warm shutdown:
the running jobs finish); when one of them ends, the others are stopped and this process exits with its status;
when this process is killed, they are killed with it (SIGKILL: their job processes die with them, and the jobs'
leases run out and continue elsewhere, as when a single worker is killed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from factory.engines import child
from factory.errors import SpecError

CORES_PER_SLOT = 4  # a slot's units feed the card from a core each, its evaluations from one more
MOST_SLOTS = 4  # half of a job's automatic units at once (costs.AUTOMATIC_MAX_UNITS: 8 passes keep an H200 80% busy)


def count(value: str, cores: int) -> int:
    """--slots: a positive number, or auto (for a machine of `cores` cores). SpecError (exit 2) for anything else."""
    if value == "auto":
        return max(1, min(MOST_SLOTS, cores // CORES_PER_SLOT))
    if not value.isdigit() or int(value) < 1:
        raise SpecError(f"--slots {value!r} is neither a positive number nor auto")
    return int(value)


def ledger_path(visible: str | None) -> Path:
    """The ledger of the cards CUDA_VISIBLE_DEVICES (`visible`) names (all of them when unset), for this user: in
    this machine's temporary folder, so that every worker of the user on the card shares it, and no other machine."""
    card = "all" if visible is None else visible.replace(",", "-") or "none"
    return Path(tempfile.gettempdir()) / f"quantfactory-{os.getuid()}-gpu-{card}.json"


def supervise(commands: list[list[str]], env: dict[str, str]) -> int:
    def start(command: list[str]) -> subprocess.Popen:
        return subprocess.Popen(command, env=env, preexec_fn=lambda: child.die_with_parent(signal.SIGKILL))

    slots = [start(command) for command in commands]

    def stop(*_) -> None:
        for slot in slots:
            if slot.poll() is None:
                slot.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while all(slot.poll() is None for slot in slots):
        time.sleep(0.5)
    ended = next(slot for slot in slots if slot.returncode is not None)
    stop()
    for slot in slots:
        slot.wait()
    return ended.returncode
