"""Holding a job while it runs, for workers (workers/tasks.py) and `qf run` alike: `leased` takes the job's lease and
lets go of it after, `held` is the heartbeat that renews it.

The heartbeat means "this job makes progress": it renews only while `alive()` says so (the job's process is alive and
reported progress within FACTORY_STALL_SECONDS). When the job stalls, or a renewal finds that another holder has
taken the job (this process was stopped past its lease), it stops renewing and calls `on_lost(reason)` once; the
lease then runs out and the reconciler hands the job to the next holder, whose token fences this one's writes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from factory import identity
from factory.catalog import Catalog, JobState, Lease
from factory.errors import FactoryError

log = logging.getLogger("quantfactory")


def describe_holder(worker: str | None) -> str:
    """`host:pid` as a sentence's words: "HOST pid P"."""
    host, _, pid = (worker or "an unknown holder").rpartition(":")
    return f"{host} pid {pid}" if host and pid.isdigit() else worker or "an unknown holder"


@contextmanager
def leased(catalog: Catalog, job_id: str, seconds: float, gone: str | None = None) -> Iterator[Lease | None]:
    """The job's lease for this process (None while another holder's is valid, unless that holder is `gone`), let go
    of when the block ends if the job no longer runs (it ended, or went to its publishing step). A job still running
    (its holder gave up on it, or its process could not record an end) keeps the lease until it runs out, so that
    the reconciler hands it on."""
    lease = catalog.leases.take(job_id, identity.holder_name(), seconds, gone=gone)
    if lease is None:
        yield None
        return
    try:
        yield lease
    finally:
        try:
            job = catalog.jobs.get(job_id)
            if job is not None and job.state != JobState.running:
                catalog.leases.release(lease)  # fenced: a no-op once another holder has the job
        except FactoryError:
            pass  # the catalog is away: the lease runs out


@dataclass
class Holding:
    lease: Lease
    lost: str | None = None  # why the lease was given up, once it was


@contextmanager
def held(
    catalog: Catalog,
    lease: Lease,
    seconds: float,
    alive: Callable[[], str | None] = lambda: None,
    on_lost: Callable[[str], None] = lambda reason: None,
) -> Iterator[Holding]:
    """Renew `lease` every third of `seconds` while the block runs. `alive()` returns None while the job makes
    progress, else why not (one sentence)."""
    holding, stop = Holding(lease), threading.Event()

    def beat() -> None:
        while not stop.wait(seconds / 3):
            try:
                stalled = alive()
                if stalled is None and catalog.leases.renew(lease, seconds):
                    continue
                job = catalog.jobs.get(lease.job_id)
                reason = stalled if job.lease_token == lease.token else f"lease lost to {job.worker}; stopping"
            except FactoryError:
                continue  # the database is away for a moment; the next beat tries again
            holding.lost = reason
            log.warning("job %s: %s", lease.job_id, reason)
            on_lost(reason)
            return

    thread = threading.Thread(target=beat, name=f"lease-{lease.job_id}", daemon=True)
    thread.start()
    try:
        yield holding
    finally:
        stop.set()
        thread.join()
