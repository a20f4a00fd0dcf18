"""The service's users: their tokens (only a token's sha256 is kept), scopes and quotas, and who submitted which job.

A token is `qf_` and 43 URL-safe characters (32 random bytes). Scopes:

| scope  | allows                                                          |
|--------|-----------------------------------------------------------------|
| read   | the user's own jobs, every quant, the dashboard                 |
| submit | submitting, cancelling and retrying the user's own jobs         |
| pull   | downloading a quant's files                                     |
| admin  | everything, every user's jobs, the watchlist                    |

Quotas are per user, over all of the user's tokens, and counted strictly: a submission first reserves its place
(a row in `submissions`) while holding the user's token rows (UPDATE ... last_used_at: a row lock on PostgreSQL,
the write lock on SQLite), so concurrent submissions cannot both take the last place
(tests/integration/test_service_races.py: 16 processes at one instant). A place whose submission never ended (its server
was killed) is let go after FACTORY_PLACE_SECONDS; a submission that outlived its place takes it again at `record` only
if the quotas still allow it (else OverQuota, and its job is cancelled unless another owner wants it).

A job is owned by every user who submitted it (the same submission again is the same job: the quant's work is
shared). `cancel` by a user withdraws that user's interest only: the job is cancelled when no owner is left (an
admin's cancel cancels it outright), so no user can stop another's job by submitting it too. `retry` of a failed
or cancelled job is what submitting it again does (it re-queues the job for everyone who wants it), so any owner
may ask for it; it counts against the caller's quotas as a submission does (a place reserved and recorded), and
makes the caller an owner again if they had withdrawn.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import delete, func, select, update

from factory.catalog.database import Database
from factory.catalog.jobs import Jobs
from factory.catalog.schema import Job, Submission, Token
from factory.catalog.states import TERMINAL, now
from factory.errors import AccessDenied, NotFound, OverQuota, SpecError

SCOPES = ("read", "submit", "pull", "admin")
DEFAULT_SCOPES = ("read", "submit", "pull")
PREFIX = "qf_"
DAY = timedelta(days=1)
_USER = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


class Unauthenticated(AccessDenied):
    """No token, or one this factory does not know (HTTP 401; the other refusals are 403)."""


@dataclass(frozen=True)
class Account:
    """Who a request is from: the user of a token that is known and not revoked, or the public (no token, where
    the admin allows it: read only)."""

    user: str
    scopes: frozenset[str]
    quota_jobs_per_day: int | None = None
    max_running: int | None = None
    public: bool = False  # the dashboard's visitor without a token, where the admin allows one: sees every job

    @property
    def admin(self) -> bool:
        return "admin" in self.scopes

    @property
    def sees_every_job(self) -> bool:
        return self.admin or self.public

    def can(self, scope: str) -> bool:
        return scope in self.scopes or self.admin

    def require(self, scope: str) -> None:
        if not self.can(scope):
            who = "a request without a token" if self.public else f"this token of {self.user}"
            raise AccessDenied(f"{who} lacks the {scope!r} scope; ask the factory's admin for a token that has it")


PUBLIC = Account(user="(public)", scopes=frozenset({"read"}), public=True)


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_scopes(text: str) -> tuple[str, ...]:
    """Rules: comma-separated names from SCOPES. Valid: `read,pull`, `admin`. Not valid: `write`, an empty list."""
    scopes = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown or not scopes:
        raise SpecError(f"--scope {text!r}: scopes are {', '.join(SCOPES)} (comma-separated)")
    return scopes


class Accounts:
    """Tokens, quotas and who submitted which job."""

    def __init__(self, db: Database, jobs: Jobs):
        self.db, self.jobs = db, jobs

    def create(
        self,
        user: str,
        scopes: tuple[str, ...] = DEFAULT_SCOPES,
        quota_jobs_per_day: int | None = None,
        max_running: int | None = None,
    ) -> tuple[str, Token]:
        """A new token for `user`: (the token, shown this once; its row)."""
        if not _USER.fullmatch(user):
            raise SpecError(
                f"user {user!r}: lowercase letters, digits, '.', '_' and '-', at most 64, starting with "
                "a letter or digit"
            )
        secret = PREFIX + secrets.token_urlsafe(32)
        row = Token(
            id=secrets.token_hex(4),
            username=user,
            sha256=_digest(secret),
            scopes=list(scopes),
            quota_jobs_per_day=quota_jobs_per_day,
            max_running=max_running,
        )
        with self.db.session() as s:
            s.add(row)
        return secret, row

    def tokens(self) -> list[Token]:
        with self.db.session() as s:
            return list(s.scalars(select(Token).order_by(Token.created_at)))

    def revoke(self, token_id: str) -> Token:
        with self.db.session() as s:
            row = s.get(Token, token_id)
            if row is None:
                raise NotFound(f"no token {token_id!r}; `qf token ls` lists them")
            row.revoked_at = row.revoked_at or now()
            return row

    def authenticate(self, secret: str | None) -> Account:
        if not secret:
            raise Unauthenticated(
                "this request has no token; set FACTORY_TOKEN (or send Authorization: Bearer "
                "<token>); `qf token create` on the factory makes one"
            )
        with self.db.session() as s:
            row = s.scalar(select(Token).where(Token.sha256 == _digest(secret)))
        if row is None or row.revoked_at is not None:
            raise Unauthenticated(
                "the token is not valid here (revoked, or not one of this factory's); ask the "
                "factory's admin for a new one"
            )
        return Account(
            user=row.username,
            scopes=frozenset(row.scopes),
            quota_jobs_per_day=row.quota_jobs_per_day,
            max_running=row.max_running,
        )

    def reserve(self, account: Account, place_seconds: float) -> int:
        """A place for one more submission by `account`'s user (its id, for `record` or `release`), or OverQuota
        naming the quota and when a place frees up. Places older than `place_seconds` that have no job yet were
        left by a submission that never ended (a killed server): they are let go here."""
        with self.db.session() as s:
            s.execute(update(Token).where(Token.username == account.user).values(last_used_at=now()))
            s.execute(
                delete(Submission).where(
                    Submission.username == account.user,
                    Submission.job_id.is_(None),
                    Submission.created_at < now() - timedelta(seconds=place_seconds),
                )
            )
            self._check_quotas(s, account)
            place = Submission(username=account.user, job_id=None)
            s.add(place)
            s.flush()
            return place.id

    def _check_quotas(self, s, account: Account) -> None:
        """OverQuota unless `account`'s user may have one more job (the caller holds the user's token rows)."""
        if account.quota_jobs_per_day is not None:
            since = now() - DAY
            recent = s.scalars(
                select(Submission.created_at)
                .where(Submission.username == account.user, Submission.created_at > since)
                .order_by(Submission.created_at)
            )
            recent = list(recent)
            if len(recent) >= account.quota_jobs_per_day:
                resets = (recent[0] + DAY).isoformat(sep=" ", timespec="seconds")
                raise OverQuota(
                    f"{account.user} has submitted {len(recent)} jobs in the last 24 hours, the quota "
                    f"is {account.quota_jobs_per_day} a day; the next one may be submitted at "
                    f"{resets} UTC"
                )
        if account.max_running is not None:
            running = self._running(s, account.user)
            if running >= account.max_running:
                raise OverQuota(
                    f"{account.user} has {running} jobs queued or running, at most "
                    f"{account.max_running} are allowed at once; the next one may be submitted when "
                    "one of them ends"
                )

    @staticmethod
    def _running(s, user: str) -> int:
        """The user's jobs that are not over, plus their places not yet recorded, in ONE statement: `record` turns a
        place into a job without the token's lock, and on PostgreSQL (READ COMMITTED) each statement reads its own
        snapshot, so two counts could miss a place that `record` committed between them."""
        jobs = (
            select(func.count(func.distinct(Submission.job_id)))
            .join(Job, Job.id == Submission.job_id)
            .where(
                Submission.username == user,
                Submission.withdrawn_at.is_(None),
                Job.state.not_in([str(t) for t in TERMINAL]),
            )
            .scalar_subquery()
        )
        pending = (
            select(func.count())
            .select_from(Submission)
            .where(Submission.username == user, Submission.job_id.is_(None))
            .scalar_subquery()
        )
        return s.scalar(select(jobs + pending)) or 0

    def record(self, place: int, account: Account, job_id: str) -> Job:
        """The reserved place becomes the user's submission of `job_id`, under the job's row lock, so that a
        concurrent `withdraw` sees this owner or comes first. The place is taken by compare-and-set: one that was let
        go meanwhile (its submission outlived FACTORY_PLACE_SECONDS, and another submission of the user counted
        without it) is taken again only if the quotas still allow it; else the job is cancelled unless another
        owner wants it, and OverQuota says why. Returns the job as it is now (a job its last other owner cancelled
        just before: the caller queues it again)."""
        with self.db.session() as s:
            job = s.get(Job, job_id, with_for_update=True)
            taken = update(Submission).where(
                Submission.id == place, Submission.username == account.user, Submission.job_id.is_(None)
            )
            if s.execute(taken.values(job_id=job_id)).rowcount:
                return job
            s.execute(update(Token).where(Token.username == account.user).values(last_used_at=now()))
            try:
                self._check_quotas(s, account)
            except OverQuota as e:
                if not self._owners(s, job_id):
                    self.jobs.cancel(job_id, session=s)
                lost = OverQuota(
                    f"this submission took longer than its place in {account.user}'s quota is held "
                    f"(FACTORY_PLACE_SECONDS), and the quota was taken meanwhile: {e.message}"
                )
            else:
                s.add(Submission(username=account.user, job_id=job_id))
                return job
        raise lost  # after the session: the job's cancel is committed

    @staticmethod
    def _owners(s, job_id: str) -> int:
        return s.scalar(
            select(func.count())
            .select_from(Submission)
            .where(Submission.job_id == job_id, Submission.withdrawn_at.is_(None))
        )

    def withdraw(self, account: Account, job_id: str) -> tuple[Job, int]:
        """`account`'s cancel of a job: its interest withdrawn and, when no other owner is left (or it is an
        admin's), the job cancelled, in one transaction under the job's row lock. Returns (the job, how many other
        users still want it)."""
        with self.db.session() as s:
            s.get(Job, job_id, with_for_update=True)
            s.execute(
                update(Submission)
                .where(
                    Submission.job_id == job_id, Submission.username == account.user, Submission.withdrawn_at.is_(None)
                )
                .values(withdrawn_at=now())
            )
            others = s.scalar(
                select(func.count(func.distinct(Submission.username))).where(
                    Submission.job_id == job_id, Submission.withdrawn_at.is_(None), Submission.username != account.user
                )
            )
            if others and not account.admin:
                return s.get(Job, job_id), others
            return self.jobs.cancel(job_id, session=s), others

    def rejoin(self, account: Account, job_id: str) -> None:
        """`account` wants the job again (a retry): its withdrawn submissions of it count again."""
        with self.db.session() as s:
            s.execute(
                update(Submission)
                .where(Submission.job_id == job_id, Submission.username == account.user)
                .values(withdrawn_at=None)
            )

    def release(self, place: int) -> None:
        """A reserved place whose submission was refused (bad input): it does not count."""
        with self.db.session() as s:
            s.execute(delete(Submission).where(Submission.id == place))

    def job_ids(self, account: Account) -> set[str] | None:
        """The jobs `account` may see; None: every job."""
        if account.sees_every_job:
            return None
        with self.db.session() as s:
            return set(
                s.scalars(
                    select(Submission.job_id).where(Submission.username == account.user, Submission.job_id.is_not(None))
                )
            )

    def check_job(self, account: Account, job_id: str) -> None:
        """NotFound unless the job exists and `account` submitted it (or is an admin): another user's job is
        answered exactly like one that does not exist."""
        visible = self.job_ids(account)
        if (visible is not None and job_id not in visible) or self.jobs.get(job_id) is None:
            raise NotFound(f"no job {job_id!r}; `qf status` lists the recent ones")
