"""The catalog's tables (SQLAlchemy 2), and its schema version with the migrations that bring an older catalog
up to it."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from factory import specs
from factory.catalog.states import JobState, now
from factory.registry.published import QuantRow
from factory.specs import QuantSpec


class Spec(TypeDecorator):
    """A QuantSpec in a JSON column, as its `model_dump()`: the catalog's edge, where a spec is a dict (the stored
    form is the one every catalog already holds, so old rows read back as typed specs)."""

    impl = JSON
    cache_ok = True

    def process_bind_param(self, value: QuantSpec | None, dialect) -> dict | None:
        return None if value is None else value.model_dump()

    def process_result_value(self, value: dict | None, dialect) -> QuantSpec | None:
        return None if value is None else specs.parse(value)


class Specs(TypeDecorator):
    """A job's QuantSpecs in a JSON column, as a list of their `model_dump()`s."""

    impl = JSON
    cache_ok = True

    def process_bind_param(self, value: list[QuantSpec] | None, dialect) -> list[dict] | None:
        return None if value is None else [s.model_dump() for s in value]

    def process_result_value(self, value: list[dict] | None, dialect) -> list[QuantSpec] | None:
        return None if value is None else [specs.parse(s) for s in value]


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
    specs: Mapped[list[QuantSpec]] = mapped_column(Specs)  # resolved at the inspect step (set_specs)
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
    `weights_key` (Quants.evaluations_of)."""

    __tablename__ = "quants"
    __table_args__ = (UniqueConstraint("name", "tag", "rev"),)
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    name: Mapped[str] = mapped_column(ForeignKey("models.name"))
    tag: Mapped[str] = mapped_column(String(64))
    rev: Mapped[str] = mapped_column(String(64))
    method: Mapped[str] = mapped_column(String(16))
    bits: Mapped[float] = mapped_column(Float)
    spec: Mapped[QuantSpec] = mapped_column(Spec)
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
            spec=self.spec,
            created_at=(self.created_at or now()).isoformat(timespec="seconds"),
        )


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
    baseline, reused across jobs (with its reference of FP16's distributions, factory/evaluation/kld.py)."""

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
    without a job is a place reserved by a submission in progress (catalog/accounts.py); a withdrawn row is a
    user's cancel of a job that others still want."""

    __tablename__ = "submissions"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"), index=True)
    username: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[datetime] = mapped_column(default=now, index=True)
    withdrawn_at: Mapped[datetime | None] = mapped_column()
