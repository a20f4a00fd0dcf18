"""The catalog: models, jobs, steps, quants, measurements, evaluations, and the watchlist (SQLAlchemy 2).

SQLite under FACTORY_HOME by default; FACTORY_DB_URL for any other database (PostgreSQL in production).
A job is one submission: one source, one or more specs. Its idempotency key is a hash of what decides the
result (source identity, resolved specs, calibration and eval text hashes, eval windows, engine versions), so
the same job submitted twice is the same row.

A job's state changes only through `Catalog.transition`, one compare-and-set along TRANSITIONS. A job being run is
held by a lease whose fencing token grows every time the job changes hands; every write the holder makes for the
job (state, steps, measurements, evaluations, quants) carries the token and is refused (LeaseLost) once another
holder has taken the job, so a holder that stalled and came back changes nothing.
"""

from __future__ import annotations

import enum
import fcntl
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    delete,
    func,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship, sessionmaker

from factory.errors import Cancelled, LeaseLost, ServiceUnavailable, SpecError, database_error, mask_url
from factory.identity import gone
from factory.published import QuantRow
from factory.settings import database_kind


class JobState(enum.StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


TERMINAL = frozenset({JobState.succeeded, JobState.failed, JobState.cancelled})
RETRYABLE = frozenset({JobState.failed, JobState.cancelled})  # `qf retry` queues these again

# Every change of a job's state that may happen; Catalog.transition refuses the rest.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.queued: frozenset({JobState.queued, JobState.running, JobState.failed, JobState.cancelled}),
    # queued again: handed from the gpu queue to the publishing step, or its lease expired
    JobState.running: frozenset({JobState.queued, JobState.succeeded, JobState.failed, JobState.cancelled}),
    JobState.failed: frozenset({JobState.queued, JobState.running}),  # retried; `qf run` continues it
    JobState.cancelled: frozenset({JobState.queued}),  # retried
    # queued again only when a quant it published was removed (`qf rm`) and the same job is asked for again
    # (Catalog.reopen, with only_from={succeeded}): it makes that quant again
    JobState.succeeded: frozenset({JobState.queued}),
}


class StepState(enum.StrEnum):
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    skipped = "skipped"
    interrupted = "interrupted"  # stopped by Ctrl-C or SIGTERM, or left running by an attempt that was killed
    superseded = "superseded"  # succeeded once, but what it made was removed (`qf rm`): made again, not done


def now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class Base(DeclarativeBase):
    type_annotation_map = {dict: JSON, list: JSON}


SCHEMA_VERSION = 8  # 2: jobs.lease_token; 3: steps.lease_token and expected_seconds, jobs.parameters, expected_end;
#                    4: claims.holder (was job_id), steps.holder; 5: kld, kld_p99, top1 of evaluations and quants,
#                    jobs.max_kld (a schema 4 catalog gains them in place: MIGRATIONS); 6: tokens, submissions;
#                    7: submissions.withdrawn_at; 8: quants.weights_key, files_sha, removed_at,
#                    evaluations.weights_key, steps.note
MIGRATIONS = {  # version -> the columns (table, column, SQL type) that bring a catalog of that version to the next
    "4": [(table, column, "FLOAT") for table in ("evaluations", "quants") for column in ("kld", "kld_p99", "top1")]
    + [("jobs", "max_kld", "FLOAT")],
    "5": [],  # new tables only: create_all makes them
    "6": [("submissions", "withdrawn_at", "TIMESTAMP")],
    "7": [
        ("quants", "weights_key", "VARCHAR(64)"),
        ("quants", "files_sha", "VARCHAR(64)"),
        ("quants", "removed_at", "TIMESTAMP"),
        ("evaluations", "weights_key", "VARCHAR(64)"),
        ("steps", "note", "TEXT"),
    ],
}  # a column that create_all made already (its table was new) is left as it is
_SCHEMA_LOCK_KEY = 0x71F4C7  # pg_advisory_lock key for creating the tables


class Meta(Base):
    __tablename__ = "meta"
    key: Mapped[str] = mapped_column(String(32), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Claim(Base):
    """A unit of work held by the process making it while its claim is renewed: a measurement that serves many
    jobs (`measure:<key>`), a job's conversion that a helping worker makes (`unit:<job>:quantize:<tag>`). Another
    process that needs it waits, or does other work, and takes it over once the claim runs out (or its holder, on
    this machine, is gone)."""

    __tablename__ = "claims"
    key: Mapped[str] = mapped_column(String(160), primary_key=True)
    holder: Mapped[str] = mapped_column(String(160))  # <job>@<host>:<pid> (factory/jobs/context.py: Run.claimer)
    until: Mapped[datetime] = mapped_column()
    token: Mapped[int] = mapped_column(Integer, default=1)  # +1 every time it changes hands


class Model(Base):
    """A name and the source it belongs to (a folder path or a Hub repo)."""

    __tablename__ = "models"
    name: Mapped[str] = mapped_column(String(96), primary_key=True)
    source: Mapped[str] = mapped_column(Text, unique=True)
    created_at: Mapped[datetime] = mapped_column(default=now)


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: uuid.uuid4().hex[:12])
    key: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(ForeignKey("models.name"))
    source: Mapped[str] = mapped_column(Text)
    source_identity: Mapped[str] = mapped_column(Text)
    base_model: Mapped[str] = mapped_column(Text)  # what the model card names as base_model
    specs: Mapped[list] = mapped_column()
    calibration: Mapped[str] = mapped_column(Text)
    calibration_sha: Mapped[str] = mapped_column(String(64))
    eval: Mapped[str] = mapped_column(Text)
    eval_sha: Mapped[str] = mapped_column(String(64))
    eval_windows: Mapped[int] = mapped_column(Integer)
    max_ppl_ratio: Mapped[float] = mapped_column(Float)
    max_kld: Mapped[float | None] = mapped_column(Float)
    versions: Mapped[dict] = mapped_column()
    device: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16), default=JobState.queued)
    error: Mapped[str | None] = mapped_column(Text)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    worker: Mapped[str | None] = mapped_column(Text)  # who holds (or last held) the lease
    lease_until: Mapped[datetime | None] = mapped_column()  # renewed while the job makes progress; None: released
    lease_token: Mapped[int] = mapped_column(Integer, default=0)  # fencing token: +1 every time the job is taken
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # 1 + leases lost (expired): bounds redelivery
    parameters: Mapped[int | None] = mapped_column(BigInteger)  # the source's, once inspected (for ETAs)
    expected_end: Mapped[datetime | None] = mapped_column()  # when its running attempt is expected to end
    created_at: Mapped[datetime] = mapped_column(default=now)
    updated_at: Mapped[datetime] = mapped_column(default=now, onupdate=now)
    steps: Mapped[list[Step]] = relationship(order_by="Step.id", back_populates="job")


class Step(Base):
    """One attempt at one step of a job; a retried step has several rows."""

    __tablename__ = "steps"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[datetime] = mapped_column(default=now)
    ended_at: Mapped[datetime | None] = mapped_column()
    error: Mapped[str | None] = mapped_column(Text)
    peak_gpu_bytes: Mapped[int | None] = mapped_column(BigInteger)  # what the step's tool allocated at most
    lease_token: Mapped[int | None] = mapped_column(Integer)  # the fencing token of the holder that ran it
    holder: Mapped[str | None] = mapped_column(String(160))  # the process that ran it (host:pid)
    expected_seconds: Mapped[float | None] = mapped_column(Float)  # what it was expected to take (jobs/eta.py)
    note: Mapped[str | None] = mapped_column(Text)  # what a succeeded step did instead of its work ("reused ...")
    job: Mapped[Job] = relationship(back_populates="steps")

    @property
    def seconds(self) -> float | None:
        return (self.ended_at - self.started_at).total_seconds() if self.ended_at else None


class Quant(Base):
    """A published quant: `name:tag@rev` and where its files are. `name:tag@rev` names one set of files for ever
    (`files_sha`): a row is never deleted nor given other files; `qf rm` leaves it as a tombstone (`removed_at`),
    which no listing or lookup shows and whose name only the same files can take again. Its scores are those of
    the evaluation it was published with; later evaluations of the same weights are rows of `evaluations` with its
    `weights_key` (Catalog.quant_evaluations)."""

    __tablename__ = "quants"
    __table_args__ = (UniqueConstraint("name", "tag", "rev"),)
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    name: Mapped[str] = mapped_column(ForeignKey("models.name"))
    tag: Mapped[str] = mapped_column(String(64))
    rev: Mapped[str] = mapped_column(String(64))
    method: Mapped[str] = mapped_column(String(16))
    bits: Mapped[float] = mapped_column(Float)
    spec: Mapped[dict] = mapped_column()
    bytes: Mapped[int] = mapped_column(BigInteger)
    path: Mapped[str] = mapped_column(Text)  # relative to the registry folder
    source: Mapped[str] = mapped_column(Text)
    source_identity: Mapped[str] = mapped_column(Text)
    calibration: Mapped[str] = mapped_column(Text)
    calibration_sha: Mapped[str] = mapped_column(String(64))
    eval: Mapped[dict] = mapped_column()  # text, sha256, windows, window_length, device
    versions: Mapped[dict] = mapped_column()
    ppl: Mapped[float] = mapped_column(Float)
    fp16_ppl: Mapped[float] = mapped_column(Float)
    kld: Mapped[float | None] = mapped_column(Float)  # mean KL(FP16 || quant) per token, on the eval windows
    kld_p99: Mapped[float | None] = mapped_column(Float)
    top1: Mapped[float | None] = mapped_column(Float)  # share of positions where both pick the same next token
    weights_key: Mapped[str | None] = mapped_column(String(64), index=True)  # identity.weights_key; None: schema 7
    files_sha: Mapped[str | None] = mapped_column(String(64))  # identity.files_sha; None: published before schema 8
    removed_at: Mapped[datetime | None] = mapped_column()  # `qf rm`: a tombstone
    created_at: Mapped[datetime] = mapped_column(default=now)

    def row(self) -> QuantRow:
        """The public form of this quant (the model card, `qf ls`, `qf show`, `--json`)."""
        return QuantRow(
            name=self.name,
            tag=self.tag,
            rev=self.rev,
            method=self.method,
            bits=self.bits,
            bytes=self.bytes,
            ppl=self.ppl,
            fp16_ppl=self.fp16_ppl,
            kld=self.kld,
            kld_p99=self.kld_p99,
            top1=self.top1,
            source=self.source,
            source_identity=self.source_identity,
            calibration=self.calibration,
            eval=self.eval,
            versions=self.versions,
            job=self.job_id,
            path=self.path,
            spec=self.spec or {},
            created_at=(self.created_at or now()).isoformat(timespec="seconds"),
        )


def _holding(held: Claim) -> bool:
    """A claim is held until it runs out, or until its holder on this machine is gone (a killed process)."""
    return held.until > now() and not gone(held.holder.rpartition("@")[2])


class Measurement(Base):
    """An engine's measurement of a model, reusable by every size made with the same key."""

    __tablename__ = "measurements"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(64), unique=True)
    path: Mapped[str] = mapped_column(Text)
    source_identity: Mapped[str] = mapped_column(Text)
    calibration_sha: Mapped[str] = mapped_column(String(64))
    rows: Mapped[int] = mapped_column(Integer)
    length: Mapped[int] = mapped_column(Integer)
    tool_version: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(default=now)


class Evaluation(Base):
    """A perplexity measured on one token stream, and a quant's divergence from FP16 on it; subject `fp16` is the
    baseline, reused across jobs (with its reference of FP16's distributions, factory/kld.py)."""

    __tablename__ = "evaluations"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    subject: Mapped[str] = mapped_column(String(64))
    source_identity: Mapped[str] = mapped_column(Text)
    evaluator: Mapped[str] = mapped_column(String(32))
    device: Mapped[str] = mapped_column(String(16))
    eval_sha: Mapped[str] = mapped_column(String(64))
    windows: Mapped[int] = mapped_column(Integer)
    window_length: Mapped[int] = mapped_column(Integer)
    ppl: Mapped[float] = mapped_column(Float)
    kld: Mapped[float | None] = mapped_column(Float)
    kld_p99: Mapped[float | None] = mapped_column(Float)
    top1: Mapped[float | None] = mapped_column(Float)
    weights_key: Mapped[str | None] = mapped_column(String(64), index=True)  # a quant's: which weights were scored
    seconds: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=now)


class Watch(Base):
    """A watchlist entry: a Hub repo (`org/name`) or an author's repos by name pattern (`org/*-Instruct`)."""

    __tablename__ = "watches"
    target: Mapped[str] = mapped_column(String(200), primary_key=True)
    recipe: Mapped[dict] = mapped_column()  # as written: the engine keys of a recipe
    filter: Mapped[dict] = mapped_column()  # architectures, max_params
    created_at: Mapped[datetime] = mapped_column(default=now)


class Upstream(Base):
    """What the scheduler did with one upstream commit for one watch: submitted a job, or skipped it (reason)."""

    __tablename__ = "upstream"
    __table_args__ = (UniqueConstraint("watch", "repo", "sha"),)
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    watch: Mapped[str] = mapped_column(String(200))
    repo: Mapped[str] = mapped_column(String(200))
    sha: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str | None] = mapped_column(String(32))
    skipped: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=now)


class Token(Base):
    """A person's key to the service (`qf token create`): only its sha256 is kept."""

    __tablename__ = "tokens"
    id: Mapped[str] = mapped_column(String(16), primary_key=True)  # shown by `qf token ls`, named by revoke
    username: Mapped[str] = mapped_column(String(64), index=True)
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[list] = mapped_column()
    quota_jobs_per_day: Mapped[int | None] = mapped_column(Integer)
    max_running: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=now)
    last_used_at: Mapped[datetime | None] = mapped_column()  # its last submission
    revoked_at: Mapped[datetime | None] = mapped_column()


class Submission(Base):
    """Who asked for a job, and when: a job submitted again by another user is theirs too (the same job id). A row
    without a job is a place reserved by a submission in progress (service/accounts.py); a withdrawn row is a
    user's cancel of a job that others still want."""

    __tablename__ = "submissions"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"), index=True)
    username: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[datetime] = mapped_column(default=now, index=True)
    withdrawn_at: Mapped[datetime | None] = mapped_column()


def _normalize_url(url: str) -> str:
    # Users write postgresql://...; SQLAlchemy's default driver for that is psycopg2, which we install.
    return re.sub(r"^postgres(ql)?://", "postgresql+psycopg2://", url)


class Catalog:
    def __init__(self, url: str):
        self.url = url
        if database_kind(url) == "sqlite":
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        args = {"timeout": 30} if url.startswith("sqlite") else {"connect_timeout": 5}
        self.engine = create_engine(_normalize_url(url), connect_args=args, pool_pre_ping=True)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        try:
            with self._schema_lock():
                had_tables = inspect(self.engine).has_table("jobs")
                Base.metadata.create_all(self.engine)
                self._check_schema(had_tables)
        except OperationalError as e:
            raise database_error(url, e) from None

    @contextmanager
    def _schema_lock(self) -> Iterator[None]:
        """Processes that open a new catalog at the same moment create its tables one at a time."""
        if self.engine.dialect.name == "postgresql":
            with self.engine.connect() as conn:
                conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _SCHEMA_LOCK_KEY})
                try:
                    yield
                finally:
                    conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _SCHEMA_LOCK_KEY})
                    conn.commit()
        elif self.url.startswith("sqlite:///"):
            with open(self.url.removeprefix("sqlite:///") + ".lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                yield
        else:
            yield

    def _check_schema(self, had_tables: bool) -> None:
        """A catalog of an older version that MIGRATIONS knows is brought up to this one; any other version is
        refused in one sentence."""
        with self.session() as s:
            found = s.get(Meta, "schema")
            if found is None and not had_tables:
                s.add(Meta(key="schema", value=str(SCHEMA_VERSION)))
                return
            version = found.value if found else "0"
            while version in MIGRATIONS:
                for table, column, kind in MIGRATIONS[version]:
                    if column not in {c["name"] for c in inspect(s.connection()).get_columns(table)}:
                        s.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {kind}"))
                version = found.value = str(int(version) + 1)
        if version != str(SCHEMA_VERSION):
            raise ServiceUnavailable(
                f"the catalog at {mask_url(self.url)} has schema version {version}, this quantfactory needs "
                f"{SCHEMA_VERSION}; point FACTORY_DB_URL at a new database (no migration from it exists)"
            )

    @contextmanager
    def session(self) -> Iterator[Session]:
        try:
            with self._sessions.begin() as session:
                yield session
        except OperationalError as e:
            raise database_error(self.url, e) from None

    # models
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

    # jobs
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

    def job(self, job_id: str) -> Job | None:
        with self.session() as s:
            job = s.get(Job, job_id)
            if job is not None:
                _ = job.steps
            return job

    # state: the one compare-and-set
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
        with self.session() as s:
            return s.execute(query).rowcount == 1

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

    # leases: who runs the job now, fenced by a token
    def take_lease(self, job_id: str, worker: str, seconds: float, gone: str | None = None) -> Lease | None:
        """Hold the job for `worker` with a new fencing token, or None while another holder's lease is valid (a
        duplicate message, a second `qf run`) unless that holder is `gone` (known dead: its lease is not waited
        out). Taking a lease that expired counts an attempt; one that was released (the hand-off to the publishing
        step) does not."""
        with self.session() as s:
            job = s.get(Job, job_id, with_for_update=True)
            valid = job.lease_until is not None and job.lease_until > now()
            if valid and job.worker not in (worker, gone):
                return None
            if job.attempts == 0 or job.lease_until is not None:
                job.attempts += 1
            job.worker, job.lease_until = worker, now() + timedelta(seconds=seconds)
            job.lease_token += 1
            return Lease(job_id, worker, job.lease_token, job.attempts)

    def renew_lease(self, lease: Lease, seconds: float) -> bool:
        """Extend the lease; False when another holder has taken the job since (the lease is lost)."""
        with self.session() as s:
            renewed = s.execute(
                update(Job)
                .where(Job.id == lease.job_id, Job.lease_token == lease.token)
                .values(lease_until=now() + timedelta(seconds=seconds))
            )
            return renewed.rowcount == 1

    def release_lease(self, lease: Lease) -> None:
        with self.session() as s:
            s.execute(
                update(Job).where(Job.id == lease.job_id, Job.lease_token == lease.token).values(lease_until=None)
            )

    def holder(self, job_id: str) -> str | None:
        """Who holds a valid lease on the job now, if anyone."""
        job = self.job(job_id)
        return job.worker if job and job.lease_until is not None and job.lease_until > now() else None

    def check_lease(self, job_id: str, token: int | None) -> None:
        """Raises LeaseLost when `token` no longer holds the job, Cancelled when it was cancelled."""
        with self.session() as s:
            self._fence(s, job_id, token, running=True)

    def _fence(self, s: Session, job_id: str, token: int | None, running: bool = False) -> None:
        """Inside a write's own transaction: take the job's row lock, and go on only while `token` holds the job
        (and, with `running`, while it is running). The no-op UPDATE takes the lock on PostgreSQL and SQLite alike."""
        query = update(Job).where(Job.id == job_id)
        if token is not None:
            query = query.where(Job.lease_token == token)
        if running:
            query = query.where(Job.state == JobState.running)
        if s.execute(query.values(lease_token=Job.lease_token, updated_at=Job.updated_at)).rowcount == 1:
            return
        job = s.get(Job, job_id)
        if token is not None and job.lease_token != token:
            raise LeaseLost(f"lease lost to {job.worker}; stopping")
        raise (
            Cancelled(f"job {job_id} was cancelled")
            if job.state == JobState.cancelled
            else LeaseLost(f"job {job_id} is {job.state}, not running; stopping")
        )

    def expired_leases(self) -> list[str]:
        """Running jobs whose holder stopped renewing: queued again (the next take counts the loss)."""
        with self.session() as s:
            candidates = list(s.scalars(select(Job.id).where(Job.state == JobState.running, Job.lease_until < now())))
        return [
            job_id
            for job_id in candidates
            if self.transition(job_id, JobState.queued, lease_expired=True, only_from=frozenset({JobState.running}))
        ]

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

    # steps
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
            s.add(Step(job_id=job_id, name=name, state=StepState.skipped, error=reason, ended_at=now()))

    def unit_history(self, family: str, device: str, limit: int = 200) -> list[tuple[str, float, int]]:
        """(step name, seconds, the job's parameters) of the newest finished steps whose name starts with
        `family` (jobs/eta.py: `quantize:<engine>`), on jobs of this device."""
        with self.session() as s:
            rows = s.execute(
                select(Step.name, Step.started_at, Step.ended_at, Job.parameters)
                .join(Job)
                .where(
                    Step.name.startswith(family),
                    Step.state == StepState.succeeded,
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

    def reuse_step(self, job_id: str, name: str, note: str, token: int | None = None) -> None:
        """A step that succeeded without its work: what it used instead (`note`)."""
        with self.session() as s:
            self._fence(s, job_id, token)
            s.add(
                Step(job_id=job_id, name=name, state=StepState.succeeded, note=note, lease_token=token, ended_at=now())
            )

    def done_steps(self, job_id: str) -> set[str]:
        with self.session() as s:
            rows = s.scalars(select(Step.name).where(Step.job_id == job_id, Step.state == StepState.succeeded))
            return set(rows)

    # the watchlist
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

    # quants
    def put_quant(self, quant: Quant, token: int | None = None, publish=None) -> Quant:
        """Record a published quant; `publish()`, the registry's act, runs inside the same transaction, after the
        fence: while the job is running and `token` holds it, so a cancel or a new holder either comes first
        (nothing is published) or waits for it. A row of name:tag@rev is never replaced: one with the same files
        (quant.files_sha) is kept as it is, a tombstone with them is restored (its new row's scores: the job that
        made it again); one with other files raises RevTaken (the publisher takes another rev). A concurrent insert
        of the same name:tag@rev (a publisher that raced this one) is looked at again as it commits."""
        try:
            return self._put_quant(quant, token, publish)
        except IntegrityError:
            won = self.quant_at(quant.name, quant.tag, quant.rev)
            if won is None or won.files_sha != quant.files_sha:
                raise RevTaken(f"{quant.name}:{quant.tag}@{quant.rev} holds other files") from None
            return won

    def _put_quant(self, quant: Quant, token: int | None, publish) -> Quant:
        with self.session() as s:
            self._fence(s, quant.job_id, token, running=publish is not None)
            old = s.scalars(
                select(Quant).where(Quant.name == quant.name, Quant.tag == quant.tag, Quant.rev == quant.rev)
            ).one_or_none()
            if old is not None and old.files_sha != quant.files_sha:
                raise RevTaken(f"{quant.name}:{quant.tag}@{quant.rev} holds other files")
            if publish is not None:
                publish()
            if old is None:
                s.add(quant)
                return quant
            if old.removed_at is not None:  # the same files made again after `qf rm`
                for column in Quant.__table__.columns.keys():
                    if column not in ("id", "created_at"):
                        setattr(old, column, getattr(quant, column))
                old.removed_at = None
            return old

    def quant_at(self, name: str, tag: str, rev: str) -> Quant | None:
        """The row of name:tag@rev, a tombstone too (what decides whether that rev is free for some files)."""
        with self.session() as s:
            return s.scalars(select(Quant).where(Quant.name == name, Quant.tag == tag, Quant.rev == rev)).one_or_none()

    def quants(self, name: str | None = None, job_id: str | None = None) -> list[Quant]:
        """The live quants (never tombstones); `job_id`: those the job published or evaluated (a quant it reused)."""
        with self.session() as s:
            query = select(Quant).where(Quant.removed_at.is_(None))
            query = query.order_by(Quant.name, Quant.method, Quant.bits, Quant.created_at.desc())
            if name is not None:
                query = query.where(Quant.name == name)
            if job_id is not None:
                evaluated = select(Evaluation.weights_key).where(
                    Evaluation.job_id == job_id, Evaluation.weights_key.is_not(None)
                )
                query = query.where((Quant.job_id == job_id) | Quant.weights_key.in_(evaluated))
            return list(s.scalars(query))

    def quant_with_weights(self, weights_key: str) -> Quant | None:
        """The live quant whose weights this key makes (the oldest, should there be two: they race to publish)."""
        with self.session() as s:
            return s.scalars(
                select(Quant)
                .where(Quant.weights_key == weights_key, Quant.removed_at.is_(None))
                .order_by(Quant.id)
                .limit(1)
            ).one_or_none()

    def removed_quants(self, job_id: str) -> list[Quant]:
        """The tombstones of quants the job published or evaluated whose weights are not published any more."""
        with self.session() as s:
            evaluated = select(Evaluation.weights_key).where(
                Evaluation.job_id == job_id, Evaluation.weights_key.is_not(None)
            )
            live = select(Quant.weights_key).where(Quant.removed_at.is_(None), Quant.weights_key.is_not(None))
            query = select(Quant).where(
                Quant.removed_at.is_not(None),
                (Quant.job_id == job_id) | Quant.weights_key.in_(evaluated),
                Quant.weights_key.not_in(live) | Quant.weights_key.is_(None),
            )
            return list(s.scalars(query.order_by(Quant.id)))

    def remove_quant(self, name: str, tag: str, rev: str) -> bool:
        """Take the published quant name:tag@rev out of every listing (`qf rm`), leaving its row as a tombstone so
        that the name never names other files; False when there was none."""
        with self.session() as s:
            return (
                s.execute(
                    update(Quant)
                    .where(Quant.name == name, Quant.tag == tag, Quant.rev == rev, Quant.removed_at.is_(None))
                    .values(removed_at=now())
                ).rowcount
                > 0
            )

    def reopen(self, job_id: str, tags: list[str]) -> bool:
        """A succeeded job queued again to make the quants of `tags` again (they were removed): their quantize,
        evaluate, gate, publish and push steps are superseded. False when the job is not succeeded (any more)."""
        with self.session() as s:
            if not self.transition(job_id, JobState.queued, only_from=frozenset({JobState.succeeded}), session=s):
                return False
            names = {"gate"} | {f"{kind}:{tag}" for tag in tags for kind in ("quantize", "evaluate", "publish", "push")}
            for step in s.scalars(select(Step).where(Step.job_id == job_id, Step.state == StepState.succeeded)):
                if step.name in names or any(step.name.startswith(f"evaluate:{tag}:") for tag in tags):
                    step.state = StepState.superseded
            return True

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

    # measurements
    def measurement(self, key: str) -> Measurement | None:
        with self.session() as s:
            return s.scalars(select(Measurement).where(Measurement.key == key)).one_or_none()

    def add_measurement(self, job_id: str, token: int | None = None, **fields: object) -> None:
        """Record a measurement made for `job_id`; a concurrent twin with the same key is kept as it is."""
        try:
            with self.session() as s:
                self._fence(s, job_id, token)
                s.add(Measurement(**fields))
        except IntegrityError:
            pass

    # claims of units that serve many jobs
    def claim(self, key: str, holder: str, seconds: float) -> int | None:
        """Hold `key` for `holder` (its token), or None while another holder's claim is valid."""
        for _ in range(2):  # a concurrent first claim wins the insert; look again once
            try:
                with self.session() as s:
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
        with self.session() as s:
            renewed = s.execute(
                update(Claim)
                .where(Claim.key == key, Claim.token == token)
                .values(until=now() + timedelta(seconds=seconds))
            )
            return renewed.rowcount == 1

    def release_claim(self, key: str, token: int) -> None:
        with self.session() as s:
            s.execute(delete(Claim).where(Claim.key == key, Claim.token == token))

    def claimant(self, key: str) -> str | None:
        """The holder whose valid claim holds `key`, if any (one on this machine whose process is gone holds
        nothing: `claim` takes it over at once)."""
        with self.session() as s:
            held = s.get(Claim, key)
            return held.holder if held is not None and _holding(held) else None

    def _fence_claim(self, s: Session, claim: tuple[str, int] | None) -> None:
        """Inside a write's own transaction: go on only while `claim` (key, token) is still held."""
        if claim is None:
            return
        key, token = claim
        held = s.get(Claim, key, with_for_update=True)
        if held is None or held.token != token:
            raise LeaseLost(f"{key} was taken over by {held.holder if held else 'another holder'}; stopping")

    # evaluations
    def add_evaluation(self, token: int | None = None, **fields: object) -> None:
        with self.session() as s:
            self._fence(s, str(fields["job_id"]), token)
            s.add(Evaluation(**fields))

    def baseline(
        self, source_identity: str, eval_sha: str, windows: int, window_length: int, device: str
    ) -> float | None:
        """A stored FP16 perplexity for exactly this token stream, if one was measured before."""
        with self.session() as s:
            return s.scalar(
                select(Evaluation.ppl)
                .where(
                    Evaluation.subject == "fp16",
                    Evaluation.source_identity == source_identity,
                    Evaluation.eval_sha == eval_sha,
                    Evaluation.windows == windows,
                    Evaluation.window_length == window_length,
                    Evaluation.device == device,
                )
                .limit(1)
            )

    def quant_evaluations(self, quant: Quant) -> list[dict]:
        """Every evaluation of the quant's weights (the one it was published with and those of later jobs that reused
        it), oldest first: job, text, windows, window_length, device, ppl, kld, kld_p99, top1, created_at. A quant
        published before weights keys has only its own."""
        with self.session() as s:
            rows = (
                s.execute(
                    select(Evaluation, Job.eval)
                    .join(Job, Job.id == Evaluation.job_id)
                    .where(Evaluation.weights_key == quant.weights_key, Evaluation.subject == quant.tag)
                    .order_by(Evaluation.id)
                )
                if quant.weights_key
                else []
            )
            found = [
                {
                    "job": e.job_id,
                    "text": text_name,
                    "windows": e.windows,
                    "window_length": e.window_length,
                    "device": e.device,
                    "ppl": e.ppl,
                    "kld": e.kld,
                    "kld_p99": e.kld_p99,
                    "top1": e.top1,
                    "created_at": e.created_at.isoformat(timespec="seconds"),
                }
                for e, text_name in rows
            ]
        if found:
            return found
        e = quant.eval
        return [
            {
                "job": quant.job_id,
                "text": e.get("text"),
                "windows": e.get("windows"),
                "window_length": e.get("window_length"),
                "device": e.get("device"),
                "ppl": quant.ppl,
                "kld": quant.kld,
                "kld_p99": quant.kld_p99,
                "top1": quant.top1,
                "created_at": quant.row().created_at,
            }
        ]

    def quant_row(self, quant: Quant) -> QuantRow:
        """A quant's row with every evaluation of its weights (`qf show`, the Hub repo's main card)."""
        return replace(quant.row(), evaluations=self.quant_evaluations(quant))

    def evaluations(self, job_id: str) -> list[Evaluation]:
        with self.session() as s:
            return list(s.scalars(select(Evaluation).where(Evaluation.job_id == job_id).order_by(Evaluation.id)))


class RevTaken(Exception):
    """name:tag@rev names other files (a row or a registry folder): publish under another rev."""


@dataclass(frozen=True)
class Lease:
    """A holder's claim on a job: its fencing token goes with every write the holder makes for the job."""

    job_id: str
    worker: str
    token: int
    attempts: int
