"""The service's quotas and ownership under real concurrency, on SQLite and PostgreSQL alike: N processes submit
at one instant to a real `qf serve` of 2 processes; a server killed (SIGKILL) while a submission holds its place;
several users who want the same job."""
# ruff: noqa: F811 (the fixtures of test_service, imported by name)

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import create_engine, text

from tests.support.catalog_jobs import bare_job
from tests.support.processes import qf
from tests.support.service import Server, race, user_env


def _explain(server: Server, env: dict, answers: list[tuple[int, str]]) -> str:
    """What a failed race assertion prints: each racer's answer, the catalog's submissions and the server's log."""
    lines = ["answers (racer: status, job id or error):"]
    lines += [f"  {w}: {code} {said}" for w, (code, said) in enumerate(answers, 1)]
    lines.append("201s: " + ", ".join(said for code, said in answers if code == 201))
    try:
        engine = create_engine(
            (env["FACTORY_DB_URL"] or f"sqlite:///{env['FACTORY_HOME']}/catalog.db").replace(
                "postgresql://", "postgresql+psycopg2://", 1
            )
        )
        try:
            with engine.connect() as conn:
                rows = conn.execute(
                    text(
                        "SELECT s.id, s.username, s.job_id, s.created_at, s.withdrawn_at, j.state, j.created_at "
                        "FROM submissions s LEFT JOIN jobs j ON j.id = s.job_id ORDER BY s.id"
                    )
                ).all()
        finally:
            engine.dispose()
        lines.append("submissions (id, user, job, created, withdrawn, job state, job created):")
        lines += [f"  {tuple(str(v) for v in row)}" for row in rows]
    except Exception as e:  # the diagnostics never hide the assertion
        lines.append(f"submissions: not read ({e!r})")
    log = server.log.read_text(errors="replace").splitlines()
    lines.append(f"server log (last 60 of {len(log)} lines):")
    lines += ["  " + line for line in log[-60:]]
    return "\n".join(lines)


def test_max_running_holds_when_16_submissions_race(server, factory_env, tmp_path):
    model = str(Path(factory_env["FACTORY_SERVE_SOURCES"]) / "tiny")
    token = server.token("frank", "--max-running", "2")
    answers = race(server, token, model, 16)
    assert sorted(code for code, _ in answers) == [201] * 2 + [429] * 14, _explain(server, factory_env, answers)
    assert all(
        said.startswith("frank has 2 jobs queued or running, at most 2 are allowed at once")
        for code, said in answers
        if code == 429
    ), _explain(server, factory_env, answers)
    frank = user_env(server, token, tmp_path / "frank")
    jobs = json.loads(qf(frank, "status", "--json", check=True).stdout)
    assert sorted(j["id"] for j in jobs) == sorted(said for code, said in answers if code == 201), _explain(
        server, factory_env, answers
    )
    assert "Traceback" not in server.log.read_text(), _explain(server, factory_env, answers)


POST = """
import sys, time
import httpx
import pytest
url, token, path, start = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
    http.get(url + "/api/me").raise_for_status()
    time.sleep(max(0.0, start - time.time()))
    answer = http.post(url + path)
print(answer.status_code, answer.text)
"""


def _at_once(server: Server, calls: list[tuple[str, str]]) -> list[tuple[int, dict]]:
    """POST each (token, path) from its own process at the same instant: their (status, body)."""
    start = time.time() + 3
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", POST, server.url, token, path, str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for token, path in calls
    ]
    answers = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), answers
    return [(int(out.split(" ", 1)[0]), json.loads(out.split(" ", 1)[1])) for out, _ in answers]


def test_another_user_who_submits_the_same_job_cannot_cancel_it_for_its_owner(server, factory_env, tmp_path):
    """bob posts alice's exact submission: he gets her job id (the work is shared), but his cancel withdraws only
    his own interest; the job is cancelled when its last owner cancels, even when both cancel at one instant."""
    model = Path(factory_env["FACTORY_SERVE_SOURCES"]) / "tiny"
    alice_token, bob_token = server.token("alice"), server.token("bob")
    alice = user_env(server, alice_token, tmp_path / "alice")
    bob = user_env(server, bob_token, tmp_path / "bob")
    job_id = qf(alice, "submit", model, "--awq", "--eval-windows", 1, check=True).stdout.strip()
    assert qf(bob, "submit", model, "--awq", "--eval-windows", 1, check=True).stdout.strip() == job_id

    cancelled = qf(bob, "cancel", job_id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stderr.strip() == (
        f"job {job_id}: withdrawn; it goes on (queued) for 1 other user(s) who submitted it too"
    )
    assert json.loads(qf(alice, "status", job_id, "--json", check=True).stdout)["state"] == "queued"
    assert qf(alice, "cancel", job_id, check=True).stderr.strip() == f"job {job_id}: cancelled"

    retried = qf(bob, "retry", job_id)  # bob wants it again: the job is his, and queued for him
    assert retried.returncode == 0 and retried.stdout.strip() == job_id, retried.stderr
    assert json.loads(qf(bob, "status", job_id, "--json", check=True).stdout)["state"] == "queued"
    assert qf(alice, "submit", model, "--awq", "--eval-windows", 1, check=True).stdout.strip() == job_id
    for _ in range(3):  # both owners cancel at one instant: the last withdrawal, whichever it is, cancels the job
        answers = _at_once(
            server, [(alice_token, f"/api/jobs/{job_id}/cancel"), (bob_token, f"/api/jobs/{job_id}/cancel")]
        )
        assert [code for code, _ in answers] == [200, 200], answers
        assert sorted(body["others"] for _, body in answers) == [0, 1], answers
        assert json.loads(qf(alice, "status", job_id, "--json").stdout)["state"] == "cancelled"
        qf(alice, "retry", job_id, check=True)
        assert qf(bob, "submit", model, "--awq", "--eval-windows", 1, check=True).stdout.strip() == job_id

    carol = user_env(server, server.token("carol"), tmp_path / "carol")  # never submitted it: nothing to act on
    assert qf(carol, "cancel", job_id).returncode == 4 and qf(carol, "retry", job_id).returncode == 4
    assert "Traceback" not in server.log.read_text()


def _pending_places(db_url: str, home: str) -> int:
    engine = create_engine(
        (db_url or f"sqlite:///{home}/catalog.db").replace("postgresql://", "postgresql+psycopg2://", 1)
    )
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT count(*) FROM submissions WHERE job_id IS NULL")).scalar()
    finally:
        engine.dispose()


PLACE_SECONDS = 15  # long enough that a loaded machine restarts the server and asks again inside it


def test_a_place_held_by_a_server_killed_mid_submission_is_let_go(factory_env, tmp_path):
    """`qf serve` is SIGKILLed while a submission of a user with --max-running 1 holds its place (its source, with
    2 GB to hash, takes a while): the place is let go after FACTORY_PLACE_SECONDS, and the user may submit again."""
    env = {**factory_env, "FACTORY_PLACE_SECONDS": str(PLACE_SECONDS)}
    slow = Path(env["FACTORY_SERVE_SOURCES"]) / "slow"
    shutil.copytree(Path(env["FACTORY_SERVE_SOURCES"]) / "tiny", slow)
    with open(slow / "tokenizer.model", "wb") as f:  # sparse: hashed, but it takes no disk
        f.truncate(2 << 30)
    server = Server(env, tmp_path / "server.log", "--workers", "1")
    token = server.token("dora", "--max-running", "1")
    dora = user_env(server, token, tmp_path / "dora")
    # the server she asks next is up before the place is taken: a server's start on a loaded machine took longer
    # than the place's 15 s (CI, 2026-12-07), and her next submission must come while it is held
    second = Server(env, tmp_path / "server2.log", "--workers", "1")
    try:
        submitting = subprocess.Popen(
            [sys.executable, "-m", "factory.cli", "submit", str(slow), "--awq"],
            env=dora,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while _pending_places(env["FACTORY_DB_URL"], env["FACTORY_HOME"]) == 0:
            assert submitting.poll() is None and time.monotonic() < deadline, submitting.communicate()
            time.sleep(0.01)
        expires = time.monotonic() + PLACE_SECONDS  # at the latest: the place was taken a moment ago
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(timeout=30)
        assert submitting.wait(timeout=60) == 5  # the service went away
        dora = user_env(second, token, tmp_path / "dora")
        model = Path(env["FACTORY_SERVE_SOURCES"]) / "tiny"
        body = {"source": str(model), "flags": {"awq": True}, "eval_windows": 1}
        with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
            held = http.post(second.url + "/api/jobs", json=body)  # at once: a `qf` child takes seconds to start
        assert time.monotonic() < expires, "the place ran out before it could be asked for: too slow a machine"
        assert held.status_code == 429 and held.json()["error"].startswith(
            "dora has 1 jobs queued or running, at most 1"
        ), held.text
        time.sleep(max(0.0, expires - time.monotonic()) + 0.5)
        again = qf(dora, "submit", model, "--awq", "--eval-windows", 1)
        assert again.returncode == 0, again.stderr
        assert _pending_places(env["FACTORY_DB_URL"], env["FACTORY_HOME"]) == 0
    finally:
        for each in (server, second):
            if each.proc.poll() is None:
                each.stop()


class Follower:
    """One open `GET /api/jobs/J/events` stream, read in a thread until it is closed."""

    def __init__(self, url: str, token: str, job_id: str):
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=httpx.Timeout(30, read=None)
        )
        self.response = self.http.send(self.http.build_request("GET", f"/api/jobs/{job_id}/events"), stream=True)
        self.status = self.response.status_code
        if self.status == 200:
            threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        try:
            for _ in self.response.iter_lines():
                pass
        except httpx.HTTPError:
            pass  # closed by the test

    def close(self) -> None:
        self.response.close()
        self.http.close()


def test_followers_are_bounded_and_let_their_redis_connection_go(factory_env, tmp_path):
    """8 streams of one user are the most; 64 of one server process; other routes answer meanwhile; once the
    clients go, every Redis subscription of theirs is gone within a few seconds and new followers are taken."""
    server = Server(factory_env, tmp_path / "server.log", "--workers", "1")
    try:
        _followers_bounded(server, factory_env, tmp_path)
    finally:
        server.stop()


def _followers_bounded(server: Server, factory_env: dict, tmp_path: Path) -> None:
    from tests.support.fleet import BROKER

    model = Path(factory_env["FACTORY_SERVE_SOURCES"]) / "tiny"
    tokens = [server.token(f"user{i}") for i in range(9)]
    job_id = qf(user_env(server, tokens[0], tmp_path / "u0"), "submit", model, "--awq", check=True).stdout.strip()
    for token in tokens[1:]:  # the same job: each user owns it too, and may follow it
        qf(user_env(server, token, tmp_path / "u"), "submit", model, "--awq", check=True)
    followers = [Follower(server.url, tokens[0], job_id) for _ in range(8)]
    ninth = Follower(server.url, tokens[0], job_id)
    assert [f.status for f in followers] == [200] * 8 and ninth.status == 429
    ninth.response.read()
    assert ninth.response.json() == {
        "error": "user0 follows 8 jobs at once on this server, the most it allows; "
        "stop one (Ctrl-C its `qf status --follow`) and follow again",
        "exit_code": 5,
    }
    followers += [Follower(server.url, token, job_id) for token in tokens[1:8] for _ in range(8)]
    assert [f.status for f in followers] == [200] * 64
    refused = Follower(server.url, tokens[8], job_id)
    assert (
        refused.status == 429
        and refused.response.read()
        and refused.response.json()["error"].startswith("this server has 64 followers, the most it allows")
    )
    broker = redis.Redis.from_url(BROKER)
    channel = f"quantfactory:events:{job_id}"
    assert broker.pubsub_numsub(channel) == [(channel.encode(), 64)]
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tokens[8]}"}) as api:
        assert api.get("/api/jobs").status_code == 200 and api.get(f"/api/jobs/{job_id}").status_code == 200
    for f in followers:
        f.close()
    deadline = time.monotonic() + 20
    while broker.pubsub_numsub(channel) != [(channel.encode(), 0)]:
        assert time.monotonic() < deadline, broker.pubsub_numsub(channel)
        time.sleep(0.2)
    again = Follower(server.url, tokens[8], job_id)
    assert again.status == 200
    again.close()
    assert "Traceback" not in server.log.read_text()


def test_a_place_recorded_between_the_quota_counts_is_still_counted(db_url):
    """The interleaving behind a rare third 201 of the race above, forced: C reserves while A's place becomes A's job
    (record, which takes no token lock) right after C's count reads the catalog. Counted in two statements, A's place
    fell between them on PostgreSQL (READ COMMITTED: one snapshot per statement) and C got a third place."""
    if not db_url:
        pytest.skip("SQLite serializes writers: record() cannot commit inside reserve's transaction there")
    from sqlalchemy import event

    from factory.catalog import Catalog
    from factory.errors import OverQuota

    catalog = Catalog(db_url)
    accounts = catalog.accounts
    secret, _ = accounts.create("frank", max_running=2)
    frank = accounts.authenticate(secret)

    def job(windows: int):
        return bare_job(catalog, windows, name="tiny", source="/m/tiny", eval_windows=windows)

    place_a, job_a = accounts.reserve(frank, 900), job(1)  # A: its place, its job, not recorded yet
    accounts.reserve(frank, 900)  # B
    recorded = []

    @event.listens_for(catalog.db.engine, "after_cursor_execute")
    def record_a_now(conn, cursor, statement, *args):
        if not recorded and "count(" in statement:  # C has read its count: A's record commits now
            recorded.append(accounts.record(place_a, frank, job_a.id))

    with pytest.raises(OverQuota, match="frank has 2 jobs queued or running"):
        accounts.reserve(frank, 900)
    assert recorded
    catalog.db.engine.dispose()


def test_a_retry_counts_against_the_quotas_as_a_submission_does(server, factory_env, tmp_path):
    """gus may have 1 job at once and 4 a day. Of three jobs submitted and cancelled in turn, the third still
    queued, the first two cannot be retried while it is (it was how a user had 3 jobs queued); once it is cancelled,
    one retry is his 4th job of the day, and the next is refused by the daily quota."""
    model = Path(factory_env["FACTORY_SERVE_SOURCES"]) / "tiny"
    gus = user_env(server, server.token("gus", "--max-running", "1", "--quota-jobs-per-day", "4"), tmp_path / "gus")
    jobs = []
    for windows in (1, 2, 3):
        jobs.append(qf(gus, "submit", model, "--awq", "--eval-windows", windows, check=True).stdout.strip())
        if windows < 3:
            qf(gus, "cancel", jobs[-1], check=True)
    for job_id in jobs[:2]:
        refused = qf(gus, "retry", job_id)
        assert (refused.returncode, refused.stderr) == (
            5,
            "error: gus has 1 jobs queued or running, at most 1 are allowed at once; the next one may be "
            "submitted when one of them ends\n",
        )
    qf(gus, "cancel", jobs[2], check=True)
    assert qf(gus, "retry", jobs[0], check=True).stdout.strip() == jobs[0]
    qf(gus, "cancel", jobs[0], check=True)
    refused = qf(gus, "retry", jobs[1])
    assert refused.returncode == 5 and refused.stderr.startswith(
        "error: gus has submitted 4 jobs in the last 24 hours, the quota is 4 a day"
    ), refused.stderr
    states = {j["id"]: j["state"] for j in json.loads(qf(gus, "status", "--json", check=True).stdout)}
    assert states == dict.fromkeys(jobs, "cancelled")
    assert _pending_places(factory_env["FACTORY_DB_URL"], factory_env["FACTORY_HOME"]) == 0


def test_a_place_let_go_while_its_submission_still_runs_is_not_recorded_past_the_quota(db_url):
    """A's submission outlives its place (FACTORY_PLACE_SECONDS): B's reserve lets the place go, takes the user's
    only place (--max-running 1) and records its job. A's record must not add a second running job: it is refused
    with OverQuota and A's job, which nobody else wants, is cancelled. A place let go while the quota stays free is
    taken again at record."""
    from factory.catalog import Catalog, JobState
    from factory.errors import OverQuota

    catalog = Catalog(db_url or "sqlite:///" + str(Path(tempfile.mkdtemp()) / "catalog.db"))
    accounts = catalog.accounts
    secret, _ = accounts.create("hal", max_running=1)
    hal = accounts.authenticate(secret)

    def job(windows: int):
        return bare_job(catalog, windows, name="tiny", source="/m/tiny", eval_windows=windows)

    place_a, job_a = accounts.reserve(hal, 900), job(1)
    place_b = accounts.reserve(hal, 0)  # B finds A's place expired (a place of 0 seconds) and lets it go
    job_b = job(2)
    assert accounts.record(place_b, hal, job_b.id).state == JobState.queued
    with pytest.raises(OverQuota, match="hal has 1 jobs queued or running, at most 1") as refused:
        accounts.record(place_a, hal, job_a.id)
    assert refused.value.message.startswith("this submission took longer than its place in hal's quota is held")
    assert (
        catalog.jobs.get(job_a.id).state == JobState.cancelled and catalog.jobs.get(job_b.id).state == JobState.queued
    )
    assert accounts.job_ids(hal) == {job_b.id}

    catalog.jobs.cancel(job_b.id)  # the quota is free again: a place let go meanwhile is taken again at record
    place_c, job_c = accounts.reserve(hal, 900), job(3)
    accounts.release(accounts.reserve(hal, 0))  # lets C's place go; its own submission is refused (bad input)
    assert accounts.record(place_c, hal, job_c.id).state == JobState.queued
    assert accounts.job_ids(hal) == {job_b.id, job_c.id}
    catalog.db.engine.dispose()
