"""Tasks are thin: they take a job id, re-read the job from the catalog and run the steps not done yet.

A job runs on its device's queue up to its quality gate (`run_job`), then a task on the cpu queue publishes it
(`publish_job`); both go through `Factory.execute`, which reuses every finished step.

Which device, and so which queue: a submission to the fleet (`qf submit`, the service, the watchlist) plans its job
for FACTORY_WORKER_DEVICE: `cuda` or `cpu` as it says, or with `auto` (a fleet of both kinds, as compose.yaml runs
it) for CUDA when one of the job's engines needs it (the engine's `requires_cuda`) and for the CPU otherwise
(`job_device`). A CUDA job goes to the `gpu` queue, a CPU job to `cpu` (settings.DEVICE_QUEUES). A job planned for
CUDA that reaches a worker without it (a `qf worker` taking the gpu queue on a machine without a GPU) fails with
one sentence that says so, before any step. Each worker says every WORKER_BEAT_SECONDS in Redis which queues it
takes (settings.WORKERS_KEY), so that `qf status` of a queued job can say that no worker takes its queue.

Crash recovery does not wait
for the broker: a running job holds a lease in the catalog that a heartbeat thread renews while the job's process
is alive and makes progress (factory/jobs/heartbeat.py); `reconcile` (beat, every FACTORY_RECONCILE_SECONDS) puts jobs
whose lease expired back on the queue, and queued jobs the broker lost. The lease's fencing token goes to the job
process, which writes nothing once another holder has the job: a worker that was stopped (SIGSTOP, a paused VM)
and comes back finds its lease lost, kills its job process and writes nothing. A job whose process stalls is
killed by its own worker and continues elsewhere. A job that lost its holder FACTORY_MAX_ATTEMPTS times fails as
lost, so a job that kills its workers does not loop forever; the hand-off from the gpu queue to the publishing step
is not a loss. Redis' visibility timeout stays a backstop: a redelivered message of a job that finished or is held
by another worker does nothing. `enqueue` is the one place that hands a job to the broker.

A job's conversions spread over the gpu queue: the worker that takes a job queues a `help_job` per target beyond the
first, and a worker with nothing else to do converts the sizes nobody holds yet beside the job's holder
(Factory.help: each size under a claim in the catalog, fenced by its token). Help is optional: a message that
finds the job done, or every size taken, does nothing.

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
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import NoReturn

import redis
from celery.exceptions import Reject
from celery.signals import worker_ready, worker_shutdown
from kombu.exceptions import OperationalError

from factory import engines, schedule, settings
from factory.catalog import RETRYABLE, TERMINAL, Job, JobState, Lease
from factory.engines import child, starter, warm
from factory.errors import Conflict, FactoryError, LeaseLost, NotFound, ServiceUnavailable, SpecError, mask_url
from factory.evaluation import evaluate
from factory.factory import Factory
from factory.jobs import heartbeat
from factory.jobs.planning import Request
from factory.recipes import recipe_from_dict
from workers.app import app

QUEUES = tuple(sorted(set(settings.DEVICE_QUEUES.values())))
# Job processes are forked from a server process (multiprocessing's forkserver, started by the worker's first job
# process) that imports PRELOAD once and runs nothing: each one starts with torch and transformers loaded (spawned,
# each imported them: test_workers and test_fleet_cpu took 375 CPU-s that way, 329 forked; 2026-12-07) and nothing
# that may hold CUDA is ever forked.
PRELOAD = [*starter.PRELOADED, "factory.factory", "workers.tasks"]  # what a warm engine child's starter imports too
_JOBS = multiprocessing.get_context("forkserver")
_JOBS.set_forkserver_preload(PRELOAD)
log = logging.getLogger("quantfactory")
WATCH_LOCK = "quantfactory:watch-lock"
EVENTS = "quantfactory:events:"  # + job id: the pipeline's events, published for `qf status --follow`


@app.task(name="quantfactory.run_job", ignore_result=True)  # outcomes live in the catalog
def run_job(job_id: str) -> None:
    """The job's device's queue: everything up to the quality gate, then the publishing step goes to the cpu
    queue."""
    with _not_done_without_catalog(job_id):
        if _run(job_id, publish=False):
            publish_job.apply_async(args=[job_id], queue="cpu")


@app.task(name="quantfactory.help_job", ignore_result=True)
def help_job(job_id: str) -> None:
    """The job's device's queue: convert some of a running job's sizes beside its holder (Factory.help), in a job
    process of its own; a job that is not running, or has nothing left to take, is nothing to do."""
    with _not_done_without_catalog(job_id):
        config = settings.load()
        job = Factory(config).catalog.jobs.get(job_id)
        if job is not None and job.state in (JobState.queued, JobState.running):  # queued: its holder starts it
            _execute_help(job_id, config.stall_seconds)


@app.task(name="quantfactory.publish_job", ignore_result=True)
def publish_job(job_id: str) -> None:
    """cpu queue: publish what passed the gate (the job's finished steps are reused, not run again)."""
    with _not_done_without_catalog(job_id):
        _run(job_id, publish=True)


@contextmanager
def _not_done_without_catalog(job_id: str):
    """A task that cannot reach the catalog or the broker is not acknowledged as done: its message is rejected and
    the reconciler queues the job again (its lease runs out, or it is queued with no message)."""
    try:
        yield
    except ServiceUnavailable as e:
        log.warning("job %s: %s; leaving it to the reconciler", job_id, e.message)
        raise Reject(e.message, requeue=False) from None


def _run(job_id: str, publish: bool) -> bool:
    """Execute under a lease; True when the job got through (queued for publishing, or succeeded)."""
    config = settings.load()
    factory = Factory(config, _publisher(config.broker_url, job_id))
    job = factory.catalog.jobs.get(job_id)
    if job is None or job.state in TERMINAL:
        return False
    with heartbeat.leased(factory.catalog, job_id, config.lease_seconds) as lease:
        if lease is None:
            return False  # another worker holds it
        if lease.attempts > config.max_attempts:
            message = (
                f"job lost its worker {lease.attempts - 1} times; giving up "
                f"(FACTORY_MAX_ATTEMPTS={config.max_attempts})"
            )
            factory.catalog.jobs.fail(job_id, message, lease.token)  # and the lost attempt's step left running
            return False
        if not publish:
            _call_helpers(job)
        outcome = _execute(factory, lease, publish, config.lease_seconds, config.stall_seconds)
        if outcome is LOST:
            return False  # the job is another holder's now, or will be once the lease runs out
        state = factory.catalog.jobs.get(job_id).state
        if state == JobState.running:  # its process ended without recording how (the catalog was away?)
            factory.catalog.jobs.fail(job_id, "the job's process ended without recording an outcome", lease.token)
    return outcome == state and state in (JobState.queued, JobState.succeeded)


LOST = "lost"  # what _execute returns when the lease was lost or given up


def _call_helpers(job: Job) -> None:
    """One help_job per target beyond the first, on the job's queue: workers of its device with nothing else to do
    take some of the job's conversions (those that find the job done, or nothing left, do nothing). Helping is
    optional: a broker that cannot take them leaves the job to its holder."""
    for _ in range(len(job.specs) - 1):
        try:
            help_job.apply_async(args=[job.id], queue=settings.DEVICE_QUEUES[job.device], retry=False)
        except OperationalError:
            return


def _execute_help(job_id: str, stall: float) -> None:
    """Factory.help in a job process, as _execute runs a job; killed when it stops reporting progress
    (its claims then run out and the job's holder makes those units)."""
    proc, conn, progress = _hand_to_job_process(("help", job_id))
    while proc.is_alive():
        proc.join(timeout=1.0)
        if proc.is_alive() and time.time() - progress.value > stall:
            log.warning("job %s: a helper made no progress for %g s; killing its process", job_id, stall)
            _kill(proc)


def _execute(factory: Factory, lease: Lease, publish: bool, seconds: float, stall: float) -> str | None:
    """Factory.execute in a fresh job process: what a job does to its process (CUDA memory and context, an
    out-of-memory kill, a crash in native code) ends with that process, and the worker takes the next job clean.
    The process for the next job is started (and has done its imports) while this one runs. The lease is renewed
    while that process lives and reports progress (a timestamp it shares); a stall or a lost lease kills it.
    Returns the state the job process reported (None when it died, LOST when the lease went)."""
    proc, conn, progress = _hand_to_job_process(("run", lease, publish))

    def alive() -> str | None:
        if not proc.is_alive():
            return None  # it is ending: its outcome comes through the pipe
        if time.time() - progress.value > stall:
            return f"no progress for {stall:g} s (FACTORY_STALL_SECONDS); killing its process"
        return None

    with heartbeat.held(factory.catalog, lease, seconds, alive, on_lost=lambda reason: _kill(proc)) as holding:
        proc.join()
    if holding.lost:
        return LOST
    try:
        outcome = conn.recv() if conn.poll() else None
    except EOFError:  # it died before saying anything
        outcome = None
    if outcome == LOST:
        return LOST
    if proc.exitcode != 0:
        how = f"killed by {signal.Signals(-proc.exitcode).name}" if proc.exitcode < 0 else f"exit {proc.exitcode}"
        factory.catalog.jobs.fail(lease.job_id, f"the job's process died ({how})", lease.token)
        return None
    return outcome


def _hand_to_job_process(message: tuple):
    """The spare job process (or a new one) takes `message`; another spare starts for the next job."""
    global _spare
    proc, conn, progress = _spare if _spare and _spare[0].is_alive() else _start()
    progress.value = time.time()
    conn.send(message)
    _spare = _start()
    return proc, conn, progress


def _kill(proc) -> None:
    """SIGKILL the job process (stopped or hung: nothing else reaches it); its engines die with it."""
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_spare = None  # (process, connection, progress): a job process that waits for its job (daemonic)


def _start():
    ours, theirs = _JOBS.Pipe()
    progress = _JOBS.Value("d", time.time(), lock=False)  # when the job last reported progress
    proc = _JOBS.Process(target=_job_process, args=(theirs, os.getpid(), progress), name="qf-job", daemon=True)
    proc.start()
    theirs.close()
    return proc, ours, progress


def _job_process(conn, worker: int, progress) -> None:
    _end_with(worker)  # a killed worker takes its job process (and that one its engines) along
    print(f"job process {os.getpid()} ready for the next job", file=sys.stderr, flush=True)  # the worker's log
    try:
        kind, *args = conn.recv()
    except EOFError:  # the worker stopped
        return
    config = settings.load()
    job_id = args[0] if kind == "help" else args[0].job_id
    publish_event = _publisher(config.broker_url, job_id)

    def emit(event: dict) -> None:
        progress.value = time.time()
        publish_event(event)

    if kind == "help":
        try:  # a helper helps a job planned for the device its machine has (the job's queue sent it here)
            Factory(replace(config, worker_device=evaluate.device()), emit).help(job_id)
        except FactoryError as e:  # the job's holder meets the same problem and records it
            log.warning("job %s: a helper stops: %s", job_id, e.message)
        _end_without_teardown()
    lease, publish = args
    factory = Factory(config, emit)
    if not publish and _refused_for_its_device(factory, lease):
        conn.send(JobState.failed)
        _end_without_teardown()
    try:
        conn.send(factory.execute(lease.job_id, publish=publish, lease=lease).state)
    except LeaseLost:
        conn.send(LOST)
    except FactoryError:
        conn.send(JobState.failed)  # marked failed in the catalog, unless the catalog was what failed
    _end_without_teardown()


def _end_with(worker: int) -> None:
    """SIGTERM to this process when the worker ends, as PDEATHSIG gave it while the worker was its parent: its
    parent is the fork server, which outlives the worker while any job process holds the server's pipe (each
    does). Exits at once if the worker has ended already."""
    try:
        pidfd = os.pidfd_open(worker)
    except ProcessLookupError:
        os._exit(0)
    except (AttributeError, OSError):  # no pidfd (not Linux 5.3+): the job may outlive a killed worker, as before
        return

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="qf-worker-watch", daemon=True).start()


def _refused_for_its_device(factory: Factory, lease: Lease) -> bool:
    """A job planned for CUDA that reached a worker without it fails with one sentence before any step, rather than
    with torch's "Torch not compiled with CUDA enabled" from its first unit. True when it did (its publishing
    step, which needs no GPU, is never refused)."""
    job = factory.catalog.jobs.get(lease.job_id)
    if job.device != "cuda" or evaluate.device() == "cuda":
        return False
    message = (
        f"job {job.id} needs a CUDA GPU and the worker on {socket.gethostname()} that took it from the gpu "
        f"queue has none; start workers without one with `qf worker --queues cpu`, then `qf retry {job.id}`"
    )
    factory.catalog.jobs.transition(
        job.id,
        JobState.failed,
        lease.token,
        message,
        SpecError.exit_code,
        only_from=frozenset({JobState.queued, JobState.running}),
    )
    return True


def _end_without_teardown() -> NoReturn:
    """Exit 0 now: the interpreter's teardown with torch loaded takes 0.8 s (2 cores), which the worker would wait
    for between a job's gate and its publishing step. Every write of the job is committed when it is made and its
    outcome is sent; its output is flushed here. An exception (a bug) does not come here: it ends the process with
    its traceback and exit 1, as before."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@worker_ready.connect
def _warm_up(sender, **_) -> None:
    global _spare, _up
    warm.share(child.environment())  # one starter of warm engine children for all its job processes
    _spare = _spare or _start()
    _up = (sender.hostname, sorted(q.name for q in sender.task_consumer.queues))
    threading.Thread(target=_say_up, args=_up, name="qf-worker-up", daemon=True).start()


_up: tuple[str, list[str]] | None = None  # (this worker's node name, the queues it takes), once it is ready
_going = threading.Event()  # set as the worker shuts down: it no longer says it is up


def _say_up(node: str, queues: list[str]) -> None:
    """Every WORKER_BEAT_SECONDS, in the sorted set of each queue this worker takes: its node name, scored by the
    time (what factory/catalog/status.py reads); members three beats old are dropped. A broker that is away is tried
    again at the next beat."""
    client, beat = redis.Redis.from_url(settings.load().broker_url), settings.WORKER_BEAT_SECONDS
    while not _going.is_set():
        now = time.time()
        try:
            with client.pipeline() as pipe:
                for queue in queues:
                    pipe.zadd(settings.WORKERS_KEY + queue, {node: now})
                    pipe.zremrangebyscore(settings.WORKERS_KEY + queue, "-inf", now - 3 * beat)
                pipe.execute()
        except redis.RedisError:
            pass
        _going.wait(beat)


@worker_shutdown.connect
def _say_down(**_) -> None:
    """A worker that stops is no longer up at once, not three beats later."""
    _going.set()
    if _up is None:
        return
    node, queues = _up
    try:
        client = redis.Redis.from_url(settings.load().broker_url, socket_timeout=2)
        for queue in queues:
            client.zrem(settings.WORKERS_KEY + queue, node)
    except redis.RedisError:
        pass


def _publisher(broker_url: str, job_id: str):
    """An emit that publishes each event on the job's channel; followers are optional, so failures are ignored."""
    client = redis.Redis.from_url(broker_url)

    def emit(event: dict) -> None:
        try:
            client.publish(EVENTS + job_id, json.dumps(event, default=str))
        except redis.RedisError:
            pass

    return emit


def follow(catalog, broker_url: str, job_id: str, tick: float = 2.0) -> Iterator[dict | None]:
    """A job's events as its worker publishes them, until its result event or a terminal state; None every `tick`
    seconds without one (a follower over HTTP sends a keep-alive then). NotFound for a job that does not exist."""
    client = redis.Redis.from_url(broker_url)
    try:
        channel = client.pubsub(ignore_subscribe_messages=True)
        channel.subscribe(EVENTS + job_id)
    except redis.RedisError:
        client.close()
        raise _broker_unreachable() from None
    try:
        while True:
            job = catalog.jobs.get(job_id)
            if job is None:
                raise NotFound(f"no job {job_id!r}; `qf status` lists the recent ones")
            message = channel.get_message(timeout=tick)
            if message is not None:
                event = json.loads(message["data"])
                yield event
                if event["event"] == "result":
                    return
            elif job.state in TERMINAL:
                return
            else:
                yield None
    finally:
        channel.close()
        client.close()


@app.task(name="quantfactory.reconcile", ignore_result=True)
def reconcile() -> list[str]:
    """One pass: re-enqueue jobs whose lease expired and queued jobs that the broker does not hold."""
    config = settings.load()
    factory = Factory(config)
    again = factory.catalog.leases.expired()
    held = _jobs_in_broker()
    again += [j for j in factory.catalog.jobs.queued(older_than=60) if j not in held and j not in again]
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
            raw += client.hvals("unacked")  # each entry is [message, exchange, routing key]
    except (OperationalError, redis.RedisError):
        raise _broker_unreachable() from None
    ids = set()
    for message in raw:
        try:
            decoded = json.loads(message)
            if isinstance(decoded, list):  # an unacked entry: its message comes first
                decoded = decoded[0]
            headers = decoded.get("headers", {})
            if headers.get("task") in (run_job.name, publish_job.name):  # help_job messages are optional
                ids.update(ast.literal_eval(headers.get("argsrepr", "()")))
        except (ValueError, SyntaxError, TypeError, AttributeError, IndexError, RecursionError, MemoryError):
            log.warning("reconcile: skipped a malformed message in the broker: %.200r", message)
    return ids


def check_broker() -> None:
    """Raises ServiceUnavailable (exit 5) when the broker cannot be reached (a connection from the app's pool: a
    process that submits many jobs, the service, connects once)."""
    try:
        with app.pool.acquire(block=True) as conn:
            conn.ensure_connection(max_retries=1)
    except OperationalError:
        raise _broker_unreachable() from None


def job_device(request: Request) -> str:
    """The device a fleet's job is planned for, from `request.device` (FACTORY_WORKER_DEVICE): cuda or cpu as it
    says; auto: cuda when one of the recipe's engines needs CUDA, else cpu."""
    if request.device != "auto":
        return request.device
    return "cuda" if any(engines.get(s.method).requires_cuda for s in request.recipe.specs()) else "cpu"


def submit(factory: Factory, request: Request) -> Job:
    """Create the job (or find the same one) and queue it unless it is queued, running or done already (done, with
    a quant `qf rm` removed, it is queued again to make it: Factory.remake_removed): what
    `qf submit`, the service and the watchlist check do. A broker that cannot be reached is found before any job
    exists."""
    check_broker()
    job, created = factory.submit(replace(request, device=job_device(request)))
    if created or job.state in (JobState.failed, JobState.cancelled):
        enqueue(factory, job.id)
    return job


def retry(factory: Factory, job_id: str) -> Job:
    """Queue a failed or cancelled job again (`qf retry`, the service's retry); its finished steps are kept. The
    job as it is after that (queued, or already taken by a worker)."""
    job = factory.catalog.jobs.get(job_id)
    if job is None:
        raise NotFound(f"no job {job_id!r}; `qf status` lists the recent ones")
    if factory.remake_removed(job):  # succeeded, but `qf rm` removed a quant of it: made again
        enqueue(factory, job.id)
        return factory.catalog.jobs.get(job_id)
    if job.state not in RETRYABLE:
        raise Conflict(f"job {job_id} is {job.state}; only failed or cancelled jobs can be retried")
    enqueue(factory, job.id)
    return factory.catalog.jobs.get(job_id)


def enqueue(factory: Factory, job_id: str) -> None:
    """Queue `job_id` (queued, failed or cancelled) on its device's queue; a broker that cannot be reached fails
    the job and raises (exit 5). A job that moved on meanwhile (a worker started it) is left alone."""
    if not factory.catalog.jobs.transition(job_id, JobState.queued, only_from=frozenset({JobState.queued, *RETRYABLE})):
        return
    try:
        run_job.apply_async(
            args=[job_id], queue=settings.DEVICE_QUEUES[factory.catalog.jobs.get(job_id).device], retry=False
        )
    except OperationalError:
        unreachable = _broker_unreachable()
        factory.catalog.jobs.transition(
            job_id,
            JobState.failed,
            error=unreachable.message,
            exit_code=unreachable.exit_code,
            only_from=frozenset({JobState.queued}),
        )
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
    """One check: {"planned": [...], "errors": [...], "exit_code": N} (and "busy": True when another check holds the
    lock); `exit_code` is the highest of its errors' (5: the Hub or the broker cannot be reached), 0 without one.
    dry_run plans without submitting or recording anything."""
    config = settings.load()
    factory = Factory(config)
    watches = [schedule.WatchEntry(w.target, w.recipe, w.filter) for w in factory.catalog.watchlist.watches()]
    with _lock(config.broker_url, WATCH_LOCK, seconds=3600, skip=dry_run) as held:
        if not held:
            return {"busy": True, "planned": [], "errors": [], "exit_code": 0}
        releases, errors = schedule.hub_releases(watches)
        seen = {(u.watch, u.repo, u.sha): u for u in factory.catalog.watchlist.upstream()}
        # a skipped release is planned again at every check: an engine that takes it now (a newer one, a wider
        # filter, access to a gated repo) submits it; one still skipped for the same reason is not listed again
        done = {key for key, u in seen.items() if u.job_id}
        planned = schedule.plan(watches, releases, done, {e.name: set(e.architectures) for e in engines.all_engines()})
        rows = []
        for p in planned:
            before = seen.get((p.watch, p.repo, p.sha))
            if before is not None and before.skipped == p.skipped:
                continue
            row = {"watch": p.watch, "repo": p.repo, "sha": p.sha, "skipped": p.skipped, "job": None}
            if not dry_run:
                row.update(_carry_out(factory, p, errors))
            rows.append(row)
    return {
        "planned": rows,
        "errors": [e.message for e in errors],
        "exit_code": max((e.exit_code for e in errors), default=0),
    }


def _carry_out(factory: Factory, p: schedule.Planned, errors: list[FactoryError]) -> dict:
    """Submit (or skip) one planned release and record it; a Hub or broker outage records nothing (next check)."""
    job_id, skipped = None, p.skipped
    if skipped is None:
        recipe = recipe_from_dict(p.recipe, f"the recipe of watch {p.watch}")
        try:
            job_id = submit(
                factory, Request(source=f"{p.repo}@{p.sha}", recipe=recipe, device=factory.settings.worker_device)
            ).id
        except ServiceUnavailable as e:
            errors.append(e)
            return {"job": None, "error": e.message}
        except FactoryError as e:
            skipped = e.message
    factory.catalog.watchlist.record_upstream(p.watch, p.repo, p.sha, job_id, skipped)
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
