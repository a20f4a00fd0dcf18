"""The Celery implementation of factory/fleet.py's Queue, which `qf` and the service load through the
`quantfactory.queue` entry point (pyproject.toml): the tasks of workers/tasks.py, and the Celery command lines of
`qf worker` and `qf beat`."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

from factory.catalog import Catalog, Job
from factory.factory import Factory
from factory.jobs.planning import Request
from workers import tasks

CELERY = (sys.executable, "-m", "celery", "-A", "workers.app")  # this interpreter's celery, on our app


class CeleryQueue:
    def check_broker(self) -> None:
        tasks.check_broker()

    def submit(self, factory: Factory, request: Request) -> Job:
        return tasks.submit(factory, request)

    def retry(self, factory: Factory, job_id: str) -> Job:
        return tasks.retry(factory, job_id)

    def follow(self, catalog: Catalog, broker_url: str, job_id: str) -> Iterator[dict | None]:
        return tasks.follow(catalog, broker_url, job_id)

    def watch_check(self, dry_run: bool) -> dict:
        return tasks.watch_check(dry_run=dry_run)

    def reconcile(self) -> list[str]:
        return tasks.reconcile()

    def worker_command(self, node: str, queues: str) -> list[str]:
        """One job at a time, acknowledged when done (workers/app.py); the solo pool: the job runs in a spawned
        process of its own (workers/tasks.py)."""
        return [
            *CELERY,
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
            f"{node}@%h",
            "--loglevel",
            "INFO",
        ]

    def beat_command(self, schedule: Path) -> list[str]:
        return [
            *CELERY,
            "beat",
            "--loglevel",
            "INFO",
            "--schedule",
            str(schedule),
        ]


QUEUE = CeleryQueue()
