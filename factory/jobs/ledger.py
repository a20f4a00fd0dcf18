"""The units running on one machine's GPU and cores, across the job processes that share them (the slots of
`qf worker`: factory/cli/slots.py): one small JSON file that each job process reads and rewrites under an exclusive
lock (flock) when it starts or ends a unit, so that the units of all its jobs pack together into the card's memory
and the machine's cores by what each unit is predicted to need (factory/jobs/packing.py's rule, over every process's
running units), never more than fit; a unit the card holds nothing beside (after it ran out of memory) runs with
nothing else on the card.

An entry is a running unit: its process id, its predicted GPU bytes and cores, whether it runs alone. Entries of
processes that are gone (a job process killed with its units) are dropped by the next reader, so a crash frees
what it held. `qf worker` names the file (FACTORY_GPU_LEDGER: factory/cli/slots.py's ledger_path) for its slots.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from factory.jobs.packing import Need


@dataclass(frozen=True)
class Ledger:
    path: Path

    def take(self, key: str, need: Need, admits: Callable[[list[Need]], bool]) -> bool:
        """Record the unit `key` as running if `admits(the other processes' running units)` says it fits."""
        with self._entries() as entries:
            if not admits(_needs(entries, but=key)):
                return False
            entries[key] = {"pid": os.getpid(), "gpu_bytes": need.gpu_bytes, "cores": need.cores, "alone": need.alone}
            return True

    def give_back(self, key: str) -> None:
        with self._entries() as entries:
            entries.pop(key, None)

    def others(self) -> list[Need]:
        """What the units of other processes are predicted to hold now."""
        with self._entries() as entries:
            return _needs(entries, but=None)

    @contextmanager
    def _entries(self) -> Iterator[dict[str, dict]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with os.fdopen(os.dup(fd), "r+", encoding="utf-8") as f:
                try:
                    entries = json.loads(f.read() or "{}")
                except ValueError:  # a writer killed mid-write: what it held is unknown, and its process gone
                    entries = {}
                entries = {k: e for k, e in entries.items() if _alive(e["pid"])}
                yield entries
                f.seek(0)
                f.truncate()
                f.write(json.dumps(entries))
        finally:
            os.close(fd)  # and the lock with it


def _needs(entries: dict[str, dict], but: str | None) -> list[Need]:
    """Other processes' units as the packer counts them (their evaluations run in their own processes: not ours)."""
    mine = f"{os.getpid()}:"
    return [
        Need(e["gpu_bytes"], e["cores"], alone=e["alone"])
        for k, e in entries.items()
        if k != but and not k.startswith(mine)
    ]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
