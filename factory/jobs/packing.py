"""Running a job's units several at a time on one machine: a unit starts once the units it needs are done and its
predicted needs fit beside the running ones (GPU memory, CPU cores, at most `max_units`). One unit always runs,
whatever its prediction. A unit that runs out of GPU memory beside others runs again alone (an estimate was low;
that is not a lost attempt).

Units run in threads; the work they start (engine conversions) runs in child processes of those threads, and a
unit's thread ends only after its child has (child.py's PDEATHSIG belongs to the thread that started it).
Evaluations run torch in this process: one at a time (`in_process`), so that each one's peak memory is its own.
With max_units 1 the units run in this thread, in their order: the job runs as it did before packing.
With a ledger (factory/jobs/ledger.py: the slots of one worker share the card), a unit is admitted beside the running
units of every job process on the machine, and its entry there is given back when it ends.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Protocol

from factory.engines import child
from factory.jobs.graph import Unit

OOM_MARKS = ("CUDA out of memory", "OutOfMemoryError", "out of memory")
DEFERRED_POLL_SECONDS = 1.0
WAITING_EVERY_SECONDS = 60.0  # how often units kept waiting by other jobs' units say so (an event: alive)


@dataclass(frozen=True)
class Need:
    gpu_bytes: int = 0  # what the unit's process adds on the card at its peak (its CUDA context included)
    cores: int = 0
    in_process: bool = False  # torch in the factory's own process (evaluations)
    alone: bool = False  # runs with nothing beside it (after it ran out of memory beside others)


@dataclass(frozen=True)
class Packer:
    max_units: int
    gpu_budget: int | None = None  # bytes units may take on the card; None: no GPU, not a limit
    cores: int = os.cpu_count() or 1

    def admits(self, need: Need, running: list[Need]) -> bool:
        if not running:
            return True
        if need.alone or any(n.alone for n in running) or len(running) >= self.max_units:
            return False
        if need.in_process and any(n.in_process for n in running):
            return False
        if self.gpu_budget is not None and sum(n.gpu_bytes for n in running) + need.gpu_bytes > self.gpu_budget:
            return False
        return sum(n.cores for n in running) + need.cores <= self.cores


class Shared(Protocol):
    """The running units of every process on this machine (factory/jobs/ledger.py's Ledger)."""

    def take(self, key: str, need: Need, admits: Callable[[list[Need]], bool]) -> bool: ...

    def give_back(self, key: str) -> None: ...


def out_of_memory(error: BaseException) -> bool:
    text = f"{type(error).__name__}: {getattr(error, 'message', None) or error}"
    return any(mark in text for mark in OOM_MARKS)


class Stopped(KeyboardInterrupt):
    """Raised in a running unit (through its progress) when the job stops: another unit failed, or Ctrl-C."""


def run(
    units: list[Unit],
    work: Callable[[Unit], None],
    need: Callable[[Unit], Need],
    packer: Packer,
    stop: threading.Event,
    note: Callable[[str], None] = lambda message: None,
    deferred: Callable[[Unit], bool] = lambda unit: False,
    ledger: Shared | None = None,
    waiting: Callable[[list[str]], None] = lambda names: None,
) -> None:
    """Run every unit once its `needs` are done. The first failure stops the rest (`stop_units`: their progress
    raises Stopped, their engines get SIGTERM) and is raised once they have ended; so is a KeyboardInterrupt of
    this thread. A unit that is `deferred` (another machine makes it) waits, taking nothing from the packer, while
    others run; its work runs once it is not, and finds what the other machine made. One at a time, `work` itself
    waits. With a `ledger`, units that are ready but find no room beside other processes' units wait, and say so
    (`waiting`) every WAITING_EVERY_SECONDS."""
    if packer.max_units <= 1:
        for unit in units:  # in dependency order already
            with _held(unit, need(unit), packer, ledger, waiting):
                work(unit)
        return
    pending, done = list(units), set()
    running: dict[str, tuple[Unit, Need, threading.Thread, int]] = {}  # name -> unit, need, thread, others beside
    ended: queue.Queue[tuple[str, BaseException | None]] = queue.Queue()
    alone: set[str] = set()
    failure: BaseException | None = None
    said = time.monotonic()

    def admitted(unit: Unit, wanted: Need) -> bool:
        local = [n for _, n, _, _ in running.values()]
        if ledger is None:
            return packer.admits(wanted, local)
        return packer.admits(wanted, local) and ledger.take(
            _key(unit), wanted, lambda others: packer.admits(wanted, local + others)
        )

    def body(unit: Unit) -> None:
        try:
            work(unit)
        except BaseException as e:  # reported to the loop, which decides
            ended.put((unit.name, e))
        else:
            ended.put((unit.name, None))

    try:
        while pending or running:
            if failure is None:
                for unit in [u for u in pending if u.needs <= done and not deferred(u)]:
                    wanted = replace(need(unit), alone=unit.name in alone)
                    if admitted(unit, wanted):
                        thread = threading.Thread(target=body, args=(unit,), name=unit.name, daemon=True)
                        running[unit.name] = (unit, wanted, thread, len(running))
                        pending.remove(unit)
                        thread.start()
            if ledger is not None and failure is None and time.monotonic() - said > WAITING_EVERY_SECONDS:
                said = time.monotonic()
                if ready := [u.name for u in pending if u.needs <= done and not deferred(u)]:
                    waiting(ready)  # for room on the card, which other jobs' units hold
            if not running:
                if failure is None and any(u.needs <= done for u in pending):  # deferred, or no room: look again
                    time.sleep(DEFERRED_POLL_SECONDS)
                    continue
                if failure is None and pending:
                    raise RuntimeError(f"units wait for units that never run: {[u.name for u in pending]}")
                break
            try:
                name, error = ended.get(timeout=0.5)
            except queue.Empty:
                continue
            unit, _, thread, beside = running.pop(name)
            thread.join()
            if ledger is not None:
                ledger.give_back(_key(unit))
            if error is None:
                done.add(name)
            elif out_of_memory(error) and beside + len(running) > 0 and name not in alone and failure is None:
                alone.add(name)
                pending.insert(0, unit)
                note(f"{name} ran out of GPU memory beside other units; running it again alone")
            elif failure is None:
                failure = error
                stop_units(stop)
    except BaseException:
        stop_units(stop)
        for unit, _, thread, _ in running.values():
            thread.join()
            if ledger is not None:
                ledger.give_back(_key(unit))
        raise
    if failure is not None:
        raise failure


@contextmanager
def _held(unit: Unit, wanted: Need, packer: Packer, ledger: Shared | None, waiting: Callable[[list[str]], None]):
    """One unit at a time: its room in the ledger while it runs, once the other processes' units leave room for it
    (memory and cores: this job's one unit at a time is its own rule, not theirs)."""
    if ledger is None:
        yield
        return
    roomy = replace(packer, max_units=2**31)
    said = time.monotonic()
    while not ledger.take(_key(unit), wanted, lambda others: roomy.admits(wanted, others)):
        if time.monotonic() - said > WAITING_EVERY_SECONDS:
            said = time.monotonic()
            waiting([unit.name])
        time.sleep(DEFERRED_POLL_SECONDS)
    try:
        yield
    finally:
        ledger.give_back(_key(unit))


def _key(unit: Unit) -> str:
    """A unit's entry in the ledger: this process's (the ledger counts a process's own units as it runs them)."""
    return f"{os.getpid()}:{unit.name}"


def stop_units(stop: threading.Event) -> None:
    """The running units stop: at their next progress (Stopped), and their engines now (SIGTERM)."""
    stop.set()
    child.stop_running()
