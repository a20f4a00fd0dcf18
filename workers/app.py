"""The Celery app, configured for multi-hour GPU jobs.

- acks_late + prefetch 1 + concurrency 1: a job is acknowledged only when it is done and a worker holds one job
  at a time; a worker that dies is noticed through its lease in the catalog (workers/tasks.py), not the broker;
- the Redis visibility timeout (broker and result backend) is longer than the longest job
  (FACTORY_VISIBILITY_TIMEOUT seconds, default 12 hours), so a slow job is not handed to a second worker;
- queues: a job's units up to its quality gate go to the queue of the device it was planned for (`gpu` for CUDA,
  `cpu` for the CPU: settings.DEVICE_QUEUES; FACTORY_WORKER_DEVICE says how a submission picks the device,
  workers/tasks.py `job_device`), and so does the help with its conversions; publishing, the reconciler and the
  watchlist check go to `cpu`. A worker takes the queues it is started with (`qf worker --queues`) and says so
  in Redis every few seconds (settings.WORKERS_KEY), so that `qf status` can tell why a job waits.
The worker's own process only takes messages and holds leases (solo pool); each job runs in a fresh process forked
from a server that only imported torch, transformers and the factory (multiprocessing's forkserver, workers/tasks.py),
and its engines in their own children: nothing that may hold CUDA is ever forked, and a job's GPU memory, or its
crash, ends with its process.
"""

from __future__ import annotations

from celery import Celery

from factory import settings

_settings = settings.load()
app = Celery("quantfactory", broker=_settings.broker_url, backend=_settings.broker_url, include=["workers.tasks"])
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    worker_concurrency=1,
    task_track_started=True,
    task_default_queue="cpu",  # run_job and help_job name their job's queue when they are sent (tasks.enqueue)
    task_routes={
        "quantfactory.publish_job": {"queue": "cpu"},
        "quantfactory.reconcile": {"queue": "cpu"},
        "quantfactory.check_watchlist": {"queue": "cpu"},
    },
    broker_transport_options={"visibility_timeout": _settings.visibility_timeout},
    result_backend_transport_options={"visibility_timeout": _settings.visibility_timeout},
    broker_connection_retry_on_startup=True,
    result_expires=7 * 24 * 3600,
    beat_schedule={
        "reconcile": {"task": "quantfactory.reconcile", "schedule": _settings.reconcile_seconds},
        "check-watchlist": {"task": "quantfactory.check_watchlist", "schedule": _settings.watch_seconds},
    },
)
