"""What every store of the catalog stands on: the database and its schema, a session, and the fences every write of a
holder goes through."""

from __future__ import annotations

import fcntl
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, inspect, text, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from factory.catalog.schema import MIGRATIONS, SCHEMA_VERSION, Base, Claim, Job, Meta
from factory.catalog.states import JobState
from factory.errors import Cancelled, LeaseLost, ServiceUnavailable, database_error, mask_url
from factory.settings import database_kind

_SCHEMA_LOCK_KEY = 0x71F4C7  # pg_advisory_lock key for creating the tables


def _normalize_url(url: str) -> str:
    # Users write postgresql://...; SQLAlchemy's default driver for that is psycopg2, which we install.
    return re.sub(r"^postgres(ql)?://", "postgresql+psycopg2://", url)


class Database:
    """The database and its schema, a session and the fences: what every store of the catalog is given, and the only
    thing they share."""

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

    def fence(self, s: Session, job_id: str, token: int | None, running: bool = False) -> None:
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

    def fence_claim(self, s: Session, claim: tuple[str, int] | None) -> None:
        """Inside a write's own transaction: go on only while `claim` (key, token) is still held."""
        if claim is None:
            return
        key, token = claim
        held = s.get(Claim, key, with_for_update=True)
        if held is None or held.token != token:
            raise LeaseLost(f"{key} was taken over by {held.holder if held else 'another holder'}; stopping")
