"""factory/vram.py's arithmetic against what was measured on the H200 (benchmarks/results/h200-2026-11-30/
vram_smollm2.json), and `qf plan`'s answers and refusals."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from factory import vram
from factory.errors import SpecError

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "benchmarks" / "results" / "h200-2026-11-30" / "vram_smollm2.json"


def _bench():
    spec = importlib.util.spec_from_file_location("vram_fit", ROOT / "benchmarks" / "vram_fit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_prediction_is_within_target_of_the_measured_drop():
    result = _bench().compare([MEASURED])
    assert len(result["rows"]) == 26
    for r in result["rows"]:
        margin = max(0.05 * r["measured_drop"], 64 * 2**20)
        assert -margin <= r["predicted"] - r["measured_drop"] <= margin, r
    assert result["all_ok"]
    committed = json.loads((ROOT / "benchmarks" / "results" / "vram_fit.json").read_text())
    assert [r["predicted"] for r in committed["rows"]] == [r["predicted"] for r in result["rows"]]


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
    shape = vram.Shape(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152,
                       max_positions=8192)
    assert vram.cache_bytes(shape, 2048, "fp16") == 30 * 2 * 2048 * 192 * 2
    q4 = vram.cache_bytes(shape, 2048, "q4")
    assert q4 == 30 * 2 * 2048 * 192 // 2 + 30 * 2 * (2048 * 192 // 32) * 2 + 2 * 2048 * 192 * 2
    assert vram.cache_bytes(shape, 2048, "q8") > q4 and vram.cache_bytes(shape, 8192, "q4") == 4 * q4


@pytest.mark.parametrize(("text", "size"), [("24GB", 24 * 2**30), ("24 GiB", 24 * 2**30), ("16g", 16 * 2**30),
                                            ("12288MB", 12 * 2**30), ("1.5GB", int(1.5 * 2**30))])
def test_sizes(text, size):
    assert vram.parse_size(text) == size


@pytest.mark.parametrize("text", ["24", "24 bananas", "-8GB", "0GB", "GB"])
def test_bad_sizes(text):
    with pytest.raises(SpecError):
        vram.parse_size(text)


def test_plan_on_the_cli(qf, tiny):
    result = qf.json("plan", tiny, "--vram", "2GB", "--ctx", 2048, "--kv-cache", "q4")
    assert [r["bpw"] for r in result["rows"]] == [x / 2 for x in range(4, 17)]
    assert result["best_bpw"] == 8.0 and all(r["fits"] for r in result["rows"])
    assert result["rows"][0]["total"] < result["rows"][-1]["total"]
    assert set(result["awq"]) == {"fp16", "fp8"}
    table = qf("plan", tiny, "--vram", "2GB")
    assert table.exit_code == 0 and "highest bpw that fits: 8.00" in table.stdout


@pytest.mark.parametrize(("args", "sentence"), [
    (["--vram", "700MB"], "even 2.0 bpw needs"),
    (["--vram", "24GB", "--ctx", "99999"], "a context of 99999 tokens is more than the model's 4096 positions"),
    (["--vram", "24 parsecs"], "is not a number with a unit"),
    (["--vram", "24GB", "--kv-cache", "q3"], "KV cache 'q3' is not one of fp16, q8, q6, q4"),
])
def test_plan_refusals(qf, tiny, args, sentence):
    result = qf("plan", tiny, *args)
    assert result.exit_code == 2, result.output
    assert sentence in result.stderr


def test_too_small_says_by_how_much():
    shape = vram.Shape(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192, vocab=32000,
                       max_positions=32768)
    params = vram.Params(embed=32000 * 2048, head=32000 * 2048, linear=16 * (2048 * 2048 * 2 + 2048 * 512 * 2
                                                                              + 3 * 2048 * 8192), other=0)
    with pytest.raises(SpecError, match=r"even 2.0 bpw needs .* more than 2.00 GiB minus 512 MiB of headroom"):
        vram.plan(shape, params, 2 * 2**30, 32768, "fp16")
    one = vram.plan(shape, params, 8 * 2**30, 32768, "q4")["best_bpw"]
    two = vram.plan(shape, params, 8 * 2**30, 32768, "q4", gpus=2)
    assert two["estimate"] and two["best_bpw"] >= one
