"""`qf worker`, `qf beat`, `qf reconcile`: the fleet's processes. Registered on the `qf` app (factory/cli/)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from factory import settings
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
    from workers.tasks import reconcile as reconcile_pass

    for job_id in reconcile_pass():
        print(job_id)


@app.command()
def beat() -> None:
    """Start Celery beat: the periodic reconciler and watchlist check (a second beat is harmless: the check takes
    a lock, and submissions collapse into existing jobs). Its schedule file lives in FACTORY_HOME."""
    import os

    home = settings.load().home
    home.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "workers.app",
        "beat",
        "--loglevel",
        "INFO",
        "--schedule",
        str(home / "celerybeat-schedule"),
    ]
    os.execvp(sys.executable, argv)


@app.command()
@handled
def worker(
    gpu: Annotated[int | None, typer.Option("--gpu", min=0, help="The GPU it owns (CUDA_VISIBLE_DEVICES).")] = None,
    queues: Annotated[str, typer.Option("--queues", help="Queues to take jobs from.")] = "gpu,cpu",
    max_units: UnitsOpt = None,
    slots: Annotated[
        int,
        typer.Option(
            "--slots",
            min=1,
            help="Jobs run at once on this worker's GPU, each packing its units into its share of the card.",
        ),
    ] = 1,
) -> None:
    """Start a Celery worker with the factory's settings: one job at a time (per slot), acknowledged when done. A
    catalog or broker that cannot be reached is exit 5 before it takes any message."""
    import os

    from workers.tasks import check_broker

    open_catalog()
    check_broker()
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    if max_units is not None:
        env["FACTORY_MAX_UNITS"] = str(max_units)  # read by the job processes it spawns (factory/settings.py)
    env["FACTORY_GPU_SLOTS"] = str(slots)
    node = f"qf-{'gpu' + str(gpu) if gpu is not None else 'worker'}"

    def celery(name: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "workers.app",
            "worker",
            "-Q",
            queues,
            "--pool",
            "solo",
            "--concurrency",
            "1",
            "--prefetch-multiplier",
            "1",
            "-n",
            f"{name}@%h",
            "--loglevel",
            "INFO",
        ]

    if slots == 1:
        os.execvpe(sys.executable, celery(node), env)
    from workers.slots import supervise

    sys.exit(supervise([celery(f"{node}-{i}") for i in range(1, slots + 1)], env))
