"""Who runs a job now (a lease fenced by its token) and who makes a unit that serves many jobs (a claim)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError

from factory.catalog.database import Database
from factory.catalog.jobs import Jobs
from factory.catalog.schema import Claim, Job
from factory.catalog.states import JobState, now
from factory.identity import gone


@dataclass(frozen=True)
class Lease:
    """A holder's claim on a job: its fencing token goes with every write the holder makes for the job."""

    job_id: str
    worker: str
    token: int
    attempts: int


def _holding(held: Claim) -> bool:
    """A claim is held until it runs out, or until its holder on this machine is gone (a killed process)."""
    return held.until > now() and not gone(held.holder.rpartition("@")[2])


class Leases:
    """Who holds a job (a lease, its token fencing the holder's writes) and who makes a unit (a claim)."""

    def __init__(self, db: Database, jobs: Jobs):
        self.db, self.jobs = db, jobs

    def take(self, job_id: str, worker: str, seconds: float, gone: str | None = None) -> Lease | None:
        """Hold the job for `worker` with a new fencing token, or None while another holder's lease is valid (a
        duplicate message, a second `qf run`) unless that holder is `gone` (known dead: its lease is not waited
        out). Taking a lease that expired counts an attempt; one that was released (the hand-off to the publishing
        step) does not."""
        with self.db.session() as s:
            job = s.get(Job, job_id, with_for_update=True)
            valid = job.lease_until is not None and job.lease_until > now()
            if valid and job.worker not in (worker, gone):
                return None
            if job.attempts == 0 or job.lease_until is not None:
                job.attempts += 1
            job.worker, job.lease_until = worker, now() + timedelta(seconds=seconds)
            job.lease_token += 1
            return Lease(job_id, worker, job.lease_token, job.attempts)

    def renew(self, lease: Lease, seconds: float) -> bool:
        """Extend the lease; False when another holder has taken the job since (the lease is lost)."""
        with self.db.session() as s:
            renewed = s.execute(
                update(Job)
                .where(Job.id == lease.job_id, Job.lease_token == lease.token)
                .values(lease_until=now() + timedelta(seconds=seconds))
            )
            return renewed.rowcount == 1

    def release(self, lease: Lease) -> None:
        with self.db.session() as s:
            s.execute(
                update(Job).where(Job.id == lease.job_id, Job.lease_token == lease.token).values(lease_until=None)
            )

    def holder(self, job_id: str) -> str | None:
        """Who holds a valid lease on the job now, if anyone."""
        job = self.jobs.get(job_id)
        return job.worker if job and job.lease_until is not None and job.lease_until > now() else None

    def check(self, job_id: str, token: int | None) -> None:
        """Raises LeaseLost when `token` no longer holds the job, Cancelled when it was cancelled."""
        with self.db.session() as s:
            self.db.fence(s, job_id, token, running=True)

    def expired(self) -> list[str]:
        """Running jobs whose holder stopped renewing: queued again (the next take counts the loss)."""
        with self.db.session() as s:
            candidates = list(s.scalars(select(Job.id).where(Job.state == JobState.running, Job.lease_until < now())))
        return [
            job_id
            for job_id in candidates
            if self.jobs.transition(
                job_id, JobState.queued, lease_expired=True, only_from=frozenset({JobState.running})
            )
        ]

    def claim(self, key: str, holder: str, seconds: float) -> int | None:
        """Hold `key` for `holder` (its token), or None while another holder's claim is valid."""
        for _ in range(2):  # a concurrent first claim wins the insert; look again once
            try:
                with self.db.session() as s:
                    held = s.get(Claim, key, with_for_update=True)
                    until = now() + timedelta(seconds=seconds)
                    if held is None:
                        s.add(Claim(key=key, holder=holder, until=until, token=1))
                        return 1
                    if _holding(held) and held.holder != holder:
                        return None
                    held.holder, held.until, held.token = holder, until, held.token + 1
                    return held.token
            except IntegrityError:
                continue
        return None

    def renew_claim(self, key: str, token: int, seconds: float) -> bool:
        with self.db.session() as s:
            renewed = s.execute(
                update(Claim)
                .where(Claim.key == key, Claim.token == token)
                .values(until=now() + timedelta(seconds=seconds))
            )
            return renewed.rowcount == 1

    def release_claim(self, key: str, token: int) -> None:
        with self.db.session() as s:
            s.execute(delete(Claim).where(Claim.key == key, Claim.token == token))

    def claimant(self, key: str) -> str | None:
        """The holder whose valid claim holds `key`, if any (one on this machine whose process is gone holds
        nothing: `claim` takes it over at once)."""
        with self.db.session() as s:
            held = s.get(Claim, key)
            return held.holder if held is not None and _holding(held) else None
