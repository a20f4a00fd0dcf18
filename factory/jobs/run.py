"""Running a job: `execute` moves it to running, prepares it (factory/jobs/prepared.py), then runs its units
(factory/jobs/graph.py: measure, quantize:<tag>, evaluate:fp16, evaluate:<tag>, gate, publish:<tag>, push:<tag>),
several at once where they fit (factory/jobs/packing.py), and ends it. Each unit kind's work is a function of the
attempt's context (factory/jobs/context.py's Run): conversions.py makes the measure and quantize units,
evaluations.py the evaluation units; the gate, publishing and pushing are here. The job's state moves only through
the catalog's compare-and-set, fenced by the lease's token.

A failed job runs again from where it stopped: finished quantize and evaluate steps are reused; steps an earlier
attempt left running (it was killed) are marked interrupted. A job whose every quant is published (and pushed) is
succeeded, whatever stops its attempt after that: published means succeeded.
"""

from __future__ import annotations

import logging
import math
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from factory import engines, events, tables
from factory.catalog import Job, JobState
from factory.engines import QuantSpec
from factory.errors import Cancelled, FactoryError, JobFailed, LeaseLost, QualityGateRefused, QuantRemoved, mask_url
from factory.evaluation import kld
from factory.jobs import conversions, eta, evaluations, graph, packing, rivals
from factory.jobs.context import Run
from factory.jobs.costs import Sized
from factory.jobs.graph import Unit
from factory.jobs.packing import Need, Packer
from factory.jobs.prepared import Prepared, check_unchanged, prepare
from factory.publish import publishing

log = logging.getLogger("quantfactory")
INTERRUPTED = "interrupted (Ctrl-C or SIGTERM); run the same command again to continue from the finished steps"


@dataclass
class _Made:
    """What the units of this attempt made, for the units after them (units in threads write distinct keys)."""

    measurements: dict[str, Path] = field(default_factory=dict)  # shared unit (<stage>:<key>) -> its file
    outputs: dict[str, Path] = field(default_factory=dict)  # tag -> quant folder
    fp16: float = math.nan
    ppls: dict[str, float] = field(default_factory=dict)
    divergences: dict[str, kld.Divergence | None] = field(default_factory=dict)  # tag -> from FP16
    extra: dict[str, dict[str, dict]] = field(default_factory=dict)  # tag -> group -> {key: ppl}
    refused: dict[str, QualityGateRefused] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)  # tag -> why the gate did not keep it (rivals.py)


def execute(run: Run, job_id: str, publish: bool) -> Job:
    """Run the steps not done yet (Factory.execute says what `publish` and a lease do)."""
    job = run.catalog.jobs.get(job_id)
    if job.state in (JobState.succeeded, JobState.cancelled):
        result(run, job)
        return job
    try:
        if job.state != JobState.running:  # running: taken over from a holder whose lease expired
            run.catalog.jobs.transition(
                job_id, JobState.running, run.token, only_from=frozenset({JobState.queued, JobState.failed})
            )
        run.catalog.leases.check(job_id, run.token)
        run.catalog.steps.interrupt(job_id, run.token)  # an earlier attempt that was killed left them running
        prepared = prepare(run, job)
        keys = {s.tag: conversions.measurement_keys(job, s) for s in prepared.specs}
        units = graph.units(prepared.specs, keys, publish, bool(run.settings.hub_owner))
        made = _Made()
        packer, needs = run.costs.packer(job), run.costs.needs(job, prepared.model, units)
        run = replace(run, expected=_expect(run, job, prepared.model, units, needs, packer))
        packing.run(
            units,
            lambda unit: _unit(run, job, prepared, unit, made),
            lambda unit: needs[unit.name],
            packer,
            run.stop,
            run.note,
            lambda unit: conversions.held_elsewhere(run, job, unit),
            run.costs.ledger,
            lambda names: run.emit(events.waiting(names, "other jobs' units on this machine")),
        )
        if not publish:
            handed = run.catalog.jobs.transition(
                job_id, JobState.queued, run.token, only_from=frozenset({JobState.running})
            )
            if not handed:
                run.catalog.leases.check(job_id, run.token)  # says why: cancelled, or taken over
            return run.catalog.jobs.get(job_id)
        if made.refused:
            raise made.refused[next(iter(made.refused))]
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: failed, so that running it again continues where it stopped
        if _published_all(run, job_id):
            return _succeed(run, job_id)
        run.catalog.jobs.transition(job_id, JobState.failed, run.token, INTERRUPTED, 130)
        raise
    except Cancelled:
        shutil.rmtree(run.settings.work / job_id, ignore_errors=True)
        job = run.catalog.jobs.get(job_id)
        result(run, job)
        return job
    except LeaseLost as e:  # another holder runs the job now: not one more write for it
        log.warning("job %s: %s", job_id, e.message)
        raise
    except FactoryError as e:
        if _published_all(run, job_id):
            return _succeed(run, job_id)
        run.catalog.jobs.transition(job_id, JobState.failed, run.token, e.message, e.exit_code)
        result(run, run.catalog.jobs.get(job_id))
        raise
    except Exception as e:
        if _published_all(run, job_id):
            return _succeed(run, job_id)
        message = mask_url(f"internal error: {type(e).__name__}: {e}")
        run.catalog.jobs.transition(job_id, JobState.failed, run.token, message, 1)
        result(run, run.catalog.jobs.get(job_id))
        raise JobFailed(message) from e
    return _succeed(run, job_id)


def result(run: Run, job: Job) -> None:
    run.emit(
        events.result(
            job.id,
            job.state,
            job.error,
            job.exit_code or 0,
            [q.row().to_json() for q in run.catalog.quants.live(job_id=job.id)],
        )
    )


def _succeed(run: Run, job_id: str) -> Job:
    run.catalog.jobs.transition(job_id, JobState.succeeded, run.token, only_from=frozenset({JobState.running}))
    shutil.rmtree(run.settings.work / job_id, ignore_errors=True)
    job = run.catalog.jobs.get(job_id)
    result(run, job)
    return job


def _published_all(run: Run, job_id: str) -> bool:
    """Whether the job has nothing left to do: every quant of it published (and pushed, with FACTORY_HUB_OWNER).
    Such a job succeeded, whatever stopped this attempt after its last publish (an interrupt that came while a
    unit in a thread was publishing, an error of a later attempt): published means succeeded."""
    job = run.catalog.jobs.get(job_id)
    try:
        tags = {s.tag for s in job.specs}
    except ValueError:  # specs not resolved yet: nothing was published
        return False
    tags -= {name.removeprefix("publish:") for name in run.catalog.steps.skipped(job_id)}  # the gate dropped them
    done = run.catalog.steps.done(job_id)
    published = {q.tag for q in run.catalog.quants.live(job_id=job_id)}
    return (
        bool(tags) and tags <= published and (not run.settings.hub_owner or all(f"push:{tag}" in done for tag in tags))
    )


def _unit(run: Run, job: Job, prepared: Prepared, unit: Unit, made: _Made) -> None:
    """One unit's work; what it makes goes into `made` for the units after it."""
    spec = unit.spec
    if unit.kind == "measure":  # unless every quant that needs it is made already (a job run again)
        if any(
            conversions.quantized(run, job, s) is None
            for s in prepared.specs
            if unit.measurement in conversions.measurement_keys(job, s).values()
        ):
            earlier = _shared_files(unit, made) | _made_from(spec, made)
            made.measurements[unit.name] = conversions.measure(
                run, job, prepared, spec, unit.stage, unit.measurement, earlier
            )
    elif unit.kind == "quantize":
        made.outputs[spec.tag] = conversions.quantize(
            run, job, prepared, spec, _shared_files(unit, made), _made_from(spec, made)
        )
    elif unit.kind == "evaluate" and spec is None:
        made.fp16 = evaluations.evaluate_fp16(run, job, prepared.folder, prepared.stream)
    elif unit.kind == "evaluate" and unit.group is None:
        out = made.outputs[spec.tag]
        made.ppls[spec.tag], made.divergences[spec.tag] = evaluations.evaluate_quant(
            run, job, spec, out, prepared.stream
        )
    elif unit.kind == "evaluate":
        scores = evaluations.evaluate_group(run, job, spec, unit.group, made.outputs[spec.tag], prepared.stream)
        made.extra.setdefault(spec.tag, {})[unit.group] = scores
    elif unit.kind == "gate":
        made.refused = _gate(run, job, made.ppls, made.fp16, made.divergences)
        for decision in rivals.decide(run.catalog, job.id, prepared.specs, made.outputs):
            run.note(f"gate: {decision}")
            if not decision.kept:  # not published, and so not a reason to fail the job either
                made.dropped[decision.tag] = str(decision)
                made.refused.pop(decision.tag, None)
    elif unit.kind == "publish" and spec.tag in made.dropped:
        if f"publish:{spec.tag}" not in run.catalog.steps.skipped(job.id):
            run.catalog.steps.skip(job.id, f"publish:{spec.tag}", made.dropped[spec.tag], run.token)
    elif unit.kind == "publish" and spec.tag not in made.refused:
        scores = publishing.Scores(
            made.ppls[spec.tag],
            made.fp16,
            made.divergences.get(spec.tag),
            made.extra.get(spec.tag, {}),
            len(prepared.stream.windows),
            prepared.stream.window_length,
        )
        _publish(run, job, prepared, spec, made.outputs[spec.tag], scores)
    elif unit.kind == "push" and spec.tag not in made.refused and spec.tag not in made.dropped:
        _push(run, job, prepared, spec)


def _shared_files(unit: Unit, made: _Made) -> dict[str, Path]:
    """{stage: file} of the shared units `unit` needs that this attempt made (a quant made already needs none)."""
    return {name.partition(":")[0]: made.measurements[name] for name in unit.needs if name in made.measurements}


def _made_from(spec: QuantSpec, made: _Made) -> dict[str, Path]:
    """{tag: folder} of the quants `spec` is made from (Engine.made_from), in its engine's order."""
    return {s.tag: made.outputs[s.tag] for s in engines.get(spec.method).made_from(spec)}


def _expect(
    run: Run, job: Job, model: Sized, units: list[Unit], needs: dict[str, Need], packer: Packer
) -> dict[str, float]:
    """Each unit's expected seconds (returned: its step records them) and when the job should end (the catalog
    keeps it for `qf status`); a note of what is left to run, and how many units of it run at once here (none when
    nothing is: a publishing pass after the worker's)."""
    done = run.catalog.steps.done(job.id)
    expected = {u.name: run.costs.seconds(job, model, u) for u in units}
    left = {name: 0.0 if name in done else s for name, s in expected.items()}
    wall, most = eta.packed(units, left, lambda unit: needs[unit.name], packer)
    run.catalog.jobs.set_expected_end(job.id, wall, run.token)
    to_run = [u for u in units if u.name not in done]
    if not to_run or wall <= 0:
        return expected
    what = f"{len(to_run)} units" if len(to_run) == len(units) else f"{len(to_run)} of {len(units)} units left"
    at_once = "one at a time" if most <= 1 else f"up to {most} at once"
    run.note(f"{what}, expected to take {tables.duration(wall)} ({at_once})")
    return expected


def _gate(
    run: Run, job: Job, ppls: dict[str, float], fp16: float, divergences: dict[str, kld.Divergence | None]
) -> dict[str, QualityGateRefused]:
    """The quants the recipe's gate refuses: perplexity not finite or above max_ppl_ratio x FP16, or (with
    max_kld) a mean KL divergence from FP16 above it."""
    refused = {}
    with run.step_once(job.id, "gate", run.catalog.steps.done(job.id)):  # decided again quietly in a later pass
        for tag, ppl in ppls.items():
            divergence = divergences.get(tag)
            if not (math.isfinite(ppl) and ppl <= job.max_ppl_ratio * fp16):
                refused[tag] = QualityGateRefused.perplexity(tag, ppl, fp16, job.max_ppl_ratio)
            elif job.max_kld is not None and divergence is not None and not divergence.mean <= job.max_kld:
                refused[tag] = QualityGateRefused.divergence(tag, divergence.mean, job.max_kld)
    return refused


def _publish(run: Run, job: Job, prepared: Prepared, spec: QuantSpec, out: Path, scores: publishing.Scores) -> None:
    if out.is_relative_to(run.settings.registry):  # a published quant reused: its evaluation is added to it
        twin = run.catalog.quants.with_weights(publishing.weights_key(job, spec))
        if twin is None:
            raise QuantRemoved(job.name, spec.tag)
        note = f"{twin.name}:{twin.tag}@{twin.rev} is published (job {twin.job_id}); this evaluation is added to it"
        run.catalog.steps.reuse(job.id, f"publish:{spec.tag}", note, run.token)
        run.note(f"publish:{spec.tag}: {note}")
        return
    with run.step(job.id, f"publish:{spec.tag}"):
        check_unchanged(run, job, prepared)
        run.publisher.to_registry(job, spec, out, scores, prepared.upstream, run.token)
    publishing.moment("ended")


def _push(run: Run, job: Job, prepared: Prepared, spec: QuantSpec) -> None:
    with run.step(job.id, f"push:{spec.tag}"):
        run.publisher.to_hub(job, spec, prepared.upstream, lambda: run.check_ours(job.id))
