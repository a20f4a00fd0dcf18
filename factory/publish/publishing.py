"""Publishing a job's quant: its catalog row and registry folder (with its model card and manifest) in one act
fenced by the job's lease token, then, with FACTORY_HUB_OWNER, its branch on the Hub and its repo's main (the card
of every variant there, the plot, the files its engine puts on main). The pipeline calls these in its publish and
push units; nothing here decides whether a quant passed its gate.

The row is the publication: the folder is put in place inside the row's transaction and taken out again when that
transaction does not commit. A process killed in the instant between the two leaves a folder that nothing lists
(`qf ls` and pull read the rows); the job's next attempt finds the same files there and records its row.

A published quant never changes under its name: `name:tag@rev` names one set of files (its weights and companions,
every file but the card and manifest: identity.files_sha) for ever. The rev comes from the content: the source's
short rev when no row (live or a `qf rm` tombstone) and no folder holds other files under it, else the source's rev
and the first 9 hex of the files' sha256 (`@<source rev>` still selects the newest quant of that source revision:
factory/publish/lookup.py). The registry folder's card and manifest record the evaluation the quant was published with;
a later job with the same weights key reuses the quant (factory/jobs/conversions.py) and its evaluation is added to
the catalog, listed by `qf show` and the Hub repo's main card (made again by that job's push). The card is the one
file that is not the quant's content: `qf pull` writes its Evaluations section again from the catalog
(card.with_evaluations, folder.replace_card), so the card a user pulls lists every evaluation; the registry's
folder itself never changes.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import shutil
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import calibration
from factory import engines, identity, ranking
from factory.catalog import Catalog, Job, Quant, RevTaken
from factory.checkpoints import files
from factory.engines import QuantSpec
from factory.errors import FactoryError, JobFailed
from factory.evaluation.kld import Divergence
from factory.publish import card, folder, frontier, hub
from factory.publish.upstream import Upstream
from factory.registry.published import QuantRow
from factory.settings import Settings

STOP_AT = "FACTORY_TEST_STOP_AT"  # tests only: see moment()


@dataclass(frozen=True)
class Scores:
    """What a quant scored, as its row and card record it."""

    ppl: float
    fp16_ppl: float
    divergence: Divergence | None  # from FP16 (mean KL, its 99th percentile, top-1 agreement)
    extra: dict[str, dict]  # the engine's other scores by group (kv_cache: {fp16: ..., q4: ...})
    windows: int
    window_length: int


class Publisher:
    def __init__(self, settings: Settings, catalog: Catalog):
        self.settings = settings
        self.catalog = catalog
        self._hub_writer = None  # an HfApi checked once for writing under FACTORY_HUB_OWNER

    def to_registry(
        self, job: Job, spec: QuantSpec, out: Path, scores: Scores, upstream: Upstream, token: int | None
    ) -> None:
        """The quant's row and its registry folder `<name>/<tag>@<rev>`, one act fenced by `token`: a cancel or a
        new holder either comes before it (nothing published) or waits for it."""
        engine = engines.get(spec.method)
        (out / card.FILENAME).unlink(missing_ok=True)
        files.check_publishable(out, engine.outputs)
        content = identity.files_sha(folder.file_table(out))
        source_rev = identity.rev(job.source_identity)
        for rev in (source_rev, source_rev + content[:9]):
            taken = self.catalog.quants.at(job.name, spec.tag, rev)
            if taken is not None and taken.files_sha != content:
                continue
            try:
                self._to_registry(job, spec, out, scores, upstream, token, rev, content)
                return
            except RevTaken:  # a folder there holds other files, or a publisher that raced this one recorded them
                continue
        raise JobFailed(f"{job.name}:{spec.tag}: both {source_rev} and {source_rev + content[:9]} hold other files")

    def _to_registry(
        self,
        job: Job,
        spec: QuantSpec,
        out: Path,
        scores: Scores,
        upstream: Upstream,
        token: int | None,
        rev: str,
        content: str,
    ) -> None:
        engine = engines.get(spec.method)
        (out / card.FILENAME).unlink(missing_ok=True)
        quant = Quant(
            job_id=job.id,
            name=job.name,
            tag=spec.tag,
            rev=rev,
            method=spec.method,
            bits=spec.bits,
            spec=spec,
            bytes=sum(p.stat().st_size for p in out.iterdir() if p.is_file()),
            path=str(
                folder.quant_dir(self.settings.registry, job.name, spec.tag, rev).relative_to(self.settings.registry)
            ),
            source=job.source,
            source_identity=job.source_identity,
            calibration=job.calibration,
            calibration_sha=job.calibration_sha,
            versions=_versions(job.versions),
            weights_key=weights_key(job, spec),
            files_sha=content,
            ppl=scores.ppl,
            fp16_ppl=scores.fp16_ppl,
            kld=_finite(scores.divergence.mean) if scores.divergence else None,
            kld_p99=_finite(scores.divergence.p99) if scores.divergence else None,
            top1=scores.divergence.top1 if scores.divergence else None,
            eval={
                "text": job.eval,
                "sha256": job.eval_sha,
                "windows": scores.windows,
                "window_length": scores.window_length,
                "device": job.device,
                # the engine's other scores, e.g. kv_cache (JSON: no NaN or infinity, so null)
                **{
                    group: {k: p if math.isfinite(p) else None for k, p in values.items()}
                    for group, values in scores.extra.items()
                },
            },
        )
        this = _with_engine_notes(self.catalog.quants.row(quant), engine, out)  # with its evaluations
        others = [q.row() for q in self.catalog.quants.live(name=job.name) if (q.tag, q.rev) != (spec.tag, rev)]
        moment("card")
        everyone = [this, *others]
        picks = frontier.section(job.name, everyone, self._model(job))
        (out / card.FILENAME).write_text(card.render(job.name, upstream, this, everyone, picks=picks))
        manifest = {  # identities, never local paths
            "source_identity": job.source_identity,
            "base_model": job.base_model,
            "calibration": calibration.public_name(job.calibration),
            "calibration_sha256": job.calibration_sha,
            "versions": this.versions,
            "job": job.id,
            "spec": spec.model_dump(),
            "eval": {
                **quant.eval,
                "text": calibration.public_name(job.eval),
                "ppl": scores.ppl,
                "fp16_ppl": scores.fp16_ppl,
                "kld": quant.kld,
                "kld_p99": quant.kld_p99,
                "top1": quant.top1,
            },
        }
        placed: list[Path] = []  # the folder this publish put in place, where there was none

        def publish() -> None:  # inside the quant row's transaction, once the fence holds
            dest = folder.quant_dir(self.settings.registry, job.name, spec.tag, rev)
            new = not dest.is_dir()
            folder.publish(self.settings.registry, job.name, spec.tag, rev, out, manifest, card.FILENAME)
            if new:
                placed.append(dest)
            moment("placed")

        try:
            self.catalog.quants.put(quant, token, publish=publish)
        except BaseException:
            self._take_back(placed, quant)
            raise
        moment("recorded")

    def _model(self, job: Job) -> ranking.Model | None:
        """The FP16 checkpoint's shape for the card's picks: from the job's staged copy, else its source; None where
        neither can be read any more (the card says so)."""
        staged = self.settings.work / job.id / "source"
        try:
            return ranking.Model.of(str(staged) if staged.is_dir() else job.source)
        except FactoryError:
            return None

    def _take_back(self, placed: list[Path], quant: Quant) -> None:
        """The row and its folder are one act: a folder whose row was not recorded goes again (unless the row is
        there after all: a commit whose answer was lost). A catalog that cannot be read leaves it, unlisted; the
        job's next attempt adopts it."""
        try:
            recorded = any((q.tag, q.rev) == (quant.tag, quant.rev) for q in self.catalog.quants.live(name=quant.name))
        except Exception:
            return
        if not recorded:
            for dest in placed:
                folder.remove(dest)

    def to_hub(self, job: Job, spec: QuantSpec, upstream: Upstream, check_ours: Callable[[], None]) -> None:
        """The quant's branch on the Hub, then main of its repo: the card of every variant there with its plot, and
        the files the engine puts on main (Engine.card.main_files: of the newest variant, or of every variant on the
        Hub where the engine's card says `every_variant_on_main`). `check_ours` runs right before the push (it raises
        once the job is not the caller's any more)."""
        s, engine = self.settings, engines.get(spec.method)
        templates = hub.templates(s.hub_repos)

        def where(tag: str) -> hub.Place:
            return hub.place(s.hub_owner, job.name, tag, templates)

        here, quant = where(spec.tag), self.catalog.quants.with_weights(weights_key(job, spec))
        if quant is None:
            raise JobFailed(f"{job.name}:{spec.tag} is not published (removed with qf rm?); nothing to push")
        rev, published = quant.rev, s.registry / quant.path

        def main_files() -> dict[str, Path]:  # made again after a concurrent commit to main
            on_hub = hub.refs(here.repo)
            latest = {
                q.tag: q
                for q in sorted(self.catalog.quants.live(name=job.name), key=lambda q: q.created_at)
                if q.method == spec.method and where(q.tag).branch in on_hub and (s.registry / q.path).is_dir()
            }
            rows = [
                _with_engine_notes(self.catalog.quants.row(q), engine, s.registry / q.path) for q in latest.values()
            ]
            newest = max(rows, key=lambda r: r.created_at)
            on_main = [s.registry / r.path for r in rows] if engine.card.every_variant_on_main else []
            on_main.append(s.registry / newest.path)  # the newest last: its files win a name two variants share
            main_quant = {name: d / name for d in on_main for name in engine.card.main_files(d)}
            if main_quant:
                for d in on_main:
                    files.check_publishable(d, engine.outputs)
            main = s.work / job.id / "hub-main" / spec.method
            shutil.rmtree(main, ignore_errors=True)
            main.mkdir(parents=True)
            places = {r.tag: where(r.tag) for r in rows}
            everyone = [q.row() for q in self.catalog.quants.live(name=job.name)]  # every format's, for the frontier
            picks = frontier.section(job.name, everyone, self._model(job), plot=True)
            (main / card.FILENAME).write_text(card.render(job.name, upstream, newest, rows, places, picks))
            plots = {card.PLOT: card.plot(rows, main / card.PLOT)}
            if card.has_kld(rows):
                plots[card.KLD_PLOT] = card.plot_kld(rows, main / card.KLD_PLOT)
            if picks:
                (main / frontier.FILENAME).write_text(frontier.svg(job.name, everyone))
                plots[frontier.FILENAME] = main / frontier.FILENAME
            return {**main_quant, card.FILENAME: main / card.FILENAME, **plots}

        files.check_publishable(published, engine.outputs)
        self._hub_writer = self._hub_writer or hub.writer(s.hub_owner)
        quant_files = {p.name: p for p in published.iterdir() if p.is_file()}
        message = f"{job.name}:{spec.tag}@{rev} from {job.source_identity}"
        check_ours()  # immediately before the irreversible push
        hub.put_branch(self._hub_writer, here.repo, here.branch, quant_files, message)
        hub.put_branch(self._hub_writer, here.repo, "main", main_files, f"model card of {job.name}")


def weights_key(job: Job, spec: QuantSpec) -> str:
    """The key of the weights `spec` makes from the job's source (identity.weights_key)."""
    return identity.weights_key(
        job.source_identity, spec.model_dump(), job.calibration_sha, job.versions.get(spec.method), job.device
    )


def moment(name: str) -> None:
    """A named moment of publishing: `card` (before the card is rendered), `placed` (the registry folder is in place,
    its row not recorded), `recorded` (the row is committed), `ended` (the publish step ended, the job not). With
    FACTORY_TEST_STOP_AT=<name> the process stops itself there (SIGSTOP), so that a test can kill it at that very
    point (tests/integration/test_publish_safety.py). The stop is sent to the calling thread: one sent to the process
    is taken by its main thread, and on a loaded machine the thread that publishes ran on past the moment (committed
    the row) until the main thread was scheduled to stop them all, while the process already showed as stopped."""
    if os.environ.get(STOP_AT) == name:
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def _with_engine_notes(row: QuantRow, engine, published: Path) -> QuantRow:
    """A quant's row for its card: with the engine's "fits on" table and what a user must know to load it."""
    return replace(row, fits=engine.memory.fits(published), load_note=engine.card.load_note(published))


def _finite(value: float) -> float | None:
    """JSON (the manifest, --json) has no infinity: a divergence that is not finite is stored as unknown."""
    return value if math.isfinite(value) else None


def _versions(engine_versions: dict) -> dict:
    tools = {"torch": "torch", "transformers": "transformers", "quantfactory": "quantfactory"}
    found = {}
    for key, dist in tools.items():
        try:
            found[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[key] = "unknown"
    return {**found, **engine_versions}
