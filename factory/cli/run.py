"""`qf run` (a job in this process) and `qf submit` (a job for the workers, or the service)."""

from __future__ import annotations

import time

from factory import fleet, identity, settings, tables
from factory.cli.render import Renderer
from factory.cli.shared import (
    JsonOpt,
    UnitsOpt,
    app,
    err,
    handled,
    make_factory,
    open_catalog,
    out,
    quiet_libraries,
    say,
    service_client,
    with_submission_options,
)
from factory.errors import JobFailed
from factory.publish import hub
from factory.submission import Options


@app.command()
@handled
@with_submission_options
def run(options: Options, max_units: UnitsOpt = None, as_json: JsonOpt = False) -> None:
    """Quantize, evaluate and publish SOURCE in this process: inspect, quantize, evaluate, gate, publish (units
    that do not wait for each other at once, where they fit)."""
    request = options.request(say=say, catalog=open_catalog)  # the catalog: where --fit asks the ranking
    if owner := settings.load().hub_owner:
        hub.writer(owner)  # a missing or read-only token fails now, not after hours of quantizing
    quiet_libraries()
    with Renderer(as_json) as render:
        factory = make_factory(render, max_units)
        job, created = factory.submit(request)
        job = _run_held(factory, job)
    if not as_json:
        quants = factory.catalog.quants
        rows = [quants.job_row(q, job.id) for q in quants.live(job_id=job.id)]  # its scores, as the job measured
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
    gone = holder if identity.gone(holder) else None
    last = [time.monotonic()]
    render = factory.emit

    def emit(event: dict) -> None:
        last[0] = time.monotonic()
        render(event)

    def alive() -> str | None:
        if time.monotonic() - last[0] > config.stall_seconds:
            return f"no progress for {config.stall_seconds:g} s (FACTORY_STALL_SECONDS); giving up its lease"
        return None

    with heartbeat.leased(factory.catalog, job.id, config.lease_seconds, gone) as lease:
        if lease is None:
            who = heartbeat.describe_holder(factory.catalog.leases.holder(job.id))
            raise JobFailed(f"job {job.id} is running on {who}; `qf status {job.id} --follow` follows it")
        factory.emit = emit
        with heartbeat.held(factory.catalog, lease, config.lease_seconds, alive):
            return factory.execute(job.id, lease=lease)


@app.command()
@handled
@with_submission_options
def submit(options: Options) -> None:
    """Queue a job for the workers; prints only its id (the same job twice: the same id)."""
    if (remote := service_client()) is not None:
        answer = remote.submit(options.model_dump(mode="json"))
        for line in answer["notes"]:
            err.print(line, markup=False, highlight=False)
        print(answer["id"])
        guess = answer["estimate"] and (answer["estimate"]["packed"], answer["estimate"]["alone"])
    else:
        factory = make_factory(_print_note)
        job = fleet.get().submit(factory, options.request(factory.settings.worker_device, say, lambda: factory.catalog))
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
