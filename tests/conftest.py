"""Fixtures: tiny seeded Llamas made on the spot, a `qf` runner with its own FACTORY_HOME, one finished run."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from typer.testing import CliRunner

from factory.cli import app
from tests.tiny_model import make_tiny_llama


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


@dataclass
class Qf:
    home: Path
    runner: CliRunner = field(default_factory=CliRunner)

    @property
    def env(self) -> dict[str, str]:
        return {"FACTORY_HOME": str(self.home), "FACTORY_DB_URL": ""}

    def __call__(self, *args: object):
        return self.runner.invoke(app, [str(a) for a in args], env=self.env)

    def json(self, *args: object):
        result = self(*args, "--json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    def registry_files(self) -> list[Path]:
        registry = self.home / "registry"
        return sorted(p for p in registry.rglob("*") if p.is_file()) if registry.exists() else []


@pytest.fixture
def qf(tmp_path) -> Qf:
    return Qf(home=tmp_path / "home")


@pytest.fixture(scope="session")
def finished(tiny, tmp_path_factory):
    """One real `qf run --awq` on the tiny model, shared by the tests that only read its results."""
    qf = Qf(home=tmp_path_factory.mktemp("finished") / "home")
    result = qf("run", tiny, "--awq", "--eval-windows", 2, "--json")
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    return qf, events
