"""Tasks are thin: they take a job id, re-read the job from the catalog and run the steps not done yet.

A job runs on the gpu queue up to its quality gate (`run_job`), then a task on the cpu queue publishes it
(`publish_job`); both go through `Factory.execute`, which reuses every finished step. Crash recovery does not wait
for the broker: a running job holds a lease in the catalog that a heartbeat thread renews; `reconcile` (beat,
every FACTORY_RECONCILE_SECONDS) puts jobs whose lease expired back on the queue, and queued jobs the broker lost.
A job taken more than FACTORY_MAX_ATTEMPTS times fails as lost, so a job that kills its workers does not loop
forever. Redis' visibility timeout stays a backstop: a redelivered message of a job that finished or is held by
another worker does nothing. `enqueue` is the one place that hands a job to the broker.

`check_watchlist` (beat, every FACTORY_WATCH_SECONDS) asks the Hub about the watchlist, plans with
factory/schedule.py and submits like `qf submit`; one check at a time (a Redis lock), so two beats still make
one job, and a release already planned is a row in the catalog's `upstream` table.
"""

from __future__ import annotations

import ast
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
from contextlib import contextmanager

import redis
from celery.signals import worker_ready
from kombu.exceptions import OperationalError

from factory import engines, schedule, settings
from factory.catalog import TERMINAL, Catalog, Job, JobState
from factory.engines import child
from factory.errors import FactoryError, ServiceUnavailable, mask_url
from factory.pipeline import Factory, Request
from factory.recipes import recipe_from_dict
from workers.app import app

QUEUE = "gpu"
QUEUES = ("gpu", "cpu")
_SPAWN = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
log = logging.getLogger("quantfactory")
WATCH_LOCK = "quantfactory:watch-lock"
EVENTS = "quantfactory:events:"  # + job id: the pipeline's events, published for `qf status --follow`


@app.task(name="quantfactory.run_job", ignore_result=True)  # outcomes live in the catalog
def run_job(job_id: str) -> None:
    """gpu queue: everything up to the quality gate, then the publishing step goes to the cpu queue."""
    if _run(job_id, publish=False):
        publish_job.apply_async(args=[job_id], queue="cpu")


@app.task(name="quantfactory.publish_job", ignore_result=True)
def publish_job(job_id: str) -> None:
    """cpu queue: publish what passed the gate (the job's finished steps are reused, not run again)."""
    _run(job_id, publish=True)


def _run(job_id: str, publish: bool) -> bool:
    """Execute under a lease; True when the job got through (queued for publishing, or succeeded)."""
    config = settings.load()
    factory = Factory(config, _publisher(config.broker_url, job_id))
    job = factory.catalog.job(job_id)
    if job is None or job.state in TERMINAL:
        return False
    me = f"{socket.gethostname()}:{os.getpid()}"
    attempts = factory.catalog.take_lease(job_id, me, config.lease_seconds)
    if attempts is None:
        return False  # another worker holds it
    if attempts > config.max_attempts:
        message = f"job lost its worker {attempts - 1} times; giving up (FACTORY_MAX_ATTEMPTS={config.max_attempts})"
        factory.catalog.set_job_state(job_id, JobState.failed, message, 1)
        return False
    with _heartbeat(factory.catalog, job_id, me, config.lease_seconds):
        outcome = _execute(factory, job_id, publish)
        state = factory.catalog.job(job_id).state
        if state == JobState.running:  # its process ended without recording how (the catalog was away?)
            factory.catalog.fail_job(job_id, "the job's process ended without recording an outcome")
        factory.catalog.release_lease(job_id, me)  # not reached when the catalog is away: the lease runs out
    return outcome == state and state in (JobState.queued, JobState.succeeded)


def _execute(factory: Factory, job_id: str, publish: bool) -> str | None:
    """Factory.execute in a fresh spawned process: what a job does to its process (CUDA memory and context, an
    out-of-memory kill, a crash in native code) ends with that process, and the worker takes the next job clean.
    The process for the next job is started (and has done its imports) while this one runs. Returns the state the
    job process reported (None when it died)."""
    global _spare
    proc, conn = _spare if _spare and _spare[0].is_alive() else _spawn()
    conn.send((job_id, publish))
    _spare = _spawn()
    proc.join()
    try:
        outcome = conn.recv() if conn.poll() else None
    except EOFError:  # it died before saying anything
        outcome = None
    if proc.exitcode != 0:
        how = f"killed by {signal.Signals(-proc.exitcode).name}" if proc.exitcode < 0 else f"exit {proc.exitcode}"
        factory.catalog.fail_job(job_id, f"the job's process died ({how})")
        return None
    return outcome


_spare = None  # (process, connection): a spawned job process that waits for its job (daemonic: it ends with us)


def _spawn():
    ours, theirs = _SPAWN.Pipe()
    proc = _SPAWN.Process(target=_job_process, args=(theirs, os.getpid()), name="qf-job", daemon=True)
    proc.start()
    theirs.close()
    return proc, ours


def _job_process(conn, parent: int) -> None:
    child.die_with_parent()  # a killed worker takes its job process (and that one its engines) along
    if os.getppid() != parent:
        return
    import torch  # noqa: F401  - what every job needs, imported before the job arrives
    import transformers  # noqa: F401

    print(f"job process {os.getpid()} ready for the next job", file=sys.stderr, flush=True)  # the worker's log
    try:
        job_id, publish = conn.recv()
    except EOFError:  # the worker stopped
        return
    config = settings.load()
    try:
        conn.send(Factory(config, _publisher(config.broker_url, job_id)).execute(job_id, publish=publish).state)
    except FactoryError:
        conn.send(JobState.failed)  # marked failed in the catalog, unless the catalog was what failed


@worker_ready.connect
def _warm_up(**_) -> None:
    global _spare
    _spare = _spare or _spawn()


def _publisher(broker_url: str, job_id: str):
    """An emit that publishes each event on the job's channel; followers are optional, so failures are ignored."""
    client = redis.Redis.from_url(broker_url)

    def emit(event: dict) -> None:
        try:
            client.publish(EVENTS + job_id, json.dumps(event, default=str))
        except redis.RedisError:
            pass

    return emit


@contextmanager
def _heartbeat(catalog: Catalog, job_id: str, worker: str, seconds: float):
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(seconds / 3):
            try:
                catalog.renew_lease(job_id, worker, seconds)
            except FactoryError:
                pass  # the database is away for a moment; the next beat tries again

    thread = threading.Thread(target=beat, name=f"lease-{job_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@app.task(name="quantfactory.reconcile", ignore_result=True)
def reconcile() -> list[str]:
    """One pass: re-enqueue jobs whose lease expired and queued jobs that the broker does not hold."""
    config = settings.load()
    factory = Factory(config)
    again = factory.catalog.expired_leases()
    held = _jobs_in_broker()
    again += [j for j in factory.catalog.queued_jobs(older_than=60) if j not in held and j not in again]
    for job_id in again:
        enqueue(factory, job_id)
    return again


def _broker_unreachable() -> ServiceUnavailable:
    return ServiceUnavailable(f"the broker at {mask_url(settings.load().broker_url)} cannot be reached")


def _jobs_in_broker() -> set[str]:
    """Job ids in the queue's messages and in the messages delivered but not yet acknowledged."""
    try:
        with app.connection_for_read() as conn:
            client = conn.default_channel.client
            raw = [m for q in QUEUES for m in client.lrange(q, 0, -1)]
            raw += [json.loads(v)[0] for v in client.hvals("unacked")]
    except (OperationalError, redis.RedisError):
        raise _broker_unreachable() from None
    ids = set()
    for message in raw:
        headers = (json.loads(message) if isinstance(message, bytes | str) else message).get("headers", {})
        if headers.get("task") in (run_job.name, publish_job.name):
            ids.update(ast.literal_eval(headers.get("argsrepr", "()")))
    return ids


def submit(factory: Factory, request: Request) -> Job:
    """Create the job (or find the same one) and queue it unless it is queued, running or done already: what
    `qf submit` and the watchlist check do. A broker that cannot be reached is found before any job exists."""
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
    except OperationalError:
        raise _broker_unreachable() from None
    job, created = factory.submit(request)
    if created or job.state in (JobState.failed, JobState.cancelled):
        enqueue(factory, job.id)
    return job


def enqueue(factory: Factory, job_id: str) -> None:
    """Queue `job_id` on the gpu queue; a broker that cannot be reached fails the job and raises (exit 5)."""
    factory.catalog.set_job_state(job_id, JobState.queued)
    try:
        run_job.apply_async(args=[job_id], queue=QUEUE, retry=False)
    except OperationalError:
        unreachable = _broker_unreachable()
        factory.catalog.set_job_state(job_id, JobState.failed, unreachable.message, unreachable.exit_code)
        raise unreachable from None


@app.task(name="quantfactory.check_watchlist", ignore_result=True)
def check_watchlist() -> dict:
    result = watch_check(dry_run=False)
    for error in result["errors"]:
        log.warning("watchlist check: %s (tried again at the next check)", error)
    for p in result["planned"]:
        what = f"job {p['job']}" if p["job"] else f"skipped: {p['skipped']}" if p["skipped"] else "not submitted"
        log.info("watchlist check: %s %s@%s -> %s", p["watch"], p["repo"], p["sha"][:7], what)
    return result


def watch_check(dry_run: bool) -> dict:
    """One check: {"planned": [...], "errors": [...]} (and "busy": True when another check holds the lock).
    dry_run plans without submitting or recording anything."""
    config = settings.load()
    factory = Factory(config)
    watches = [schedule.WatchEntry(w.target, w.recipe, w.filter) for w in factory.catalog.watches()]
    with _lock(config.broker_url, WATCH_LOCK, seconds=3600, skip=dry_run) as held:
        if not held:
            return {"busy": True, "planned": [], "errors": []}
        releases, errors = schedule.hub_releases(watches)
        done = {(u.watch, u.repo, u.sha) for u in factory.catalog.upstream()}
        planned = schedule.plan(watches, releases, done, {e.name: set(e.architectures) for e in engines.all_engines()})
        rows = []
        for p in planned:
            row = {"watch": p.watch, "repo": p.repo, "sha": p.sha, "skipped": p.skipped, "job": None}
            if not dry_run:
                row.update(_carry_out(factory, p, errors))
            rows.append(row)
    return {"planned": rows, "errors": errors}


def _carry_out(factory: Factory, p: schedule.Planned, errors: list[str]) -> dict:
    """Submit (or skip) one planned release and record it; a Hub or broker outage records nothing (next check)."""
    job_id, skipped = None, p.skipped
    if skipped is None:
        recipe = recipe_from_dict(p.recipe, f"the recipe of watch {p.watch}")
        try:
            job_id = submit(factory, Request(source=f"{p.repo}@{p.sha}", recipe=recipe,
                                             device=factory.settings.worker_device)).id
        except ServiceUnavailable as e:
            errors.append(e.message)
            return {"job": None, "error": e.message}
        except FactoryError as e:
            skipped = e.message
    factory.catalog.record_upstream(p.watch, p.repo, p.sha, job_id, skipped)
    return {"job": job_id, "skipped": skipped}


@contextmanager
def _lock(broker_url: str, key: str, seconds: int, skip: bool = False):
    """Yields True while this process holds `key` in Redis (False: someone else does); skip=True holds nothing."""
    if skip:
        yield True
        return
    client = redis.Redis.from_url(broker_url)
    me = f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"
    try:
        held = bool(client.set(key, me, nx=True, ex=seconds))
    except redis.RedisError:
        raise ServiceUnavailable(f"the broker at {mask_url(broker_url)} cannot be reached") from None
    try:
        yield held
    finally:
        if held and client.get(key) == me.encode():
            client.delete(key)
