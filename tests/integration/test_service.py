"""The factory's service (`qf serve`) against a real server: uvicorn on a free port, the real catalog (SQLite, or
PostgreSQL in that pass) and Redis, a real worker; the CLI as its users run it, with FACTORY_SERVER and a token and
no way to reach the catalog or the broker themselves. The dashboard is read by headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from tests.support import ROOT
from tests.support.fleet import BROKER, follow_while_a_worker_runs, start_worker
from tests.support.processes import qf
from tests.support.service import Server, race, user_env


def test_a_user_submits_follows_and_pulls_from_another_machine(server, factory_env, tmp_path):
    alice = user_env(server, server.token("alice"), tmp_path / "alice")
    model = Path(factory_env["FACTORY_SERVE_SOURCES"]) / "tiny"
    submitted = qf(alice, "submit", model, "--awq", "--eval-windows", 1)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert len(job_id) == 12 and qf(alice, "submit", model, "--awq", "--eval-windows", 1).stdout.strip() == job_id
    worker = start_worker(factory_env, tmp_path / "worker.log")
    try:
        followed = qf(alice, "status", job_id, "--follow", "--json")
        assert followed.returncode == 0, followed.stderr
        events = [json.loads(line) for line in followed.stdout.splitlines()]
        assert events[-1]["event"] == "result" and events[-1]["state"] == "succeeded"
        assert any(e["event"] == "step" and e["step"] == "quantize:awq-w4g128" for e in events)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    status = json.loads(qf(alice, "status", job_id, "--json", check=True).stdout)
    assert status["state"] == "succeeded" and status["steps"][-1]["name"] == "publish:awq-w4g128"
    [row] = json.loads(qf(alice, "ls", "--json", check=True).stdout)
    assert row["name"] == "tiny:awq-w4g128" and row["job"] == job_id
    shown = json.loads(qf(alice, "show", "tiny", "--json", check=True).stdout)
    assert [q["name"] for q in shown["quants"]] == ["tiny:awq-w4g128"] and shown["jobs"][0]["id"] == job_id
    assert "tiny:awq-w4g128" in qf(alice, "ls", check=True).stdout

    pulled = qf(alice, "pull", "tiny:awq-w4g128", "-o", tmp_path / "pulled")
    assert pulled.returncode == 0, pulled.stderr
    assert "files verified" in pulled.stderr
    registry = Path(factory_env["FACTORY_HOME"]) / "registry" / row["path"]
    assert sorted(p.name for p in (tmp_path / "pulled").iterdir()) == sorted(p.name for p in registry.iterdir())
    for p in registry.iterdir():
        assert (tmp_path / "pulled" / p.name).read_bytes() == p.read_bytes()
    assert not list(tmp_path.glob(".qf-pull-*"))


def test_other_users_tokens_scopes_and_revocation(server, factory_env, tmp_path):
    alice = user_env(server, server.token("alice"), tmp_path / "alice")
    bob = user_env(server, server.token("bob"), tmp_path / "bob")
    admin = user_env(server, server.token("root", "--scope", "admin"), tmp_path / "admin")
    reader = user_env(server, server.token("carol", "--scope", "read"), tmp_path / "carol")
    model = Path(factory_env["FACTORY_SERVE_SOURCES"]) / "tiny"
    job_id = qf(alice, "submit", model, "--awq", "--eval-windows", 1, check=True).stdout.strip()

    for args in (("status", job_id), ("cancel", job_id), ("retry", job_id)):
        refused = qf(bob, *args)
        assert (refused.returncode, refused.stderr) == (
            4,
            f"error: no job {job_id!r}; `qf status` lists the recent ones\n",
        )
    assert json.loads(qf(bob, "status", "--json", check=True).stdout) == []
    assert [j["id"] for j in json.loads(qf(admin, "status", "--json", check=True).stdout)] == [job_id]
    refused = qf(reader, "submit", model, "--awq")
    assert (refused.returncode, refused.stderr) == (
        5,
        "error: this token of carol lacks the 'submit' scope; ask the factory's admin for a token that has it\n",
    )
    early = qf(alice, "retry", job_id)
    assert (early.returncode, early.stderr) == (
        2,
        f"error: job {job_id} is queued; only failed or cancelled jobs can be retried\n",
    )
    assert qf(alice, "cancel", job_id).stderr == f"job {job_id}: cancelled\n"
    assert qf(alice, "retry", job_id).stdout.strip() == job_id

    [alice_token] = [
        t for t in json.loads(qf(factory_env, "token", "ls", "--json", check=True).stdout) if t["user"] == "alice"
    ]
    assert "token" not in alice_token and alice_token["scopes"] == ["read", "submit", "pull"]
    qf(factory_env, "token", "revoke", alice_token["id"], check=True)
    refused = qf(alice, "status", job_id)
    assert (refused.returncode, refused.stderr) == (
        5,
        "error: the token is not valid here (revoked, or not one of "
        "this factory's); ask the factory's admin for a new one\n",
    )
    nobody = qf(user_env(server, None, tmp_path / "nobody"), "ls")
    assert nobody.returncode == 5 and "this request has no token; set FACTORY_TOKEN" in nobody.stderr
    wrong = qf({**bob, "FACTORY_SERVER": "http://127.0.0.1:1"}, "ls")
    assert (wrong.returncode, wrong.stderr) == (
        5,
        "error: the factory's service at http://127.0.0.1:1 cannot be reached\n",
    )


def test_quotas_refuse_the_next_job_with_when_it_resets(server, factory_env, tmp_path):
    model = Path(factory_env["FACTORY_SERVE_SOURCES"]) / "tiny"
    daily = user_env(server, server.token("dora", "--quota-jobs-per-day", "2"), tmp_path / "dora")
    for windows in (1, 2):
        qf(daily, "submit", model, "--awq", "--eval-windows", windows, check=True)
    refused = qf(daily, "submit", model, "--awq", "--eval-windows", 3)
    assert refused.returncode == 5, refused.stderr
    assert refused.stderr.startswith(
        "error: dora has submitted 2 jobs in the last 24 hours, the quota is 2 a day; the next one may be submitted at "
    )
    assert len(json.loads(qf(daily, "status", "--json", check=True).stdout)) == 2

    running = user_env(server, server.token("erin", "--max-running", "1"), tmp_path / "erin")
    first = qf(running, "submit", model, "--awq", "--eval-windows", 4, check=True).stdout.strip()
    refused = qf(running, "submit", model, "--awq", "--eval-windows", 5)
    assert (refused.returncode, refused.stderr) == (
        5,
        "error: erin has 1 jobs queued or running, at most 1 are "
        "allowed at once; the next one may be submitted when one of "
        "them ends\n",
    )
    qf(running, "cancel", first, check=True)
    bad = qf(running, "submit", model, "--awq", "--eval-windows", 5, "--kv-cache", "q3", "--fit", "24GB")
    assert bad.returncode == 2, bad.stderr  # refused input takes no place in the quota
    qf(running, "submit", model, "--awq", "--eval-windows", 5, check=True)
    assert len(json.loads(qf(running, "status", "--json", check=True).stdout)) == 2


def test_a_quota_holds_when_submissions_race(server, factory_env, tmp_path):
    """8 processes submit 8 different jobs for one user at the same instant, on a server of 2 processes: exactly
    the quota's 3 are accepted, the other 5 refused with 429 and the quota's sentence."""
    model = str(Path(factory_env["FACTORY_SERVE_SOURCES"]) / "tiny")
    token = server.token("frank", "--quota-jobs-per-day", "3")
    answers = race(server, token, model, 8)
    assert sorted(code for code, _ in answers) == [201] * 3 + [429] * 5, answers
    refused = [said for code, said in answers if code == 429]
    assert all(r.startswith("frank has submitted 3 jobs in the last 24 hours, the quota is 3 a day") for r in refused)
    frank = user_env(server, token, tmp_path / "frank")
    jobs = json.loads(qf(frank, "status", "--json", check=True).stdout)
    assert sorted(j["id"] for j in jobs) == sorted(said for code, said in answers if code == 201)


def test_bad_requests_get_one_sentence_and_never_reach_the_filesystem(finished, tmp_path):
    qf_finished, _ = finished
    env = {
        **os.environ,
        "FACTORY_HOME": str(qf_finished.home),
        "FACTORY_DB_URL": qf_finished.db_url,
        "FACTORY_BROKER_URL": BROKER,
        "FACTORY_SERVE_SOURCES": str(tmp_path / "models"),
    }
    server = Server(env, tmp_path / "server.log")
    try:
        token = server.token("mallory")
        api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"})
        for path in (
            "/api/quants/tiny/awq-w4g128/files/..%2Fcatalog.db",
            "/api/quants/tiny/awq-w4g128/files/..%2F..%2F..%2Fcatalog.db",
            "/api/quants/..%2F..%2Fcatalog.db/x",
            "/api/quants/tiny/..%2F..%2F/files/manifest.json",
            "/api/jobs/..%2F..%2Fetc",
            "/api/../catalog.db",
            "/registry/tiny",
        ):
            answer = api.get(path)
            assert answer.status_code in (404, 422), (path, answer.status_code, answer.text)
            assert answer.headers["content-type"] == "application/json" and set(answer.json()) == {"error", "exit_code"}
        assert api.get("/api/quants/tiny/awq-w4g128/files/manifest.json").status_code == 200
        for source in ("/etc", str(qf_finished.home), "../../etc", "not a model"):
            answer = api.post("/api/jobs", json={"source": source, "flags": {"awq": True}})
            assert answer.status_code in (403, 422) and answer.json()["error"].startswith(f"source {source!r}")
        answer = api.post("/api/jobs", json={"source": "org/model", "calibration": "file:/etc/passwd"})
        assert answer.status_code in (403, 422, 503), answer.text
        big = api.post("/api/jobs", content=b"{" + b" " * 100_000 + b"}", headers={"Content-Type": "application/json"})
        assert (big.status_code, big.json()["error"]) == (
            413,
            "the request body is over 64 KiB, the most this factory takes",
        )
        assert (
            api.post("/api/jobs", content=b"{not json", headers={"Content-Type": "application/json"}).status_code == 422
        )
        for base_model in ("org/x\n# Free GPUs", "org/x](https://e.vil)", "gpt2"):  # it reached the card
            hostile = api.post(
                "/api/jobs", json={"source": "org/model", "flags": {"awq": True}, "base_model": base_model}
            )
            assert (hostile.status_code, hostile.json()) == (
                422,
                {
                    "error": f"--base-model {base_model!r} is not a Hub repo id: owner/name, ASCII letters, digits, "
                    "'-', '_' and '.', at most 96 each, no '--' or '..'",
                    "exit_code": 2,
                },
            )
        extra = api.post("/api/jobs", json={"source": "org/model", "surprise": 1})
        assert extra.status_code == 422 and "surprise" in extra.json()["error"]
        assert api.get("/api/jobs", params={"limit": 0}).status_code == 422
        anonymous = httpx.get(server.url + "/api/quants")
        assert anonymous.status_code == 401 and anonymous.json()["exit_code"] == 5
        assert "Traceback" not in server.log.read_text()
    finally:
        server.stop()


def test_the_api_tells_a_user_nothing_of_the_server(finished, tmp_path):
    """One answer for a source that is not allowed and one that is not there; no server path outside the served
    folders, no database or broker address, to anyone but the admin; eval_windows of 3e9 is one sentence."""
    qf_finished, _ = finished
    env = {
        **os.environ,
        "FACTORY_HOME": str(qf_finished.home),
        "FACTORY_DB_URL": qf_finished.db_url,
        "FACTORY_BROKER_URL": BROKER,
        "FACTORY_SERVE_SOURCES": str(tmp_path / "models"),
    }
    (tmp_path / "models").mkdir()
    server = Server(env, tmp_path / "server.log")
    try:
        user, admin = (
            httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token(name, *a)}"}, timeout=60)
            for name, *a in (("mallory",), ("root", "--scope", "admin"))
        )

        def answer(source: str) -> tuple[int, str]:
            got = user.post("/api/jobs", json={"source": source, "flags": {"awq": True}})
            return got.status_code, re.sub(r"^source '[^']*'", "source S", got.json()["error"])

        there = [answer(s) for s in ("/etc", "/etc/passwd", "../../../../etc", str(qf_finished.home), "tests")]
        not_there = [answer(s) for s in ("/etc/nothing-here", "/nothing/at/all", "../../../../nothing", "not-here")]
        assert len(set(there + not_there)) == 1 and there[0][0] == 403, there + not_there
        # Hub-shaped, and a path where `qf serve` was started (this repository) or not: the Hub is asked for both
        assert answer("factory/factory.py") == answer("factory/nothing.py"), answer("factory/factory.py")
        windows = user.post(
            "/api/jobs", json={"source": "org/model", "flags": {"awq": True}, "eval_windows": 3_000_000_000}
        )
        assert windows.status_code == 422 and windows.json()["exit_code"] == 2, windows.text
        assert "eval_windows: must be between 1 and 100000" in windows.json()["error"]
        home = str(qf_finished.home)
        for path in ("/api/quants", "/api/models/tiny", "/api/quants/tiny/awq-w4g128", "/api/jobs?limit=50"):
            seen = user.get(path)
            assert seen.status_code == 200 and home not in seen.text and "/tmp/" not in seen.text, (path, seen.text)
        [quant] = user.get("/api/quants").json()
        assert quant["source"] == "<server>/tiny" and admin.get("/api/quants").json()[0]["source"].startswith("/")
    finally:
        server.stop()
    unreachable = Server({**env, "FACTORY_BROKER_URL": "redis://:secret@127.0.0.1:1/0"}, tmp_path / "down.log")
    try:
        token = unreachable.token("mallory")
        (tmp_path / "models" / "tiny").mkdir()
        down = httpx.post(
            unreachable.url + "/api/jobs",
            json={"source": str(tmp_path / "models" / "tiny")},
            headers={"Authorization": f"Bearer {token}"},
            timeout=60,
        )
        assert down.status_code == 503 and down.json() == {
            "error": "the factory's service cannot reach a service it needs (its catalog, broker or the Hub) now; try "
            "again later (its log says which)",
            "exit_code": 5,
        }
        assert "redis://:***@127.0.0.1:1/0 cannot be reached" in (tmp_path / "down.log").read_text()
    finally:
        unreachable.stop()


class SlowProxy:
    """A TCP proxy in front of the server that hands its answers on 16 KiB at a time with a pause, so that a
    download lasts long enough to be killed half-way."""

    def __init__(self, port: int):
        self.upstream, self.listener = port, socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pipe, args=(client, server, 0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, 0.05), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, pause: float) -> None:
        try:
            while chunk := source.recv(16384):
                sink.sendall(chunk)
                time.sleep(pause)
        except OSError:
            pass
        finally:
            sink.close()


def test_a_pull_killed_half_way_resumes_and_a_corrupt_one_is_refused(finished, tmp_path):
    qf_finished, _ = finished
    env = {
        **os.environ,
        "FACTORY_HOME": str(qf_finished.home),
        "FACTORY_DB_URL": qf_finished.db_url,
        "FACTORY_BROKER_URL": BROKER,
    }
    server = Server(env, tmp_path / "server.log")
    try:
        user = user_env(server, server.token("paul", "--scope", "read,pull"), tmp_path / "paul")
        [row] = json.loads(qf(user, "ls", "--json", check=True).stdout)
        registry = qf_finished.home / "registry" / row["path"]
        biggest = max((p for p in registry.iterdir() if p.name != "manifest.json"), key=lambda p: p.stat().st_size)

        def partial() -> Path:  # in the pull's own staging folder, .qf-pull-out-<rev>.<random>
            return next(iter(tmp_path.glob(f".qf-pull-out-{row['rev']}.*/{biggest.name}")), tmp_path / "none")

        slow = {**user, "FACTORY_SERVER": SlowProxy(server.port).url}
        pull = subprocess.Popen(
            [sys.executable, "-m", "factory.cli", "pull", row["name"], "-o", tmp_path / "out"],
            env=slow,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while not (partial().exists() and partial().stat().st_size > biggest.stat().st_size // 4):
            assert pull.poll() is None and time.monotonic() < deadline, "the pull ended before it could be killed"
            time.sleep(0.05)
        pull.kill()
        pull.wait()
        assert 0 < partial().stat().st_size < biggest.stat().st_size and not (tmp_path / "out").exists()
        resumed = qf(user, "pull", row["name"], "-o", tmp_path / "out")
        assert resumed.returncode == 0, resumed.stderr
        assert (tmp_path / "out" / biggest.name).read_bytes() == biggest.read_bytes()
        assert "206 Partial Content" in server.log.read_text()  # it asked for the rest, not the whole file

        staging = Path(tempfile.mkdtemp(prefix=f".qf-pull-bad-{row['rev']}.", dir=tmp_path))  # as a pull makes it
        (staging / biggest.name).write_bytes(b"\0" * (biggest.stat().st_size // 2))  # a partial download gone wrong
        refused = qf(user, "pull", row["name"], "-o", tmp_path / "bad")
        assert (refused.returncode, refused.stderr) == (
            1,
            f"error: {biggest.name} of {row['name']}@{row['rev']} "
            f"from the factory's service at {server.url} does not "
            "match its sha256 in the manifest; pull again\n",
        )
        assert not (tmp_path / "bad").exists() and not (staging / biggest.name).exists()
        assert qf(user, "pull", row["name"], "-o", tmp_path / "bad").returncode == 0
    finally:
        server.stop()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DOCS = ROOT / "docs"


def _browse(url: str, screenshot: Path | None = None, wait_ms: int = 0) -> str:
    """The page's DOM after Chromium rendered it (and, where asked, a screenshot of it); `wait_ms` of (virtual)
    time for a page's scripts to finish first. No network but this machine's (Chromium's own is switched off)."""
    flags = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--window-size=1280,900",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        *([f"--virtual-time-budget={wait_ms}"] if wait_ms else []),
        f"--user-data-dir={Path(os.environ.get('TMPDIR', '/tmp')) / 'qf-chromium'}",
    ]
    if screenshot is not None:
        subprocess.run([*flags, f"--screenshot={screenshot}", url], capture_output=True, timeout=120, check=True)
    return subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True).stdout


@pytest.mark.skipif(not CHROMIUM and not os.environ.get("QF_REQUIRE_BROWSER"), reason="needs chromium")
def test_the_dashboard_in_a_browser(finished, tmp_path):
    assert CHROMIUM, "QF_REQUIRE_BROWSER is set and chromium is not installed"
    qf_finished, _ = finished
    env = {
        **os.environ,
        "FACTORY_HOME": str(qf_finished.home),
        "FACTORY_DB_URL": qf_finished.db_url,
        "FACTORY_BROKER_URL": BROKER,
    }
    private = Server(env, tmp_path / "private.log")
    try:
        assert '<form method="post" action="/login">' in httpx.get(private.url + "/", follow_redirects=True).text
    finally:
        private.stop()
    server = Server(env, tmp_path / "server.log", "--public")
    shots = Path(os.environ.get("QF_SCREENSHOTS", tmp_path))
    try:
        [row] = json.loads(qf({**env, "FACTORY_SERVER": server.url}, "ls", "--json", check=True).stdout)
        index = _browse(server.url + "/", shots / "dashboard.png")
        assert f'data-job="{row["job"]}"' in index and 'class="state-succeeded">succeeded<' in index
        assert f'data-quant="{row["name"]}"' in index and f"{row['ppl']:.3f}" in index
        model = _browse(server.url + "/models/tiny", shots / "dashboard-model.png")
        assert f"{row['ppl']:.3f}" in model and f"{row['kld']:.4f}" in model
        assert 'src="/models/tiny/ppl.png"' in model and 'src="/models/tiny/kld.png"' in model
        for plot in ("ppl", "kld"):
            png = httpx.get(f"{server.url}/models/tiny/{plot}.png")
            assert png.status_code == 200 and png.content.startswith(b"\x89PNG")
        job = _browse(f"{server.url}/jobs/{row['job']}", shots / "dashboard-job.png")
        assert 'class="step"' in job and "quantize:awq-w4g128" in job
        missing = _browse(server.url + "/models/nosuchmodel")
        assert "no model named 'nosuchmodel'" in missing
        docs_page = httpx.get(server.url + "/docs").text  # the API's docs work without internet: every asset is ours
        assets = re.findall(r'(?:src|href)="([^"]+)"', docs_page) + re.findall(r"url: '([^']+)'", docs_page)
        assert assets and all(a.startswith("/") and httpx.get(server.url + a).status_code == 200 for a in assets)
        docs = _browse(server.url + "/docs", shots / "api-docs.png", wait_ms=8000)
        assert "/api/jobs/{job_id}/events" in docs and "opblock" in docs  # Swagger UI rendered our API
    finally:
        server.stop()


def test_the_watchlist_through_the_service_is_for_admins(server, tmp_path):
    admin = user_env(server, server.token("root", "--scope", "admin"), tmp_path / "root")
    alice = user_env(server, server.token("alice"), tmp_path / "alice")
    added = qf(admin, "watch", "add", "Qwen/*-Instruct", "--awq", "--max-params", "2e9")
    assert (added.returncode, added.stderr) == (0, "watching Qwen/*-Instruct\n")
    [row] = json.loads(qf(admin, "watch", "ls", "--json", check=True).stdout)
    assert (row["target"], list(row["recipe"]), row["filter"]) == ("Qwen/*-Instruct", ["awq"], {"max_params": 2e9})
    refused = qf(alice, "watch", "ls")
    assert (refused.returncode, refused.stderr) == (
        5,
        "error: this token of alice lacks the 'admin' scope; ask the factory's admin for a token that has it\n",
    )
    bad = qf(admin, "watch", "add", "not-a-repo", "--awq")
    assert bad.returncode == 2 and "not-a-repo" in bad.stderr
    assert qf(admin, "watch", "rm", "Qwen/*-Instruct").returncode == 0
    gone = qf(admin, "watch", "rm", "Qwen/*-Instruct")
    assert (gone.returncode, gone.stderr) == (
        4,
        "error: 'Qwen/*-Instruct' is not on the watchlist; `qf watch ls` shows it\n",
    )


# A queue plugin that imports but is not a Queue (issue 43: the service answered 500). Installed as the service's own
# metadata would install it: a `quantfactory` distribution earlier on the path, whose entry point names the plugin.
WRONG_QUEUE = """
class Klass:
    def check_broker(self): pass
    def submit(self, factory, request): pass
    def retry(self, factory, job_id): pass
    def follow(self, catalog, broker_url, job_id): pass
    def watch_check(self, dry_run): pass
    def reconcile(self): pass
    def worker_command(self, node, queues): pass
    def beat_command(self, schedule): pass


class Few(Klass):
    def submit(self, factory): pass


class Names:
    check_broker = submit = retry = follow = watch_check = reconcile = worker_command = beat_command = "no method"


FEW, NAMES = Few(), Names()
"""


@pytest.mark.parametrize(
    ("target", "why"),
    [
        ("wrongqueue:MISSING", "cannot be loaded: AttributeError: module 'wrongqueue' has no attribute 'MISSING'"),
        (  # a module that is not there: an installation made before workers/queue.py became celery_queue.py
            "gonequeue:QUEUE",
            "cannot be loaded: ModuleNotFoundError: No module named 'gonequeue'; reinstall quantfactory",
        ),
        ("wrongqueue:Klass", "is not a Queue (factory/fleet.py): it is the class Klass, not a Queue object"),
        (
            "wrongqueue:FEW",
            "is not a Queue (factory/fleet.py): its submit does not take the 2 arguments of Queue.submit",
        ),
        ("wrongqueue:NAMES", "is not a Queue (factory/fleet.py): it has no method check_broker"),
    ],
    ids=["missing-name", "missing-module", "a-class", "other-arguments", "no-methods"],
)
def test_a_queue_plugin_that_is_not_a_queue_is_one_sentence_not_a_500(factory_env, tmp_path, target, why):
    plugin = tmp_path / "plugin"
    (plugin / "quantfactory-0.1.0.dist-info").mkdir(parents=True)
    (plugin / "quantfactory-0.1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: quantfactory\n")
    (plugin / "quantfactory-0.1.0.dist-info" / "entry_points.txt").write_text(
        f"[quantfactory.queue]\ncelery = {target}\n"
    )
    (plugin / "wrongqueue.py").write_text(WRONG_QUEUE)
    env = {**factory_env, "PYTHONPATH": os.pathsep.join([str(plugin), str(ROOT)])}
    # from the plugin's folder: `python -m` puts its cwd first on the path, and the clone's root holds the real
    # quantfactory.egg-info (an editable install's), whose entry point would be found first
    server = Server(env, tmp_path / "server.log", cwd=plugin)
    try:
        token = server.token("alice")
        model = Path(factory_env["FACTORY_SERVE_SOURCES"]) / "tiny"
        answer = httpx.post(
            server.url + "/api/jobs",
            json={"source": str(model), "recipe": "awq: {w_bit: 4}\n"},
            headers={"Authorization": f"Bearer {token}"},
            timeout=60,
        )
        assert answer.status_code == 503, answer.text
        submitted = qf(user_env(server, token, tmp_path / "alice"), "submit", model, "--awq")
        assert (submitted.returncode, submitted.stdout) == (5, "")
        assert submitted.stderr == (
            "error: the factory's service cannot reach a service it needs (its catalog, broker or the Hub) now; try "
            "again later (its log says which)\n"
        )
    finally:
        server.stop()
    log = (tmp_path / "server.log").read_text()
    assert f"the job queue '{target}' {why}" in log and "Traceback" not in log


def test_a_followers_events_hide_the_servers_paths_as_its_job_rows_do(server, factory_env, tmp_path):
    """The factory's admin submits a job with a calibration text in FACTORY_HOME; alice submits the same text from a
    served folder (the same job: its key is the text's hash). Her `qf status --follow` stream, like her job rows,
    shows the admin's file as `<server>/<name>`, never its path in FACTORY_HOME."""
    import calibration

    home, served = Path(factory_env["FACTORY_HOME"]), Path(factory_env["FACTORY_SERVE_SOURCES"])
    text = calibration.resolve("builtin:c4").text
    (home / "texts").mkdir(parents=True)
    for where in (home / "texts", served):
        (where / "private-cal.txt").write_text(text)
    model = served / "tiny"
    args = ("--awq", "--eval-windows", 1, "--calibration")
    job_id = qf(factory_env, "submit", model, *args, f"file:{home}/texts/private-cal.txt", check=True).stdout.strip()
    alice = user_env(server, server.token("alice"), tmp_path / "alice")
    assert qf(alice, "submit", model, *args, f"file:{served}/private-cal.txt", check=True).stdout.strip() == job_id
    events = follow_while_a_worker_runs(alice, factory_env, job_id, tmp_path / "worker.log")
    assert events[-1]["event"] == "result" and events[-1]["state"] == "succeeded"
    out = json.dumps(events)
    assert str(home) not in out and "<server>/private-cal.txt" in out
    assert events[-1]["quants"][0]["calibration"] == "file:<server>/private-cal.txt"
    rows = qf(alice, "status", job_id, "--json", check=True).stdout
    assert str(home) not in rows


def test_every_view_of_a_fleet_job_agrees_and_a_remake_says_so(server, factory_env, tmp_path):
    """Issue 45 through the service and a real worker: `qf status --follow` shows each step once (the publishing
    step's pass reads the source again without replaying inspect and the gate); `qf jobs`, `qf show`, the API and
    the dashboard count the job's steps and seconds alike; after `qf rm` on the factory, `qf submit` says what
    `qf run` says (the quant is made again), and the views still agree once it is."""
    alice = user_env(server, server.token("alice"), tmp_path / "alice")
    model = Path(factory_env["FACTORY_SERVE_SOURCES"]) / "tiny"
    job_id = qf(alice, "submit", model, "--awq", "--eval-windows", 1, check=True).stdout.strip()
    api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {alice['FACTORY_TOKEN']}"}, timeout=60)

    def followed(log: str) -> list[str]:
        """The steps a follower sees start, from before a worker takes the job to its end."""
        follower = subprocess.Popen(
            [sys.executable, "-m", "factory.cli", "status", job_id, "--follow", "--json"],
            env=alice,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        channel, deadline = f"quantfactory:events:{job_id}", time.monotonic() + 60
        while not redis.Redis.from_url(BROKER).pubsub_numsub(channel)[0][1]:  # the service listens for it
            assert follower.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        worker = start_worker(factory_env, tmp_path / log)
        try:
            out, _ = follower.communicate(timeout=180)
        finally:
            worker.terminate()
            worker.wait(timeout=30)
        events = [json.loads(line) for line in out.splitlines()]
        assert events[-1]["event"] == "result" and events[-1]["state"] == "succeeded", events[-1]
        return [e["step"] for e in events if e["event"] == "step" and e["state"] == "running"]

    def views_agree() -> str:
        summary = api.get(f"/api/jobs/{job_id}").json()["summary"]
        cell = f"{summary['done']}/{summary['total']} done, {summary['seconds']:.0f}s"
        for args in (("jobs",), ("show", "tiny", "--wide")):
            line = next(x for x in qf(alice, *args, check=True).stdout.splitlines() if x.startswith(job_id))
            assert cell in line, (args, line, cell)
        page = httpx.get(server.url + "/", cookies={"qf_token": alice["FACTORY_TOKEN"]}).text
        row = page.split(f'data-job="{job_id}"', 1)[1].split("</tr>", 1)[0]
        assert f'<td class="num">{summary["done"]}/{summary["total"]}, {summary["seconds"]:.0f}s</td>' in row, row
        return cell

    started = followed("worker.log")
    assert started[0] == "inspect" and len(started) == len(set(started)), started  # each step once
    assert views_agree().startswith(f"{len(started)}/{len(started)} done")
    [quant] = json.loads(qf(alice, "ls", "--json", check=True).stdout)
    ref = f"{quant['name']}@{quant['rev']}"
    assert qf(factory_env, "rm", ref).returncode == 0  # on the factory's side
    again = qf(alice, "submit", model, "--awq", "--eval-windows", 1, check=True)
    assert again.stdout.strip() == job_id
    assert f"job {job_id}: its quant {ref} was removed with qf rm; making it again\n" in again.stderr
    remade = followed("worker-again.log")
    assert "quantize:awq-w4g128" in remade and len(remade) == len(set(remade)), remade
    views_agree()
    shown = qf(alice, "show", "tiny", check=True).stdout
    assert "evaluated once:" in shown and shown.count("(job ") == 1, shown
