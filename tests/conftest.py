"""Fixtures: tiny seeded Llamas made on the spot, a `qf` runner with its own FACTORY_HOME and catalog, one
finished run.

The catalog is SQLite under each test's FACTORY_HOME, or, with QF_TEST_PG=postgresql://user@host:port/db, a fresh
PostgreSQL database per test on that server (scripts/test runs the suite both ways).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import redis

from tests.support.fleet import BROKER
from tests.support.qf import PG, Qf, fresh_database
from tests.support.service import Server
from tests.support.tiny_model import make_tiny_llama


@pytest.fixture(scope="session", autouse=True)
def one_warm_starter():
    """One starter of warm engine children for this test process and every `qf`, worker and server it starts
    (factory/engines/warm.py `share`): each of them would otherwise start its own, 5 CPU-seconds of imports
    (about 80 in a CI run, 2026-12-07)."""
    from factory.engines import child, warm

    warm.share(child.environment())


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """hidden 128, 2 layers: AWQ picks group 128."""
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tiny192(tmp_path_factory) -> Path:
    """hidden 192: 128 does not divide it, so AWQ falls back to group 64."""
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny192", hidden=192)


@pytest.fixture
def model_copy(tiny, tmp_path):
    """A fresh copy of the tiny model to break in a test."""

    def copy(name: str = "broken") -> Path:
        dest = tmp_path / name
        shutil.copytree(tiny, dest)
        return dest

    return copy


CATALOG_FIXTURES = {"db_url", "finished"}  # every test that writes or reads a catalog uses one of these
# The tests where the database itself is under test: concurrent writers and fenced holders (leases, claims, the
# workers), plain SQL (status), the service's quotas and plain SQL; elsewhere, a test marked `database`: two runs of
# one job side by side and after a kill, the catalog's names (test_safety), a measurement another job makes or left
# when killed (test_packing), a release recorded once however many schedulers look (test_schedule), a quant removed
# under a job that evaluates it and a publish killed before its row (test_housekeeping). The other catalog tests go
# through the same SQLAlchemy code and ran on SQLite.
DATABASE_MODULES = {
    "test_workers",
    "test_leases",
    "test_status",
    "test_service",
    "test_service_races",
    "test_fleet_cpu",
}


def pytest_collection_modifyitems(config, items):
    """The PostgreSQL pass (QF_TEST_PG) runs the catalog tests of DATABASE_MODULES and those marked `database`: the
    others already ran in the SQLite pass (scripts/test)."""
    if not PG:
        return
    others = [
        item
        for item in items
        if not CATALOG_FIXTURES & set(getattr(item, "fixturenames", ()))
        or (item.module.__name__.rpartition(".")[2] not in DATABASE_MODULES and not item.get_closest_marker("database"))
    ]
    if others:
        config.hook.pytest_deselected(items=others)
        items[:] = [item for item in items if item not in others]


@pytest.fixture
def round_engine():
    """The test-only engine of tests/support/round_engine.py, registered in this process for the test."""
    from factory import engines
    from tests.support.round_engine import ENGINE

    engines.register(ENGINE)
    yield ENGINE
    engines.unregister(ENGINE.name)


@pytest.fixture
def db_url():
    with fresh_database() as url:
        yield url


@pytest.fixture
def qf(tmp_path, db_url) -> Qf:
    return Qf(home=tmp_path / "home", db_url=db_url)


@pytest.fixture(scope="session")
def finished(tiny, tmp_path_factory):
    """One real `qf run --awq` on the tiny model, shared by the tests that only read its results."""
    with fresh_database() as url:
        qf = Qf(home=tmp_path_factory.mktemp("finished") / "home", db_url=url)
        result = qf("run", tiny, "--awq", "--eval-windows", 2, "--json")
        assert result.exit_code == 0, result.output
        events = [json.loads(line) for line in result.stdout.splitlines()]
        yield qf, events


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """The real SmolLM2-135M-Instruct in FP16 (tests/support/smollm2.py), made once a session."""
    from tests.support.smollm2 import convert

    return convert(tmp_path_factory.mktemp("models") / "SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def smollm2_job(smollm2, tmp_path_factory):
    """One `qf run` on SmolLM2 with AutoAWQ on 8 x 128 calibration tokens of builtin:c4 (the demo's CPU default is
    16: AWQ's grid search is most of the run), and GGUF Q4_K_M and IQ4_XS with an importance matrix on 8 x 512 tokens
    of it, scored on the same WINDOWS (2) windows of builtin:wiki against one FP16 evaluation. Yields the runner and
    the job's quants by method (GGUF's: `gguf-q4_k_m`, `gguf-iq4_xs`). AWQ-CT is compared with AutoAWQ in
    `smollm2_cut_job`."""
    from tests.support.smollm2 import BASE

    yield from _job(
        smollm2,
        tmp_path_factory,
        "awq:\n  w_bit: 4\n  calib_rows: 8\n"
        "gguf:\n  types: [Q4_K_M, IQ4_XS]\n  imatrix_chunks: 8\n  imatrix_ctx: 512\n",
        "--base-model",
        BASE,
    )


SMOLLM2_CUT_LAYERS = 4


@pytest.fixture(scope="session")
def smollm2_cut_job(smollm2, tmp_path_factory):
    """Both AWQ engines, AutoAWQ and llm-compressor, on SmolLM2 cut to its first SMOLLM2_CUT_LAYERS decoder layers
    (tests/support/smollm2.py `cut`: real weights, so what the engines do with real activations shows), with the same
    calibration and windows as `smollm2_job`: the engines compared at a fraction of the full model's grid search
    (AWQ-CT's unit took 1362 s at load on the 30 layers). Yields the runner and the job's quants by method."""
    from tests.support.smollm2 import cut

    folder = tmp_path_factory.mktemp("models") / f"SmolLM2-135M-Instruct-{SMOLLM2_CUT_LAYERS}-layers"
    source = cut(smollm2, folder, SMOLLM2_CUT_LAYERS)
    yield from _job(
        source, tmp_path_factory, "awq:\n  w_bit: 4\n  calib_rows: 8\nawqct:\n  w_bit: 4\n  calib_rows: 8\n"
    )


def _job(source, tmp_path_factory, targets: str, *args):
    """`qf run SOURCE` with a recipe of `targets`, scored on WINDOWS windows of builtin:wiki (tests/support/smollm2.py):
    yields its runner and quants while its catalog is there."""
    from tests.support.smollm2 import WINDOWS

    with fresh_database() as url:
        qf = Qf(home=tmp_path_factory.mktemp("smollm2") / "home", db_url=url)
        recipe = tmp_path_factory.mktemp("recipe") / "recipe.yaml"
        recipe.write_text(targets + "eval: builtin:wiki\nmax_ppl_ratio: 1.5\n")
        result = qf("run", source, "--recipe", recipe, "--eval-windows", WINDOWS, *args, "--json")
        assert result.exit_code == 0, result.output
        events = [json.loads(line) for line in result.stdout.splitlines()]
        rows = events[-1]["quants"]
        yield qf, {row["method"]: row for row in rows} | {row["name"].split(":")[1]: row for row in rows}


@pytest.fixture
def factory_env(tmp_path, db_url, tiny):
    """The service's tests (tests/support/service.py): the factory's side: its home, catalog, broker, and the folder
    its users may name models in."""
    redis.Redis.from_url(BROKER).flushdb()
    models = tmp_path / "models"
    shutil.copytree(tiny, models / "tiny")
    return {
        **os.environ,
        "FACTORY_HOME": str(tmp_path / "home"),
        "FACTORY_DB_URL": db_url,
        "FACTORY_BROKER_URL": BROKER,
        "FACTORY_WORKER_DEVICE": "cpu",
        "FACTORY_SERVE_SOURCES": str(models),
    }


@pytest.fixture
def server(factory_env, tmp_path):
    server = Server(factory_env, tmp_path / "server.log")
    yield server
    server.stop()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A local in-memory Hugging Face Hub (tests/support/hub_server.py), with HF_ENDPOINT and huggingface_hub pointed
    at it.

    Yields the HubServer: .url, .add_repo(repo_id, files, branch="main") -> sha, .fail(method, path_regex, status,
    times=1, headers=None), .corrupt(repo_id, path, revision="main"), .set_gated(repo_id), .requests, .count(...),
    .files(repo_id, revision). Tokens: "hf_alice_write", "hf_alice_read" (alice, read-only), "hf_bob_write".
    Xet is off (HF_HUB_DISABLE_XET), so uploads take the LFS "basic" path; HF_HOME and the cache are under tmp_path,
    and no HF_TOKEN or stored token leaks in."""
    from huggingface_hub import constants

    from tests.support.hub_server import TOKENS, HubServer

    server = HubServer(TOKENS).start()
    home = tmp_path / "hf_home"
    env = {
        "HF_ENDPOINT": server.url,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_OFFLINE": "0",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in (
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_TOKEN_PATH",
        "HF_OIDC_RESOURCE",
        "HUGGINGFACE_HUB_CACHE",
        "TRANSFORMERS_OFFLINE",
        "HF_XET_CACHE",
    ):
        monkeypatch.delenv(name, raising=False)
    # huggingface_hub read the environment at import time: patch what it computed from it as well.
    patched = {
        "ENDPOINT": server.url,
        "HUGGINGFACE_CO_URL_TEMPLATE": server.url + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HUGGINGFACE_HUB_CACHE": str(home / "hub"),
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "HF_XET_CACHE": str(home / "xet"),
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_OFFLINE": False,
    }
    for name, value in patched.items():
        monkeypatch.setattr(constants, name, value)
    yield server
    server.stop()
