"""An engine is the only place a method lives: one that exists only in tests/ (tests/support/round_engine.py) runs
`qf run` end to end, is named in the environment of every process, and the fleet's commands without a queue say so.
The import graph's layers are tests/unit/test_layers.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from factory import fleet
from factory.publish import card
from tests.support import ROOT


def test_an_engine_from_tests_runs_end_to_end(qf, tiny, tmp_path, round_engine):
    recipe = tmp_path / "round.yaml"
    recipe.write_text("round: {mantissa: [3]}\n")
    result = qf("run", tiny, "--recipe", recipe, "--eval-windows", 2)
    assert result.exit_code == 0, result.output
    [row] = qf.json("ls")
    assert (row["name"], row["method"], row["bits"]) == ("tiny:round-m3", "round", 9.0)
    assert row["fp16_ppl"] < row["ppl"] < 1.5 * row["fp16_ppl"]  # 3 mantissa bits cost something, not everything
    steps = {s["name"] for s in qf.json("status", row["job"])["steps"]}
    assert {"inspect", "quantize:round-m3", "evaluate:fp16", "evaluate:round-m3", "gate", "publish:round-m3"} <= steps
    result = qf("pull", "tiny:round-m3", "-o", tmp_path / "pulled")
    assert result.exit_code == 0, result.output
    pulled = tmp_path / "pulled"
    assert json.loads((pulled / "config.json").read_text())["quantization_config"]["quant_method"] == "round"
    text = (pulled / card.FILENAME).read_text()
    assert card.metadata(text)["library_name"] == "transformers" and "round" in card.metadata(text)["tags"]
    assert "transformers loads ./tiny-round-m3" in text
    logits = round_engine.load(pulled, "cpu")  # what was published is what was scored
    assert logits is not None


def test_an_unknown_engine_key_lists_the_registered_ones(qf, tiny, tmp_path, round_engine):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("rounds: {mantissa: [3]}\n")
    result = qf("run", tiny, "--recipe", recipe)
    assert result.exit_code == 2
    assert "unknown key 'rounds' (recipe keys: awq, awqct, exl2, exl3, gguf, round, calibration" in result.stderr


@pytest.mark.parametrize(
    ("entry", "sentence"),
    [
        ("tests.support.round_engine:ENGINE", None),
        (
            "tests.nowhere:ENGINE",
            "FACTORY_ENGINES names 'tests.nowhere:ENGINE', which cannot be loaded: No module named",
        ),
        (
            "tests.support.round_engine:RoundSpec",
            "FACTORY_ENGINES names 'tests.support.round_engine:RoundSpec', which is not an engine",
        ),
    ],
)
def test_engines_named_in_the_environment(tmp_path, entry, sentence):
    """FACTORY_ENGINES registers engines in every process (workers and their job processes); one that cannot be
    loaded is one sentence and exit 2 at the first command, not a traceback at import."""
    env = {**os.environ, "FACTORY_ENGINES": entry, "FACTORY_HOME": str(tmp_path), "FACTORY_DB_URL": ""}
    recipe = tmp_path / "round.yaml"
    recipe.write_text("round: {mantissa: [3]}\n")
    result = subprocess.run(
        [sys.executable, "-m", "factory.cli", "run", str(tmp_path), "--recipe", str(recipe)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if sentence is None:  # registered: its recipe key is known (the folder is no model: refused by inspection)
        assert result.returncode == 3 and "config.json" in result.stderr, result.stderr
    else:
        assert result.returncode == 2 and sentence in result.stderr.strip().splitlines()[-1], result.stderr


def test_without_a_queue_the_fleet_commands_say_so(qf, monkeypatch):
    """An installation without the entry point (its metadata older than it): one sentence, exit 5, as a broker
    that cannot be reached."""
    monkeypatch.setattr(fleet, "entry_points", lambda group: [])
    fleet.get.cache_clear()
    try:
        for args in (["retry", "0123abcd"], ["reconcile"], ["watch", "check"]):
            result = qf(*args)
            assert result.exit_code == 5, result.output
            assert "this installation has no single job queue for `qf submit` and the fleet" in result.stderr
    finally:
        fleet.get.cache_clear()
