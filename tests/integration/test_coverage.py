"""Each engine claims exactly the architectures its coverage run proved (issue 32): the committed results of
benchmarks/coverage.py (benchmarks/results/coverage-*.json: a tiny seeded checkpoint of each family through `qf
run`, `qf pull` and the engine's own loader, on CPU here and on the H200 for the GPU engines), the README's table is
those results, and the CPU engines' claims are proven again here, end to end (two families on every CI run, all
with QF_COVERAGE=all).

An engine that claims a family its run did not prove fails here: run it again (for EXL3 the GPU sitting
benchmarks/exl3_sitting.sh) or drop the claim with the reason in the README; `python benchmarks/coverage.py
--unproven exl3` prints what the committed results leave unproven, with their reasons."""

from __future__ import annotations

import json
import os
import re

import pytest

from benchmarks import coverage
from factory import engines
from tests.support import ROOT

RESULTS = coverage.results()


def _architectures(name: str) -> dict[str, str]:
    """model type -> config architecture of an engine's results (where a run built the checkpoint)."""
    rows = RESULTS[name]["architectures"]
    return {t: r["architecture"] for t, r in rows.items() if "architecture" in r}


@pytest.mark.parametrize("name", engines.available())
def test_each_engine_claims_what_its_coverage_proved(name):
    assert name in RESULTS, f"{name} has no coverage results: run benchmarks/coverage.py --engine {name}"
    proven = coverage.proven(RESULTS[name])
    claims = set(engines.get(name).architectures)
    assert claims == proven, (
        f"claimed but not proven: {sorted(claims - proven)}; proven but not claimed: {sorted(proven - claims)}"
    )


def test_the_readme_table_is_the_committed_results():
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- coverage -->\n(.*?)\n<!-- /coverage -->", readme, re.S)
    assert found, "README.md lacks the coverage table (benchmarks/coverage.py --table)"
    assert found[1] == coverage.table(RESULTS), "regenerate it: python benchmarks/coverage.py --table"


def test_the_totals_the_readme_states():
    readme = (ROOT / "README.md").read_text()
    text_archs = {a for name in RESULTS for a in coverage.proven(RESULTS[name])}
    awq = {a for name in RESULTS if name.startswith("awq") for a in coverage.proven(RESULTS[name])}
    assert f"{len(text_archs)} architectures quantized by some engine, {len(awq)} by AWQ" in readme


# A CI run proves again the families whose layout differs most from Llama's (every other test runs a Llama):
# GPT-J's separate projections with their own names, GPT-NeoX's fused query-key-value. QF_COVERAGE=all proves
# every family a CPU engine claims (about 45 s each here; the committed results did, benchmarks/coverage.py).
CI_FAMILIES = {"gptj", "gpt_neox"}
CPU_CLAIMS = [
    (name, t)
    for name in engines.available()
    if not engines.get(name).requires_cuda and name in RESULTS
    for t, arch in sorted(_architectures(name).items())
    if arch in engines.get(name).architectures and (t in CI_FAMILIES or os.environ.get("QF_COVERAGE") == "all")
]


@pytest.mark.parametrize(("name", "model_type"), CPU_CLAIMS, ids=[f"{n}-{t}" for n, t in CPU_CLAIMS])
def test_a_cpu_engine_still_converts_each_family_it_claims(name, model_type, tmp_path, monkeypatch):
    """benchmarks/coverage.py's run of one family, here: `qf run` with the engine, `qf pull`, the pulled quant
    scored through the engine's loader to the perplexity the factory published, close to the committed one."""
    monkeypatch.delenv("FACTORY_SERVER", raising=False)
    outcome = coverage.run_one(name, model_type, tmp_path / "models", tmp_path / "work", "cpu")
    assert outcome["status"] == "quantized", outcome
    committed = RESULTS[name]["architectures"][model_type]
    assert abs(outcome["ppl"] - committed["ppl"]) < 0.01 * committed["ppl"], (outcome, committed)
    assert (
        json.loads(
            (tmp_path / "models").joinpath(f"{model_type}-{coverage.WIDTH.get(name, 128)}", "config.json").read_text()
        )["architectures"][0]
        == committed["architecture"]
    )
