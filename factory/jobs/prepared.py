"""What every unit of a job works from, and how a job comes to it: the fetch, dequantize and inspect steps
(`prepare`), and `read`, which a helping worker also uses (into a folder of its own). Sources are read through a
staging folder of their allowlisted files (factory/checkpoints/files.py); `check_staged` says whether it still holds
what was submitted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import calibration
from factory import engines, events, identity
from factory.catalog import Job
from factory.checkpoints import dequantize, files, sources
from factory.checkpoints.inspect import inspect
from factory.engines import QuantSpec
from factory.errors import ModelRefused, SpecError
from factory.evaluation import evaluate, layered
from factory.jobs.context import Run
from factory.jobs.costs import Sized
from factory.publish import upstream
from factory.vram import Params, Shape


@dataclass
class Prepared:
    """What the inspect step learns, kept in memory for the later units of this attempt (`read`)."""

    folder: Path  # the staging folder: links to the source's allowlisted files
    specs: list[QuantSpec]
    calibration: dict[str, list[list[int]]]  # tag -> token windows, for engines that take tokens
    calibration_file: Path  # the calibration text as parquet, for engines that tokenize it themselves
    stream: evaluate.Stream
    upstream: upstream.Upstream  # what the card says about the base model
    model: Sized


def prepare(run: Run, job: Job) -> Prepared:
    """The job's fetch (a Hub source), dequantize (FP8 or MXFP4) and inspect steps; inspect records the resolved
    specs. A later pass of the job (its publishing step, a retry) reads them again without recording them again."""
    fetched, done = None, run.catalog.done_steps(job.id)  # done: read again quietly (Run.step_once)
    if identity.is_hub(job.source_identity):  # the Hub commit, downloaded and checked once
        with run.step_once(job.id, "fetch", done) as progress:
            fetched = sources.fetch_hub(job.source_identity, run.settings.cache, progress)
    if dequantize.wanted(fetched or Path(job.source)):  # FP8 or MXFP4: every unit reads its BF16 copy
        with run.step_once(job.id, "dequantize", done) as progress:
            fetched = _bf16(run, job, fetched or _local_folder(run, job), progress)
    with run.step_once(job.id, "inspect", done):
        prepared = read(run, job, fetched, run.settings.work / job.id)
        run.catalog.set_job_specs(
            job.id, [s.model_dump() for s in prepared.specs], run.token, parameters=prepared.model.parameters
        )
    for s in prepared.specs:
        if (
            s.tag in prepared.calibration and "inspect" not in done
        ):  # what the engine takes of the text, said before it runs for minutes
            used = engines.get(s.method).describe_calibration(s.model_dump(), job.calibration)
            run.note(
                f"{s.tag}: calibration {used}; eval {job.eval} "
                f"{job.eval_windows} x {prepared.stream.window_length} tokens on {job.device}"
            )
    return prepared


def read(run: Run, job: Job, fetched: Path | None, where: Path) -> Prepared:
    """Check the source, stage it under `where`, resolve the specs against it and read the calibration and
    eval texts' token ids (tokenized once, then from cache/tokens/): what every unit works from. Writes nothing
    to the catalog (a helping worker reads a job this way, into a folder of its own: staging replaces the files
    the job's own units read)."""
    source_folder = _bf16(run, job, fetched or _local_folder(run, job))
    specs = engines.specs_from_dicts(job.specs)
    info = inspect(source_folder, engines.architectures())
    folder = files.stage(source_folder, where / "source")
    check_staged(run, job, source_folder, folder, "since the job was submitted", "submit it again")
    specs = [engines.resolve(spec, info, job.device) for spec in specs]
    cal = _text(job.calibration, job.calibration_sha)
    cal_ids = _tokens(run, job, folder, cal)
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
    eval_ids = _tokens(
        run,
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


def check_staged(run: Run, job: Job, source_folder: Path, staged: Path, since: str, then: str) -> None:
    """What the job reads, its staging of a local folder, is what was submitted (a Hub commit was checked by its
    fetch; the BF16 copy of an FP8 or MXFP4 source is what the staging must hold): ModelRefused says that the
    source changed `since`, and `then` what to do."""
    expected = job.source_identity
    if (copy := dequantize.made(run.settings.home, job.source_identity)) is not None:
        source_folder, expected = copy, identity.folder_identity(copy, run.settings.cache)
    elif identity.is_hub(job.source_identity):
        return
    try:
        same, why = identity.folder_identity(source_folder, run.settings.cache, staged) == expected, ""
    except ModelRefused as e:  # a file became a link out of the folder, a FIFO, ...
        same, why = False, f" ({e.message})"
    if not same:
        raise ModelRefused(f"source folder {job.source!r} changed {since}{why}; {then}")


def _local_folder(run: Run, job: Job) -> Path:
    folder = Path(job.source)
    if not folder.is_dir():
        raise ModelRefused(f"source folder {job.source!r} is gone")
    if identity.folder_identity(folder, run.settings.cache) != job.source_identity:
        raise ModelRefused(f"source folder {job.source!r} changed since the job was submitted; submit it again")
    return folder


def _bf16(run: Run, job: Job, folder: Path, progress: Callable[..., None] = lambda **_: None) -> Path:
    """The folder the units read: the source, or its BF16 copy when it is FP8 or MXFP4
    (factory/checkpoints/dequantize.py), made once per source (checked by inspection first) and then reused, by this
    job's next attempt, its helpers and later jobs of the same source."""
    if not dequantize.wanted(folder):
        return folder
    inspect(folder, engines.architectures())
    copy, made = dequantize.bf16(folder, job.source_identity, run.settings.home, progress)
    if not made:
        run.emit(events.note(f"dequantize: the BF16 copy of this source made earlier is reused ({copy})"))
    return copy


def _tokens(run: Run, job: Job, folder: Path, text: calibration.TextSet, first: int | None = None) -> list[int]:
    """The text's ids (calibration windows are drawn from all of it), or its `first` ids (the eval's windows)."""
    key = identity.tokens_key(job.source_identity, text.sha256, evaluate.tokenizer_version())
    name = f"{key}.npy" if first is None else f"{key}-first{first}.npy"
    return evaluate.cached_tokens(folder, text.text, run.settings.cache / "tokens" / name, first)


def _text(name: str, sha256: str) -> calibration.TextSet:
    text = calibration.resolve(name)
    if text.sha256 != sha256:
        raise SpecError(f"text set {name!r} changed since the job was submitted; submit it again")
    return text
