"""Every table of the CLI at 80 columns, through the real `qf` in a subprocess with COLUMNS=80 and stdout piped (as
a user's `qf ls | less` or a terminal 80 wide): no identifier cut, a line under the table exactly when columns were
dropped (and `--wide` shows them), one plain style (no box), `qf plan` on a 40-line screen and without the engines
that refuse the model; KLD never shown below zero; progress read as "layer 3 of 30"."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from tests.support import ROOT
from tests.support.tiny_model import make_tiny_llama

BOX = set("│┃━─╭╮╰╯┏┓┗┛┡┩└┘┌┐├┤┼╇")
LONG = "smollm2-135m-instruct"  # the name the issue saw cut, and long enough to push columns out
KLD_BELOW_ZERO = -3e-5  # the estimator's dip on a quant that is almost FP16
TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct-with-a-long-repository-name"


def qf(home: Path, *args: object, columns: int = 80, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "FACTORY_HOME": str(home), "FACTORY_DB_URL": "", "COLUMNS": str(columns)}
    result = subprocess.run(
        [sys.executable, "-m", "factory.cli", *map(str, args)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


def lines(text: str) -> list[str]:
    return text.rstrip("\n").splitlines()


def hidden_line(text: str) -> list[str]:
    return [line for line in lines(text) if " hidden at " in line]


def plain(text: str) -> None:
    assert not BOX & set(text), text


@pytest.fixture(scope="module")
def home(finished, tmp_path_factory) -> Path:
    """The finished run's home, copied, with a second quant of the same files under a long name whose KLD dipped
    below zero."""
    from factory.catalog import Catalog, Model, Quant

    source, _ = finished
    assert not source.db_url, "a SQLite catalog to copy (the PostgreSQL pass deselects this module: conftest.py)"
    copy = tmp_path_factory.mktemp("tables80") / "home"
    shutil.copytree(source.home, copy)
    catalog = Catalog(f"sqlite:///{copy / 'catalog.db'}")
    [quant] = catalog.quants.live()
    with catalog.db.session() as s:
        s.add(Model(name=LONG, source=str(copy / LONG)))
    fields = {c.name: getattr(quant, c.name) for c in Quant.__table__.columns if c.name not in ("id", "created_at")}
    catalog.quants.put(Quant(**{**fields, "name": LONG, "kld": KLD_BELOW_ZERO}))
    return copy


def test_ls_says_what_it_hides_and_cuts_no_name(home):
    shown = qf(home, "ls")
    plain(shown.stdout)
    rev = json.loads(qf(home, "ls", "--json").stdout)[0]["rev"]
    out = lines(shown.stdout)
    assert any(line.startswith(f"{LONG}:awq-w4g128@{rev}  ") for line in out), shown.stdout
    assert any(line.startswith(f"tiny:awq-w4g128@{rev}  ") for line in out), shown.stdout
    assert all(len(line) <= 80 for line in out), shown.stdout
    assert hidden_line(shown.stdout) == ["METHOD, BITS, TOP-1, SOURCE hidden at 80 columns: see --wide or --json"]
    assert "KLD" in out[0] and "TOP-1" not in out[0]
    wide = qf(home, "ls", "--wide")
    assert hidden_line(wide.stdout) == [] and "TOP-1" in wide.stdout and "SOURCE" in wide.stdout
    assert not hidden_line(qf(home, "ls", columns=200).stdout)  # nothing dropped, nothing said
    narrow = lines(qf(home, "ls", columns=30).stdout)  # the name alone is wider: the line is, and the terminal wraps it
    assert narrow[1].startswith(f"{LONG}:awq-w4g128@{rev}  ")
    assert narrow[-1] == "METHOD, BITS, KLD, TOP-1, SOURCE hidden at 30 columns: see --wide or --json"


def test_kld_below_zero_shows_as_zero(home):
    """The estimator can dip a hair below zero: shown as 0.0000, kept as it is in --json."""
    for args in (["ls", "--wide"], ["show", LONG, "--wide"]):
        shown = qf(home, *args).stdout
        row = next(line for line in lines(shown) if line.startswith(f"{LONG}:"))
        assert "-0.0000" not in shown and " 0.0000 " in f"{row} ", shown
    rows = {r["name"]: r for r in json.loads(qf(home, "ls", "--json").stdout)}
    assert rows[f"{LONG}:awq-w4g128"]["kld"] == KLD_BELOW_ZERO


def test_show_at_80_columns(home):
    shown = qf(home, "show", LONG)
    plain(shown.stdout)
    assert f"{LONG}:awq-w4g128@" in shown.stdout
    assert hidden_line(shown.stdout) == ["METHOD, BITS, TOP-1, SOURCE hidden at 80 columns: see --wide or --json"]
    assert not hidden_line(qf(home, "show", LONG, "--wide").stdout)
    job = json.loads(qf(home, "jobs", "--json").stdout)[0]
    jobs = lines(qf(home, "show", "tiny", columns=60).stdout)
    assert any(line.startswith(f"{job['id']}  tiny  succeeded") for line in jobs), jobs
    assert jobs[-1].endswith("hidden at 60 columns: see --wide or --json")  # the jobs table: `qf show` has --wide


def test_jobs_table_names_what_it_hides(home):
    shown = qf(home, "jobs", columns=60)
    plain(shown.stdout)
    job = json.loads(qf(home, "jobs", "--json").stdout)[0]
    assert any(line.startswith(f"{job['id']}  {job['name']}  ") for line in lines(shown.stdout)), shown.stdout
    [note] = hidden_line(shown.stdout)
    assert note.endswith("hidden at 60 columns: see --json")  # `qf jobs` has no --wide


def test_watch_ls_keeps_the_target_whole(home, tmp_path):
    watched = tmp_path / "home"
    shutil.copytree(home, watched)
    qf(
        watched,
        "watch",
        "add",
        TARGET,
        "--exl2",
        "3.0,4.0,5.0,6.0",
        "--arch",
        "LlamaForCausalLM",
        "--max-params",
        "8e9",
    )
    shown = qf(watched, "watch", "ls")
    plain(shown.stdout)
    out = lines(shown.stdout)
    assert any(line.startswith(f"{TARGET}  ") for line in out), shown.stdout
    assert all(len(line) <= 80 for line in out) and len(out) == 3 + len(hidden_line(shown.stdout)), shown.stdout
    assert hidden_line(shown.stdout) == ["RECIPE, FILTER, SKIPPED hidden at 80 columns: see --wide or --json"]
    wide = qf(watched, "watch", "ls", "--wide")
    assert "exl2-3.0bpw, exl2-4.0bpw, exl2-5.0bpw, exl2-6.0bpw" in wide.stdout and not hidden_line(wide.stdout)
    assert "{" not in wide.stdout and "LlamaForCausalLM, at most 8B parameters" in wide.stdout  # not the JSON
    assert qf(watched, "watch", "rm", TARGET).returncode == 0  # what the table showed is what rm takes


def test_token_ls(home, tmp_path):
    tokens = tmp_path / "home"
    shutil.copytree(home, tokens)
    made = json.loads(qf(tokens, "token", "create", "--user", "alice-with-a-rather-long-user-name", "--json").stdout)
    shown = qf(tokens, "token", "ls")
    plain(shown.stdout)
    row = next(line for line in lines(shown.stdout) if line.startswith(made["id"]))
    assert "alice-with-a-rather-long-user-name" in row and all(len(line) <= 80 for line in lines(shown.stdout))
    assert bool(hidden_line(shown.stdout)) == ("CREATED" not in lines(shown.stdout)[0])


def test_calib_ls(home):
    shown = qf(home, "calib", "ls")
    plain(shown.stdout)
    names = [r["name"] for r in json.loads(qf(home, "calib", "ls", "--json").stdout)]
    assert [line.split()[0] for line in lines(shown.stdout)[1:]] == names and not hidden_line(shown.stdout)


@pytest.fixture(scope="module")
def tiny576(tmp_path_factory) -> Path:
    """SmolLM2's hidden size, 576: exllamav3 pads it to 640 and its MLP does not crop the padding (EXL3 refuses)."""
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny576", hidden=576, layers=2)


def screen_lines(text: str, width: int = 80) -> int:
    return sum(max(1, math.ceil(len(line) / width)) for line in lines(text))


def test_plan_leaves_out_an_engine_that_refuses_the_model(tiny576, tmp_path):
    plans = json.loads(qf(tmp_path, "plan", tiny576, "--vram", "24GB", "--json").stdout)
    reason = (
        "EXL3 cannot convert a model whose hidden size (576) is not a multiple of 128: exllamav3 pads it and its "
        "MLP does not crop the padding back"
    )
    assert plans["exl3"] == {"refused": reason}
    assert plans["exl2"]["best_bpw"] == 8.0 and set(plans["awq"]) >= {"fp16", "fp8"}
    shown = qf(tmp_path, "plan", tiny576, "--vram", "24GB")
    plain(shown.stdout)
    assert reason in lines(shown.stdout) and "EXL3 with exllamav3" not in shown.stdout
    assert "highest EXL3" not in shown.stdout and "converting with EXL3" not in shown.stdout
    assert "highest EXL2 bpw that fits: 8.00" in shown.stdout


def test_plan_fits_a_40_line_screen(tiny, tmp_path):
    shown = qf(tmp_path, "plan", tiny, "--vram", "24GB")
    plain(shown.stdout)
    assert screen_lines(shown.stdout) <= 40, shown.stdout
    assert "EXL3 with exllamav3" in shown.stdout and "highest EXL3 bpw that fits: 8.00" in shown.stdout
    one = qf(tmp_path, "plan", tiny, "--vram", "24GB", "--engine", "exl3")
    assert "EXL3 with exllamav3" in one.stdout and "EXL2" not in one.stdout and "AWQ" not in one.stdout
    unknown = qf(tmp_path, "plan", tiny, "--vram", "24GB", "--engine", "gptq", check=False)
    assert (
        unknown.returncode == 2 and "no engine named 'gptq'; available: awq, awqct, exl2, exl3, gguf" in unknown.stderr
    )


def test_exl3_weights_the_same_at_every_size_are_explained(tiny, tmp_path):
    """Not a bug of the memory model: exllamav3 loads every tensor of up to 16 MiB into 128 MiB blocks (Gemma-3-270M
    peaked the same at 2.0 to 6.0 bpw on the H200), so a small model's weights take one block at every size."""
    plan = json.loads(qf(tmp_path, "plan", tiny, "--vram", "24GB", "--json").stdout)["exl3"]
    assert len({r["weights"] for r in plan["rows"]}) == 1
    shown = qf(tmp_path, "plan", tiny, "--vram", "24GB", "--engine", "exl3").stdout
    assert "1.0-8.0" in shown  # one row for the sizes that need the same
    assert "the same at every size: exllamav3 loads tensors of up to 16 MiB into 128 MiB blocks" in shown


def test_progress_reads_layer_3_of_30(monkeypatch, capsys):
    """Piped: the heartbeat line; on a terminal: the progress bar's text."""
    from factory.cli import render as cli  # what Renderer prints with

    monkeypatch.setattr(cli, "HEARTBEAT_SECONDS", 0)
    monkeypatch.setattr(cli, "err", Console(stderr=True, soft_wrap=True, force_terminal=False))
    with cli.Renderer(as_json=False) as render:
        render({"event": "step", "step": "quantize:awq-w4g64", "state": "running"})
        render({"event": "progress", "step": "quantize:awq-w4g64", "done": 3, "total": 30, "unit": "layer"})
        render({"event": "progress", "step": "quantize:awq-w4g64", "done": 37.5, "total": 100, "unit": "%"})
    assert capsys.readouterr().err.splitlines() == [
        "quantize:awq-w4g64 ...",
        "quantize:awq-w4g64: layer 3 of 30",
        "quantize:awq-w4g64: 37.5%",
    ]
    screen = io.StringIO()
    monkeypatch.setattr(cli, "err", Console(file=screen, force_terminal=True, width=100, color_system=None))
    with cli.Renderer(as_json=False) as render:
        render({"event": "step", "step": "quantize:awq-w4g64", "state": "running"})
        render({"event": "progress", "step": "quantize:awq-w4g64", "done": 3, "total": 30, "unit": "layer"})
        render.progress.refresh()
    assert "layer 3 of 30" in screen.getvalue() and "3/30" not in screen.getvalue()


def test_divergence_line_never_says_minus_zero(monkeypatch, capsys):
    from factory.cli import render as cli  # what Renderer prints with

    monkeypatch.setattr(cli, "err", Console(stderr=True, soft_wrap=True, force_terminal=False))
    with cli.Renderer(as_json=False) as render:
        render(
            {
                "event": "evaluation",
                "subject": "awq-w4g64",
                "ppl": 12.5,
                "kld": KLD_BELOW_ZERO,
                "kld_p99": -1e-4,
                "top1": 0.99,
            }
        )
    assert capsys.readouterr().err.strip() == (
        "perplexity awq-w4g64: 12.5000, KL divergence from FP16 0.0000 (p99 0.000), top-1 99.0%"
    )


def test_the_cards_table_never_says_minus_zero(tmp_path):
    from factory.publish import card, upstream
    from tests.support.quant_rows import quant_row

    row = quant_row(
        "llama:awq-w4g64",
        kld=KLD_BELOW_ZERO,
        top1=0.99,
        eval={"text": "builtin:wiki", "windows": 8, "window_length": 2048, "device": "cpu"},
    )
    text = card.render("llama", upstream.read("meta-llama/Llama-3.2-1B", None, tmp_path), row, [row])
    assert "-0.0000" not in text and "| 0.0000 |" in text


def test_a_duration_under_a_second_never_reads_zero():
    from factory.tables import duration

    assert [duration(s) for s in (0.0, 0.3, 0.6, 12.4, 240, 7200)] == [
        "under 1 s",
        "under 1 s",
        "1 s",
        "12 s",
        "4 min",
        "2.0 h",
    ]


def test_plan_projects_the_whole_job_packed_as_the_factory_packs(tiny, tmp_path):
    """`qf plan` with engine flags (as `qf run` takes them): the job's units on one card, when each runs, and the
    units its end waits on; packed is never slower than one unit after another."""
    job = json.loads(qf(tmp_path, "plan", tiny, "--vram", "24GB", "--exl3", "4.0", "--awq", "--json").stdout)["job"]
    assert job["quants"] == ["awq-w4g128", "exl3-4.0bpw"]
    assert {"quantize:awq-w4g128", "quantize:exl3-4.0bpw", "evaluate:fp16", "gate", "publish:exl3-4.0bpw"} <= set(
        job["units"]
    )
    assert 0 < job["expected_seconds"] <= job["one_at_a_time_seconds"]
    path = [step["unit"] for step in job["critical_path"]]
    # the tiny model's conversions are seconds: its path may begin with FP16's evaluation as well as a conversion
    assert job["units"][path[0]]["start"] == 0 and path[-1].startswith("publish:")
    assert job["units"][path[-1]]["end"] == job["expected_seconds"]
    shown = qf(tmp_path, "plan", tiny, "--vram", "24GB", "--exl3", "4.0", "--awq").stdout
    [line] = [line for line in lines(shown) if line.startswith("the whole job (2 quants) on one 24GB GPU and ")]
    assert "packed as the factory packs: about " in line and f"the critical path: {path[0]} " in line


def test_plan_packs_for_the_cores_it_is_told(tiny, tmp_path):
    """`qf plan --cores N` packs for the machine that runs the job, not the one planning it: a GPU unit's child
    keeps a core busy, so on one core the two conversions run one after the other and on 16 side by side."""

    def job(cores: int) -> dict:
        args = ("plan", tiny, "--vram", "24GB", "--exl3", "4.0", "--awq", "--cores", cores)
        return json.loads(qf(tmp_path, *args, "--json").stdout)["job"]

    one, many = job(1), job(16)
    starts = {n: [j["units"][f"quantize:{n}"]["start"] for j in (one, many)] for n in ("awq-w4g128", "exl3-4.0bpw")}
    assert starts["awq-w4g128"][1] == starts["exl3-4.0bpw"][1] == 0  # side by side on 16
    assert (
        0 in (starts["awq-w4g128"][0], starts["exl3-4.0bpw"][0])
        and max(starts["awq-w4g128"][0], starts["exl3-4.0bpw"][0]) > 0
    )
    assert one["expected_seconds"] > many["expected_seconds"]
    shown = qf(tmp_path, "plan", tiny, "--vram", "24GB", "--awq", "--cores", 16).stdout
    assert "the whole job (1 quant) on one 24GB GPU and 16 cores, packed" in " ".join(lines(shown))
