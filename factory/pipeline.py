"""The steps of a job (its state moves only through the catalog's compare-and-set, fenced by the lease's token).

    submit:  check the request (exit 2/4/5 before any job exists), then create the job or find the same one
    execute: inspect, then the job's units (factory/jobs/graph.py: measure, quantize:<tag>, evaluate:fp16,
             evaluate:<tag>, gate, publish:<tag>, push:<tag>), several at once where they fit
             (factory/jobs/packing.py)

`qf run` calls both in-process; a worker calls `execute` with a job id. A failed job runs again from where it
stopped: finished quantize and evaluate steps are reused; steps an earlier attempt left running (it was killed)
are marked interrupted. Engines and evaluators read the source through a staging folder of its allowlisted files
(factory/files.py), and a quant is published only when its folder holds nothing else. The evaluation units are
factory/jobs/evaluations.py's (a mixin of Factory), what units cost factory/jobs/costs.py's. Nothing here prints:
progress goes to `emit` as events (factory/events.py) that the CLI renders.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import calibration
from factory import engines, evaluate, events, files, identity, kld, layered, naming, sources, tables
from factory.catalog import Catalog, Job, JobState, Lease, StepState
from factory.engines import Engine, QuantSpec
from factory.errors import (
    Cancelled,
    FactoryError,
    JobFailed,
    LeaseLost,
    ModelRefused,
    QualityGateRefused,
    SpecError,
    mask_url,
)
from factory.events import Emit
from factory.identity import job_key, measurement_key
from factory.inspect import ModelInfo, inspect
from factory.jobs import eta, graph, packing
from factory.jobs.costs import Costs, Sized
from factory.jobs.evaluations import Evaluations
from factory.jobs.graph import Unit
from factory.jobs.packing import Need, Packer
from factory.publish import publishing, upstream
from factory.recipes import Recipe
from factory.settings import Settings
from factory.vram import Params, Shape

CANCEL_CHECK_SECONDS = 1.0  # how often a running step looks whether its job was cancelled or taken over
WAIT_SECONDS = 2.0  # how often a process that waits for another one (its measurement, a unit it claimed) looks again
log = logging.getLogger("quantfactory")
INTERRUPTED = "interrupted (Ctrl-C or SIGTERM); run the same command again to continue from the finished steps"


@dataclass
class Request:
    source: str
    recipe: Recipe
    asked: set[str] = field(default_factory=set)  # engines a flag asked for: no CUDA is an error, not a skip
    name: str | None = None
    base_model: str | None = None  # what the model card names as base_model (default: the source's name)
    device: str | None = None  # where the job will run: None = this machine (qf run); qf submit: the workers'


@dataclass
class _Prepared:
    """What the inspect step learns, kept in memory for the later steps of this attempt."""

    folder: Path  # the staging folder: links to the source's allowlisted files
    specs: list[QuantSpec]
    calibration: dict[str, list[list[int]]]  # tag -> token windows, for engines that take tokens
    calibration_file: Path  # the calibration text as parquet, for engines that tokenize it themselves
    stream: evaluate.Stream
    upstream: upstream.Upstream  # what the card says about the base model
    model: Sized


@dataclass
class _Made:
    """What the units of this attempt made, for the units after them (units in threads write distinct keys)."""

    measurements: dict[str, Path] = field(default_factory=dict)  # measure unit -> measurement file
    outputs: dict[str, Path] = field(default_factory=dict)  # tag -> quant folder
    fp16: float = math.nan
    ppls: dict[str, float] = field(default_factory=dict)
    divergences: dict[str, kld.Divergence | None] = field(default_factory=dict)  # tag -> from FP16
    extra: dict[str, dict[str, dict]] = field(default_factory=dict)  # tag -> group -> {key: ppl}
    refused: dict[str, QualityGateRefused] = field(default_factory=dict)


class Factory(Evaluations):
    def __init__(self, settings: Settings, emit: Emit = lambda event: None):
        self.settings = settings
        self.catalog = Catalog(settings.db_url)
        self.emit = emit
        self.publisher = publishing.Publisher(settings, self.catalog)
        self.token: int | None = None  # the fencing token of the lease `execute` runs under, if any
        self.costs = Costs(self.catalog, settings.max_units, settings.gpu_slots)
        self._stop = threading.Event()  # set: the running units stop at their next progress event
        self._expected_seconds: dict[str, float] = {}  # unit -> seconds, for its step
        self.holder = identity.holder_name()  # this process, in the steps it runs and the claims it holds

    # submit ---------------------------------------------------------------------------------------------
    def submit(self, request: Request) -> tuple[Job, bool]:
        recipe = request.recipe
        device = request.device or evaluate.device()
        specs = self._runnable(recipe.specs(), request, device)
        used = [engines.get(name) for name in sorted({s.method for s in specs})]
        versions = {engine.name: engine.version() for engine in used}
        cal, ev = _calibration(recipe.calibration, used), calibration.resolve(recipe.eval)
        if cal.sha256 == ev.sha256:
            raise SpecError(
                f"calibration {cal.name!r} and eval {ev.name!r} are the same text; evaluate on held-out text"
            )
        windows = recipe.eval_windows or evaluate.default_windows(device)

        source = sources.resolve(request.source, self.settings.cache)
        if source.path is not None:  # a folder that cannot work is refused before a job exists (a Hub repo: at fetch)
            info = inspect(source.path, _architectures(specs))
            for spec in specs:
                _resolve(spec, info, device)
        if request.name:
            ref = naming.parse(request.name)
            if ref.tag or ref.rev:
                raise SpecError(f"--name {request.name!r} holds a tag or revision; use --name NAME; tags come from "
                                "the spec and revisions from the source")
            name = self.catalog.name_for(source.source, ref.name, None)
        else:
            name = self.catalog.name_for(
                source.source, naming.model_name(source.label), naming.model_name(f"{source.owner}-{source.label}")
            )
        spec_dicts = [s.model_dump() for s in specs]
        job, created = self.catalog.create_job(
            key=job_key(source.identity, spec_dicts, cal.sha256, ev.sha256, windows, versions, device),
            name=name,
            source=source.source,
            source_identity=source.identity,
            base_model=request.base_model or source.base_model,
            specs=spec_dicts,
            calibration=cal.name,
            calibration_sha=cal.sha256,
            eval=ev.name,
            eval_sha=ev.sha256,
            eval_windows=windows,
            max_ppl_ratio=recipe.max_ppl_ratio,
            max_kld=recipe.max_kld,
            versions=versions,
            device=device,
        )
        self.emit(events.job(job.id, created, job.state, name, source.source, source.identity))
        return job, created

    def _runnable(self, specs: list[QuantSpec], request: Request, device: str) -> list[QuantSpec]:
        """The specs this device can make: without CUDA, those of engines that need it are skipped with a note,
        or refused when a flag asked for them."""
        if device != "cuda":
            for engine in sorted({engines.get(s.method) for s in specs if engines.get(s.method).requires_cuda},
                                 key=lambda e: e.name):
                if engine.name in request.asked:
                    where = ("this machine has" if request.device is None
                             else "the workers (FACTORY_WORKER_DEVICE) have")
                    flags = f"--{engine.name}" + (", --fit" if engine.sizes_to_budget else "")
                    others = [e for e in engines.all_engines() if not e.requires_cuda and e.flag]
                    alternative = ", ".join(f"{e.label} runs without one (--{e.name})" for e in others)
                    raise SpecError(f"{engine.label} ({flags}) needs a CUDA GPU and {where} none"
                                    + (f"; {alternative}" if alternative else ""))
                specs = [s for s in specs if s.method != engine.name]
                self.emit(events.note(f"no CUDA GPU: skipping the recipe's {engine.label} targets"))
        if not specs:
            flags = ", ".join(f"--{e.name}" + (" VALUE" if e.flag.takes_value else "")
                              for e in engines.all_engines() if e.flag)
            raise SpecError(f"nothing to make: pass {flags}, or a recipe with {' or '.join(engines.available())} "
                            "targets")
        return specs

    # execute --------------------------------------------------------------------------------------------
    def execute(self, job_id: str, publish: bool = True, lease: Lease | None = None) -> Job:
        """Run the steps not done yet. publish=False (a GPU worker) stops after the gate and leaves the job queued
        for its publishing step, which runs `execute` again elsewhere: every finished step is reused there.
        With `lease`, every write is fenced by its token: once another holder has the job, this one stops (its
        engines too) at the next write or progress event, writes nothing more, and raises LeaseLost."""
        self.token = lease.token if lease else None
        job = self.catalog.job(job_id)
        if job.state in (JobState.succeeded, JobState.cancelled):
            self._result(job)
            return job
        try:
            if job.state != JobState.running:  # running: taken over from a holder whose lease expired
                self.catalog.transition(job_id, JobState.running, self.token,
                                        only_from=frozenset({JobState.queued, JobState.failed}))
            self.catalog.check_lease(job_id, self.token)
            self.catalog.interrupt_steps(job_id, self.token)  # an earlier attempt that was killed left them running
            prepared = self._inspect(job)
            keys = {s.tag: self._measurement_key(job, s) for s in prepared.specs
                    if engines.get(s.method).needs_measurement}
            units = graph.units(prepared.specs, keys, publish, bool(self.settings.hub_owner))
            made = _Made()
            self._stop.clear()
            packer, needs = self.costs.packer(job), self.costs.needs(job, prepared.model, units)
            self._expect(job, prepared.model, units, needs, packer)
            packing.run(units, lambda unit: self._unit(job, prepared, unit, made), lambda unit: needs[unit.name],
                        packer, self._stop, self._note, lambda unit: self.held_elsewhere(job, unit))
            if not publish:
                handed = self.catalog.transition(job_id, JobState.queued, self.token,
                                                 only_from=frozenset({JobState.running}))
                if not handed:
                    self.catalog.check_lease(job_id, self.token)  # says why: cancelled, or taken over
                return self.catalog.job(job_id)
            if made.refused:
                raise made.refused[next(iter(made.refused))]
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: failed, so that running it again continues where it stopped
            self.catalog.transition(job_id, JobState.failed, self.token, INTERRUPTED, 130)
            raise
        except Cancelled:
            shutil.rmtree(self.settings.work / job_id, ignore_errors=True)
            job = self.catalog.job(job_id)
            self._result(job)
            return job
        except LeaseLost as e:  # another holder runs the job now: not one more write for it
            log.warning("job %s: %s", job_id, e.message)
            raise
        except FactoryError as e:
            self.catalog.transition(job_id, JobState.failed, self.token, e.message, e.exit_code)
            self._result(self.catalog.job(job_id))
            raise
        except Exception as e:
            message = mask_url(f"internal error: {type(e).__name__}: {e}")
            self.catalog.transition(job_id, JobState.failed, self.token, message, 1)
            self._result(self.catalog.job(job_id))
            raise JobFailed(message) from e
        self.catalog.transition(job_id, JobState.succeeded, self.token, only_from=frozenset({JobState.running}))
        shutil.rmtree(self.settings.work / job_id, ignore_errors=True)
        job = self.catalog.job(job_id)
        self._result(job)
        return job

    def help(self, job_id: str) -> None:
        """Convert some of a running job's sizes here while its holder runs the rest (a GPU worker with nothing
        else to do): the quantize units nobody holds, each claimed (`unit:<job>:quantize:<tag>`) once its
        measurement exists, packed as `execute` packs them. What it makes is the job's (its steps, its work
        folder); the evaluations, the gate and publishing stay with the job's holder, which waits for the units
        held here and makes any whose claim runs out itself. Ends when nothing is left to take or the job stops."""
        job = self.catalog.job(job_id)
        if job is None or job.device != self.settings.worker_device:
            return
        start = time.monotonic()
        while "inspect" not in self.catalog.done_steps(job_id):  # the job's holder resolves the specs first
            state = self.catalog.job(job_id).state
            if state != JobState.running and not (state == JobState.queued and time.monotonic() - start < 60):
                return  # over, or not started by its holder within a minute
            self.emit(events.waiting(["inspect"], self.holder))
            time.sleep(WAIT_SECONDS)
        job = self.catalog.job(job_id)
        if job.state != JobState.running:
            return
        fetched = (sources.fetch_hub(job.source_identity, self.settings.cache, lambda **_: None)
                   if identity.is_hub(job.source_identity) else None)
        prepared = self._read(job, fetched, self._helper_work(job))
        keys = {s.tag: self._measurement_key(job, s) for s in prepared.specs
                if engines.get(s.method).needs_measurement}
        units = [replace(u, needs=frozenset()) for u in graph.units(prepared.specs, keys, False, False)
                 if u.kind == "quantize"]
        self._stop.clear()
        packer, needs = self.costs.packer(job), self.costs.needs(job, prepared.model, units)

        def work(unit: Unit) -> None:
            measurement = self._known_measurement(keys[unit.spec.tag]) if unit.measurement else None
            self._quantize(job, prepared, unit.spec, measurement, helping=True)

        try:
            while self.catalog.job(job_id).state == JobState.running:
                left = [u for u in units if self._quantized(job, u.spec) is None and not self.held_elsewhere(job, u)]
                ready = [u for u in left if u.measurement is None or self._known_measurement(keys[u.spec.tag])]
                if not left:
                    return
                if ready:
                    packing.run(ready, work, lambda unit: needs[unit.name], packer, self._stop, self._note)
                else:  # the job's holder is making the measurement; an event: this helper is alive
                    self.emit(events.waiting(sorted({u.measurement for u in left}), self.holder))
                    time.sleep(WAIT_SECONDS)
        except (Cancelled, LeaseLost) as e:  # the job ended, or a claim went to another holder: nothing more here
            log.warning("job %s: a helper stops: %s", job_id, e.message)
        except packing.Stopped:  # a unit's claim went to another holder while this process was stopped
            log.warning("job %s: a helper stops: a unit it held was taken over", job_id)

    def _note(self, message: str) -> None:
        self.emit(events.note(message))

    def _unit(self, job: Job, prepared: _Prepared, unit: Unit, made: _Made) -> None:
        """One unit's work; what it makes goes into `made` for the units after it."""
        spec = unit.spec
        if unit.kind == "measure":  # unless every quant that needs it is made already (a job run again)
            if any(self._quantized(job, s) is None for s in prepared.specs
                   if engines.get(s.method).needs_measurement and self._measurement_key(job, s) == unit.measurement):
                made.measurements[unit.name] = self._measurement(job, prepared, spec, unit.measurement)
        elif unit.kind == "quantize":
            measurement = made.measurements.get(unit.measurement) if unit.measurement else None
            made.outputs[spec.tag] = self._quantize(job, prepared, spec, measurement)
        elif unit.kind == "evaluate" and spec is None:
            made.fp16 = self.evaluate_fp16(job, prepared.folder, prepared.stream)
        elif unit.kind == "evaluate" and unit.group is None:
            out = made.outputs[spec.tag]
            made.ppls[spec.tag], made.divergences[spec.tag] = self.evaluate_quant(job, spec, out, prepared.stream)
        elif unit.kind == "evaluate":
            scores = self.evaluate_group(job, spec, unit.group, made.outputs[spec.tag], prepared.stream)
            made.extra.setdefault(spec.tag, {})[unit.group] = scores
        elif unit.kind == "gate":
            made.refused = self._gate(job, made.ppls, made.fp16, made.divergences)
        elif unit.kind == "publish" and spec.tag not in made.refused:
            scores = publishing.Scores(made.ppls[spec.tag], made.fp16, made.divergences.get(spec.tag),
                                       made.extra.get(spec.tag, {}), len(prepared.stream.windows),
                                       prepared.stream.window_length)
            self._publish(job, prepared, spec, made.outputs[spec.tag], scores)
        elif unit.kind == "push" and spec.tag not in made.refused:
            self._push(job, prepared, spec)

    def _expect(self, job: Job, model: Sized, units: list[Unit], needs: dict[str, Need], packer: Packer) -> None:
        """Each unit's expected seconds (its step records them) and when the job should end (the catalog keeps
        it for `qf status`)."""
        done = self.catalog.done_steps(job.id)
        self._expected_seconds = {u.name: self.costs.seconds(job, model, u) for u in units}
        left = {name: 0.0 if name in done else s for name, s in self._expected_seconds.items()}
        wall = eta.wall_seconds(units, left, lambda unit: needs[unit.name], packer)
        self.catalog.set_expected_end(job.id, wall, self.token)
        self.emit(events.note(f"{len(units)} units, expected to take {tables.duration(wall)} "
                   f"(up to {packer.max_units} at once)"))

    def estimate(self, job: Job) -> tuple[float, float] | None:
        """(packed, one after another) expected seconds of a job that was just submitted, from its source's shape
        (config and headers only); None where the shape cannot be read here (a Hub repo without the network)."""
        try:
            config, tensors = sources.layout(job.source)
            specs = _specs(job.specs)
            if Path(job.source).is_dir():  # the specs' defaults that depend on the model (a group size)
                info = inspect(Path(job.source), _architectures(specs))
                specs = [_resolve(s, info, job.device) for s in specs]
            [s.tag for s in specs]  # noqa: B018  - a Hub repo's spec may have no tag before it is fetched
        except (FactoryError, ValueError):
            return None
        shape = Shape.of(config)
        model = Sized(shape, Params.of(tensors, shape), min(evaluate.WINDOW, shape.max_positions),
                      layered.walkable(config))
        keys = {s.tag: self._measurement_key(job, s) for s in specs if engines.get(s.method).needs_measurement}
        return self.costs.estimate(job, model, graph.units(specs, keys, True, bool(self.settings.hub_owner)))

    @contextmanager
    def _step(self, job_id: str, name: str, claim: tuple[str, int] | None = None,
              on_success: Callable[[], None] | None = None):
        """Record one attempt at a step; yields `progress(**fields)`, which forwards progress events and keeps
        the highest `peak_gpu_bytes` any of them reports. `claim` (key, token): the unit's claim, which fences the
        step's records besides the job's lease; `on_success` runs under those fences as the step succeeds."""
        self._check_ours(job_id)
        expected = self._expected_seconds.get(name)
        self.emit(events.step_started(name, expected))
        step_id = self.catalog.start_step(job_id, name, self.token, expected, self.holder, claim)
        start = time.monotonic()
        peak: list[int] = []
        checked = [start]

        def progress(**event) -> None:
            if event.get("peak_gpu_bytes") is not None:
                peak.append(event["peak_gpu_bytes"])
            self.emit(events.progress(name, event))
            if self._stop.is_set():
                raise packing.Stopped(f"{name} stopped: the job stops")
            if time.monotonic() - checked[0] > CANCEL_CHECK_SECONDS:
                checked[0] = time.monotonic()
                self._check_ours(job_id)  # raising here stops the engine: its child gets SIGTERM

        try:
            yield progress
        except LeaseLost:  # the step is the new holder's now
            raise
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (qf run turns it into one)
            self.catalog.end_step(step_id, StepState.interrupted, "interrupted", max(peak, default=None), self.token,
                                  claim)
            raise
        except BaseException as e:
            error = mask_url(e.message if isinstance(e, FactoryError) else f"{type(e).__name__}: {e}")
            self.catalog.end_step(step_id, StepState.failed, error, max(peak, default=None), self.token, claim)
            self.emit(events.step_failed(name, error))
            raise
        self.catalog.end_step(step_id, StepState.succeeded, None, max(peak, default=None), self.token, claim,
                              on_success)
        seconds = round(time.monotonic() - start, 3)
        self.emit(events.step_succeeded(name, seconds, max(peak, default=None)))

    def _check_ours(self, job_id: str) -> None:
        """Raises Cancelled when the job was cancelled, LeaseLost when another holder has it."""
        self.catalog.check_lease(job_id, self.token)

    def _local_folder(self, job: Job) -> Path:
        folder = Path(job.source)
        if not folder.is_dir():
            raise ModelRefused(f"source folder {job.source!r} is gone")
        if identity.folder_identity(folder, self.settings.cache) != job.source_identity:
            raise ModelRefused(f"source folder {job.source!r} changed since the job was submitted; submit it again")
        return folder

    def _inspect(self, job: Job) -> _Prepared:
        fetched = None
        if identity.is_hub(job.source_identity):  # the Hub commit, downloaded and checked once
            with self._step(job.id, "fetch") as progress:
                fetched = sources.fetch_hub(job.source_identity, self.settings.cache, progress)
        with self._step(job.id, "inspect"):
            prepared = self._read(job, fetched, self.settings.work / job.id)
            self.catalog.set_job_specs(job.id, [s.model_dump() for s in prepared.specs], self.token,
                                       parameters=prepared.model.parameters)
        for s in prepared.specs:
            if s.tag in prepared.calibration:  # what the engine takes of the text, said before it runs for minutes
                used = engines.get(s.method).describe_calibration(s.model_dump(), job.calibration)
                self.emit(events.note(f"{s.tag}: calibration {used}; eval {job.eval} "
                           f"{job.eval_windows} x {prepared.stream.window_length} tokens on {job.device}"))
        return prepared

    def _read(self, job: Job, fetched: Path | None, where: Path) -> _Prepared:
        """Check the source, stage it under `where`, resolve the specs against it and tokenize the calibration and
        eval texts: what every unit works from. Writes nothing to the catalog (a helping worker reads a job this
        way, into a folder of its own: staging replaces the links the job's own units read)."""
        source_folder = fetched or self._local_folder(job)
        specs = _specs(job.specs)
        info = inspect(source_folder, _architectures(specs))
        folder = files.stage(source_folder, where / "source")
        specs = [_resolve(spec, info, job.device) for spec in specs]
        cal = _text(job.calibration, job.calibration_sha)
        cal_ids = evaluate.tokenize(folder, cal.text)
        specs = [engines.get(s.method).fit_calibration(s, len(cal_ids)) for s in specs]
        config, tensors = sources.layout(str(source_folder))  # the staging folder is links: read the source
        shape = Shape.of(config)
        params = Params.of(tensors, shape)
        windows = {}
        for s in specs:
            engine = engines.get(s.method)
            for rows, length in engine.calibration_lengths(s):
                calibration.check_length(cal_ids, rows, length, job.calibration)
            if asked := engine.calibration_windows(s):
                windows[s.tag] = calibration.token_windows(cal_ids, *asked, job.calibration)
        cal_file = calibration.write_parquet(cal, where / "calibration.parquet")
        eval_ids = evaluate.tokenize(folder, _text(job.eval, job.eval_sha).text)
        stream = evaluate.stream(eval_ids, job.eval_windows, info.max_positions, job.eval)
        up = upstream.read(job.base_model, files.upstream_card(source_folder), folder)
        return _Prepared(folder=folder, specs=specs, calibration=windows, calibration_file=cal_file, stream=stream,
                         upstream=up, model=Sized(shape, params, stream.window_length, layered.walkable(config)))

    def _quantized(self, job: Job, spec: QuantSpec) -> Path | None:
        """The quant an earlier attempt of this job made, if its step finished and its folder is there."""
        out = self.settings.work / job.id / spec.tag / "out"
        if f"quantize:{spec.tag}" in self.catalog.done_steps(job.id) and out.is_dir() and any(out.iterdir()):
            return out
        return None

    def _quantize(self, job: Job, prepared: _Prepared, spec: QuantSpec, measurement: Path | None,
                  helping: bool = False) -> Path | None:
        """The quant of `spec`, made here under the claim `unit:<job>:quantize:<tag>` unless it is made already.
        While another process holds the claim (a worker helping with the job), the job waits for its quant and
        makes it itself once the claim runs out; a helper (`helping`) leaves it and returns None."""
        claim = unit_claim(job.id, f"quantize:{spec.tag}")
        while (out := self._quantized(job, spec)) is None:
            if (token := self.catalog.claim(claim, self._claimer(job), self.settings.lease_seconds)) is None:
                if helping:
                    return None
                self._check_ours(job.id)
                time.sleep(WAIT_SECONDS)
                continue
            try:
                if self._quantized(job, spec) is None:  # not finished while we took the claim
                    if token > 1:  # taken over: the step its last holder left running is not running
                        self.catalog.interrupt_steps(job.id, self.token, f"quantize:{spec.tag}")
                    with self._renewed(claim, token, stop_when_lost=True):
                        self._make_quant(job, prepared, spec, measurement, (claim, token), helping)
            finally:
                self.catalog.release_claim(claim, token)
        return out

    def _make_quant(self, job: Job, prepared: _Prepared, spec: QuantSpec, measurement: Path | None,
                    claim: tuple[str, int], helping: bool) -> None:
        """The job's holder converts in the job's work folder (a conversion taken over resumes there); a helper in
        a folder of its own, whose quant becomes the job's only under the claim's lock as its step succeeds, so
        a helper that lost its claim (stopped past it) never mixes its files with the new holder's."""
        job_work = self.settings.work / job.id / spec.tag
        work = self._helper_work(job) / spec.tag if helping else job_work
        engine = engines.get(spec.method)

        def hand_over() -> None:
            shutil.rmtree(job_work / "out", ignore_errors=True)  # what a holder before left unfinished
            job_work.mkdir(parents=True, exist_ok=True)
            os.rename(work / "out", job_work / "out")

        with self._step(job.id, f"quantize:{spec.tag}", claim, hand_over if helping else None) as progress:
            request = engines.QuantizeRequest(
                source_dir=prepared.folder,
                out_dir=work / "out",
                work_dir=work,
                spec=spec.model_dump(),
                calibration=prepared.calibration.get(spec.tag, []),
                calibration_file=prepared.calibration_file,
                measurement=measurement,
            )
            engine.quantize(request, lambda event: progress(**event))

    def _helper_work(self, job: Job) -> Path:
        return self.settings.work / job.id / "helpers" / self.holder.replace(":", "-")

    def _claimer(self, job: Job) -> str:
        return f"{job.id}@{self.holder}"

    def held_elsewhere(self, job: Job, unit: Unit) -> bool:
        """A quantize unit another process holds the claim of (a helping worker makes it)."""
        if unit.kind != "quantize":
            return False
        holder = self.catalog.claimant(unit_claim(job.id, unit.name))
        return holder is not None and holder != self._claimer(job)

    def _measurement_key(self, job: Job, spec: QuantSpec) -> str:
        engine = engines.get(spec.method)
        rows, length = engine.measurement_settings(spec)
        return measurement_key(job.source_identity, job.calibration_sha, rows, length, engine.version())

    def _measurement(self, job: Job, prepared: _Prepared, spec: QuantSpec, key: str) -> Path:
        """The measurement for this source, calibration and settings: made once across every job and worker, and
        reused by every later target. The job that makes it holds the claim `measure:<key>` while it does (renewed
        in the background); another job that needs it meanwhile waits for it (a `wait:measure:...` step), and
        makes it itself if the claim runs out first (its maker is gone)."""
        engine = engines.get(spec.method)
        rows, length = engine.measurement_settings(spec)
        name, claim = f"measure:{key[:12]}", f"measure:{key}"
        while True:
            if (known := self._known_measurement(key)) is not None:
                self.emit(events.note(f"reusing {engine.label} measurement {key[:12]} ({rows} x "
                           f"{length} tokens)"))
                return known
            if (token := self.catalog.claim(claim, self._claimer(job), self.settings.lease_seconds)) is not None:
                if self._known_measurement(key) is None:  # not finished while we took the claim
                    break
                self.catalog.release_claim(claim, token)
                continue
            self._wait_for_measurement(job, claim, name, key)
        path = self.settings.measurements / f"{key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self._renewed(claim, token), self._step(job.id, name) as progress:
                engine.measure(
                    prepared.folder,
                    prepared.calibration_file,
                    rows,
                    length,
                    self.settings.work / job.id / f"measure-{key[:12]}",
                    path,
                    lambda event: progress(**event),
                )
                self.catalog.add_measurement(
                    job.id,
                    self.token,
                    key=key,
                    path=str(path),
                    source_identity=job.source_identity,
                    calibration_sha=job.calibration_sha,
                    rows=rows,
                    length=length,
                    tool_version=engine.version(),
                )
        finally:
            self.catalog.release_claim(claim, token)
        return path

    def _known_measurement(self, key: str) -> Path | None:
        known = self.catalog.measurement(key)
        return Path(known.path) if known is not None and Path(known.path).is_file() else None

    def _wait_for_measurement(self, job: Job, claim: str, name: str, key: str) -> None:
        """Until the measurement exists or nobody holds its claim any more."""
        maker = self.catalog.claimant(claim)
        self.emit(events.note(f"{name}: {_claim_holder(maker)} is making this measurement; "
                   "waiting for it"))
        with self._step(job.id, f"wait:{name}") as progress:
            while self._known_measurement(key) is None and (maker := self.catalog.claimant(claim)) is not None:
                progress(waiting_for=_claim_holder(maker))  # an event: this job is alive while it waits
                time.sleep(WAIT_SECONDS)

    @contextmanager
    def _renewed(self, claim: str, token: int, stop_when_lost: bool = False):
        """Renew the claim every third of its life while the block runs (a thread: an engine can be silent). A
        claim taken over meanwhile (this process was stopped past it) is left: a second measurement is harmless;
        a unit of a job (`stop_when_lost`) stops, and its records are refused (the claim fences them)."""
        done = threading.Event()

        def renew() -> None:
            while not done.wait(self.settings.lease_seconds / 3):
                if not self.catalog.renew_claim(claim, token, self.settings.lease_seconds):
                    if stop_when_lost:
                        self._stop.set()
                    return

        thread = threading.Thread(target=renew, name=f"renew {claim[:20]}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _gate(self, job: Job, ppls: dict[str, float], fp16: float,
              divergences: dict[str, kld.Divergence | None]) -> dict[str, QualityGateRefused]:
        """The quants the recipe's gate refuses: perplexity not finite or above max_ppl_ratio x FP16, or (with
        max_kld) a mean KL divergence from FP16 above it."""
        refused = {}
        with self._step(job.id, "gate"):
            for tag, ppl in ppls.items():
                divergence = divergences.get(tag)
                if not (math.isfinite(ppl) and ppl <= job.max_ppl_ratio * fp16):
                    refused[tag] = QualityGateRefused.perplexity(tag, ppl, fp16, job.max_ppl_ratio)
                elif job.max_kld is not None and divergence is not None and not divergence.mean <= job.max_kld:
                    refused[tag] = QualityGateRefused.divergence(tag, divergence.mean, job.max_kld)
        return refused

    def _publish(self, job: Job, prepared: _Prepared, spec: QuantSpec, out: Path, scores: publishing.Scores) -> None:
        with self._step(job.id, f"publish:{spec.tag}"):
            self.publisher.to_registry(job, spec, out, scores, prepared.upstream, self.token)

    def _push(self, job: Job, prepared: _Prepared, spec: QuantSpec) -> None:
        with self._step(job.id, f"push:{spec.tag}"):
            self.publisher.to_hub(job, spec, prepared.upstream, lambda: self._check_ours(job.id))

    def _result(self, job: Job) -> None:
        self.emit(events.result(job.id, job.state, job.error, job.exit_code or 0,
                                [q.row().to_json() for q in self.catalog.quants(job_id=job.id)]))


def unit_claim(job_id: str, unit: str) -> str:
    """The claim a unit of a job is made under, by the job's holder or a helping worker."""
    return f"unit:{job_id}:{unit}"


def _claim_holder(holder: str | None) -> str:
    """`job@host:pid` in a sentence."""
    job, _, process = (holder or "").rpartition("@")
    return f"job {job} ({process})" if job else "another process"


def _calibration(name: str | None, used: list) -> calibration.TextSet:
    """The recipe's text set, else the engines' default: the longest of their defaults, so each has enough."""
    if name:
        return calibration.resolve(name)
    return max((calibration.resolve(e.default_calibration) for e in used), key=lambda t: len(t.text))


def _specs(dicts: list[dict]) -> list[QuantSpec]:
    return [engines.spec_from_dict(d) for d in dicts]


def _architectures(specs: list[QuantSpec]) -> set[str]:
    """What inspection accepts: the architectures some engine of the job converts (each refuses the rest itself)."""
    return {a for name in {s.method for s in specs} for a in engines.get(name).architectures}


def _resolve(spec: QuantSpec, info: ModelInfo, device: str) -> QuantSpec:
    """The spec with its model- and device-dependent defaults, after its engine said it can take the model."""
    engine: Engine = engines.get(spec.method)
    if (reason := engine.refuse(info)) is not None:
        raise ModelRefused(reason)
    return engine.resolve(spec, info, device)


def _text(name: str, sha256: str) -> calibration.TextSet:
    text = calibration.resolve(name)
    if text.sha256 != sha256:
        raise SpecError(f"text set {name!r} changed since the job was submitted; submit it again")
    return text
