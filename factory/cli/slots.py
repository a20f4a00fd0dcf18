"""Several jobs at once on one GPU (`qf worker --gpu N --slots K`): K Celery workers, each running one job at a time
in a job process of its own as a single worker does, so that the units of several jobs share the card. Each job
packs its units into its share of the card's free memory (FACTORY_GPU_SLOTS: factory/jobs/costs.py); a slot with no
job of its own helps a running job with its conversions (help_job), as another worker would.

This process only starts and stops them. SIGTERM or Ctrl-C stop them the way one worker stops (a warm shutdown:
the running jobs finish); when one of them ends, the others are stopped and this process exits with its status;
when this process is killed, they are killed with it (SIGKILL: their job processes die with them, and the jobs'
leases run out and continue elsewhere, as when a single worker is killed).
"""

from __future__ import annotations

import signal
import subprocess
import time

from factory.engines import child


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
