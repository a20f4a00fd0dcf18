"""Published quants (never replaced under their name), measurements and evaluations."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from factory.catalog.database import Database
from factory.catalog.jobs import Jobs
from factory.catalog.schema import Evaluation, Job, Measurement, Quant, Step
from factory.catalog.states import DONE_STEPS, JobState, StepState, now
from factory.registry.published import QuantRow


class RevTaken(Exception):
    """name:tag@rev names other files (a row or a registry folder): publish under another rev."""


SUPERSEDED = "its quant was removed with qf rm; made again"


class Quants:
    """Published quants, measurements and evaluations: each write fenced by the lease of the job that makes it."""

    def __init__(self, db: Database, jobs: Jobs):
        self.db, self.jobs = db, jobs

    def put(self, quant: Quant, token: int | None = None, publish=None) -> Quant:
        """Record a published quant; `publish()`, the registry's act, runs inside the same transaction, after the
        fence: while the job is running and `token` holds it, so a cancel or a new holder either comes first
        (nothing is published) or waits for it. A row of name:tag@rev is never replaced: one with the same files
        (quant.files_sha) is kept as it is, a tombstone with them is restored (its new row's scores: the job that
        made it again); one with other files raises RevTaken (the publisher takes another rev). A concurrent insert
        of the same name:tag@rev (a publisher that raced this one) is looked at again as it commits."""
        try:
            return self._put(quant, token, publish)
        except IntegrityError:
            won = self.at(quant.name, quant.tag, quant.rev)
            if won is None or won.files_sha != quant.files_sha:
                raise RevTaken(f"{quant.name}:{quant.tag}@{quant.rev} holds other files") from None
            return won

    def _put(self, quant: Quant, token: int | None, publish) -> Quant:
        with self.db.session() as s:
            self.db.fence(s, quant.job_id, token, running=publish is not None)
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

    def remove_unlisted(self, name: str, tag: str, rev: str, job_id: str | None, remove: Callable[[], None]) -> bool:
        """Run `remove()`, the registry's removal of folder name:tag@rev, if no live row lists that folder and the job
        that placed it (`job_id`, from its manifest) is not running, under the job's row lock: no publisher of it is
        then between placing its folder and recording its row (put_quant fences on a running job, and waits for this
        lock), and no later attempt adopts the folder while it goes. False when it was left."""
        with self.db.session() as s:
            if job_id is not None:
                self._fence_quiet(s, job_id)
                job = s.get(Job, job_id)
                if job is not None and job.state == JobState.running:
                    return False
            listed = select(Quant.id).where(
                Quant.name == name, Quant.tag == tag, Quant.rev == rev, Quant.removed_at.is_(None)
            )
            if s.scalars(listed).first() is not None:
                return False
            remove()
            return True

    @staticmethod
    def _fence_quiet(s, job_id: str) -> None:
        """The job's row lock, for the rest of the transaction (a no-op UPDATE, as Database.fence takes it)."""
        s.execute(update(Job).where(Job.id == job_id).values(lease_token=Job.lease_token, updated_at=Job.updated_at))

    def at(self, name: str, tag: str, rev: str) -> Quant | None:
        """The row of name:tag@rev, a tombstone too (what decides whether that rev is free for some files)."""
        with self.db.session() as s:
            return s.scalars(select(Quant).where(Quant.name == name, Quant.tag == tag, Quant.rev == rev)).one_or_none()

    def live(self, name: str | None = None, job_id: str | None = None) -> list[Quant]:
        """The live quants (never tombstones); `job_id`: those the job published or evaluated (a quant it reused)."""
        with self.db.session() as s:
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

    def with_weights(self, weights_key: str) -> Quant | None:
        """The live quant whose weights this key makes (the oldest, should there be two: they race to publish)."""
        with self.db.session() as s:
            return s.scalars(
                select(Quant)
                .where(Quant.weights_key == weights_key, Quant.removed_at.is_(None))
                .order_by(Quant.id)
                .limit(1)
            ).one_or_none()

    def removed(self, job_id: str) -> list[Quant]:
        """The tombstones of quants the job published or evaluated whose weights are not published any more."""
        with self.db.session() as s:
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

    def remove(self, name: str, tag: str, rev: str) -> bool:
        """Take the published quant name:tag@rev out of every listing (`qf rm`), leaving its row as a tombstone so
        that the name never names other files; False when there was none."""
        with self.db.session() as s:
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
        with self.db.session() as s:
            if not self.jobs.transition(job_id, JobState.queued, only_from=frozenset({JobState.succeeded}), session=s):
                return False
            names = {"gate"} | {f"{kind}:{tag}" for tag in tags for kind in ("quantize", "evaluate", "publish", "push")}
            for step in s.scalars(select(Step).where(Step.job_id == job_id, Step.state.in_(DONE_STEPS))):
                if step.name in names or any(step.name.startswith(f"evaluate:{tag}:") for tag in tags):
                    step.state, step.note = StepState.superseded, SUPERSEDED
            return True

    def measurement(self, key: str) -> Measurement | None:
        with self.db.session() as s:
            return s.scalars(select(Measurement).where(Measurement.key == key)).one_or_none()

    def add_measurement(self, job_id: str, token: int | None = None, **fields: object) -> None:
        """Record a measurement made for `job_id`; a concurrent twin with the same key is kept as it is."""
        try:
            with self.db.session() as s:
                self.db.fence(s, job_id, token)
                s.add(Measurement(**fields))
        except IntegrityError:
            pass

    def add_evaluation(self, token: int | None = None, **fields: object) -> None:
        with self.db.session() as s:
            self.db.fence(s, str(fields["job_id"]), token)
            s.add(Evaluation(**fields))

    def baseline(
        self, source_identity: str, eval_sha: str, windows: int, window_length: int, device: str
    ) -> float | None:
        """A stored FP16 perplexity for exactly this token stream, if one was measured before."""
        with self.db.session() as s:
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

    def evaluations_of(self, quant: Quant) -> list[dict]:
        """Every evaluation of the quant's weights (the one it was published with and those of later jobs that reused
        it), oldest first: job, text, windows, window_length, device, ppl, kld, kld_p99, top1, created_at. A quant
        published before weights keys has only its own."""
        with self.db.session() as s:
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
            return _once_each(found)
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

    def row(self, quant: Quant) -> QuantRow:
        """A quant's row with every evaluation of its weights (`qf show`, the Hub repo's main card)."""
        return replace(quant.row(), evaluations=self.evaluations_of(quant))

    def job_row(self, quant: Quant, job_id: str) -> QuantRow:
        """A quant's row as job `job_id` scored it: its own scores for a quant the job published, the job's evaluation
        for one it reused (on other windows or text), so that the job's own table shows what it measured."""
        row = quant.row()
        if quant.job_id == job_id:
            return row
        with self.db.session() as s:
            e = s.scalars(
                select(Evaluation)
                .where(
                    Evaluation.job_id == job_id,
                    Evaluation.subject == quant.tag,
                    Evaluation.weights_key == quant.weights_key,
                )
                .order_by(Evaluation.id.desc())
                .limit(1)
            ).first()
            text = s.scalar(select(Job.eval).where(Job.id == job_id))
        if e is None:
            return row
        fp16 = self.baseline(e.source_identity, e.eval_sha, e.windows, e.window_length, e.device)
        protocol = {"text": text, "sha256": e.eval_sha, "windows": e.windows, "window_length": e.window_length}
        return replace(
            row,
            ppl=e.ppl,
            fp16_ppl=fp16 if fp16 is not None else row.fp16_ppl,
            kld=e.kld,
            kld_p99=e.kld_p99,
            top1=e.top1,
            eval={**protocol, "device": e.device},
        )

    def evaluations(self, job_id: str) -> list[Evaluation]:
        with self.db.session() as s:
            return list(s.scalars(select(Evaluation).where(Evaluation.job_id == job_id).order_by(Evaluation.id)))


def _once_each(evaluations: list[dict]) -> list[dict]:
    """One evaluation per job and protocol (text, windows, device): a job that made its quant again after `qf rm`
    evaluated the same files again; its latest scores stand in the place of its first."""
    latest: dict[tuple, dict] = {}
    for e in evaluations:
        latest[(e["job"], e["text"], e["windows"], e["window_length"], e["device"])] = e
    return list(latest.values())
