"""A job's steps: what ran, what was skipped or reused, and what the estimates learn from them."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import func, select

from factory.catalog.database import Database
from factory.catalog.schema import Job, Step
from factory.catalog.states import DONE_STEPS, StepState, now


class Steps:
    """A job's steps, each write fenced by the lease of the job (and the claim of the unit) that makes it."""

    def __init__(self, db: Database):
        self.db = db

    def start(
        self,
        job_id: str,
        name: str,
        token: int | None = None,
        expected_seconds: float | None = None,
        holder: str | None = None,
        claim: tuple[str, int] | None = None,
    ) -> int:
        """`claim`: the unit's (key, token), which fences the write as the job's lease token does."""
        with self.db.session() as s:
            self.db.fence(s, job_id, token)
            self.db.fence_claim(s, claim)
            step = Step(
                job_id=job_id,
                name=name,
                state=StepState.running,
                lease_token=token,
                holder=holder,
                expected_seconds=expected_seconds,
            )
            s.add(step)
            s.flush()
            return step.id

    def end(
        self,
        step_id: int,
        state: StepState,
        error: str | None = None,
        peak_gpu_bytes: int | None = None,
        token: int | None = None,
        claim: tuple[str, int] | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> None:
        """`before_commit`: what must happen only while the fences hold (a helper's quant handed to the job),
        with the job's and the claim's rows locked; if it raises, the step is not ended."""
        with self.db.session() as s:
            step = s.get(Step, step_id)
            self.db.fence(s, step.job_id, token)
            self.db.fence_claim(s, claim)
            if before_commit is not None:
                before_commit()
            step.state, step.error, step.ended_at, step.peak_gpu_bytes = state, error, now(), peak_gpu_bytes

    def interrupt(self, job_id: str, token: int | None = None, name: str | None = None) -> None:
        """Mark the steps of `job_id` (named `name`, or all) that are still running as interrupted (their attempt
        is gone)."""
        with self.db.session() as s:
            self.db.fence(s, job_id, token)
            query = select(Step).where(Step.job_id == job_id, Step.state == StepState.running)
            for step in s.scalars(query.where(Step.name == name) if name else query):
                step.state, step.error, step.ended_at = StepState.interrupted, "interrupted", now()

    def skip(self, job_id: str, name: str, reason: str, token: int | None = None) -> None:
        with self.db.session() as s:
            self.db.fence(s, job_id, token)
            at = now()  # one instant: a step that did not run took no time (never -0.0 s)
            s.add(Step(job_id=job_id, name=name, state=StepState.skipped, error=reason, started_at=at, ended_at=at))

    def reuse(self, job_id: str, name: str, note: str, token: int | None = None) -> None:
        """A step done without its work: what it used instead (`note`). Recorded as reused, at one instant: no
        view shows it seconds, and no estimate learns from it (`unit_history`)."""
        with self.db.session() as s:
            self.db.fence(s, job_id, token)
            at = now()
            s.add(
                Step(
                    job_id=job_id,
                    name=name,
                    state=StepState.reused,
                    note=note,
                    lease_token=token,
                    started_at=at,
                    ended_at=at,
                )
            )

    def skipped(self, job_id: str) -> set[str]:
        """The names of the job's steps recorded as skipped (`skip`: a quant the gate did not keep, its publish)."""
        with self.db.session() as s:
            rows = s.scalars(select(Step.name).where(Step.job_id == job_id, Step.state == StepState.skipped))
            return set(rows)

    def done(self, job_id: str) -> set[str]:
        with self.db.session() as s:
            rows = s.scalars(select(Step.name).where(Step.job_id == job_id, Step.state.in_(DONE_STEPS)))
            return set(rows)

    def history(self, family: str, device: str, limit: int = 200) -> list[tuple[str, float, int]]:
        """(step name, seconds, the job's parameters) of the newest steps whose name starts with `family`
        (jobs/eta.py: `quantize:<engine>`) that ran and succeeded, on jobs of this device: never a reused step
        (nor one a catalog from before the reused state recorded as succeeded with its note)."""
        with self.db.session() as s:
            rows = s.execute(
                select(Step.name, Step.started_at, Step.ended_at, Job.parameters)
                .join(Job)
                .where(
                    Step.name.startswith(family),
                    Step.state == StepState.succeeded,
                    Step.note.is_(None),
                    Step.ended_at.is_not(None),
                    Job.parameters.is_not(None),
                    Job.device == device,
                )
                .order_by(Step.id.desc())
                .limit(limit)
            )
            return [(name, (end - start).total_seconds(), parameters) for name, start, end, parameters in rows]

    def peaks(self, source_identity: str) -> dict[str, int]:
        """The highest GPU memory each step name allocated in the finished steps of any job of this source: what
        the next units of the same source are predicted to take."""
        with self.db.session() as s:
            rows = s.execute(
                select(Step.name, func.max(Step.peak_gpu_bytes))
                .join(Job)
                .where(
                    Job.source_identity == source_identity,
                    Step.state == StepState.succeeded,
                    Step.peak_gpu_bytes.is_not(None),
                )
                .group_by(Step.name)
            )
            return {name: int(peak) for name, peak in rows}
