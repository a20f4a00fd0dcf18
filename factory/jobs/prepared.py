"""What every unit of a job works from, and how a job comes to it: the fetch, dequantize and inspect steps
(`prepare`), and `read`, which a helping worker also uses (into a folder of its own). Every unit reads the job's
staging folder of the source's allowlisted files (factory/checkpoints/files.py): for a local folder, a snapshot the
job copies and hashes in one pass, whose hash must be the identity the job was submitted with (SourceChanged, exit 3,
otherwise); for a verified Hub download or a BF16 copy, both in FACTORY_HOME, links to it. `check_unchanged` says,
before a publish, whether the staging still holds what the job verified."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import calibration
from factory import engines, events, identity
from factory.catalog import Job
from factory.checkpoints import dequantize, files, inspection, snapshots, sources
from factory.checkpoints.inspection import inspect, inspected
from factory.engines import QuantSpec
from factory.errors import JobFailed, ModelRefused, SourceChanged, SpecError
from factory.evaluation import evaluate, layered
from factory.jobs.context import Run
from factory.jobs.costs import Sized
from factory.publish import upstream
from factory.vram import Params, Shape


def _quiet(**_: object) -> None:
    pass


@dataclass
class Prepared:
    """What the inspect step learns, kept in memory for the later units of this attempt (`read`)."""

    folder: Path  # the staging folder: the job's snapshot of a local folder, or links into FACTORY_HOME
    specs: list[QuantSpec]
    calibration: dict[str, list[list[int]]]  # tag -> token windows, for engines that take tokens
    calibration_file: Path  # the calibration text as parquet, for engines that tokenize it themselves
    stream: evaluate.Stream
    upstream: upstream.Upstream  # what the card says about the base model
    model: Sized
    stamps: dict[str, tuple[int, int, int]] | None  # a snapshot's files as verified (files.stamps); None: links


def prepare(run: Run, job: Job) -> Prepared:
    """The job's fetch (a Hub source), dequantize (FP8 or MXFP4) and inspect steps; inspect records the resolved
    specs. A later pass of the job (its publishing step, a retry) reads them again without recording them again."""
    fetched, where = None, run.settings.work / job.id
    done = run.catalog.steps.done(job.id)  # done: read again quietly (Run.step_once)
    if identity.is_hub(job.source_identity):  # the Hub commit, downloaded and checked once
        with run.step_once(job.id, "fetch", done) as progress:
            fetched = sources.fetch_hub(job.source_identity, run.settings.cache, progress)
    if dequantize.wanted(fetched or Path(job.source)):  # FP8 or MXFP4: every unit reads its BF16 copy
        with run.step_once(job.id, "dequantize", done) as progress:
            fetched = _bf16(run, job, fetched or _local(run, job, where, progress), progress)
    with run.step_once(job.id, "inspect", done) as progress:
        prepared = read(run, job, fetched, where, progress)
        run.catalog.jobs.set_specs(job.id, prepared.specs, run.token, parameters=prepared.model.parameters)
    for s in prepared.specs:
        if (
            s.tag in prepared.calibration and "inspect" not in done
        ):  # what the engine takes of the text, said before it runs for minutes
            used = engines.get(s.method).describe_calibration(s, job.calibration)
            run.note(
                f"{s.tag}: calibration {used}; eval {job.eval} "
                f"{job.eval_windows} x {prepared.stream.window_length} tokens on {job.device}"
            )
    return prepared


def read(run: Run, job: Job, fetched: Path | None, where: Path, progress: Callable[..., None] = _quiet) -> Prepared:
    """Check the source, stage it under `where` (a local folder: snapshot and verified there), resolve the specs
    against it and read the calibration and eval texts' token ids (tokenized once, then from cache/tokens/): what
    every unit works from. Writes nothing to the catalog (a helping worker reads a job this way, into a folder of its
    own: staging replaces the files the job's own units read)."""
    folder = where / "source"
    source_folder = _bf16(run, job, fetched or _local(run, job, where, progress))
    stamps = files.stamps(folder) if source_folder == folder else None
    if stamps is not None:  # the snapshot, hashed to the job's identity: what submit inspected, read back
        info = inspected(folder, engines.architectures(), job.source_identity, run.settings.cache)
    else:  # a Hub download (not fetched at submit) or a BF16 copy (other bytes than the source's)
        info = inspect(source_folder, engines.architectures())
    if stamps is None:
        files.stage(source_folder, folder)
        _check_links(run, job, folder, "since the job was submitted", "submit it again")
    specs = [engines.resolve(spec, info, job.device) for spec in job.specs]
    cal = _text(job.calibration, job.calibration_sha)
    cal_ids = _tokens(run, job, folder, cal)
    calibration.check_vocabulary(cal_ids, info.config["vocab_size"], job.calibration)
    specs = [engines.get(s.method).fit_calibration(s, len(cal_ids), job.device) for s in specs]
    config, tensors = sources.layout(str(source_folder))
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
    calibration.check_vocabulary(eval_ids, info.config["vocab_size"], job.eval)
    stream = evaluate.stream(eval_ids, job.eval_windows, info.max_positions, job.eval)
    card_from = Path(job.source) if stamps is not None else source_folder  # a snapshot holds no README
    up = upstream.read(job.base_model, files.upstream_card(card_from), folder)
    return Prepared(
        folder=folder,
        specs=specs,
        calibration=windows,
        calibration_file=cal_file,
        stream=stream,
        upstream=up,
        model=Sized(shape, params, stream.window_length, layered.walkable(config)),
        stamps=stamps,
    )


def check_unchanged(run: Run, job: Job, prepared: Prepared) -> None:
    """Before a publish: the staging folder still holds what the job verified (a snapshot's files are the same files,
    which only the factory writes; links still lead to what they led to), else nothing is published."""
    if prepared.stamps is None:
        _check_links(run, job, prepared.folder, "since it was inspected", "nothing was published")
    elif files.stamps(prepared.folder) != prepared.stamps:
        raise JobFailed(
            f"the job's snapshot of {job.source!r} ({prepared.folder}) changed since it was inspected; nothing was "
            "published"
        )


def _check_links(run: Run, job: Job, staged: Path, since: str, then: str) -> None:
    """The staging folder's links lead to the BF16 copy of the source (a Hub commit was checked by its fetch):
    ModelRefused says that it changed `since`, and `then` what to do."""
    if (copy := dequantize.made(run.settings.home, job.source_identity)) is None:
        return
    expected = sources.folder_identity(copy, run.settings.cache)
    try:
        same, why = sources.folder_identity(copy, run.settings.cache, staged) == expected, ""
    except ModelRefused as e:  # a file became a link out of the folder, a FIFO, ...
        same, why = False, f" ({e.message})"
    if not same:
        raise ModelRefused(f"the BF16 copy of {job.source!r} changed {since}{why}; {then}")


def _local(run: Run, job: Job, where: Path, progress: Callable[..., None]) -> Path:
    """A local source as the job reads it: the BF16 copy made from it earlier (from bytes a job verified), else
    `where`/source, links to the snapshot of the folder that every job of it shares (factory/checkpoints/snapshots.py;
    made now if no job made it), whose hash must be the identity the job was submitted with (the hash cache that
    identity came from is a hint: SourceChanged names the files it was wrong about, and forgets them)."""
    if (copy := dequantize.made(run.settings.home, job.source_identity)) is not None:
        _reused_copy(run, copy)
        return copy
    folder = Path(job.source)
    if not folder.is_dir():
        raise ModelRefused(f"source folder {job.source!r} is gone")

    def verify(hashes: dict[str, str]) -> None:
        if identity.of_files(hashes) != job.source_identity:
            inspection.forget(job.source_identity, run.settings.cache)  # what submit recorded describes these bytes
            raise SourceChanged(
                job.source, sources.forget_changed(folder, run.settings.cache, hashes), "submit it again"
            )

    dest = where / "source"
    try:
        made = snapshots.staged(run.settings.home, folder, job.source_identity, dest, verify, progress)
    except SourceChanged:
        raise
    except ModelRefused as e:  # a file became a link out of the folder, a FIFO, ...
        raise ModelRefused(f"source folder {job.source!r} changed since the job was submitted ({e.message})") from None
    if not made:
        shared = snapshots.folder(run.settings.home, job.source_identity)
        run.emit(events.note(f"inspect: the snapshot of this source an earlier job made is reused ({shared})"))
    return dest


def _bf16(run: Run, job: Job, folder: Path, progress: Callable[..., None] = _quiet) -> Path:
    """The folder the units read: the source, or its BF16 copy when it is FP8 or MXFP4
    (factory/checkpoints/dequantize.py), made once per source (checked by inspection first) and then reused, by this
    job's next attempt, its helpers and later jobs of the same source."""
    if not dequantize.wanted(folder):
        return folder
    inspect(folder, engines.architectures())
    copy, made = dequantize.bf16(folder, job.source_identity, run.settings.home, progress)
    if not made:
        _reused_copy(run, copy)
    return copy


def _reused_copy(run: Run, copy: Path) -> None:
    run.emit(events.note(f"dequantize: the BF16 copy of this source made earlier is reused ({copy})"))


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
