"""The catalog: models, jobs, steps, quants, measurements, evaluations, and the watchlist (SQLAlchemy 2).

SQLite under FACTORY_HOME by default; FACTORY_DB_URL for any other database (PostgreSQL in production).
A job is one submission: one source, one or more specs. Its idempotency key is a hash of what decides the
result (source identity, resolved specs, calibration and eval text hashes, eval windows, engine versions), so
the same job submitted twice is the same row.

A job's state changes only through `Jobs.transition`, one compare-and-set along TRANSITIONS. A job being run is
held by a lease whose fencing token grows every time the job changes hands; every write the holder makes for the
job (state, steps, measurements, evaluations, quants) carries the token and is refused (LeaseLost) once another
holder has taken the job, so a holder that stalled and came back changes nothing.

A caller receives the store it works with, each a few methods over one Database (database.py: the schema, a
session, the fences): `jobs` (jobs.py: jobs, the compare-and-set, model names), `steps` (steps.py), `leases`
(leases.py: leases and claims), `quants` (quants.py: quants, measurements, evaluations), `accounts` (accounts.py:
the service's tokens, quotas and submissions) and `watchlist` (watchlist.py: watches and upstream releases).
states.py holds the states and transitions, schema.py the tables and the schema version, status.py the plain-SQL
readers for the hot paths of `qf status`. Every SQL statement of the project is in this package.
"""

from factory.catalog.accounts import Accounts
from factory.catalog.database import Database
from factory.catalog.jobs import Jobs
from factory.catalog.leases import Lease, Leases
from factory.catalog.quants import Quants, RevTaken
from factory.catalog.schema import (
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
from factory.catalog.states import RETRYABLE, TERMINAL, TRANSITIONS, JobState, StepState, now
from factory.catalog.steps import Steps
from factory.catalog.watchlist import Watchlist


class Catalog:
    """The catalog's stores over one database; a caller takes the one it needs (`catalog.leases`)."""

    def __init__(self, url: str):
        self.db = Database(url)
        self.jobs = Jobs(self.db)
        self.steps = Steps(self.db)
        self.leases = Leases(self.db, self.jobs)
        self.quants = Quants(self.db, self.jobs)
        self.accounts = Accounts(self.db, self.jobs)
        self.watchlist = Watchlist(self.db)


__all__ = [
    "Catalog",
    "Database",
    "Jobs",
    "Steps",
    "Leases",
    "Quants",
    "Accounts",
    "Watchlist",
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
