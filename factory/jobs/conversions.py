"""A job's shared and quantize units, as factory/jobs/run.py runs them: each made once, under a claim in the catalog. A
shared unit (`<stage>:<key>`: EXL2's `measure`, GGUF's `convert` and `imatrix`) serves every job and worker that
needs it: the first to claim it makes it, the others wait for it and make it themselves only if its claim runs out. A
quant (`unit:<job>:quantize:<tag>`) is made by the job's holder or by a GPU worker helping with the job (`help`),
whose quant becomes the job's only under its claim's lock. Claims are renewed in the background while their unit
runs.

A quant whose weights key (identity.weights_key: source, resolved spec, calibration, engine version, device) is
published already, in a registry folder that verifies, is not made again: the quantize unit uses that folder (read
only: the evaluations read it, nothing writes it) and records its step as succeeded with a note ("reused
NAME:TAG@REV, published by job J"); the job's evaluation is then added to that quant (factory/publish/publishing.py).

Each function takes the attempt's context (factory/jobs/context.py's Run) first: its catalog writes are fenced by
its lease token and, for a unit, by the unit's claim.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from factory import engines, events, identity
from factory.catalog import Job, JobState
from factory.checkpoints import sources
from factory.engines import QuantSpec, child
from factory.errors import Cancelled, JobFailed, LeaseLost
from factory.jobs import graph, packing
from factory.jobs import prepared as preparing
from factory.jobs.context import Run
from factory.jobs.graph import Unit
from factory.jobs.prepared import Prepared
from factory.publish import folder, publishing

WAIT_SECONDS = 2.0  # how often a process that waits for another one (its measurement, a unit it claimed) looks again
log = logging.getLogger("quantfactory")
FENCE = ".claim"  # in a unit's work folder: the mark of the process that holds the unit (its claim)


def help(run: Run, job_id: str) -> None:
    """Convert some of a running job's sizes here while its holder runs the rest (a GPU worker with nothing
    else to do): the quantize units nobody holds, each claimed (`unit:<job>:quantize:<tag>`) once its
    measurement exists, packed as `execute` packs them. What it makes is the job's (its steps, its work
    folder); the evaluations, the gate and publishing stay with the job's holder, which waits for the units
    held here and makes any whose claim runs out itself. Ends when nothing is left to take or the job stops."""
    job = run.catalog.jobs.get(job_id)
    if job is None or job.device != run.settings.worker_device:
        return
    start = time.monotonic()
    while "inspect" not in run.catalog.steps.done(job_id):  # the job's holder resolves the specs first
        state = run.catalog.jobs.get(job_id).state
        if state != JobState.running and not (state == JobState.queued and time.monotonic() - start < 60):
            return  # over, or not started by its holder within a minute
        run.emit(events.waiting(["inspect"], run.holder))
        time.sleep(WAIT_SECONDS)
    job = run.catalog.jobs.get(job_id)
    if job.state != JobState.running:
        return
    fetched = (
        sources.fetch_hub(job.source_identity, run.settings.cache, lambda **_: None)
        if identity.is_hub(job.source_identity)
        else None
    )
    prepared = preparing.read(run, job, fetched, _own_work(run, job))
    keys = {s.tag: measurement_keys(job, s) for s in prepared.specs}
    units = [
        replace(u, needs=frozenset()) for u in graph.units(prepared.specs, keys, False, False) if u.kind == "quantize"
    ]
    packer, needs = run.costs.packer(job), run.costs.needs(job, prepared.model, units)

    def known(unit: Unit) -> dict[str, Path] | None:
        """Its engine's shared units' files, once every one exists."""
        made = {stage: _known_measurement(run, key) for stage, key in keys[unit.spec.tag].items()}
        return None if None in made.values() else made

    def inputs(unit: Unit) -> dict[str, Path] | None:
        """The folders of the quants it is made from, once every one is made."""
        made = {s.tag: quantized(run, job, s) for s in engines.get(unit.spec.method).made_from(unit.spec)}
        return None if None in made.values() else made

    def work(unit: Unit) -> None:
        quantize(run, job, prepared, unit.spec, known(unit) or {}, inputs(unit) or {}, helping=True)

    try:
        while run.catalog.jobs.get(job_id).state == JobState.running:
            left = [u for u in units if quantized(run, job, u.spec) is None and not held_elsewhere(run, job, u)]
            ready = [u for u in left if known(u) is not None and inputs(u) is not None]
            if not left:
                return
            if ready:
                packing.run(
                    ready,
                    work,
                    lambda unit: needs[unit.name],
                    packer,
                    run.stop,
                    run.note,
                    ledger=run.costs.ledger,
                    waiting=lambda names: run.emit(events.waiting(names, "other jobs' units on this machine")),
                )
            else:  # the job's holder is making the shared units; an event: this helper is alive
                waited = {f"{stage}:{key[:12]}" for u in left for stage, key in keys[u.spec.tag].items()}
                run.emit(events.waiting(sorted(waited), run.holder))
                time.sleep(WAIT_SECONDS)
    except (Cancelled, LeaseLost) as e:  # the job ended, or a claim went to another holder: nothing more here
        log.warning("job %s: a helper stops: %s", job_id, e.message)
    except packing.Stopped:  # a unit's claim went to another holder while this process was stopped
        log.warning("job %s: a helper stops: a unit it held was taken over", job_id)


def quantized(run: Run, job: Job, spec: QuantSpec) -> Path | None:
    """The quant an earlier attempt of this job made, if its step finished and its folder is there; else the
    registry folder of a published quant with the same weights (`_reused` checks its files)."""
    out = run.settings.work / job.id / spec.tag / "out"
    if f"quantize:{spec.tag}" in run.catalog.steps.done(job.id) and out.is_dir() and any(out.iterdir()):
        return out
    twin = run.catalog.quants.with_weights(publishing.weights_key(job, spec))
    if twin is not None and (run.settings.registry / twin.path).is_dir():
        return run.settings.registry / twin.path
    return None


def _reused(run: Run, job: Job, spec: QuantSpec) -> Path | None:
    """The registry folder of a published quant with this job's weights key whose files verify, its quantize
    step recorded as succeeded with a note; None when there is none (this job makes its quant), or when it is
    this job's own (an attempt killed after its publish: it goes on from its own work, as any attempt does)."""
    twin = run.catalog.quants.with_weights(publishing.weights_key(job, spec))
    if twin is None or twin.job_id == job.id:
        return None
    published = run.settings.registry / twin.path
    try:
        folder.verify(published)
    except JobFailed as e:
        log.warning("job %s: not reusing %s:%s@%s: %s", job.id, twin.name, twin.tag, twin.rev, e.message)
        return None
    note = f"reused {twin.name}:{twin.tag}@{twin.rev}, published by job {twin.job_id}"
    if f"quantize:{spec.tag}" not in run.catalog.steps.done(job.id):
        run.catalog.steps.reuse(job.id, f"quantize:{spec.tag}", note, run.token)
    run.emit(events.note(f"quantize:{spec.tag}: {note}"))
    return published


def quantize(
    run: Run,
    job: Job,
    prepared: Prepared,
    spec: QuantSpec,
    measurements: dict[str, Path],
    quants: dict[str, Path],
    helping: bool = False,
) -> Path | None:
    """The quant of `spec`, made here under the claim `unit:<job>:quantize:<tag>` unless it is made already
    (`quants`: the folders of the quants it is made from, by tag). While another process holds the claim (a worker
    helping with the job), the job waits for its quant and makes it itself once the claim runs out; a helper
    (`helping`) leaves it and returns None."""
    if not helping and (reused := _reused(run, job, spec)) is not None:
        return reused
    claim = unit_claim(job.id, f"quantize:{spec.tag}")
    while (out := quantized(run, job, spec)) is None:
        if (token := run.catalog.leases.claim(claim, run.claimer(job), run.settings.lease_seconds)) is None:
            if helping:
                return None
            run.check_ours(job.id)
            time.sleep(WAIT_SECONDS)
            continue
        try:
            if quantized(run, job, spec) is None:  # not finished while we took the claim
                if token > 1:  # taken over: the step its last holder left running is not running
                    run.catalog.steps.interrupt(job.id, run.token, f"quantize:{spec.tag}")
                with _renewed(run, claim, token, stop_when_lost=True):
                    _make_quant(run, job, prepared, spec, measurements, quants, (claim, token), helping)
        finally:
            run.catalog.leases.release_claim(claim, token)
    return out


def _make_quant(
    run: Run,
    job: Job,
    prepared: Prepared,
    spec: QuantSpec,
    measurements: dict[str, Path],
    quants: dict[str, Path],
    claim: tuple[str, int],
    helping: bool,
) -> None:
    """The job's holder converts in the job's work folder (a failed job run again resumes there); a helper, and
    a holder that took the unit over from a process that may still be converting (stopped past its claim), in a
    folder of its own, whose quant becomes the job's only under the claim's lock as its step succeeds, so that a
    process that lost its claim never mixes its files with the new holder's. The engine is fenced by the claim:
    the unit's FENCE file holds its taker's mark, and the engine of a process whose unit was taken over is killed
    by its watchdog (factory/engines/fence.py) once the new taker writes its own."""
    job_work = run.settings.work / job.id / spec.tag
    separate = helping or claim[1] > 1
    work = _own_work(run, job, "helpers" if helping else "takeovers") / spec.tag if separate else job_work
    engine = engines.get(spec.method)
    mark = f"{run.claimer(job)}#{claim[1]}"
    _write_fence(job_work / FENCE, mark)

    def hand_over() -> None:
        shutil.rmtree(job_work / "out", ignore_errors=True)  # what a holder before left unfinished
        job_work.mkdir(parents=True, exist_ok=True)
        os.rename(work / "out", job_work / "out")

    with (
        run.step(job.id, f"quantize:{spec.tag}", claim, hand_over if separate else None) as progress,
        child.fenced(job_work / FENCE, mark),
    ):
        request = engines.QuantizeRequest(
            source_dir=prepared.folder,
            out_dir=work / "out",
            work_dir=work,
            spec=spec,
            calibration=prepared.calibration.get(spec.tag, []),
            calibration_file=prepared.calibration_file,
            measurements=measurements,
            quants=quants,
            model=Path(job.source.split("@")[0].rstrip("/")).name or job.name,
        )
        engine.quantize(request, lambda event: progress(**event))


def _own_work(run: Run, job: Job, kind: str = "helpers") -> Path:
    return run.settings.work / job.id / kind / run.holder.replace(":", "-")


def _write_fence(path: Path, mark: str) -> None:
    """`mark` into `path` at once (a watchdog reading it sees the old mark or the new one, never a part)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{mark.replace('/', '-').replace(':', '-')}")
    tmp.write_text(mark)
    os.replace(tmp, path)


def held_elsewhere(run: Run, job: Job, unit: Unit) -> bool:
    """A quantize unit another process holds the claim of (a helping worker makes it)."""
    if unit.kind != "quantize":
        return False
    holder = run.catalog.leases.claimant(unit_claim(job.id, unit.name))
    return holder is not None and holder != run.claimer(job)


def measurement_keys(job: Job, spec: QuantSpec) -> dict[str, str]:
    """{stage: key} of the spec's engine's shared units, in its order (none for an engine without them); a unit
    made from the job's other quants (Engine.made_from) is keyed by their weights too."""
    engine = engines.get(spec.method)
    inputs = [publishing.weights_key(job, s) for s in engine.made_from(spec)]
    keys = {}
    for shared in engine.shared_units(spec):
        rows, length = engine.measurement_settings(spec, shared.stage)
        calibration = job.calibration_sha if rows else ""
        keys[shared.stage] = identity.measurement_key(
            job.source_identity, calibration, rows, length, engine.version(), shared.stage, inputs
        )
    return keys


def measure(
    run: Run, job: Job, prepared: Prepared, spec: QuantSpec, stage: str, key: str, earlier: dict[str, Path]
) -> Path:
    """An engine's shared unit (`stage`) for this source, calibration and settings: made once across every job and
    worker, and reused by every later target. The job that makes it holds the claim `<stage>:<key>` while it does
    (renewed in the background); another job that needs it meanwhile waits for it (a `wait:<stage>:...` step),
    and makes it itself if the claim runs out first (its maker is gone). `earlier`: the files of the stages before
    it."""
    engine = engines.get(spec.method)
    shared = next(s for s in engine.shared if s.stage == stage)
    rows, length = engine.measurement_settings(spec, stage)
    name, claim = f"{stage}:{key[:12]}", f"{stage}:{key}"
    reads = f" ({rows} x {length} tokens)" if rows else ""
    while True:
        if (known := _known_measurement(run, key)) is not None:
            run.emit(events.note(f"reusing {engine.label} {shared.about} {key[:12]}{reads}"))
            return known
        if (token := run.catalog.leases.claim(claim, run.claimer(job), run.settings.lease_seconds)) is not None:
            if _known_measurement(run, key) is None:  # not finished while we took the claim
                break
            run.catalog.leases.release_claim(claim, token)
            continue
        _wait_for_measurement(run, job, claim, name, key, shared.about)
    path = run.settings.measurements / f"{key}{shared.suffix}"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _renewed(run, claim, token), run.step(job.id, name) as progress:
            engine.measure(
                stage,
                prepared.folder,
                prepared.calibration_file,
                rows,
                length,
                run.settings.work / job.id / f"{stage}-{key[:12]}",
                path,
                earlier,
                lambda event: progress(**event),
                run.costs.measure_processes(engine, job, stage),
            )
            run.catalog.quants.add_measurement(
                job.id,
                run.token,
                key=key,
                path=str(path),
                source_identity=job.source_identity,
                calibration_sha=job.calibration_sha if rows else "",
                rows=rows,
                length=length,
                tool_version=engine.version(),
            )
    finally:
        run.catalog.leases.release_claim(claim, token)
    return path


def _known_measurement(run: Run, key: str) -> Path | None:
    known = run.catalog.quants.measurement(key)
    return Path(known.path) if known is not None and Path(known.path).is_file() else None


def _wait_for_measurement(run: Run, job: Job, claim: str, name: str, key: str, about: str) -> None:
    """Until the shared unit exists or nobody holds its claim any more."""
    maker = run.catalog.leases.claimant(claim)
    run.emit(events.note(f"{name}: {_claim_holder(maker)} is making this {about}; waiting for it"))
    with run.step(job.id, f"wait:{name}") as progress:
        while _known_measurement(run, key) is None and (maker := run.catalog.leases.claimant(claim)) is not None:
            progress(waiting_for=_claim_holder(maker))  # an event: this job is alive while it waits
            time.sleep(WAIT_SECONDS)


@contextmanager
def _renewed(run: Run, claim: str, token: int, stop_when_lost: bool = False):
    """Renew the claim every third of its life while the block runs (a thread: an engine can be silent). A
    claim taken over meanwhile (this process was stopped past it) is left: a second measurement is harmless;
    a unit of a job (`stop_when_lost`) stops, and its records are refused (the claim fences them)."""
    done = threading.Event()

    def renew() -> None:
        while not done.wait(run.settings.lease_seconds / 3):
            if not run.catalog.leases.renew_claim(claim, token, run.settings.lease_seconds):
                if stop_when_lost:
                    packing.stop_units(run.stop)
                return

    thread = threading.Thread(target=renew, name=f"renew {claim[:20]}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def unit_claim(job_id: str, unit: str) -> str:
    """The claim a unit of a job is made under, by the job's holder or a helping worker."""
    return f"unit:{job_id}:{unit}"


def _claim_holder(holder: str | None) -> str:
    """`job@host:pid` in a sentence."""
    job, _, process = (holder or "").rpartition("@")
    return f"job {job} ({process})" if job else "another process"
