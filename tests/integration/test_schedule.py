"""The watchlist and the scheduler: the pure plan, then real checks against the local Hub stand-in, the real Redis
and the catalog (SQLite in the first pass of scripts/test, PostgreSQL in the second)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from factory import engines, schedule
from factory.errors import SpecError
from tests.support import ROOT
from tests.support.fleet import BROKER

LLAMA = ("LlamaForCausalLM",)


# -- the plan: pure ------------------------------------------------------------------------------------------------
def _plan(watches, releases, done=()):
    return schedule.plan(watches, releases, set(done), {e.name: set(e.architectures) for e in engines.all_engines()})


def test_plan_matches_repos_and_patterns_once():
    repo = schedule.entry("meta/Tiny-Llama", {"awq": {}})
    pattern = schedule.entry("meta/*-chat", {"exl2": {"bpw": [4.0]}})
    releases = [
        schedule.Release(repo, sha * 40, LLAMA)
        for repo, sha in [
            ("meta/tiny-llama", "a"),
            ("meta/tiny-chat", "b"),
            ("meta/tiny-base", "c"),
            ("other/x-chat", "d"),
        ]
    ]
    planned = _plan([repo, pattern], releases)
    assert [(p.watch, p.repo, p.skipped) for p in planned] == [
        ("meta/Tiny-Llama", "meta/tiny-llama", None),
        ("meta/*-chat", "meta/tiny-chat", None),
    ]
    assert _plan([repo, pattern], releases, {(p.watch, p.repo, p.sha) for p in planned}) == []
    newer = schedule.Release("meta/tiny-llama", "e" * 40, LLAMA)
    assert [(p.repo, p.sha) for p in _plan([repo], [newer], {(p.watch, p.repo, p.sha) for p in planned})] == [
        ("meta/tiny-llama", "e" * 40)
    ]


def test_each_watch_takes_what_its_engines_convert():
    """Gemma 3 is EXL3's (exllamav3), not AWQ's or EXL2's: a watch with EXL3 targets plans it, the others skip it."""
    gemma = [schedule.Release("google/gemma-3-270m", "7" * 40, ("Gemma3ForCausalLM",))]
    awq = schedule.entry("google/gemma-3-270m", {"awq": {}})
    exl3 = schedule.entry("google/*", {"exl3": {"bpw": [4.0]}})
    assert {p.watch: p.skipped for p in _plan([awq, exl3], gemma)} == {
        "google/gemma-3-270m": "architecture Gemma3ForCausalLM is not supported by awq",
        "google/*": None,
    }


def test_plan_skips_with_a_reason():
    watch = schedule.entry("meta/*", {"awq": {}}, {"architectures": ["LlamaForCausalLM"], "max_params": 2e9})
    releases = [
        schedule.Release("meta/gated", "1" * 40, problem="meta/gated is gated and this token has no access"),
        schedule.Release("meta/bert", "2" * 40, ("BertModel",)),
        schedule.Release("meta/qwen", "3" * 40, ("Qwen2ForCausalLM",)),
        schedule.Release("meta/big", "4" * 40, LLAMA, params=7_000_000_000),
        schedule.Release("meta/small", "5" * 40, LLAMA, params=1_000_000_000),
        schedule.Release("meta/bare", "6" * 40),
    ]
    assert {p.repo: p.skipped for p in _plan([watch], releases)} == {
        "meta/gated": "meta/gated is gated and this token has no access",
        "meta/bert": "architecture BertModel is not supported by awq",
        "meta/qwen": "architecture Qwen2ForCausalLM is not in the watch's filter (LlamaForCausalLM)",
        "meta/big": "7.00B parameters, the watch's filter allows 2.00B",
        "meta/small": None,
        "meta/bare": "its config.json names no architecture",
    }


@pytest.mark.parametrize(
    ("target", "recipe", "filter", "message"),
    [
        ("tiny-llama", {"awq": {}}, None, "is neither org/name nor org/pattern"),
        ("me*/x", {"awq": {}}, None, "is neither org/name nor org/pattern"),
        ("meta/x", {}, None, "makes nothing: give it awq, awqct, exl2, exl3 or gguf targets"),
        ("meta/x", {"awq": {"w_bit": 3}}, None, "w_bit"),
        ("meta/x", {"awq": {}}, {"size": 1}, "unknown filter keys ['size']"),
        ("meta/x", {"awq": {}}, {"max_params": "big"}, "max_params must be a number"),
    ],
)
def test_bad_watches_are_refused(target, recipe, filter, message):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        schedule.entry(target, recipe, filter)


def test_the_shipped_watchlist_loads():
    entries = schedule.load(ROOT / "configs" / "watchlist.yaml")
    assert [e.target for e in entries] == ["HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/*-Instruct"]
    assert entries[1].filter == {"architectures": ["Qwen2ForCausalLM", "Qwen3ForCausalLM"], "max_params": 8_000_000_000}


# -- checks against the Hub stand-in, Redis and the catalog ------------------------------------------------------
@pytest.fixture
def env(tmp_path, db_url, hub, monkeypatch):
    redis.Redis.from_url(BROKER).flushdb()
    for name, value in {
        "FACTORY_HOME": str(tmp_path / "home"),
        "FACTORY_DB_URL": db_url,
        "FACTORY_BROKER_URL": BROKER,
        "FACTORY_WORKER_DEVICE": "cpu",
        "FACTORY_HUB_BACKOFF": "0.01",
    }.items():
        monkeypatch.setenv(name, value)
    return dict(os.environ)


def qf(*args, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "factory.cli", *map(str, args)],
        env=dict(os.environ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=check,
        timeout=120,
    )


def watch_check(*flags) -> dict:
    return json.loads(qf("watch", "check", "--json", *flags).stdout)


def jobs() -> list[dict]:
    return json.loads(qf("jobs", "--json", "--limit", 100).stdout)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.mark.database
def test_new_releases_become_one_job_per_watch_and_only_once(env, hub, tiny):
    first = hub.add_repo("meta/tiny-llama", _files(tiny))
    hub.add_repo("meta/tiny-chat", _files(tiny))
    hub.add_repo("meta/tiny-base", _files(tiny))
    qf("watch", "add", "meta/tiny-llama", "--awq")
    qf("watch", "add", "meta/*-chat", "--awq", "--max-params", "1e9")

    dry = watch_check("--dry-run")
    assert sorted((p["watch"], p["repo"], p["skipped"]) for p in dry["planned"]) == [
        ("meta/*-chat", "meta/tiny-chat", None),
        ("meta/tiny-llama", "meta/tiny-llama", None),
    ]
    assert jobs() == [] and json.loads(qf("watch", "ls", "--json").stdout)[0]["seen"] == []

    tick = watch_check()
    assert sorted(p["repo"] for p in tick["planned"] if p["job"]) == ["meta/tiny-chat", "meta/tiny-llama"]
    listed = jobs()
    assert sorted(j["source_identity"] for j in listed) == sorted(f"{p['repo']}@{p['sha']}" for p in tick["planned"])
    assert all(j["state"] == "queued" for j in listed)
    assert redis.Redis.from_url(BROKER).llen("cpu") == 2  # planned for the CPU (FACTORY_WORKER_DEVICE): its queue

    assert watch_check()["planned"] == []  # unchanged repos: nothing
    assert len(jobs()) == 2

    newer = hub.add_repo("meta/tiny-llama", {"generation_config.json": b'{"do_sample": false}'})
    assert newer != first
    tick = watch_check()
    assert [(p["repo"], p["sha"]) for p in tick["planned"]] == [("meta/tiny-llama", newer)]
    assert len(jobs()) == 3
    assert f"meta/tiny-llama@{newer}" in {j["source_identity"] for j in jobs()}


@pytest.mark.database
def test_two_schedulers_still_one_job(env, hub, tiny):
    hub.add_repo("meta/tiny-llama", _files(tiny))
    qf("watch", "add", "meta/tiny-llama", "--awq")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "factory.cli", "watch", "check", "--json"],
            env=dict(os.environ),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert len(jobs()) == 1
    assert sum(1 for r in results for p in r["planned"] if p.get("job")) == 1
    assert watch_check()["planned"] == []
    assert len(json.loads(qf("watch", "ls", "--json").stdout)[0]["seen"]) == 1


def test_hub_outage_loses_nothing_and_the_next_check_catches_up(env, hub, tiny, monkeypatch):
    hub.add_repo("meta/tiny-llama", _files(tiny))
    qf("watch", "add", "meta/tiny-llama", "--awq")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the Hub is down
    down = watch_check()
    assert down["planned"] == [] and "cannot be reached" in down["errors"][0]
    assert jobs() == []
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    hub.fail("GET", r"/api/models/meta/tiny-llama", 503, times=20)  # then it answers 503 for a while
    assert watch_check()["errors"] and jobs() == []
    hub.failures.clear()
    up = watch_check()
    assert up["errors"] == [] and [p["repo"] for p in up["planned"] if p["job"]] == ["meta/tiny-llama"]
    assert len(jobs()) == 1


def test_watch_check_exits_5_when_the_hub_cannot_be_reached(env, hub, tiny, monkeypatch):
    """As every other command that asks the Hub (exit 5, errors.py): the error said once per watch, never "nothing
    new"; with --json 0, and its `exit_code` says 5."""
    hub.add_repo("meta/tiny-llama", _files(tiny))
    qf("watch", "add", "meta/tiny-llama", "--awq")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    down = qf("watch", "check", check=False)
    assert down.returncode == 5, down.stderr
    assert "cannot be reached" in down.stderr and "nothing new" not in down.stderr
    assert watch_check()["exit_code"] == 5
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    up = qf("watch", "check", check=False)
    assert up.returncode == 0 and "meta/tiny-llama: meta/tiny-llama@" in up.stdout, up.stderr


def test_a_config_the_hub_cannot_serve_now_is_an_error_not_a_skip(env, hub, tiny, monkeypatch):
    """A 5xx on config.json (which huggingface_hub retries, then reports as a missing local entry) is an outage:
    the release is not recorded as skipped, and the next check gets it."""
    import types

    from huggingface_hub.utils import _http

    monkeypatch.setattr(_http, "time", types.SimpleNamespace(sleep=lambda seconds: None))  # its backoff, not ours
    hub.add_repo("meta/tiny-llama", _files(tiny))
    hub.fail("*", r"/resolve/[^/]+/config\.json$", 503, times=100)
    releases, errors = schedule.hub_releases([schedule.entry("meta/tiny-llama", {"awq": {}})])
    assert releases == [] and [str(e) for e in errors] == ["the Hub at " + hub.url + " cannot be reached"]
    hub.failures.clear()
    releases, errors = schedule.hub_releases([schedule.entry("meta/tiny-llama", {"awq": {}})])
    assert errors == [] and [(r.repo, r.problem) for r in releases] == [("meta/tiny-llama", None)]


@pytest.mark.database
def test_gated_and_unsupported_models_are_skipped_once(env, hub, tiny):
    hub.add_repo("meta/tiny-gated", _files(tiny))
    hub.set_gated("meta/tiny-gated")
    config = json.loads((tiny / "config.json").read_text())
    hub.add_repo(
        "meta/tiny-bert",
        {**_files(tiny), "config.json": json.dumps({**config, "architectures": ["BertModel"]}).encode()},
    )
    qf("watch", "add", "meta/tiny-*", "--awq")
    tick = watch_check()
    assert {p["repo"]: p["skipped"] for p in tick["planned"]} == {
        "meta/tiny-bert": "architecture BertModel is not supported by awq",
        "meta/tiny-gated": "meta/tiny-gated is gated and this token has no access; accept its terms on the Hub, or "
        "use a token (HF_TOKEN) that has",
    }
    assert watch_check()["planned"] == [] and jobs() == []
    [watch] = json.loads(qf("watch", "ls", "--json").stdout)
    assert sorted(s["repo"] for s in watch["seen"] if s["skipped"]) == ["meta/tiny-bert", "meta/tiny-gated"]


@pytest.mark.database
def test_a_skipped_release_is_quantized_once_an_engine_takes_it(env, hub, tiny, monkeypatch):
    """Skipped because no engine of the watch converted it, the release is looked at again at every check: with a
    factory whose AWQ takes it, the next check submits it, and `qf watch ls` shows the job in the skip's place."""
    config = json.loads((tiny / "config.json").read_text())
    hub.add_repo(
        "meta/tiny-bert",
        {**_files(tiny), "config.json": json.dumps({**config, "architectures": ["BertModel"]}).encode()},
    )
    qf("watch", "add", "meta/tiny-bert", "--awq")
    assert [p["skipped"] for p in watch_check()["planned"]] == ["architecture BertModel is not supported by awq"]
    monkeypatch.setenv("FACTORY_ENGINES", "tests.support.later_awq:ENGINE")
    [later] = watch_check()["planned"]
    assert later["skipped"] is None and later["job"] and [j["id"] for j in jobs()] == [later["job"]]
    assert watch_check()["planned"] == []  # submitted: done
    [watch] = json.loads(qf("watch", "ls", "--json").stdout)
    assert [(s["repo"], s["job"], s["skipped"]) for s in watch["seen"]] == [("meta/tiny-bert", later["job"], None)]


def test_watch_add_refusals_and_rm(env):
    bad = qf("watch", "add", "tiny", "--awq", check=False)
    assert bad.returncode == 2 and "is neither org/name nor org/pattern" in bad.stderr
    assert qf("watch", "rm", "meta/none", check=False).returncode == 4
    qf("watch", "add", "--file", ROOT / "configs" / "watchlist.yaml")
    assert [w["target"] for w in json.loads(qf("watch", "ls", "--json").stdout)] == [
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "Qwen/*-Instruct",
    ]
    removed = qf("watch", "rm", "Qwen/*-Instruct")
    assert removed.stderr == "stopped watching Qwen/*-Instruct; the jobs it submitted stay\n"  # says what went
    assert len(json.loads(qf("watch", "ls", "--json").stdout)) == 1
