"""`qf worker`, `qf beat`, `qf reconcile`: the fleet's processes. Registered on the `qf` app (factory/cli/)."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from factory import fleet, settings
from factory.cli import slots as sharing
from factory.cli.shared import (
    UnitsOpt,
    app,
    handled,
    open_catalog,
)


@app.command()
@handled
def reconcile() -> None:
    """One reconciler pass (beat runs it periodically): re-enqueue jobs of lost workers and lost messages."""
    for job_id in fleet.get().reconcile():
        print(job_id)


@app.command()
@handled
def beat() -> None:
    """Start Celery beat: the periodic reconciler and watchlist check (a second beat is harmless: the check takes
    a lock, and submissions collapse into existing jobs). Its schedule file lives in FACTORY_HOME."""
    home = settings.load().home
    home.mkdir(parents=True, exist_ok=True)
    argv = fleet.get().beat_command(home / "celerybeat-schedule")
    os.execvp(sys.executable, argv)


@app.command()
@handled
def worker(
    gpu: Annotated[int | None, typer.Option("--gpu", min=0, help="The GPU it owns (CUDA_VISIBLE_DEVICES).")] = None,
    queues: Annotated[str, typer.Option("--queues", help="Queues to take jobs from.")] = "gpu,cpu",
    max_units: UnitsOpt = None,
    slots: Annotated[
        str,
        typer.Option(
            "--slots",
            help="Jobs run at once on this worker's GPU, their units packed together into the card by what each is "
            "predicted to need: a number, or auto (a job for every 4 cores, at most 4).",
        ),
    ] = "auto",
) -> None:
    """Start a Celery worker with the factory's settings: one job at a time (per slot), acknowledged when done. A
    catalog or broker that cannot be reached is exit 5 before it takes any message; --slots that is neither a
    positive number nor auto is exit 2."""
    count = sharing.count(slots, os.cpu_count() or 1)
    queue = fleet.get()
    open_catalog()
    queue.check_broker()
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    if max_units is not None:
        env["FACTORY_MAX_UNITS"] = str(max_units)  # read by the job processes it spawns (factory/settings.py)
    node = f"qf-{'gpu' + str(gpu) if gpu is not None else 'worker'}"
    if count == 1:
        os.execvpe(sys.executable, queue.worker_command(node, queues), env)
    env["FACTORY_GPU_LEDGER"] = str(sharing.ledger_path(env.get("CUDA_VISIBLE_DEVICES")))  # the slots share it
    commands = [queue.worker_command(f"{node}-{i}", queues) for i in range(1, count + 1)]
    sys.exit(sharing.supervise(commands, env))
