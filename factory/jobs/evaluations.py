"""A job's evaluation units, as factory/jobs/run.py runs them: FP16 (its perplexity and its reference for KL
divergence, both reused from any earlier job on the same token stream), each quant (its perplexity and divergence
from FP16), and an engine's other scores (e.g. through its runtime's quantized KV caches). Each is a step; each
score a row of the catalog's evaluations, fenced by the job's lease token; a quant's rows carry its weights key, so
that every evaluation of the same weights (by this job or a later one that reused the quant) is listed with it.

Each function takes the attempt's context (factory/jobs/context.py's Run) first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import astuple
from pathlib import Path

from factory import engines, events
from factory.catalog import Job
from factory.engines import QuantSpec
from factory.errors import QuantRemoved
from factory.evaluation import evaluate, kld
from factory.identity import reference_key
from factory.jobs.context import Run
from factory.publish.publishing import weights_key


def evaluate_fp16(run: Run, job: Job, folder: Path, stream: evaluate.Stream) -> float:
    """FP16's perplexity and its reference for the quants' KL divergence (a file under FACTORY_HOME), both
    reused from any earlier job on the same token stream."""
    key = (job.source_identity, job.eval_sha, job.eval_windows, stream.window_length, job.device)
    path = _reference_path(run, job, stream)
    if (ppl := run.catalog.quants.baseline(*key)) is not None and path.is_file():
        run.emit(events.note(f"FP16 perplexity {ppl:.4f} and its KL reference reused from an earlier evaluation"))
        return ppl
    reference = kld.Reference()
    return _scored(
        run,
        job,
        stream,
        "fp16",
        folder,
        evaluate.load_fp16,
        evaluate.FP16_EVALUATOR,
        keep=reference,
        on_scored=lambda: reference.save(path),
    ).ppl


def _reference_path(run: Run, job: Job, stream: evaluate.Stream) -> Path:
    key = reference_key(
        job.source_identity, job.eval_sha, job.eval_windows, stream.window_length, job.device, kld.LAYOUT
    )
    return run.settings.references / f"{key}.safetensors"


def evaluate_quant(
    run: Run, job: Job, spec: QuantSpec, out: Path, stream: evaluate.Stream
) -> tuple[float, kld.Divergence | None]:
    """The quant's perplexity and its divergence from FP16 (whose reference evaluate:fp16 made or found)."""
    done = {e.subject: e for e in run.catalog.quants.evaluations(job.id)}
    if spec.tag in done and f"evaluate:{spec.tag}" in run.catalog.steps.done(job.id):
        found = done[spec.tag]
        return found.ppl, kld.Divergence(found.kld, found.kld_p99, found.top1) if found.kld is not None else None
    engine = engines.get(spec.method)
    reference = kld.Reference.load(_reference_path(run, job, stream))
    result = _scored(
        run,
        job,
        stream,
        spec.tag,
        out,
        engine.load,
        engine.evaluator,
        reference=reference,
        weights_key=weights_key(job, spec),
    )
    return result.ppl, result.divergence


def evaluate_group(run: Run, job: Job, spec: QuantSpec, group: str, out: Path, stream: evaluate.Stream) -> dict:
    """One group of the engine's scores beyond perplexity (e.g. through its runtime's quantized KV caches), as
    {key: ppl}, in one step."""
    engine = engines.get(spec.method)
    done = {e.subject: e.ppl for e in run.catalog.quants.evaluations(job.id)}
    mine = [e for e in engine.evaluations(spec) if e.group == group]
    subjects = {e.key: f"{spec.tag}:{e.suffix}" for e in mine}
    if all(s in done for s in subjects.values()):
        return {key: done[s] for key, s in subjects.items()}
    scores = {}
    with (
        run.step(job.id, f"evaluate:{spec.tag}:{group.split('_')[0]}") as progress,
        _published(run, job, spec.tag, out),
    ):
        for e in mine:

            def on_progress(d: int, t: int, unit: str, window: str = e.unit) -> None:
                progress(done=d, total=t, unit=window if unit == "window" else unit)

            result = evaluate.evaluate(out, e.load, engine.evaluator, stream, on_progress)
            scores[e.key] = _record(run, job, stream, subjects[e.key], result, progress, weights_key(job, spec))
            run.emit(events.evaluation(subjects[e.key], result.ppl))
    return scores


def _scored(
    run: Run,
    job: Job,
    stream: evaluate.Stream,
    subject: str,
    folder: Path,
    load,
    evaluator: str,
    reference: kld.Reference | None = None,
    keep: kld.Reference | None = None,
    on_scored: Callable[[], None] | None = None,
    weights_key: str | None = None,
) -> evaluate.Result:
    """One evaluation step: the model in `folder` scored on the job's stream (against FP16's `reference`, or
    keeping its own into `keep`); `on_scored` runs before the result is recorded (the reference is saved)."""
    with run.step(job.id, f"evaluate:{subject}") as progress, _published(run, job, subject, folder):
        result = evaluate.evaluate(
            folder,
            load,
            evaluator,
            stream,
            lambda done, total, unit: progress(done=done, total=total, unit=unit),
            reference=reference,
            keep=keep,
        )
        if on_scored:
            on_scored()
        _record(run, job, stream, subject, result, progress, weights_key)
    divergence = astuple(result.divergence) if result.divergence else None  # mean, p99, top1
    run.emit(events.evaluation(subject, result.ppl, divergence))
    return result


@contextmanager
def _published(run: Run, job: Job, tag: str, folder: Path) -> Iterator[None]:
    """An evaluation of `folder`; where it is a published quant (another job's, reused) that `qf rm` removed
    meanwhile, it fails with that sentence (QuantRemoved), whatever the reader hit when its files went."""
    try:
        yield
    except Exception as e:
        if folder.is_relative_to(run.settings.registry) and not folder.is_dir():
            raise QuantRemoved(job.name, tag) from e
        raise


def _record(
    run: Run,
    job: Job,
    stream: evaluate.Stream,
    subject: str,
    result: evaluate.Result,
    progress,
    weights_key: str | None = None,
) -> float:
    progress(peak_gpu_bytes=result.peak_gpu_bytes)
    divergence = result.divergence
    run.catalog.quants.add_evaluation(
        run.token,
        job_id=job.id,
        subject=subject,
        source_identity=job.source_identity,
        evaluator=result.evaluator,
        device=result.device,
        eval_sha=job.eval_sha,
        windows=len(stream.windows),
        window_length=stream.window_length,
        ppl=result.ppl,
        kld=divergence.mean if divergence else None,
        kld_p99=divergence.p99 if divergence else None,
        top1=divergence.top1 if divergence else None,
        weights_key=weights_key,
        seconds=result.seconds,
    )
    return result.ppl
