"""Jobs and their steps as `qf status`, `qf jobs` and `qf show` print them, read with plain SQL.

The catalog (the other modules of factory/catalog/) owns the schema and every write. This module only reads,
through sqlite3 or psycopg2, because importing SQLAlchemy alone takes 0.4 s on a 2-core machine and `qf status` has
half a second (benchmarks/queue_costs.py). tests/integration/test_status.py checks that both read the same rows.

A row's `steps` are every attempt at each step, in order; the tables show each step once, its latest record
(`latest_steps`): a job taken over, or retried after a step failed, records again the steps it runs again (a later
pass reads the source again without recording its fetch, inspect or gate: factory/jobs/context.py, `step_once`).
Every view of a job (`qf jobs`, `qf show`, `qf status`, the dashboard, the API) says how far it is from the same
`summary`: done and total steps, each counted once, and their seconds. A queued job says why it waits when no
worker takes its queue (`waiting`): each worker keeps its name in a sorted set per queue in Redis
(settings.WORKERS_KEY, workers/tasks.py), so the answer is one ZCOUNT per queue (tests/integration/test_fleet_cpu.py).
"""

from __future__ import annotations

import json
import sqlite3
import time
from datetime import UTC, datetime

from factory.errors import ServiceUnavailable, database_error, mask_url
from factory.settings import DEVICE_QUEUES, POSTGRES_URL, WORKER_BEAT_SECONDS, WORKERS_KEY, database_kind

# states.DONE_STEPS and StepState.reused as strings: importing factory.catalog imports SQLAlchemy
DONE, REUSED = frozenset({"succeeded", "reused", "skipped"}), "reused"
_JOBS = (
    "SELECT id, name, state, error, exit_code, source, source_identity, specs, created_at, worker, lease_until, "
    "attempts, expected_end, device FROM jobs"
)
_STEPS = (
    "SELECT job_id, name, state, started_at, ended_at, error, peak_gpu_bytes, expected_seconds, holder, note FROM steps"
)


def job_rows(
    url: str,
    job_id: str | None = None,
    name: str | None = None,
    limit: int = 20,
    user: str | None = None,
    broker_url: str | None = None,
) -> list[dict]:
    """The newest `limit` jobs (of model `name`, or the one job `job_id`; of those, the ones `user` submitted
    through the service), newest first; [] for a new catalog. With `broker_url`, a queued job that no worker
    would take now says why in `waiting` (else None)."""
    clauses, args = [], []
    for clause, value in (
        ("id = ?", job_id),
        ("name = ?", name),
        ("id IN (SELECT job_id FROM submissions WHERE username = ?)", user),
    ):
        if value is not None:
            clauses.append(clause)
            args.append(value)
    where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
    conn, database_error = _connect(url)
    if conn is None:
        return []
    try:
        jobs = _query(conn, f"{_JOBS} {where} ORDER BY created_at DESC LIMIT ?", [*args, limit])
        ids = [j[0] for j in jobs]
        steps = _query(conn, f"{_STEPS} WHERE job_id IN ({', '.join('?' * len(ids))}) ORDER BY id", ids) if ids else []
    except database_error as e:
        if "no such table" in str(e) or getattr(e, "pgcode", None) == "42P01":  # a catalog without tables yet
            return []
        reason = str(e).strip().splitlines()[0]
        raise ServiceUnavailable(f"the catalog database at {mask_url(url)} cannot be read: {reason}") from None
    finally:
        conn.close()
    by_job: dict[str, list[dict]] = {i: [] for i in ids}
    for job, step, state, started, ended, error, peak, expected, holder, note in steps:
        seconds = None if state == REUSED or not ended else (_time(ended) - _time(started)).total_seconds()
        by_job[job].append(
            {
                "name": step,
                "state": state,
                "started_at": _time(started).isoformat(),
                "seconds": seconds,
                "expected_seconds": expected,
                "error": error,
                "peak_gpu_bytes": peak,
                "holder": holder,
                "note": note,
            }
        )
    now = datetime.now(UTC).replace(tzinfo=None)  # the catalog's clock: naive UTC
    rows = [
        {
            "id": i,
            "name": n,
            "state": s,
            "error": e,
            "exit_code": code,
            "source": src,
            "source_identity": ident,
            "specs": json.loads(specs) if isinstance(specs, str) else specs,
            "device": device,
            "created_at": _time(created).isoformat(timespec="seconds"),
            "steps": by_job[i],
            "holder": worker if until is not None and _time(until) > now else None,
            "attempts": attempts,
            "summary": summary(by_job[i]),
            **_eta(s, end, now),
            "waiting": None,
        }
        for i, n, s, e, code, src, ident, specs, created, worker, until, attempts, end, device in jobs
    ]
    if broker_url is not None:
        _say_why_queued([r for r in rows if r["state"] == "queued"], broker_url)
    return rows


def latest_steps(steps: list[dict]) -> list[dict]:
    """Each step once: its latest record, in the place of its first (what `qf status` and `qf jobs` show)."""
    latest: dict[str, dict] = {}
    for step in steps:
        latest[step["name"]] = step
    return list(latest.values())


def summary(steps: list[dict]) -> dict:
    """How far a job is, as every view says it: its steps each counted once (their latest records), how many of
    them are done (succeeded, reused from an earlier job, or skipped), the ones running, and the seconds they took
    (reused and skipped steps took none)."""
    latest = latest_steps(steps)
    return {
        "done": sum(s["state"] in DONE for s in latest),
        "total": len(latest),
        "running": [s["name"] for s in latest if s["state"] == "running"],
        "seconds": round(sum(s["seconds"] or 0.0 for s in latest), 1),
    }


def _queue(row: dict) -> str:
    """The queue a queued job waits on: its device's, or the cpu queue's once its gate passed (its publishing)."""
    if any(s["name"] == "gate" and s["state"] == "succeeded" for s in row["steps"]):
        return DEVICE_QUEUES["cpu"]
    return DEVICE_QUEUES[row["device"]]


def _say_why_queued(rows: list[dict], broker_url: str) -> None:
    """`waiting` for each queued row whose queue no worker said it takes within three beats."""
    if not rows:
        return
    import redis

    since = time.time() - 3 * WORKER_BEAT_SECONDS
    client = redis.Redis.from_url(broker_url, socket_connect_timeout=2, socket_timeout=2)
    try:
        up = {q: client.zcount(WORKERS_KEY + q, since, "+inf") for q in {_queue(r) for r in rows}}
    except redis.RedisError:
        for row in rows:
            row["waiting"] = "the broker cannot be reached"
        return
    finally:
        client.close()
    for row in rows:
        if not up[_queue(row)]:
            row["waiting"] = f"no worker on the {_queue(row)} queue is up"


def _eta(state: str, end, now: datetime) -> dict:
    """A running job's expected end (naive UTC, ISO) and the seconds left until then (negative: overdue)."""
    if state != "running" or end is None:
        return {"expected_end": None, "eta_seconds": None}
    end = _time(end)
    return {"expected_end": end.isoformat(timespec="seconds"), "eta_seconds": round((end - now).total_seconds())}


def _connect(url: str):
    """(connection or None when there is no catalog yet, the driver's error class)."""
    if database_kind(url) == "sqlite":
        try:
            conn = sqlite3.connect(f"file:{url.removeprefix('sqlite:///')}?mode=ro", uri=True, timeout=30)
        except sqlite3.OperationalError:
            return None, sqlite3.Error
        return conn, sqlite3.Error
    import psycopg2

    try:
        return psycopg2.connect(POSTGRES_URL.sub("postgresql://", url), connect_timeout=5), psycopg2.Error
    except psycopg2.OperationalError as e:
        raise database_error(url, e) from None


def _query(conn, sql: str, args: list) -> list[tuple]:
    cursor = conn.cursor()
    cursor.execute(sql if isinstance(conn, sqlite3.Connection) else sql.replace("?", "%s"), args)
    return cursor.fetchall()


def _time(value) -> datetime:
    return datetime.fromisoformat(value) if isinstance(value, str) else value
