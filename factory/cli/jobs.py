"""`qf jobs`, `qf status`, `qf cancel`, `qf retry`: jobs, locally or through the service."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from factory import fleet, settings, tables
from factory.cli.render import Renderer
from factory.cli.shared import (
    JsonOpt,
    app,
    err,
    handled,
    job_rows,
    latest,
    make_factory,
    open_catalog,
    out,
    service_client,
)
from factory.errors import JobFailed, NotFound, SpecError


@app.command()
@handled
def jobs(
    as_json: JsonOpt = False,
    limit: Annotated[int, typer.Option("--limit", min=1)] = 20,
) -> None:
    """Recent jobs with their state and step timings."""
    rows = job_rows(limit=limit)
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        out.print(tables.jobs(rows, out.width))


# `qf status JOB` of a job that ended so (errors.py); with --json 0, as its `state` says it to the scripts that read it
STATUS_EXIT = {"failed": JobFailed.exit_code, "cancelled": 6}


@app.command()
@handled
def status(
    job_id: Annotated[str | None, typer.Argument(metavar="JOB")] = None,
    as_json: JsonOpt = False,
    follow: Annotated[
        bool, typer.Option("--follow", metavar="", help="Show the job's progress live until it ends.")
    ] = False,
) -> None:
    """A job's state and steps; without JOB, the recent jobs. With JOB it exits 1 when the job failed and 6 when
    it was cancelled (0 while it is queued or running, when it succeeded, and with --json, whose `state` says)."""
    if follow and job_id is None:
        raise SpecError("--follow needs a JOB to follow; `qf status` lists the recent ones")
    if follow and job_id is not None:
        _follow(job_id, as_json)
    rows = job_rows(job_id=job_id) if job_id else job_rows(limit=20)
    if job_id is not None and not rows:
        raise NotFound(f"no job {job_id!r}; `qf status` lists the recent ones")
    if as_json and not follow:
        print(json.dumps(rows if job_id is None else rows[0], indent=2))
    elif job_id is None:
        out.print(tables.jobs(rows, out.width))
    elif not as_json:  # with --follow --json, the events were the output
        _print_job(rows[0])
    if job_id is not None and not as_json and rows[0]["state"] in STATUS_EXIT:
        raise typer.Exit(STATUS_EXIT[rows[0]["state"]])


def _print_job(row: dict) -> None:
    """One job as `qf status JOB` prints it: its steps, why it waits, when it should end, its holder, its error."""
    out.print(tables.steps(latest([row])[0], out.width))
    if row.get("waiting"):
        out.print(f"queued: {row['waiting']}", markup=False, highlight=False)
    if row.get("eta_seconds") is not None:
        left = row["eta_seconds"]
        when = (
            f"about {tables.duration(left)} from now" if left >= 0 else f"{tables.duration(-left)} later than expected"
        )
        out.print(
            f"expected to end at {row['expected_end'].replace('T', ' ')} UTC ({when})", markup=False, highlight=False
        )
    if row["holder"]:
        from factory.jobs.heartbeat import describe_holder

        out.print(
            f"held by {describe_holder(row['holder'])} (attempt {row['attempts']})", markup=False, highlight=False
        )
    if row["error"]:
        out.print(f"error: {row['error']}", markup=False, highlight=False)


def _follow(job_id: str, as_json: bool) -> None:
    """Render the job's events as its worker publishes them (or the service relays them), until a result event
    or a terminal state."""
    if (remote := service_client()) is not None:
        events = remote.events(job_id)
    else:
        events = fleet.get().follow(open_catalog(), settings.load().broker_url, job_id)
    with Renderer(as_json) as render:
        for event in events:
            if event is not None:
                render(event)


@app.command()
@handled
def cancel(job_id: Annotated[str, typer.Argument(metavar="JOB")]) -> None:
    """Cancel a queued or running job: its engine gets SIGTERM, its work folder goes, nothing is published. Through
    a service, a job that other users submitted too goes on for them (your interest in it is withdrawn)."""
    if (remote := service_client()) is not None:
        job = remote.cancel(job_id)
        if job.get("others") and job["state"] != "cancelled":
            err.print(
                f"job {job['id']}: withdrawn; it goes on ({job['state']}) for {job['others']} other user(s) who "
                "submitted it too"
            )
        else:
            err.print(f"job {job['id']}: {job['state']}")
        return
    job = open_catalog().jobs.cancel(job_id)
    if job is None:
        raise NotFound(f"no job {job_id!r}; `qf status` lists the recent ones")
    err.print(f"job {job.id}: {job.state}")


@app.command()
@handled
def retry(job_id: Annotated[str, typer.Argument(metavar="JOB")]) -> None:
    """Queue a failed or cancelled job again; finished steps are kept."""
    if (remote := service_client()) is not None:
        print(remote.retry(job_id)["id"])
        return
    print(fleet.get().retry(make_factory(), job_id).id)
