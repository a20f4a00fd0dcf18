"""One truth about a job (issue 45), through the CLI on the embedded factory: every view counts a job's steps and
seconds alike, after remakes too; one evaluation is one line; a reused step says so and teaches the ETA nothing;
the card a user pulls lists every evaluation while the registry's folder never changes; `qf run`'s closing table
shows that run's scores; a pull says where it wrote and gives files a user can edit; AWQ's card and `qf show` say
where each quant fits. The fleet's side (the service, a worker, `qf status --follow`) is in
tests/integration/test_service.py."""

from __future__ import annotations

import json
import os
import re
import stat

import pytest
import redis

from factory.catalog import Catalog
from factory.identity import file_sha256
from tests.support.fleet import BROKER
from tests.support.qf import Qf, fresh_database


def _catalog(qf: Qf) -> Catalog:
    return Catalog(qf.db_url or f"sqlite:///{qf.home / 'catalog.db'}")


def _steps_cell(text: str, job_id: str) -> str:
    """The STEPS cell ("N/M done, Ss") of a job's line in a jobs table."""
    line = next(line for line in text.splitlines() if line.startswith(job_id))
    return re.search(r"\d+/\d+ done, \d+s", line)[0]


@pytest.fixture(scope="module")
def two_jobs(tiny, tmp_path_factory):
    """A quant made by one `qf run` (1 eval window) and reused by a second one (3 windows)."""
    with fresh_database() as url:
        qf = Qf(home=tmp_path_factory.mktemp("two-jobs") / "home", db_url=url)
        first = qf("run", tiny, "--awq", "--eval-windows", 1)
        assert first.exit_code == 0, first.output
        second = qf("run", tiny, "--awq", "--eval-windows", 3)
        assert second.exit_code == 0, second.output
        yield qf, first, second


def _second_job(qf: Qf) -> dict:
    [quant] = qf.json("ls")
    return next(j for j in qf.json("jobs") if j["id"] != quant["job"])


def test_every_view_counts_a_job_alike_after_remakes_and_one_evaluation_is_one_line(qf, tiny, monkeypatch):
    monkeypatch.setenv("FACTORY_BROKER_URL", BROKER)
    redis.Redis.from_url(BROKER).flushdb()
    assert qf("run", tiny, "--awq", "--eval-windows", 1).exit_code == 0
    [quant] = qf.json("ls")
    ref = f"{quant['name']}@{quant['rev']}"
    for _ in range(2):  # removed and made again, twice: the second time through `qf submit` (it says so), then run
        assert qf("rm", ref).exit_code == 0
        empty = qf("show", "tiny")
        assert empty.exit_code == 0 and "tiny has no quants (none published, or all removed with qf rm)" in empty.stdout
        submitted = qf("submit", tiny, "--awq", "--eval-windows", 1)
        assert submitted.exit_code == 0, submitted.output
        assert f"job {quant['job']}: its quant {ref} was removed with qf rm; making it again" in submitted.stderr
        redo = qf("status", quant["job"])
        assert "to redo" in redo.stdout and "its quant was removed with qf rm; made again" in redo.stdout, redo.stdout
        assert qf("run", tiny, "--awq", "--eval-windows", 1).exit_code == 0
    [shown] = qf.json("show", "tiny")["quants"]
    assert len(shown["evaluations"]) == 1  # the same job's evaluation of the same files: one, its latest
    text = qf("show", "tiny", "--wide").stdout
    assert f"{ref} evaluated once:" in text and text.count("(job ") == 1, text
    row = qf.json("status", quant["job"])
    summary = row["summary"]
    names = list(dict.fromkeys(s["name"] for s in row["steps"]))
    assert (summary["done"], summary["total"]) == (len(names), len(names))
    cell = f"{summary['done']}/{summary['total']} done, {summary['seconds']:.0f}s"
    assert _steps_cell(text, quant["job"]) == cell
    assert _steps_cell(qf("jobs").stdout, quant["job"]) == cell


def test_a_reused_step_says_reused_and_teaches_the_eta_nothing(two_jobs):
    qf, _, _ = two_jobs
    job = _second_job(qf)
    [quantize] = [s for s in qf.json("status", job["id"])["steps"] if s["name"].startswith("quantize:")]
    assert (quantize["state"], quantize["seconds"]) == ("reused", None)
    assert quantize["note"].startswith("reused tiny:awq-w4g128@")
    table = qf("status", job["id"]).stdout
    line = next(line for line in table.splitlines() if line.startswith("quantize:"))
    assert line.split()[1] == "reused" and "-0.0" not in table and " 0.0 " not in line, table
    history = _catalog(qf).steps.history("quantize:awq", "cpu")
    assert len(history) == 1 and history[0][1] > 0  # the first job's quantize, which ran; not the reused one


def test_the_closing_table_of_a_run_shows_its_own_evaluation(two_jobs):
    qf, first, second = two_jobs
    [quant] = qf.json("ls")
    [shown] = qf.json("show", "tiny")["quants"]
    by_windows = {e["windows"]: e for e in shown["evaluations"]}
    assert sorted(by_windows) == [1, 3] and by_windows[3]["ppl"] != quant["ppl"]
    assert f"{by_windows[3]['ppl']:.4f}" in second.stdout.splitlines()[-1], second.stdout
    assert f"{quant['ppl']:.4f}" in first.stdout.splitlines()[-1]


def test_the_pulled_card_lists_every_evaluation_and_the_registry_never_changes(two_jobs, tmp_path, monkeypatch):
    qf, _, _ = two_jobs
    [quant] = qf.json("ls")
    registry = qf.home / "registry" / quant["path"]
    published = (registry / "README.md").read_text()
    manifest = json.loads((registry / "manifest.json").read_text())
    assert file_sha256(registry / "README.md") == manifest["files"]["README.md"]["sha256"]  # as published
    assert "## Evaluations" in published and "| 1 x " in published and "| 3 x " not in published
    monkeypatch.chdir(tmp_path)
    pulled = qf("pull", quant["name"])  # no -o: ./NAME-TAG here, and it says so
    assert pulled.exit_code == 0, pulled.output
    dest = tmp_path / "tiny-awq-w4g128"
    assert pulled.stdout.strip() == str(dest)
    assert f"in {dest} (without -o: NAME-TAG in the current folder)" in pulled.stderr
    card = (dest / "README.md").read_text()
    assert card.split("## Evaluations")[0] == published.split("## Evaluations")[0]
    rows = [line for line in card.split("## Evaluations")[1].splitlines() if line.startswith("| builtin:")]
    assert [row.split("|")[2].strip().split()[0] for row in rows] == ["1", "3"], card
    pulled_manifest = json.loads((dest / "manifest.json").read_text())
    assert pulled_manifest["files"]["README.md"]["sha256"] == file_sha256(dest / "README.md")
    assert {k: v for k, v in pulled_manifest["files"].items() if k != "README.md"} == {
        k: v for k, v in manifest["files"].items() if k != "README.md"
    }
    weights = dest / "model.safetensors"
    assert weights.stat().st_mode & stat.S_IWUSR and os.access(weights, os.W_OK)  # the user's copy to edit
    assert not (registry / "model.safetensors").stat().st_mode & stat.S_IWUSR
    text = qf("show", "tiny", "--wide").stdout
    assert "evaluated 2 times:" in text and text.count("on cpu: ppl") == 2, text


def test_awq_cards_and_qf_show_say_where_each_quant_fits(two_jobs):
    qf, _, _ = two_jobs
    [quant] = qf.json("ls")
    card = (qf.home / "registry" / quant["path"] / "README.md").read_text()
    assert "## Fits on" in card and "| GPU | longest context, fp16 KV cache | longest context, fp8 KV cache |" in card
    assert re.search(r"\| 8 GB \| [\d,]+ tokens \| [\d,]+ tokens \|", card), card
    text = qf("show", "tiny", "--wide").stdout
    assert re.search(r"GPU +FP16 CACHE +FP8 CACHE", text) and "the longest context that fits each GPU" in text, text
