"""The catalog: models, jobs, steps, quants, measurements, evaluations, and the watchlist (SQLAlchemy 2).

SQLite under FACTORY_HOME by default; FACTORY_DB_URL for any other database (PostgreSQL in production).
A job is one submission: one source, one or more specs. Its idempotency key is a hash of what decides the
result (source identity, resolved specs, calibration and eval text hashes, eval windows, engine versions), so
the same job submitted twice is the same row.

A job's state changes only through `Catalog.transition`, one compare-and-set along TRANSITIONS. A job being run is
held by a lease whose fencing token grows every time the job changes hands; every write the holder makes for the
job (state, steps, measurements, evaluations, quants) carries the token and is refused (LeaseLost) once another
holder has taken the job, so a holder that stalled and came back changes nothing.

The parts: states.py (states and transitions), tables.py (tables and schema), database.py (the database, the
compare-and-set and the fences), jobs.py (jobs, steps, the watchlist), leases.py (leases and claims), quants.py
(quants, measurements, evaluations), status.py (plain-SQL readers for the hot paths of `qf status`).
"""

from factory.catalog.jobs import Jobs
from factory.catalog.leases import Lease, Leases
from factory.catalog.quants import Quants, RevTaken
from factory.catalog.states import RETRYABLE, TERMINAL, TRANSITIONS, JobState, StepState, now
from factory.catalog.tables import (
    MIGRATIONS,
    SCHEMA_VERSION,
    Base,
    Claim,
    Evaluation,
    Job,
    Measurement,
    Meta,
    Model,
    Quant,
    Step,
    Submission,
    Token,
    Upstream,
    Watch,
)


class Catalog(Jobs, Leases, Quants):
    """The catalog: one object for every reader and writer, made of its parts."""


__all__ = [
    "Catalog",
    "Lease",
    "RevTaken",
    "JobState",
    "StepState",
    "TERMINAL",
    "RETRYABLE",
    "TRANSITIONS",
    "now",
    "SCHEMA_VERSION",
    "MIGRATIONS",
    "Base",
    "Meta",
    "Claim",
    "Model",
    "Job",
    "Step",
    "Quant",
    "Measurement",
    "Evaluation",
    "Watch",
    "Upstream",
    "Token",
    "Submission",
]
