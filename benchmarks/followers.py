"""What open event streams cost the service's other answers (issue 30: 250 followers made every other answer take
5-16 s and left 255 Redis connections open a minute after their clients left).

    .venv/bin/python benchmarks/followers.py [--followers 250] [--db postgresql://root@127.0.0.1:5432/test]

Starts `qf serve` (its default processes) on a fresh catalog with one queued job of the tiny model; times 50
`GET /api/jobs` and 50 `GET /api/jobs/J` (target: well under a second each) with no followers, then with
`--followers` streams open from 32 users (past the bound most are refused with 429), then counts the server's Redis
connections (CLIENT LIST: those opened since it started) 10 s after every client left. Adds its run to
benchmarks/results/followers.json (one per commit; the first is the code before the bound, at 2f361d2).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _latencies(url: str, token: str, job_id: str, n: int = 50) -> dict:
    seconds = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as api:
        for i in range(n):
            start = time.monotonic()
            api.get("/api/jobs" if i % 2 else f"/api/jobs/{job_id}").raise_for_status()
            seconds.append(time.monotonic() - start)
    seconds.sort()
    return {
        "median_s": round(statistics.median(seconds), 4),
        "p95_s": round(seconds[int(0.95 * n) - 1], 4),
        "max_s": round(seconds[-1], 4),
    }


def _follow(url: str, token: str, job_id: str, opened: list, stop: threading.Event) -> None:
    with (
        httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=httpx.Timeout(30, read=None)
        ) as http,
        http.stream("GET", f"/api/jobs/{job_id}/events") as response,
    ):
        opened.append(response.status_code)
        if response.status_code == 200:
            for _ in response.iter_lines():
                if stop.is_set():
                    return


def _redis_clients(broker: str, before: set[int]) -> int:
    """Connections to Redis opened since `before` (the server's: nothing else runs here)."""
    return len({c["id"] for c in redis.Redis.from_url(broker).client_list()} - before)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--followers", type=int, default=250)
    parser.add_argument("--db", default="")
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/11")
    args = parser.parse_args()
    from tests.support.tiny_model import make_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        models = Path(tmp) / "models"
        model = make_tiny_llama(models / "tiny")
        env = {
            **os.environ,
            "FACTORY_HOME": f"{tmp}/home",
            "FACTORY_DB_URL": args.db,
            "FACTORY_BROKER_URL": args.broker,
            "FACTORY_WORKER_DEVICE": "cpu",
            "FACTORY_SERVE_SOURCES": str(models),
        }
        redis.Redis.from_url(args.broker).flushdb()

        def qf(*argv: str) -> str:
            return subprocess.run(
                [sys.executable, "-m", "factory.cli", *argv],
                env=env,
                cwd=ROOT,
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()

        tokens = [qf("token", "create", "--user", f"user{i}") for i in range(32)]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        before = {c["id"] for c in redis.Redis.from_url(args.broker).client_list()}
        server = subprocess.Popen(
            [sys.executable, "-m", "factory.cli", "serve", "--port", str(port)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    httpx.get(url + "/openapi.json")
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
            body = {"source": str(model), "flags": {"awq": True}}
            for token in tokens:  # the same job: every user owns it and may follow it
                job_id = (
                    httpx.post(url + "/api/jobs", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=60)
                    .raise_for_status()
                    .json()["id"]
                )
            idle = _latencies(url, tokens[0], job_id)
            opened, stop = [], threading.Event()
            threads = [
                threading.Thread(target=_follow, args=(url, tokens[i % 32], job_id, opened, stop), daemon=True)
                for i in range(args.followers)
            ]
            for t in threads:
                t.start()
            while len(opened) < args.followers:
                time.sleep(0.1)
            time.sleep(3)  # every admitted follower is waiting on Redis now
            busy = _latencies(url, tokens[0], job_id)
            during = _redis_clients(args.broker, before)
            stop.set()
            for t in threads:
                t.join(timeout=30)
            time.sleep(10)
            after = _redis_clients(args.broker, before)
        finally:
            server.terminate()
            server.wait(timeout=30)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result = {
        "commit": commit.stdout.strip(),
        "command": "benchmarks/followers.py " + " ".join(sys.argv[1:]),
        "cpu_cores": os.cpu_count(),
        "followers_asked": args.followers,
        "followers_admitted": opened.count(200),
        "followers_refused_429": opened.count(429),
        "no_followers": idle,
        "at_the_bound": busy,
        "redis_connections_while_following": during,
        "redis_connections_10s_after_clients_left": after,
    }
    out = ROOT / "benchmarks" / "results" / "followers.json"  # one run per commit: the code before a fix stays
    runs = [r for r in (json.loads(out.read_text()) if out.exists() else []) if r["commit"] != result["commit"]]
    out.write_text(json.dumps([*runs, result], indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
