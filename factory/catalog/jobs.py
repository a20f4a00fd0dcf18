"""Jobs, the one compare-and-set of a job's state, and the names of models."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from factory.catalog.database import Database
from factory.catalog.schema import Job, Model, Step
from factory.catalog.states import TRANSITIONS, JobState, StepState, now
from factory.errors import SpecError
from factory.specs import QuantSpec


class Jobs:
    """Jobs (created once per key, moved along TRANSITIONS by `transition` alone) and the names of models."""

    def __init__(self, db: Database):
        self.db = db

    def get(self, job_id: str) -> Job | None:
        with self.db.session() as s:
            job = s.get(Job, job_id)
            if job is not None:
                _ = job.steps
            return job

    def transition(
        self,
        job_id: str,
        to: JobState,
        token: int | None = None,
        error: str | None = None,
        exit_code: int | None = None,
        only_from: frozenset[JobState] | None = None,
        lease_expired: bool = False,
        session: Session | None = None,
    ) -> bool:
        """Move the job to `to` if its state allows it (TRANSITIONS, narrowed by `only_from`) and, with `token`, if
        that lease still holds it (`lease_expired`: only if its lease ran out). True when it happened. With
        `session`, inside that transaction (a caller that decides under the job's row lock)."""
        froms = [state for state, tos in TRANSITIONS.items() if to in tos and (only_from is None or state in only_from)]
        query = update(Job).where(Job.id == job_id, Job.state.in_(froms))
        if token is not None:
            query = query.where(Job.lease_token == token)
        if lease_expired:
            query = query.where(Job.lease_until < now())
        query = query.values(state=to, error=error, exit_code=exit_code, updated_at=now())
        if session is not None:
            return session.execute(query).rowcount == 1
        with self.db.session() as s:
            return s.execute(query).rowcount == 1

    def name_for(self, source: str, wanted: str, fallback: str | None) -> str:
        """The name `source` is known by: its own if it has one, else `wanted`, else `fallback` if `wanted` is
        taken by another source. `fallback` None: `wanted` was asked for explicitly (--name)."""
        owner = "another source"
        for _ in range(3):  # a concurrent submission of another source may take a name between read and write
            try:
                with self.db.session() as s:
                    if known := s.scalar(select(Model.name).where(Model.source == source)):
                        if fallback is None and known != wanted:
                            raise SpecError(
                                f"{source!r} is already named {known!r} in the catalog, not {wanted!r}; "
                                f"drop --name (its quants are published as {known!r})"
                            )
                        return known
                    for name in (wanted, fallback):
                        if name is not None and s.get(Model, name) is None:
                            s.add(Model(name=name, source=source))
                            return name
                    owner = s.get(Model, wanted).source
                break
            except IntegrityError:
                continue
        also = f" and {fallback!r}" if fallback else ""
        raise SpecError(f"the name {wanted!r}{also} already belong(s) to {owner!r}; pass another --name")

    def create(self, **fields: object) -> tuple[Job, bool]:
        """The job with this key: (job, True) if created now, (existing job, False) if it was there."""
        try:
            with self.db.session() as s:
                job = Job(**fields)
                s.add(job)
            return job, True
        except IntegrityError:
            return self.by_key(str(fields["key"])), False

    def by_key(self, key: str) -> Job:
        with self.db.session() as s:
            return s.scalars(select(Job).where(Job.key == key)).one()

    def cancel(self, job_id: str, session: Session | None = None) -> Job | None:
        """Mark a job cancelled unless it already ended; its holder stops at its next progress event and publishes
        nothing after (publishing checks the state in the same transaction)."""
        self.transition(job_id, JobState.cancelled, error="cancelled", exit_code=1, session=session)
        return self.get(job_id) if session is None else session.get(Job, job_id, populate_existing=True)

    def fail(self, job_id: str, error: str, token: int | None = None) -> bool:
        """The job and its running steps failed with `error` (a job process that died without saying why); with
        `token`, only while that lease holds the job. False when it did not happen. One transaction: no reader sees
        the job failed and its steps still running."""
        with self.db.session() as s:
            if not self.transition(
                job_id, JobState.failed, token, error, 1, frozenset({JobState.queued, JobState.running}), session=s
            ):
                return False
            for step in s.scalars(select(Step).where(Step.job_id == job_id, Step.state == StepState.running)):
                step.state, step.error, step.ended_at = StepState.failed, error, now()
        return True

    def queued(self, older_than: float) -> list[str]:
        """Jobs queued for more than `older_than` seconds (younger ones may be on their way to the broker)."""
        with self.db.session() as s:
            cutoff = now() - timedelta(seconds=older_than)
            return list(s.scalars(select(Job.id).where(Job.state == JobState.queued, Job.updated_at < cutoff)))

    def set_specs(
        self, job_id: str, specs: list[QuantSpec], token: int | None = None, parameters: int | None = None
    ) -> None:
        with self.db.session() as s:
            self.db.fence(s, job_id, token)
            job = s.get(Job, job_id)
            job.specs, job.parameters = specs, parameters

    def set_expected_end(self, job_id: str, seconds: float, token: int | None = None) -> None:
        with self.db.session() as s:
            self.db.fence(s, job_id, token)
            s.get(Job, job_id).expected_end = now() + timedelta(seconds=seconds)

    def states(self) -> dict[str, tuple[JobState, str]]:
        """Every job's (state, source identity), for `qf gc`."""
        with self.db.session() as s:
            return {
                i: (JobState(state), ident)
                for i, state, ident in s.execute(select(Job.id, Job.state, Job.source_identity))
            }

    def model_names(self) -> list[str]:
        with self.db.session() as s:
            return list(s.scalars(select(Model.name).order_by(Model.name)))
