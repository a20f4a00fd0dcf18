"""The watchlist and its memory of upstream releases."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from factory.catalog.database import Database
from factory.catalog.schema import Upstream, Watch


class Watchlist:
    """The watches (`qf watch`) and what became of each upstream release they saw."""

    def __init__(self, db: Database):
        self.db = db

    def watches(self) -> list[Watch]:
        with self.db.session() as s:
            return list(s.scalars(select(Watch).order_by(Watch.target)))

    def put(self, target: str, recipe: dict, filter: dict) -> None:
        with self.db.session() as s:
            s.merge(Watch(target=target, recipe=recipe, filter=filter))

    def remove(self, target: str) -> bool:
        with self.db.session() as s:
            watch = s.get(Watch, target)
            if watch is not None:
                s.delete(watch)
            return watch is not None

    def upstream(self) -> list[Upstream]:
        with self.db.session() as s:
            return list(s.scalars(select(Upstream).order_by(Upstream.id)))

    def record_upstream(self, watch: str, repo: str, sha: str, job_id: str | None, skipped: str | None) -> bool:
        """Remember what became of `repo@sha` for `watch`: a release skipped before takes the new outcome (its job,
        or another reason); False when it has a job already (another scheduler recorded it first)."""
        try:
            with self.db.session() as s:
                s.add(Upstream(watch=watch, repo=repo, sha=sha, job_id=job_id, skipped=skipped))
            return True
        except IntegrityError:
            with self.db.session() as s:
                changed = s.execute(
                    update(Upstream)
                    .where(
                        Upstream.watch == watch, Upstream.repo == repo, Upstream.sha == sha, Upstream.job_id.is_(None)
                    )
                    .values(job_id=job_id, skipped=skipped)
                )
                return changed.rowcount == 1
