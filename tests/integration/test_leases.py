"""The catalog's state machine and fenced leases, on the real database (SQLite, and PostgreSQL in its pass).

Processes that stall and come back are in tests/integration/test_workers.py (SIGSTOP/SIGCONT of real workers) and
tests/integration/test_safety.py (two `qf run` of one job)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
from sqlalchemy import update

from factory import engines
from factory.catalog import RETRYABLE, TERMINAL, TRANSITIONS, Catalog, Job, JobState, Quant, StepState
from factory.errors import Cancelled, LeaseLost
from tests.support.catalog_jobs import bare_job


@pytest.fixture
def catalog(tmp_path, db_url) -> Catalog:
    return Catalog(db_url or f"sqlite:///{tmp_path / 'catalog.db'}")


_made = itertools.count()


def _job(catalog: Catalog, state: JobState = JobState.queued) -> str:
    n = next(_made)
    job = bare_job(catalog, n)
    _force(catalog, job.id, state)
    return job.id


def _force(catalog: Catalog, job_id: str, state: JobState) -> None:
    """Put the job in `state` behind the state machine's back (only tests do this)."""
    with catalog.db.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(state=state))


def test_every_transition_of_the_table_and_no_other(catalog):
    job_id = _job(catalog)
    for frm, to in itertools.product(JobState, JobState):
        _force(catalog, job_id, frm)
        happened = catalog.jobs.transition(job_id, to, error="why" if to == JobState.failed else None)
        assert happened == (to in TRANSITIONS[frm]), (frm, to)
        assert catalog.jobs.get(job_id).state == (to if happened else frm)
    assert set(TRANSITIONS) == set(JobState) and RETRYABLE <= TERMINAL
    # a succeeded job leaves only for the queue (Quants.reopen, after `qf rm` of its quant), never to run or fail
    assert TRANSITIONS[JobState.succeeded] == {JobState.queued}
    assert JobState.running not in TRANSITIONS[JobState.cancelled]


def test_a_transition_can_be_narrowed_and_fenced(catalog):
    job_id = _job(catalog, JobState.running)
    assert not catalog.jobs.transition(job_id, JobState.queued, only_from=frozenset({JobState.failed}))
    lease = catalog.leases.take(job_id, "a:1", 60)
    assert not catalog.jobs.transition(job_id, JobState.succeeded, lease.token + 1)
    assert not catalog.jobs.transition(job_id, JobState.queued, lease_expired=True)  # its lease is valid
    assert catalog.jobs.transition(job_id, JobState.succeeded, lease.token)


def test_a_stale_holder_writes_nothing(catalog):
    """A takes the job, stalls past its lease; B takes it. Every write A makes with its token is refused and
    names B; B's go through."""
    job_id = _job(catalog, JobState.running)
    a = catalog.leases.take(job_id, "host-a:1", 0.01)
    time.sleep(0.05)
    b = catalog.leases.take(job_id, "host-b:2", 60)
    assert b.token == a.token + 1
    lost = "^lease lost to host-b:2; stopping$"
    with pytest.raises(LeaseLost, match=lost):
        catalog.steps.start(job_id, "quantize:awq-w4g128", a.token)
    with pytest.raises(LeaseLost, match=lost):
        catalog.quants.add_evaluation(
            a.token,
            job_id=job_id,
            subject="fp16",
            source_identity="s",
            evaluator="e",
            device="cpu",
            eval_sha="e",
            windows=1,
            window_length=8,
            ppl=1.0,
            seconds=1.0,
        )
    with pytest.raises(LeaseLost, match=lost):
        catalog.quants.add_measurement(
            job_id,
            a.token,
            key="k",
            path="p",
            source_identity="s",
            calibration_sha="c",
            rows=1,
            length=8,
            tool_version="v",
        )
    published = []
    with pytest.raises(LeaseLost, match=lost):
        catalog.quants.put(_quant(catalog, job_id), a.token, publish=lambda: published.append("A"))
    with pytest.raises(LeaseLost, match=lost):
        catalog.leases.check(job_id, a.token)
    assert not catalog.leases.renew(a, 60)
    assert not catalog.jobs.transition(job_id, JobState.succeeded, a.token)
    assert not catalog.jobs.fail(job_id, "A thinks its process died", a.token)
    catalog.leases.release(a)  # a no-op for A now
    job = catalog.jobs.get(job_id)
    assert (job.state, job.worker, job.lease_until is not None, job.steps, published) == (
        JobState.running,
        "host-b:2",
        True,
        [],
        [],
    )
    assert catalog.quants.live(job_id=job_id) == [] and catalog.quants.evaluations(job_id) == []

    step = catalog.steps.start(job_id, "quantize:awq-w4g128", b.token)
    catalog.steps.end(step, StepState.succeeded, token=b.token)
    catalog.quants.put(_quant(catalog, job_id), b.token, publish=lambda: published.append("B"))
    assert catalog.jobs.transition(job_id, JobState.succeeded, b.token)
    assert published == ["B"] and len(catalog.quants.live(job_id=job_id)) == 1


def test_attempts_count_lost_leases_not_hand_offs(catalog):
    job_id = _job(catalog, JobState.running)
    first = catalog.leases.take(job_id, "gpu:1", 60)
    assert first.attempts == 1
    assert catalog.leases.take(job_id, "cpu:2", 60) is None  # A holds it
    catalog.leases.release(first)  # the gpu worker hands the job to the publishing step
    handed = catalog.leases.take(job_id, "cpu:2", 0.01)
    assert (handed.attempts, handed.token) == (1, first.token + 1)
    time.sleep(0.05)  # ... whose worker is lost
    assert catalog.leases.expired() == [job_id] and catalog.jobs.get(job_id).state == JobState.queued
    again = catalog.leases.take(job_id, "cpu:3", 60)
    assert again.attempts == 2


def test_a_holder_known_dead_is_not_waited_out(catalog):
    job_id = _job(catalog, JobState.running)
    catalog.leases.take(job_id, "here:1", 60)
    assert catalog.leases.take(job_id, "here:2", 60) is None
    assert catalog.leases.take(job_id, "here:2", 60, gone="here:1").worker == "here:2"


def test_a_cancel_before_the_publish_means_no_publish(catalog):
    job_id = _job(catalog, JobState.running)
    lease = catalog.leases.take(job_id, "a:1", 60)
    assert catalog.jobs.cancel(job_id).state == JobState.cancelled
    published = []
    with pytest.raises(Cancelled):
        catalog.quants.put(_quant(catalog, job_id), lease.token, publish=lambda: published.append(True))
    assert published == [] and catalog.quants.live(job_id=job_id) == []
    assert not catalog.jobs.transition(job_id, JobState.succeeded, lease.token)  # a cancel is never overwritten
    assert not catalog.jobs.transition(job_id, JobState.running, lease.token)
    assert catalog.jobs.get(job_id).state == JobState.cancelled


def _quant(catalog: Catalog, job_id: str) -> Quant:
    name = catalog.jobs.get(job_id).name
    return Quant(
        job_id=job_id,
        name=name,
        tag="awq-w4g128",
        rev="abc",
        method="awq",
        bits=4.0,
        spec=engines.get("awq").spec(group_size=128),
        bytes=1,
        path=str(Path("m") / "awq-w4g128@abc"),
        source="/models/m",
        source_identity="s",
        calibration="builtin:mix",
        calibration_sha="c",
        versions={},
        ppl=1.0,
        fp16_ppl=1.0,
        eval={},
    )


def test_a_cancel_during_the_publish_waits_for_it(catalog):
    """The registry publish runs inside the fenced transaction of its quant row: a cancel that arrives meanwhile
    (another connection) waits until the quant is recorded, then wins; nothing is half-published."""
    import threading

    job_id = _job(catalog, JobState.running)
    lease = catalog.leases.take(job_id, "a:1", 60)
    other = Catalog(catalog.db.url)
    cancel = threading.Thread(target=other.jobs.cancel, args=(job_id,))
    seen = []

    def publish() -> None:
        cancel.start()
        time.sleep(0.5)
        seen.append(cancel.is_alive())  # blocked on the job's row

    catalog.quants.put(_quant(catalog, job_id), lease.token, publish=publish)
    cancel.join(30)
    other.db.engine.dispose()
    assert seen == [True] and not cancel.is_alive()
    assert catalog.jobs.get(job_id).state == JobState.cancelled and len(catalog.quants.live(job_id=job_id)) == 1


def test_a_holder_stopped_past_its_lease_has_its_engine_stopped_and_its_unit_made_elsewhere(qf, tiny, tmp_path):
    """Only `qf run`'s own process is stopped (SIGSTOP) while its engine child converts (it would for 10 minutes):
    past its lease a second `qf run` takes the job and the conversion over. The stopped holder's engine is killed
    by its watchdog at the takeover (it went on writing into the job's work folder, and the new holder's engine
    failed with FileExistsError there); the new holder converts in a folder of its own and publishes; the old
    holder, continued, writes nothing."""
    import signal
    import subprocess

    import psutil

    from factory.publish import folder as registry
    from tests.support.processes import engines, qf_process, wait_until

    recipe = tmp_path / "round.yaml"
    recipe.write_text("round: {mantissa: [3]}\n")
    args = ("run", tiny, "--recipe", recipe, "--eval-windows", 1)
    env = {"FACTORY_ENGINES": "tests.support.round_engine:ENGINE", "FACTORY_LEASE_SECONDS": "2", "OMP_NUM_THREADS": "1"}
    first = qf_process(qf, *args, env={**env, "QF_TEST_ROUND_SECONDS": "600"}, stderr=subprocess.DEVNULL)
    try:

        def converting():
            kids = [p for p in engines(first.pid) if "tests.support.round_engine" in p.cmdline()]
            return kids and kids[0]

        engine = wait_until(converting, 120)
        time.sleep(1)  # its first progress event recorded
        _stop_outside_a_transaction(qf, first)
        time.sleep(3)  # its lease and its unit's claim run out; its engine goes on
        assert engine.status() != psutil.STATUS_STOPPED
        second = qf_process(qf, *args, env={**env, "QF_TEST_ROUND_SECONDS": "0"}, stderr=subprocess.PIPE)
        _, err = second.communicate(timeout=180)
        assert second.returncode == 0, err
        assert wait_until(lambda: not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE, 10)
        [quant] = qf.json("ls")
        before = registry.verify(qf.home / "registry" / quant["path"])
        first.send_signal(signal.SIGCONT)
        first.wait(60)
        assert first.returncode != 0
        [job] = qf.json("status")
        assert job["state"] == "succeeded" and qf.json("ls") == [quant]
        assert registry.verify(qf.home / "registry" / quant["path"]) == before
    finally:
        first.kill()
        first.wait(30)


def _stop_outside_a_transaction(qf, proc) -> None:
    """SIGSTOP `proc` at a moment it holds no lock in the catalog (its heartbeat renews every third of the lease: a
    process stopped inside that transaction would hold the catalog, on SQLite, or the job's row, for every other)."""
    import signal

    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError

    url = qf.db_url or f"sqlite:///{qf.home / 'catalog.db'}"
    sqlite = url.startswith("sqlite")
    engine = create_engine(
        url.replace("postgresql://", "postgresql+psycopg2://", 1),
        connect_args={"timeout": 0.5} if sqlite else {"options": "-c lock_timeout=500"},
    )
    try:
        for _ in range(50):
            proc.send_signal(signal.SIGSTOP)
            try:
                with engine.begin() as conn:
                    conn.execute(text("UPDATE jobs SET attempts = attempts"))
                    conn.execute(text("UPDATE claims SET token = token"))
                return
            except OperationalError:
                proc.send_signal(signal.SIGCONT)
                time.sleep(0.2)
        raise AssertionError("the process held the catalog every time it was stopped")
    finally:
        engine.dispose()
