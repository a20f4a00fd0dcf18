"""Which quant to pull (issue 49): the ranking across formats against the catalog's scores, `qf pull --fit`, the
card's frontier and picks, and `--fit` across formats in a job. On the tiny model: one real job of AutoAWQ, AWQ-CT and
three GGUF types (Q5_K_M, Q3_K_M, Q2_K) on the same 2 windows (the SmolLM2 job's: tests/integration/test_smollm2.py)."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest

from factory import engines, ranking, vram
from factory.publish import frontier
from factory.registry.published import QuantRow
from tests.support.tiny_model import make_tiny_llama

GGUF_TYPES = ("Q5_K_M", "Q3_K_M", "Q2_K")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tests' tiny Llama, with 32k positions so that the card's 8k and 32k picks apply."""
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny", max_positions=32768)


@pytest.fixture(scope="module")
def made(tiny, tmp_path_factory):
    """`qf run tiny` with AutoAWQ, AWQ-CT and GGUF Q5_K_M, Q3_K_M, Q2_K, scored on the same 2 windows; the runner and
    `qf ls --json`'s rows by tag."""
    from tests.conftest import Qf, fresh_database

    with fresh_database() as url:
        qf = Qf(home=tmp_path_factory.mktemp("ranking") / "home", db_url=url)
        recipe = tmp_path_factory.mktemp("recipe") / "every.yaml"
        recipe.write_text(
            "awq: {}\nawqct: {}\n"
            f"gguf:\n  types: [{', '.join(GGUF_TYPES)}]\n  imatrix_chunks: 8\n  imatrix_ctx: 256\n"
            "eval: builtin:wiki\nmax_ppl_ratio: 3\n"
        )
        result = qf("run", tiny, "--recipe", recipe, "--eval-windows", 2, "--json")
        assert result.exit_code == 0, result.output
        rows = {row["tag"]: row for row in qf.json("ls")}
        for tag, row in sorted(rows.items(), key=lambda item: item[1]["kld"]):
            print(f"{tag}: {row['bytes']} bytes, KLD {row['kld']:.6f}")
        yield qf, rows


def _plan(qf, tiny, *args) -> dict:
    return qf.json("plan", tiny, *args)["ranking"]


def test_the_ranking_is_the_catalogs_scores_lowest_kld_first(made, tiny):
    qf, rows = made
    ranked = _plan(qf, tiny, "--vram", "24GB", "--ctx", 8192)
    measured = {r["tag"]: r for r in ranked["rows"] if r["kind"] == "measured"}
    assert {tag: r["kld"] for tag, r in measured.items()} == {tag: row["kld"] for tag, row in rows.items()}
    assert {tag: r["top1"] for tag, r in measured.items()} == {tag: row["top1"] for tag, row in rows.items()}
    assert {r["method"] for r in measured.values()} == {"awq", "awqct", "gguf"}
    assert all(r["fits"] for r in measured.values())  # a tiny model fits 24 GB whatever the runtime
    scored = [r for r in ranked["rows"] if r["fits"] and r["kld"] is not None]
    assert [r["kld"] for r in scored] == sorted(r["kld"] for r in scored)
    assert ranked["protocol"] == "builtin:wiki, 2 x 2048 tokens" and ranked["ctx"] == 8192


def test_expected_rows_read_their_formats_measured_curve(made, tiny):
    """Q4_K_M (4.89 bits) lies between the measured Q3_K_M (3.91) and Q5_K_M (5.69): its KLD is the curve's, log KLD
    linear in bits, marked expected, naming both; a type beyond the measured ones is not ranked."""
    qf, rows = made
    by_tag = {r["tag"]: r for r in _plan(qf, tiny, "--vram", "24GB", "--ctx", 8192)["rows"]}
    low, high = rows["gguf-q3_k_m"], rows["gguf-q5_k_m"]
    share = (4.89 - low["bits"]) / (high["bits"] - low["bits"])
    curve = math.exp(math.log(low["kld"]) + share * (math.log(high["kld"]) - math.log(low["kld"])))
    q4 = by_tag["gguf-q4_k_m"]
    assert q4["kind"] == "expected" and q4["kld"] == pytest.approx(curve, rel=1e-9)
    assert "between gguf-q3_k_m and gguf-q5_k_m" in q4["basis"]
    for beyond in ("gguf-iq1_s", "gguf-q8_0"):
        assert by_tag[beyond]["kind"] == "unscored" and by_tag[beyond]["kld"] is None


def test_a_quant_scored_on_other_windows_is_named_and_left_out(made, tiny):
    """KLDs compare only on the same windows: a quant scored on 48 (a GPU job's) beside the others' 2 is not ranked."""
    _, rows = made
    quants = [QuantRow.from_json(r) for r in rows.values()]
    elsewhere = replace(quants[0], eval={**quants[0].eval, "windows": 48})
    ranked = ranking.rank("tiny", ranking.Model.of(str(tiny)), [elsewhere, *quants[1:]], 24 * vram.GiB, 8192)
    assert {r.tag for r in ranked.rows if r.kind == "measured"} == {q.tag for q in quants[1:]}
    assert elsewhere.tag not in {r.tag for r in ranked.rows}  # published: not a size to make either
    assert ranked.notes == [f"not ranked, scored on other windows than builtin:wiki, 2 x 2048 tokens: {elsewhere.tag}"]


def test_qf_plan_shows_the_ranking_and_what_it_leaves_out(made, tiny):
    qf, _ = made
    result = qf("plan", tiny, "--vram", "24GB", "--ctx", 8192)
    assert result.exit_code == 0, result.output
    assert (
        "tiny ranked by KLD: what fits 24.00 GiB at 8192 tokens (fp16 cache), scored on builtin:wiki" in result.stdout
    )
    assert "~: expected, read off its format's measured curve on this model" in result.stdout
    assert "not ranked, outside GGUF's measured range on this model (2.96-5.69 bits)" in result.stdout


def test_a_runtime_ranks_only_what_it_loads(made, tiny):
    qf, _ = made
    vllm = _plan(qf, tiny, "--vram", "24GB", "--runtime", "vLLM")
    assert {r["method"] for r in vllm["rows"]} == {"awq", "awqct"} and vllm["runtime"] == "vllm"
    bad = qf("plan", tiny, "--vram", "24GB", "--runtime", "exl2")
    assert bad.exit_code == 2
    assert bad.stderr.strip() == (
        "error: runtime 'exl2' is not one the factory sizes for: exllamav2, exllamav3, llama.cpp, ollama, tabbyapi, "
        "transformers, vllm"
    )


def _cut_below(need: int) -> str:
    """A budget (in MB, as users write them) whose room is just under `need` bytes."""
    return f"{math.floor((need + vram.HEADROOM - 1) / vram.MiB * 1000) / 1000}MB"


def test_a_pull_by_budget_gets_the_lowest_kld_quant_that_fits(made, tiny, tmp_path):
    """With room for everything, the lowest KLD of all; with a budget just too small for it, the lowest KLD of those
    whose runtime's need (each engine's memory model) still fits, whatever its format."""
    qf, rows = made
    best = min(rows.values(), key=lambda r: r["kld"])
    result = qf("pull", "tiny", "--fit", "24GB", "--ctx", 4096, "-o", tmp_path / "all")
    assert result.exit_code == 0, result.output
    line = result.stderr.splitlines()[0]
    assert line.startswith(f"tiny:{best['tag']}@{best['rev']}: the lowest KLD ({best['kld']:.4f}, on builtin:wiki")
    assert f"of the {len(rows)} published quants that fit 24.00 GiB at 4096 tokens" in line
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == sorted(
        p.name for p in (qf.home / "registry" / best["path"]).iterdir()
    )

    needs = {r["tag"]: r["need"] for r in _plan(qf, tiny, "--vram", "24GB", "--ctx", 4096)["rows"] if r["rev"]}
    budget = _cut_below(needs[best["tag"]])
    room = vram.parse_size(budget) - vram.HEADROOM
    fitting = [r for tag, r in rows.items() if needs[tag] <= room]
    assert fitting and len(fitting) < len(rows)
    want = min(fitting, key=lambda r: r["kld"])
    pulled = qf("pull", "tiny", "--fit", budget, "--ctx", 4096, "-o", tmp_path / "cut", "--json")
    assert pulled.exit_code == 0, pulled.output
    data = json.loads(pulled.stdout)
    assert data["pulled"]["tag"] == want["tag"] and data["pulled"]["kld"] == want["kld"]
    assert data["path"] == str((tmp_path / "cut").resolve())
    assert {r["tag"] for r in data["ranking"]["rows"]} == set(rows)  # a pull ranks what is published
    assert [r["tag"] for r in data["ranking"]["rows"] if not r["fits"]] == [
        tag for tag in (r["tag"] for r in data["ranking"]["rows"]) if needs[tag] > room
    ]


def test_a_budget_nothing_fits_is_one_sentence(made):
    qf, _ = made
    result = qf("pull", "tiny", "--fit", "513MB", "--ctx", 4096)
    assert result.exit_code == 2
    assert result.stderr.startswith(
        "error: no published quant of tiny fits 513 MiB at 4096 tokens (fp16 cache): the smallest, gguf-q2_k, needs"
    )
    both = qf("pull", "tiny:gguf-q2_k", "--fit", "24GB")
    assert both.exit_code == 2
    assert both.stderr.strip() == "error: --fit chooses the tag: pass tiny --fit 24GB, or tiny:gguf-q2_k without --fit"


def test_the_card_draws_the_frontier_and_picks_for_each_budget(made, tiny):
    qf, rows = made
    for row in rows.values():  # each card's picks are of the quants published before it (its units run at once)
        card = (qf.home / "registry" / row["path"] / "README.md").read_text()
        assert "## Which quant to pick" in card and "| memory | 8k tokens | 32k tokens |" in card
    quants = [QuantRow.from_json(r) for r in rows.values()]
    card = frontier.section("tiny", quants, ranking.Model.of(str(tiny)))
    on = ranking.frontier(quants)
    assert on[0].bytes == min(r.bytes for r in quants)
    assert [r.kld for r in on] == sorted((r.kld for r in on), reverse=True)  # larger, and closer to FP16
    picks = ranking.picks("tiny", ranking.Model.of(str(tiny)), quants)
    for gib in ranking.BUDGETS:
        cells = [f"`{picks[gib, ctx].tag}` (KLD {picks[gib, ctx].kld:.4f}" for ctx in ranking.CONTEXTS]
        assert f"| {gib} GB | {cells[0]}" in card and cells[1] in card
    svg = ET.fromstring(frontier.svg("tiny", quants))
    points = [c for c in svg.iter("{http://www.w3.org/2000/svg}circle") if c.find("{*}title") is not None]
    assert {c.find("{*}title").text for c in points} == {r.tag for r in quants if r.kld > 0}
    box = frontier.LEFT, frontier.TOP, frontier.WIDTH - frontier.RIGHT, frontier.HEIGHT - frontier.BOTTOM
    for c in points:  # inside the axes, the smallest quant leftmost
        assert box[0] < float(c.get("cx")) < box[2] and box[1] <= float(c.get("cy")) <= box[3]
    leftmost = min(points, key=lambda c: float(c.get("cx"))).find("{*}title").text
    assert leftmost == min(quants, key=lambda r: r.bytes).tag
    assert {t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")} >= {
        engines.get(m).label for m in {r.method for r in quants}
    }


def test_fit_in_a_recipe_makes_what_the_ranking_says_across_formats(made, tiny, tmp_path):
    """With the model's quants scored, a budget just too small for GGUF Q5_K_M's runtime (and far too small for vLLM's)
    makes the row the ranking puts first: a GGUF type the GGUF curve expects, between the measured ones."""
    qf, _ = made
    needs = {r["tag"]: r for r in _plan(qf, tiny, "--vram", "24GB", "--ctx", 2048)["rows"]}
    budget = _cut_below(needs["gguf-q5_k_m"]["need"])
    room = vram.parse_size(budget) - vram.HEADROOM
    scored = [r for r in needs.values() if r["kld"] is not None and r["need"] <= room]
    first = min(scored, key=lambda r: (r["kld"], -r["bits"]))
    assert first["kind"] == "expected" and first["method"] == "gguf"
    recipe = tmp_path / "fit.yaml"
    recipe.write_text(f"fit: {budget}\ngguf:\n  imatrix_chunks: 8\n  imatrix_ctx: 256\nmax_ppl_ratio: 3\n")
    result = qf("run", tiny, "--recipe", recipe, "--ctx", 2048, "--eval-windows", 2, "--json")
    assert result.exit_code == 0, result.output
    assert f"--fit {budget}: 2048 tokens (fp16 cache): {first['tag']}, KLD about {first['kld']:.4f}" in result.stderr
    made_now = json.loads(result.stdout.splitlines()[-1])["quants"]
    assert [q["name"] for q in made_now] == [f"tiny:{first['tag']}"]
    everything = qf("run", tiny, "--fit", "24GB", "--ctx", 2048, "--eval-windows", 2)
    assert everything.exit_code == 2
    assert "is published and has the lowest KLD that fits" in everything.stderr
    assert everything.stderr.strip().endswith(
        "error: every budget's best quant of tiny is published: qf pull tiny --fit SIZE gets it"
    )


def test_fit_through_the_service_asks_the_factorys_ranking(made, tiny, tmp_path):
    """`qf submit --fit` through `qf serve` sizes the job as `qf run --fit` does, by the ranking of the model's scored
    quants in the factory's catalog (here every budget's best is published: the same sentence, nothing queued)."""
    import os

    import redis

    from tests.support.fleet import BROKER
    from tests.support.processes import qf as qf_child
    from tests.support.service import Server, user_env

    qf, _ = made
    redis.Redis.from_url(BROKER).flushdb()
    factory_side = {
        **os.environ,
        **qf.env,
        "FACTORY_BROKER_URL": BROKER,
        "FACTORY_WORKER_DEVICE": "cpu",
        "FACTORY_SERVE_SOURCES": str(tiny.parent),
    }
    server = Server(factory_side, tmp_path / "server.log")
    try:
        user = user_env(server, server.token("ana"), tmp_path / "ana")
        result = qf_child(user, "submit", tiny, "--fit", "24GB", "--ctx", 2048, "--eval-windows", 2)
    finally:
        server.stop()
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().endswith(
        "every budget's best quant of tiny is published: qf pull tiny --fit SIZE gets it"
    ), result.stderr
    assert redis.Redis.from_url(BROKER).dbsize() == 0  # nothing was queued
