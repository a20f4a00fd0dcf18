"""Jobs, their steps and names, and the watchlist's memory of upstream releases."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from factory.catalog.states import DONE_STEPS, JobState, StepState, now
from factory.catalog.database import Database
from factory.catalog.tables import Job, Model, Step, Upstream, Watch
from factory.errors import SpecError


class Jobs(Database):
    """Jobs (created once per key, cancelled, failed), their steps, the names of models, and the watchlist."""

    def name_for(self, source: str, wanted: str, fallback: str | None) -> str:
        """The name `source` is known by: its own if it has one, else `wanted`, else `fallback` if `wanted` is
        taken by another source. `fallback` None: `wanted` was asked for explicitly (--name)."""
        owner = "another source"
        for _ in range(3):  # a concurrent submission of another source may take a name between read and write
            try:
                with self.session() as s:
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

    def create_job(self, **fields: object) -> tuple[Job, bool]:
        """The job with this key: (job, True) if created now, (existing job, False) if it was there."""
        try:
            with self.session() as s:
                job = Job(**fields)
                s.add(job)
            return job, True
        except IntegrityError:
            return self.job_by_key(str(fields["key"])), False

    def job_by_key(self, key: str) -> Job:
        with self.session() as s:
            return s.scalars(select(Job).where(Job.key == key)).one()

    def cancel_job(self, job_id: str, session: Session | None = None) -> Job | None:
        """Mark a job cancelled unless it already ended; its holder stops at its next progress event and publishes
        nothing after (publishing checks the state in the same transaction)."""
        self.transition(job_id, JobState.cancelled, error="cancelled", exit_code=1, session=session)
        return self.job(job_id) if session is None else session.get(Job, job_id, populate_existing=True)

    def fail_job(self, job_id: str, error: str, token: int | None = None) -> bool:
        """The job and its running steps failed with `error` (a job process that died without saying why); with
        `token`, only while that lease holds the job. False when it did not happen."""
        if not self.transition(
            job_id, JobState.failed, token, error, 1, only_from=frozenset({JobState.queued, JobState.running})
        ):
            return False
        with self.session() as s:
            for step in s.scalars(select(Step).where(Step.job_id == job_id, Step.state == StepState.running)):
                step.state, step.error, step.ended_at = StepState.failed, error, now()
        return True

    def queued_jobs(self, older_than: float) -> list[str]:
        """Jobs queued for more than `older_than` seconds (younger ones may be on their way to the broker)."""
        with self.session() as s:
            cutoff = now() - timedelta(seconds=older_than)
            return list(s.scalars(select(Job.id).where(Job.state == JobState.queued, Job.updated_at < cutoff)))

    def set_job_specs(
        self, job_id: str, specs: list[dict], token: int | None = None, parameters: int | None = None
    ) -> None:
        with self.session() as s:
            self._fence(s, job_id, token)
            job = s.get(Job, job_id)
            job.specs, job.parameters = specs, parameters

    def set_expected_end(self, job_id: str, seconds: float, token: int | None = None) -> None:
        with self.session() as s:
            self._fence(s, job_id, token)
            s.get(Job, job_id).expected_end = now() + timedelta(seconds=seconds)

    def start_step(
        self,
        job_id: str,
        name: str,
        token: int | None = None,
        expected_seconds: float | None = None,
        holder: str | None = None,
        claim: tuple[str, int] | None = None,
    ) -> int:
        """`claim`: the unit's (key, token), which fences the write as the job's lease token does."""
        with self.session() as s:
            self._fence(s, job_id, token)
            self._fence_claim(s, claim)
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

    def end_step(
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
        with self.session() as s:
            step = s.get(Step, step_id)
            self._fence(s, step.job_id, token)
            self._fence_claim(s, claim)
            if before_commit is not None:
                before_commit()
            step.state, step.error, step.ended_at, step.peak_gpu_bytes = state, error, now(), peak_gpu_bytes

    def interrupt_steps(self, job_id: str, token: int | None = None, name: str | None = None) -> None:
        """Mark the steps of `job_id` (named `name`, or all) that are still running as interrupted (their attempt
        is gone)."""
        with self.session() as s:
            self._fence(s, job_id, token)
            query = select(Step).where(Step.job_id == job_id, Step.state == StepState.running)
            for step in s.scalars(query.where(Step.name == name) if name else query):
                step.state, step.error, step.ended_at = StepState.interrupted, "interrupted", now()

    def skip_step(self, job_id: str, name: str, reason: str, token: int | None = None) -> None:
        with self.session() as s:
            self._fence(s, job_id, token)
            at = now()  # one instant: a step that did not run took no time (never -0.0 s)
            s.add(Step(job_id=job_id, name=name, state=StepState.skipped, error=reason, started_at=at, ended_at=at))

    def reuse_step(self, job_id: str, name: str, note: str, token: int | None = None) -> None:
        """A step done without its work: what it used instead (`note`). Recorded as reused, at one instant: no
        view shows it seconds, and no estimate learns from it (`unit_history`)."""
        with self.session() as s:
            self._fence(s, job_id, token)
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

    def done_steps(self, job_id: str) -> set[str]:
        with self.session() as s:
            rows = s.scalars(select(Step.name).where(Step.job_id == job_id, Step.state.in_(DONE_STEPS)))
            return set(rows)

    def unit_history(self, family: str, device: str, limit: int = 200) -> list[tuple[str, float, int]]:
        """(step name, seconds, the job's parameters) of the newest steps whose name starts with `family`
        (jobs/eta.py: `quantize:<engine>`) that ran and succeeded, on jobs of this device: never a reused step
        (nor one a catalog from before the reused state recorded as succeeded with its note)."""
        with self.session() as s:
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

    def recorded_peaks(self, source_identity: str) -> dict[str, int]:
        """The highest GPU memory each step name allocated in the finished steps of any job of this source: what
        the next units of the same source are predicted to take."""
        with self.session() as s:
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

    def job_states(self) -> dict[str, tuple[JobState, str]]:
        """Every job's (state, source identity), for `qf gc`."""
        with self.session() as s:
            return {
                i: (JobState(state), ident)
                for i, state, ident in s.execute(select(Job.id, Job.state, Job.source_identity))
            }

    def model_names(self) -> list[str]:
        with self.session() as s:
            return list(s.scalars(select(Model.name).order_by(Model.name)))

    def watches(self) -> list[Watch]:
        with self.session() as s:
            return list(s.scalars(select(Watch).order_by(Watch.target)))

    def put_watch(self, target: str, recipe: dict, filter: dict) -> None:
        with self.session() as s:
            s.merge(Watch(target=target, recipe=recipe, filter=filter))

    def remove_watch(self, target: str) -> bool:
        with self.session() as s:
            watch = s.get(Watch, target)
            if watch is not None:
                s.delete(watch)
            return watch is not None

    def upstream(self) -> list[Upstream]:
        with self.session() as s:
            return list(s.scalars(select(Upstream).order_by(Upstream.id)))

    def record_upstream(self, watch: str, repo: str, sha: str, job_id: str | None, skipped: str | None) -> bool:
        """Remember what became of `repo@sha` for `watch`: a release skipped before takes the new outcome (its job,
        or another reason); False when it has a job already (another scheduler recorded it first)."""
        try:
            with self.session() as s:
                s.add(Upstream(watch=watch, repo=repo, sha=sha, job_id=job_id, skipped=skipped))
            return True
        except IntegrityError:
            with self.session() as s:
                changed = s.execute(
                    update(Upstream)
                    .where(
                        Upstream.watch == watch, Upstream.repo == repo, Upstream.sha == sha, Upstream.job_id.is_(None)
                    )
                    .values(job_id=job_id, skipped=skipped)
                )
                return changed.rowcount == 1
