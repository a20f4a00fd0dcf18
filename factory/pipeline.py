"""The steps of a job (its state moves only through the catalog's compare-and-set, fenced by the lease's token).

    submit:  check the request, then create the job or find the same one (factory/jobs/planning.py)
    execute: inspect, then the job's units (factory/jobs/graph.py: measure, quantize:<tag>, evaluate:fp16,
             evaluate:<tag>, gate, publish:<tag>, push:<tag>), several at once where they fit
             (factory/jobs/packing.py)

`qf run` calls both in-process; a worker calls `execute` with a job id. A failed job runs again from where it stopped:
finished quantize and evaluate steps are reused; steps an earlier attempt left running (it was killed) are marked
interrupted. A job whose every quant is published (and pushed) is succeeded, whatever stops its attempt after that:
published means succeeded. Engines and evaluators read the source through a staging folder of its allowlisted files
(factory/files.py), and a quant is published only when its folder holds nothing else. Factory's mixins hold the rest of
a job: planning (factory/jobs/planning.py: submit, estimate), the measure and quantize units and their claims, and
helping with another worker's job (factory/jobs/conversions.py), the evaluation units (factory/jobs/evaluations.py);
what units cost is factory/jobs/costs.py's. Nothing here prints: progress goes to `emit` as events (factory/events.py)
that the CLI renders.
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import calibration
from factory import dequantize, engines, evaluate, events, files, identity, kld, layered, sources, tables
from factory.catalog import Catalog, Job, JobState, Lease, StepState
from factory.engines import QuantSpec
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
from factory.inspect import inspect
from factory.jobs import eta, graph, packing
from factory.jobs.conversions import Conversions
from factory.jobs.costs import Costs, Sized
from factory.jobs.evaluations import Evaluations
from factory.jobs.graph import Unit
from factory.jobs.packing import Need, Packer
from factory.jobs.planning import Planning
from factory.jobs.prepared import Prepared
from factory.publish import publishing, upstream
from factory.settings import Settings
from factory.vram import Params, Shape

CANCEL_CHECK_SECONDS = 1.0  # how often a running step looks whether its job was cancelled or taken over
log = logging.getLogger("quantfactory")
INTERRUPTED = "interrupted (Ctrl-C or SIGTERM); run the same command again to continue from the finished steps"


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


class Factory(Planning, Conversions, Evaluations):
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
                self.catalog.transition(
                    job_id, JobState.running, self.token, only_from=frozenset({JobState.queued, JobState.failed})
                )
            self.catalog.check_lease(job_id, self.token)
            self.catalog.interrupt_steps(job_id, self.token)  # an earlier attempt that was killed left them running
            prepared = self._inspect(job)
            keys = {
                s.tag: self._measurement_key(job, s) for s in prepared.specs if engines.get(s.method).needs_measurement
            }
            units = graph.units(prepared.specs, keys, publish, bool(self.settings.hub_owner))
            made = _Made()
            self._stop.clear()
            packer, needs = self.costs.packer(job), self.costs.needs(job, prepared.model, units)
            self._expect(job, prepared.model, units, needs, packer)
            packing.run(
                units,
                lambda unit: self._unit(job, prepared, unit, made),
                lambda unit: needs[unit.name],
                packer,
                self._stop,
                self._note,
                lambda unit: self.held_elsewhere(job, unit),
            )
            if not publish:
                handed = self.catalog.transition(
                    job_id, JobState.queued, self.token, only_from=frozenset({JobState.running})
                )
                if not handed:
                    self.catalog.check_lease(job_id, self.token)  # says why: cancelled, or taken over
                return self.catalog.job(job_id)
            if made.refused:
                raise made.refused[next(iter(made.refused))]
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: failed, so that running it again continues where it stopped
            if self._published_all(job_id):
                return self._succeed(job_id)
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
            if self._published_all(job_id):
                return self._succeed(job_id)
            self.catalog.transition(job_id, JobState.failed, self.token, e.message, e.exit_code)
            self._result(self.catalog.job(job_id))
            raise
        except Exception as e:
            if self._published_all(job_id):
                return self._succeed(job_id)
            message = mask_url(f"internal error: {type(e).__name__}: {e}")
            self.catalog.transition(job_id, JobState.failed, self.token, message, 1)
            self._result(self.catalog.job(job_id))
            raise JobFailed(message) from e
        return self._succeed(job_id)

    def _succeed(self, job_id: str) -> Job:
        self.catalog.transition(job_id, JobState.succeeded, self.token, only_from=frozenset({JobState.running}))
        shutil.rmtree(self.settings.work / job_id, ignore_errors=True)
        job = self.catalog.job(job_id)
        self._result(job)
        return job

    def _published_all(self, job_id: str) -> bool:
        """Whether the job has nothing left to do: every quant of it published (and pushed, with FACTORY_HUB_OWNER).
        Such a job succeeded, whatever stopped this attempt after its last publish (an interrupt that came while a
        unit in a thread was publishing, an error of a later attempt): published means succeeded."""
        job = self.catalog.job(job_id)
        try:
            tags = {s.tag for s in engines.specs_from_dicts(job.specs)}
        except ValueError:  # specs not resolved yet: nothing was published
            return False
        done = self.catalog.done_steps(job_id)
        published = {q.tag for q in self.catalog.quants(job_id=job_id)}
        return (
            bool(tags)
            and tags <= published
            and (not self.settings.hub_owner or all(f"push:{tag}" in done for tag in tags))
        )

    def _note(self, message: str) -> None:
        self.emit(events.note(message))

    def _unit(self, job: Job, prepared: Prepared, unit: Unit, made: _Made) -> None:
        """One unit's work; what it makes goes into `made` for the units after it."""
        spec = unit.spec
        if unit.kind == "measure":  # unless every quant that needs it is made already (a job run again)
            if any(
                self._quantized(job, s) is None
                for s in prepared.specs
                if engines.get(s.method).needs_measurement and self._measurement_key(job, s) == unit.measurement
            ):
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
            scores = publishing.Scores(
                made.ppls[spec.tag],
                made.fp16,
                made.divergences.get(spec.tag),
                made.extra.get(spec.tag, {}),
                len(prepared.stream.windows),
                prepared.stream.window_length,
            )
            self._publish(job, prepared, spec, made.outputs[spec.tag], scores)
        elif unit.kind == "push" and spec.tag not in made.refused:
            self._push(job, prepared, spec)

    def _expect(self, job: Job, model: Sized, units: list[Unit], needs: dict[str, Need], packer: Packer) -> None:
        """Each unit's expected seconds (its step records them) and when the job should end (the catalog keeps
        it for `qf status`); a note of what is left to run, and how many units of it run at once here (none when
        nothing is: a publishing pass after the worker's)."""
        done = self.catalog.done_steps(job.id)
        self._expected_seconds = {u.name: self.costs.seconds(job, model, u) for u in units}
        left = {name: 0.0 if name in done else s for name, s in self._expected_seconds.items()}
        wall, most = eta.packed(units, left, lambda unit: needs[unit.name], packer)
        self.catalog.set_expected_end(job.id, wall, self.token)
        to_run = [u for u in units if u.name not in done]
        if not to_run or wall <= 0:
            return
        what = f"{len(to_run)} units" if len(to_run) == len(units) else f"{len(to_run)} of {len(units)} units left"
        at_once = "one at a time" if most <= 1 else f"up to {most} at once"
        self.emit(events.note(f"{what}, expected to take {tables.duration(wall)} ({at_once})"))

    @contextmanager
    def _step(
        self, job_id: str, name: str, claim: tuple[str, int] | None = None, on_success: Callable[[], None] | None = None
    ):
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
            self.catalog.end_step(
                step_id, StepState.interrupted, "interrupted", max(peak, default=None), self.token, claim
            )
            raise
        except BaseException as e:
            error = mask_url(e.message if isinstance(e, FactoryError) else f"{type(e).__name__}: {e}")
            self.catalog.end_step(step_id, StepState.failed, error, max(peak, default=None), self.token, claim)
            self.emit(events.step_failed(name, error))
            raise
        self.catalog.end_step(
            step_id, StepState.succeeded, None, max(peak, default=None), self.token, claim, on_success
        )
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

    def _inspect(self, job: Job) -> Prepared:
        fetched = None
        if identity.is_hub(job.source_identity):  # the Hub commit, downloaded and checked once
            with self._step(job.id, "fetch") as progress:
                fetched = sources.fetch_hub(job.source_identity, self.settings.cache, progress)
        if dequantize.wanted(fetched or Path(job.source)):  # FP8 or MXFP4: every unit reads its BF16 copy
            with self._step(job.id, "dequantize") as progress:
                fetched = self._bf16(job, fetched or self._local_folder(job), progress)
        with self._step(job.id, "inspect"):
            prepared = self._read(job, fetched, self.settings.work / job.id)
            self.catalog.set_job_specs(
                job.id, [s.model_dump() for s in prepared.specs], self.token, parameters=prepared.model.parameters
            )
        for s in prepared.specs:
            if s.tag in prepared.calibration:  # what the engine takes of the text, said before it runs for minutes
                used = engines.get(s.method).describe_calibration(s.model_dump(), job.calibration)
                self.emit(
                    events.note(
                        f"{s.tag}: calibration {used}; eval {job.eval} "
                        f"{job.eval_windows} x {prepared.stream.window_length} tokens on {job.device}"
                    )
                )
        return prepared

    def _read(self, job: Job, fetched: Path | None, where: Path) -> Prepared:
        """Check the source, stage it under `where`, resolve the specs against it and read the calibration and
        eval texts' token ids (tokenized once, then from cache/tokens/): what every unit works from. Writes nothing
        to the catalog (a helping worker reads a job this way, into a folder of its own: staging replaces the files
        the job's own units read)."""
        source_folder = self._bf16(job, fetched or self._local_folder(job))
        specs = engines.specs_from_dicts(job.specs)
        info = inspect(source_folder, engines.architectures())
        folder = files.stage(source_folder, where / "source")
        self._check_staged(job, source_folder, folder, "since the job was submitted", "submit it again")
        specs = [engines.resolve(spec, info, job.device) for spec in specs]
        cal = _text(job.calibration, job.calibration_sha)
        cal_ids = self._tokens(job, folder, cal)
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
        eval_ids = self._tokens(
            job,
            folder,
            _text(job.eval, job.eval_sha),
            first=job.eval_windows * evaluate.window_length(info.max_positions),
        )
        stream = evaluate.stream(eval_ids, job.eval_windows, info.max_positions, job.eval)
        up = upstream.read(job.base_model, files.upstream_card(source_folder), folder)
        return Prepared(
            folder=folder,
            specs=specs,
            calibration=windows,
            calibration_file=cal_file,
            stream=stream,
            upstream=up,
            model=Sized(shape, params, stream.window_length, layered.walkable(config)),
        )

    def _bf16(self, job: Job, folder: Path, progress: Callable[..., None] = lambda **_: None) -> Path:
        """The folder the units read: the source, or its BF16 copy when it is FP8 or MXFP4 (factory/dequantize.py),
        made once per source (checked by inspection first) and then reused, by this job's next attempt, its helpers
        and later jobs of the same source."""
        if not dequantize.wanted(folder):
            return folder
        inspect(folder, engines.architectures())
        copy, made = dequantize.bf16(folder, job.source_identity, self.settings.home, progress)
        if not made:
            self.emit(events.note(f"dequantize: the BF16 copy of this source made earlier is reused ({copy})"))
        return copy

    def _tokens(self, job: Job, folder: Path, text: calibration.TextSet, first: int | None = None) -> list[int]:
        """The text's ids (calibration windows are drawn from all of it), or its `first` ids (the eval's windows)."""
        key = identity.tokens_key(job.source_identity, text.sha256, evaluate.tokenizer_version())
        name = f"{key}.npy" if first is None else f"{key}-first{first}.npy"
        return evaluate.cached_tokens(folder, text.text, self.settings.cache / "tokens" / name, first)

    def _gate(
        self, job: Job, ppls: dict[str, float], fp16: float, divergences: dict[str, kld.Divergence | None]
    ) -> dict[str, QualityGateRefused]:
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

    def _check_staged(self, job: Job, source_folder: Path, staged: Path, since: str, then: str) -> None:
        """What the job reads, its staging of a local folder, is what was submitted (a Hub commit was checked by its
        fetch; the BF16 copy of an FP8 or MXFP4 source is what the staging must hold): ModelRefused says that the
        source changed `since`, and `then` what to do."""
        expected = job.source_identity
        if (copy := dequantize.made(self.settings.home, job.source_identity)) is not None:
            source_folder, expected = copy, identity.folder_identity(copy, self.settings.cache)
        elif identity.is_hub(job.source_identity):
            return
        try:
            same, why = identity.folder_identity(source_folder, self.settings.cache, staged) == expected, ""
        except ModelRefused as e:  # a file became a link out of the folder, a FIFO, ...
            same, why = False, f" ({e.message})"
        if not same:
            raise ModelRefused(f"source folder {job.source!r} changed {since}{why}; {then}")

    def _publish(self, job: Job, prepared: Prepared, spec: QuantSpec, out: Path, scores: publishing.Scores) -> None:
        if out.is_relative_to(self.settings.registry):  # a published quant reused: its evaluation is added to it
            twin = self.catalog.quant_with_weights(publishing.weights_key(job, spec))
            if twin is None:
                raise JobFailed(
                    f"{job.name}:{spec.tag} was removed while this job evaluated it; run the same "
                    "command again to make it"
                )
            note = f"{twin.name}:{twin.tag}@{twin.rev} is published (job {twin.job_id}); this evaluation is added to it"
            self.catalog.reuse_step(job.id, f"publish:{spec.tag}", note, self.token)
            self.emit(events.note(f"publish:{spec.tag}: {note}"))
            return
        with self._step(job.id, f"publish:{spec.tag}"):
            source = Path(job.source)
            self._check_staged(job, source, prepared.folder, "since it was inspected", "nothing was published")
            self.publisher.to_registry(job, spec, out, scores, prepared.upstream, self.token)
        publishing.moment("ended")

    def _push(self, job: Job, prepared: Prepared, spec: QuantSpec) -> None:
        with self._step(job.id, f"push:{spec.tag}"):
            self.publisher.to_hub(job, spec, prepared.upstream, lambda: self._check_ours(job.id))

    def _result(self, job: Job) -> None:
        self.emit(
            events.result(
                job.id,
                job.state,
                job.error,
                job.exit_code or 0,
                [q.row().to_json() for q in self.catalog.quants(job_id=job.id)],
            )
        )


def _text(name: str, sha256: str) -> calibration.TextSet:
    text = calibration.resolve(name)
    if text.sha256 != sha256:
        raise SpecError(f"text set {name!r} changed since the job was submitted; submit it again")
    return text
