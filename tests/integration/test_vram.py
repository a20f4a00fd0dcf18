"""The EXL2 memory model's arithmetic (factory/engines/exl2/memory.py) against what was measured on H200s
(SmolLM2-135M's quants at 2k and 8k tokens, the random 1.1B Llama's at 2k to 32k), and `qf plan`'s answers and
refusals."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from factory.engines.exl2 import card as exl2_card
from factory.engines.exl2 import evaluate as exl2_evaluate
from factory.engines.exl2 import memory as vram
from factory.engines.exl2.spec import Fit
from factory.engines.exl3 import memory as exl3_memory
from factory.errors import SpecError
from tests.support import ROOT
from tests.support.quant_rows import quant_row

MEASURED = ROOT / "benchmarks" / "results" / "h200-2026-11-30" / "vram_smollm2.json"
MEASURED_1B = ROOT / "benchmarks" / "results" / "h200x2-2026-11-30" / "vram_llama1b.json"
MEASURED_EXL3 = ROOT / "benchmarks" / "results" / "h200-2026-12-02" / "vram_fit_gemma_exl3.json"


def _bench():
    spec = importlib.util.spec_from_file_location("vram_fit", ROOT / "benchmarks" / "vram_fit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_prediction_is_within_target_of_the_measured_drop():
    result = _bench().compare([MEASURED, MEASURED_1B, MEASURED_EXL3])
    assert len(result["rows"]) == 26 + 36 + 21
    assert {r["method"] for r in result["rows"]} == {"exl2", "exl3"}
    assert {r["ctx"] for r in result["rows"]} == {2048, 8192, 16384, 32768}
    for r in result["rows"]:
        margin = max(0.05 * r["measured_drop"], 64 * 2**20)
        assert -margin <= r["predicted"] - r["measured_drop"] <= margin, r
    assert result["all_ok"]
    committed = json.loads((ROOT / "benchmarks" / "results" / "vram_fit.json").read_text())
    assert [r["predicted"] for r in committed["rows"]] == [r["predicted"] for r in result["rows"]]


def test_exl3_weights_before_a_quant_exists_match_the_real_quants():
    """Gemma-3-270M's quants: the head predicted within 1% of the real one, and on the GPU the head as it is plus
    one 128 MiB slab block for every tensor of up to 16 MiB (all its decoder layers' and norms')."""
    for quant in json.loads(MEASURED_EXL3.read_text())["rows"]:
        qc, real = quant["config"]["quantization_config"], quant["tensor_bytes"]
        shape = exl3_memory.Shape.of(quant["config"])
        params = exl3_memory.dense_params(shape)
        assert params.head * qc["head_bits"] / 8 == pytest.approx(real["head"], rel=0.01)
        assert (params.linear * qc["bits"] / 8 + params.other * 2) == pytest.approx(real["layers"], rel=0.03)
        on_gpu = exl3_memory.exl3_weights(shape, params, qc["bits"], qc["head_bits"])
        assert on_gpu == pytest.approx(real["head"] + exl3_memory.SLAB, rel=0.01)


def test_exl3_plan_and_its_refusals():
    shape = exl3_memory.Shape(
        hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192, vocab=32000, max_positions=32768
    )
    params = exl3_memory.dense_params(shape)
    small = exl3_memory.plan(shape, params, int(2.25 * 2**30), 32768, "q4")["best_bpw"]
    assert 1.0 <= small < exl3_memory.plan(shape, params, int(2.5 * 2**30), 32768, "q4")["best_bpw"] < 8.0
    assert exl3_memory.cache_bytes(shape, 2048, "fp16") == 16 * 2 * 2048 * 512 * 2
    elements = 2048 * 512  # of K or V in a layer
    q4 = 16 * 2 * (elements // 2 + elements // 32 * 2) + 2 * elements * 2  # bits, scales, one fp16 layer
    assert exl3_memory.cache_bytes(shape, 2048, "q4") == q4
    with pytest.raises(SpecError, match=r"even 1.0 bpw needs .* more than 1.00 GiB minus 512 MiB of headroom"):
        exl3_memory.plan(shape, params, 2**30, 32768, "fp16")
    with pytest.raises(SpecError, match="KV cache 'q3' is not one of"):
        exl3_memory.plan(shape, params, 8 * 2**30, 2048, "q3")


def test_the_allocated_peak_matches_torchs():
    """Everything but the context and the allocator's reserve is torch's allocated peak, within 20 MiB, in every
    recorded load (a regression check against these numbers): the reserve is the only rough term."""
    for path in (MEASURED, MEASURED_1B):
        for quant in json.loads(path.read_text())["rows"]:
            shape = vram.Shape.of(quant["config"])
            weights = vram.on_gpu(quant["tensor_bytes"])
            for run in (r for r in quant["runs"] if "error" not in r):
                parts = vram.exllamav2(shape, weights, run["ctx"], run["cache"])
                allocated = parts["total"] - parts["context"] - parts["reserve"]
                assert abs(allocated - run["allocated_peak"]) <= 20 * 2**20, (quant["folder"], run)


def test_weights_before_a_quant_exists_match_the_real_quants():
    data = json.loads(MEASURED.read_text())
    config = data["rows"][0]["config"]
    shape = vram.Shape.of(config)
    # SmolLM2-135M: 30 layers of q, k, v, o, gate, up, down; an untied 49152 x 576 head
    per_layer = 576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3
    params = vram.Params(embed=49152 * 576, head=49152 * 576, linear=30 * per_layer, other=0)
    for quant in data["rows"]:
        qc = quant["config"]["quantization_config"]
        real = quant["tensor_bytes"]["head"] + quant["tensor_bytes"]["layers"]
        assert vram.exl2_weights(params, qc["bits"], qc["head_bits"]) == pytest.approx(real, rel=0.01), quant["folder"]
    assert shape.kv_heads == 3 and shape.head_dim == 64 and shape.max_positions == 8192


def test_cache_sizes():
    shape = vram.Shape(
        hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152, max_positions=8192
    )
    assert vram.cache_bytes(shape, 2048, "fp16") == 30 * 2 * 2048 * 192 * 2
    q4 = vram.cache_bytes(shape, 2048, "q4")
    assert q4 == 30 * 2 * 2048 * 192 // 2 + 30 * 2 * (2048 * 192 // 32) * 2 + 2 * 2048 * 192 * 2
    assert vram.cache_bytes(shape, 2048, "q8") > q4 and vram.cache_bytes(shape, 8192, "q4") == 4 * q4


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("24GB", 24 * 2**30),
        ("24 GiB", 24 * 2**30),
        ("16g", 16 * 2**30),
        ("12288MB", 12 * 2**30),
        ("1.5GB", int(1.5 * 2**30)),
    ],
)
def test_sizes(text, size):
    assert vram.parse_size(text) == size


@pytest.mark.parametrize("text", ["24", "24 bananas", "-8GB", "0GB", "GB"])
def test_bad_sizes(text):
    with pytest.raises(SpecError):
        vram.parse_size(text)


def test_plan_on_the_cli(qf, tiny):
    plans = qf.json("plan", tiny, "--vram", "2GB", "--ctx", 2048, "--kv-cache", "q4")
    # the engines with a memory model, the job, the ranking (none of the model's quants scored in a new home)
    assert set(plans) == {"exl2", "exl3", "awq", "awqct", "gguf", "job", "ranking"}
    assert {r["kind"] for r in plans["ranking"]["rows"]} == {"unscored"}
    assert plans["awqct"]["fp16"] == plans["awq"]["fp16"]  # both are vLLM serving w4 groups
    assert [r["bpw"] for r in plans["exl3"]["rows"]] == [x / 2 for x in range(2, 17)]
    assert plans["exl3"]["best_bpw"] == 8.0 and set(plans["exl3"]["expected_seconds"]) == {"measure-kld", "quantize"}
    result = plans["exl2"]
    assert [r["bpw"] for r in result["rows"]] == [x / 2 for x in range(4, 17)]
    assert result["best_bpw"] == 8.0 and all(r["fits"] for r in result["rows"])
    assert result["rows"][0]["total"] < result["rows"][-1]["total"]
    assert set(plans["awq"]) == {"fp16", "fp8", "expected_seconds"}
    # how long converting takes: no history in a new home, so the engines' estimates (H200 timings, docs/measured.md)
    assert set(result["expected_seconds"]) == {"measure", "quantize"}
    assert result["expected_seconds"]["quantize"]["basis"] == "estimate"
    assert 60 <= result["expected_seconds"]["measure"]["seconds"] <= 90  # a tiny model: the fixed costs
    assert not (qf.home / "catalog.db").exists()  # planning makes no catalog
    table = qf("plan", tiny, "--vram", "2GB")
    assert table.exit_code == 0 and "highest EXL2 bpw that fits: 8.00" in table.stdout
    assert "highest EXL3 bpw that fits: 8.00" in table.stdout
    assert "converting with EXL2 on a GPU: the measurement about 60 s (estimate), then each size about" in table.stdout
    lines = table.stdout.splitlines()
    assert lines.index(next(x for x in lines if "highest EXL3 bpw" in x)) < lines.index(
        next(x for x in lines if x.startswith("AWQ w4 with vLLM, fp16"))
    )


@pytest.mark.parametrize(
    ("args", "sentence"),
    [
        (["--vram", "700MB"], "even 2.0 bpw needs"),
        (["--vram", "24GB", "--ctx", "99999"], "a context of 99999 tokens is more than the model's 4096 positions"),
        (["--vram", "24 parsecs"], "is not a number with a unit"),
        (["--vram", "24GB", "--kv-cache", "q3"], "KV cache 'q3' is not one of fp16, q8, q6, q4"),
    ],
)
def test_plan_refusals(qf, tiny, args, sentence):
    result = qf("plan", tiny, *args)
    assert result.exit_code == 2, result.output
    assert sentence in result.stderr


def test_too_small_says_by_how_much():
    shape = vram.Shape(
        hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192, vocab=32000, max_positions=32768
    )
    params = vram.Params(
        embed=32000 * 2048, head=32000 * 2048, linear=16 * (2048 * 2048 * 2 + 2048 * 512 * 2 + 3 * 2048 * 8192), other=0
    )
    with pytest.raises(SpecError, match=r"even 2.0 bpw needs .* more than 2.00 GiB minus 512 MiB of headroom"):
        vram.plan(shape, params, 2 * 2**30, 32768, "fp16")
    one = vram.plan(shape, params, int(3.5 * 2**30), 32768, "q4")["best_bpw"]
    assert 2.0 <= vram.plan(shape, params, int(3.25 * 2**30), 32768, "q4")["best_bpw"] < one < 8.0
    two = vram.plan(shape, params, int(3.25 * 2**30), 32768, "q4", gpus=2)
    assert two["estimate"] and two["best_bpw"] > one


def test_fit_chooses_the_sizes_and_records_the_budget(qf, tiny, monkeypatch):
    """--fit on a submission for CUDA workers: one EXL2 size per budget, chosen by the plan, the budget in the spec."""
    import redis

    from tests.support.fleet import BROKER

    monkeypatch.setenv("FACTORY_BROKER_URL", BROKER)
    monkeypatch.setenv("FACTORY_WORKER_DEVICE", "cuda")
    redis.Redis.from_url(BROKER).flushdb()
    result = qf("submit", tiny, "--fit", "2GB,1500MB", "--ctx", 2048, "--kv-cache", "q4")
    assert result.exit_code == 0, result.output
    job = qf.json("status", result.stdout.strip())
    plans = {
        b: qf.json("plan", tiny, "--vram", b, "--ctx", 2048, "--kv-cache", "q4")["exl2"]["best_bpw"]
        for b in ("2GB", "1500MB")
    }
    assert plans == {"2GB": 8.0, "1500MB": 8.0}  # the tiny model's weights are nothing: both budgets take 8.0
    assert [(s["bpw"], s["fit"]) for s in job["specs"]] == [(8.0, {"vram": 1500 * 2**20, "ctx": 2048, "cache": "q4"})]
    assert "--fit 1500MB: EXL2 8.00 bpw for 2048 tokens with a q4 cache" in result.stderr
    both = qf("submit", tiny, "--fit", "2GB", "--exl2", "4.0")
    assert both.exit_code == 2 and "give --exl2 sizes or --fit budgets, not both" in both.stderr
    small = qf("submit", tiny, "--fit", "700MB")
    assert small.exit_code == 2 and "even 2.0 bpw needs" in small.stderr


def _exl2_shaped(folder: Path) -> dict:
    """A folder shaped like SmolLM2's exl2-4.0bpw quant measured on the H200: its config and tensors of its sizes."""
    import torch
    from safetensors.torch import save_file

    quant = json.loads(MEASURED.read_text())["rows"][1]
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(quant["config"]))
    sizes = quant["tensor_bytes"]
    save_file(
        {
            "model.embed_tokens.weight": torch.zeros(sizes["embed"] // 2, dtype=torch.float16),
            "lm_head.q_weight": torch.zeros(sizes["head"] // 2, dtype=torch.int16),
            "model.layers.0.mlp.q_weight": torch.zeros(sizes["layers"] // 2, dtype=torch.int16),
        },
        str(folder / "output.safetensors"),
    )
    return sizes


def test_fits_table_of_a_finished_quant_and_its_card(tmp_path):
    """The table the card and `qf show` print, for a 135M model."""

    folder = tmp_path / "q"
    sizes = _exl2_shaped(folder)
    assert vram.quant_weights(folder) == sizes["head"] // 2 * 2 + sizes["layers"] // 2 * 2
    fits = vram.quant_fits(folder)
    assert [f["budget"] for f in fits] == list(vram.FIT_BUDGETS)
    assert all(f["fp16"] == 8192 and f["q4"] == 8192 for f in fits)  # a 135M model fits 8 GB at its full context
    row = quant_row(
        "smollm2:exl2-4.0bpw",
        fits=fits,
        spec={"head_bits": 6, "fit": {"vram": 8 * 2**30, "ctx": 8192, "cache": "q4"}},
        eval={"kv_cache": {"fp16": 16.2, "q8": 16.21, "q4": 16.5}},
    )
    text = exl2_card.fits(row)
    assert "| 8 GB | 8,192 tokens | 8,192 tokens |" in text and "Made to fit 8 GiB with 8192 tokens of q4" in text
    assert "fp16 16.2000, q8 16.2100, q4 16.5000" in text


def test_qf_show_lists_where_an_exl2_quant_fits_and_its_kv_cache_perplexities(qf, tiny, monkeypatch):
    """An EXL2 quant in the catalog (files shaped like a real one: EXL2 itself needs CUDA) beside a real AWQ one."""
    from factory import settings
    from factory.catalog import Catalog, Quant

    assert qf("run", tiny, "--awq", "--eval-windows", 2).exit_code == 0
    for var, value in qf.env.items():
        monkeypatch.setenv(var, value)
    catalog = Catalog(settings.load().db_url)
    awq = catalog.quants.live(name="tiny")[0]
    _exl2_shaped(qf.home / "registry" / "tiny" / "exl2-4.0bpw" / awq.rev)
    fields = {c.name: getattr(awq, c.name) for c in Quant.__table__.columns if c.name not in ("id", "created_at")}
    fields.update(
        tag="exl2-4.0bpw",
        method="exl2",
        path=f"tiny/exl2-4.0bpw/{awq.rev}",
        eval={**awq.eval, "kv_cache": {"fp16": 16.635, "q8": 16.627, "q4": None}},
    )
    catalog.quants.put(Quant(**fields))
    shown = qf("show", "tiny")
    assert shown.exit_code == 0, shown.output
    assert f"tiny:exl2-4.0bpw@{awq.rev}: the longest context that fits each GPU" in shown.stdout
    assert "through exllamav2's KV cache" in shown.stdout and "q8 16.6270, q4 not finite" in shown.stdout
    rows = {r["name"]: r for r in qf.json("show", "tiny")["quants"]}
    assert (
        rows["tiny:exl2-4.0bpw"]["fits"][0]["fp16"] == 8192 and rows["tiny:awq-w4g128"]["fits"]
    )  # AWQ: with vLLM (issue 45)


def test_one_list_of_cache_types():
    assert set(exl2_evaluate.KV_CACHES) == set(vram.CACHES) == set(vram._CACHE_BYTES)
    assert Fit(vram=2**30, ctx=2048, cache="q6").cache == "q6"
    with pytest.raises(ValueError, match="q3"):
        Fit(vram=2**30, ctx=2048, cache="q3")
