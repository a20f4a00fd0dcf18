"""`qf run` (a job in this process) and `qf submit` (a job for the workers, or the service)."""

from __future__ import annotations

import time

from factory import identity, queue, settings, tables
from factory.checkpoints.sources import check_base_model
from factory.cli.render import Renderer
from factory.cli.shared import (
    BaseOpt,
    CalibrationOpt,
    CtxOpt,
    EvalOpt,
    FitOpt,
    JsonOpt,
    KvOpt,
    NameOpt,
    RecipeOpt,
    SourceArg,
    UnitsOpt,
    WindowsOpt,
    app,
    err,
    handled,
    make_factory,
    out,
    quiet_libraries,
    request_from,
    service_client,
    with_engine_flags,
)
from factory.errors import JobFailed, SpecError
from factory.publish import hub


@app.command()
@handled
@with_engine_flags
def run(
    source: SourceArg,
    flags: dict,
    recipe: RecipeOpt = None,
    calibration: CalibrationOpt = None,
    eval_set: EvalOpt = None,
    eval_windows: WindowsOpt = None,
    name: NameOpt = None,
    base_model: BaseOpt = None,
    fit: FitOpt = None,
    ctx: CtxOpt = None,
    kv_cache: KvOpt = "fp16",
    max_units: UnitsOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Quantize, evaluate and publish SOURCE in this process: inspect, quantize, evaluate, gate, publish (units
    that do not wait for each other at once, where they fit)."""
    request = request_from(
        source,
        flags,
        recipe,
        calibration,
        eval_set,
        eval_windows,
        name,
        base_model,
        fit=fit,
        ctx=ctx,
        kv_cache=kv_cache,
    )
    if owner := settings.load().hub_owner:
        hub.writer(owner)  # a missing or read-only token fails now, not after hours of quantizing
    quiet_libraries()
    with Renderer(as_json) as render:
        factory = make_factory(render, max_units)
        job, created = factory.submit(request)
        job = _run_held(factory, job)
    if not as_json:
        rows = [
            factory.catalog.quants.job_row(q, job.id) for q in factory.catalog.quants.live(job_id=job.id)
        ]  # its scores
        out.print(tables.quants(rows, out.width, title=f"job {job.id} {job.state}", shows="qf ls --wide"))


def _run_held(factory, job):
    """`qf run` holds the job as a worker does (a fenced lease, renewed while it makes progress): a job that another
    `qf run` or a worker holds is not run twice; one whose holder is gone is taken over where it stopped."""
    from factory.catalog import JobState
    from factory.jobs import heartbeat

    if job.state in (JobState.succeeded, JobState.cancelled):
        return factory.execute(job.id)  # nothing to run: its result
    config = factory.settings
    holder = factory.catalog.leases.holder(job.id)
    lease = factory.catalog.leases.take(
        job.id, identity.holder_name(), config.lease_seconds, gone=holder if identity.gone(holder) else None
    )
    if lease is None:
        who = heartbeat.describe_holder(factory.catalog.leases.holder(job.id))
        raise JobFailed(f"job {job.id} is running on {who}; `qf status {job.id} --follow` follows it")
    last = [time.monotonic()]
    render = factory.emit

    def emit(event: dict) -> None:
        last[0] = time.monotonic()
        render(event)

    def alive() -> str | None:
        if time.monotonic() - last[0] > config.stall_seconds:
            return f"no progress for {config.stall_seconds:g} s (FACTORY_STALL_SECONDS); giving up its lease"
        return None

    factory.emit = emit
    try:
        with heartbeat.held(factory.catalog, lease, config.lease_seconds, alive):
            return factory.execute(job.id, lease=lease)
    finally:
        factory.catalog.leases.release(lease)  # fenced: a no-op once another holder has the job


@app.command()
@handled
@with_engine_flags
def submit(
    source: SourceArg,
    flags: dict,
    recipe: RecipeOpt = None,
    calibration: CalibrationOpt = None,
    eval_set: EvalOpt = None,
    eval_windows: WindowsOpt = None,
    name: NameOpt = None,
    base_model: BaseOpt = None,
    fit: FitOpt = None,
    ctx: CtxOpt = None,
    kv_cache: KvOpt = "fp16",
) -> None:
    """Queue a job for the workers; prints only its id (the same job twice: the same id)."""
    if (remote := service_client()) is not None:
        if base_model is not None:
            check_base_model(base_model)  # as submission.request does here, and the service there
        if recipe is not None and not recipe.is_file():
            raise SpecError(f"recipe {str(recipe)!r} does not exist; pass a YAML file such as configs/standard.yaml")
        answer = remote.submit(
            {
                "source": source,
                "flags": flags,
                "recipe": recipe.read_text(encoding="utf-8") if recipe else None,
                "calibration": calibration,
                "eval": eval_set,
                "eval_windows": eval_windows,
                "name": name,
                "base_model": base_model,
                "fit": fit,
                "ctx": ctx,
                "kv_cache": kv_cache,
            }
        )
        for line in answer["notes"]:
            err.print(line, markup=False, highlight=False)
        print(answer["id"])
        guess = answer["estimate"] and (answer["estimate"]["packed"], answer["estimate"]["alone"])
    else:
        factory = make_factory(_print_note)
        job = queue.get().submit(
            factory,
            request_from(
                source,
                flags,
                recipe,
                calibration,
                eval_set,
                eval_windows,
                name,
                base_model,
                device=factory.settings.worker_device,
                fit=fit,
                ctx=ctx,
                kv_cache=kv_cache,
            ),
        )
        print(job.id)
        guess = factory.estimate(job)
    if guess:
        packed, alone = guess
        err.print(
            f"expected to take about {tables.duration(packed)} on a worker (units packed; "
            f"{tables.duration(alone)} one after another)",
            markup=False,
            highlight=False,
        )


def _print_note(event: dict) -> None:
    """What `qf submit` says besides the job id: the notes of planning it (a quant `qf rm` removed is made again)."""
    if event["event"] == "note":
        err.print(event["message"], markup=False, highlight=False)
