"""The EXL2 engine's CPU-side logic, on status output recorded from real conversions on the H200
(tests/fixtures/convert_exl2_*.log, written by tests/gpu/test_gpu.py::test_engine_transcripts)."""

import json
from pathlib import Path

import pytest

from factory.engines.exl2 import engine as exl2
from factory.engines.exl2 import ranges as exl2_ranges
from factory.errors import JobFailed
from tests.support import FIXTURES


def _events(name: str) -> list[dict]:
    lines = (FIXTURES / name).read_text().splitlines()
    return [e for e in (exl2.parse_status(line) for line in lines) if e is not None]


def test_measurement_transcript():
    events = _events("convert_exl2_measure.log")
    stages = [e["stage"] for e in events if "stage" in e]
    assert list(dict.fromkeys(stages)) == ["Tokenizing (1)", "Embeddings", "Measuring"]
    measuring = [e["done"] for e in events if e.get("stage") == "Measuring"]
    assert measuring == sorted(measuring) and measuring[-1] == 100.0
    assert events[-1] == {"event": "progress", "peak_gpu_bytes": 123891712}


def test_quantize_transcript():
    events = _events("convert_exl2_quantize.log")
    stages = [e["stage"] for e in events if "stage" in e]
    assert list(dict.fromkeys(stages)) == ["Optimizing", "Tokenizing (2)", "Embeddings", "Quantizing", "Compiling"]
    assert all(e["total"] == 100 and 0 <= e["done"] <= 100 and e["unit"] == "%" for e in events if "stage" in e)
    assert events[-1] == {"event": "progress", "peak_gpu_bytes": 116261888}


@pytest.mark.parametrize("line", [" -- Quantizing...", "[STATUS]unterminated", "", "PEAK 12"])
def test_other_lines_are_not_events(line):
    assert exl2.parse_status(line) is None


@pytest.mark.parametrize(
    "content, flags",
    [
        (None, []),
        ({"progress": "quant"}, []),
        ({"progress": "finished"}, ["-nr"]),
        ({"progress": "quant", "invalid": True}, ["-nr"]),
        ('{"progress": "quant", "trunc', ["-nr"]),
    ],
)
def test_resume_or_wipe(tmp_path, content, flags):
    if content is not None:
        (tmp_path / "job_new.json").write_text(content if isinstance(content, str) else json.dumps(content))
    assert exl2._resume_or_wipe(tmp_path) == flags


def _quant_folder(tmp_path, qc: dict | None, outputs: bool = True):
    tmp_path.mkdir()
    if outputs:
        (tmp_path / "output.safetensors").write_bytes(b"x")
    config = {"architectures": ["LlamaForCausalLM"]}
    if qc is not None:
        config["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_outputs_are_checked_not_trusted(tmp_path):
    spec = exl2.Exl2Spec(bpw=4.0)
    good = {"quant_method": "exl2", "bits": 4.0, "head_bits": 6}
    exl2.check_output(_quant_folder(tmp_path / "a", good), spec, tmp_path / "log")
    with pytest.raises(JobFailed, match="wrote no output"):
        exl2.check_output(_quant_folder(tmp_path / "b", good, outputs=False), spec, tmp_path / "log")
    with pytest.raises(JobFailed, match="wrote no quantization_config"):
        exl2.check_output(_quant_folder(tmp_path / "c", None), spec, tmp_path / "log")
    with pytest.raises(JobFailed, match=r"does not match the spec"):
        exl2.check_output(_quant_folder(tmp_path / "d", {**good, "bits": 4.125}), spec, tmp_path / "log")


def test_flags():
    assert exl2._flags(i="/m", mr=16, cf=Path("/o")) == ["-i", "/m", "-mr", "16", "-cf", "/o"]


# -- the measurement in layer ranges (factory/engines/exl2/ranges.py; tests/gpu/test_gpu_ranges.py runs it) -----------

LLAMA_MODULES = ["model.embed_tokens"] + [f"model.layers.{i}.{m}" for i in range(16) for m in ("self_attn", "mlp")]


@pytest.mark.parametrize(
    "keys, most, spans",
    [
        ([*LLAMA_MODULES, "model.norm", "lm_head"], 4, [(1, 9), (9, 17), (17, 25), (25, 35)]),
        ([*LLAMA_MODULES[:7], "model.norm", "lm_head"], 4, [(1, 3), (3, 5), (5, 9)]),  # 3 layers: 3 ranges
        ([*LLAMA_MODULES[:11], "model.norm", "lm_head"], 4, [(1, 3), (3, 5), (5, 7), (7, 13)]),
        ([*LLAMA_MODULES, "model.norm", "lm_head"], 1, [(1, 35)]),
        (["model.embed_tokens", "model.pos_emb", *LLAMA_MODULES[1:5], "lm_head"], 2, [(1, 4), (4, 7)]),
    ],
)
def test_ranges_cut_between_layers_and_cover_every_module(keys, most, spans):
    assert exl2_ranges.split(keys, most) == spans
    covered = [i for first, end in spans for i in range(first, end)]
    assert covered == list(range(1, len(keys)))  # each module once, in order, after the embedding


def test_ranges_merge_as_one_measurement():
    parts = [
        {"measurement": {"model.layers.0.self_attn.self_attn": [{"accuracy": 0.9}]}, "last_module_idx": 2},
        {"measurement": {"model.layers.1.mlp.mlp": [{"accuracy": 0.8}], "lm_head.linear": None}, "last_module_idx": 6},
    ]
    merged = exl2_ranges.merge(parts, modules=7)
    assert merged == {"measurement": {**parts[0]["measurement"], **parts[1]["measurement"]}, "last_module_idx": 6}
    with pytest.raises(ValueError, match="two ranges measured model.layers.0"):
        exl2_ranges.merge([parts[0], parts[0]], modules=7)


def test_the_measurement_unit_predicts_its_ranges_together():
    from factory.engines.exl2.memory import CONTEXT_BYTES
    from factory.vram import Params, Shape

    memory = exl2.ENGINE.memory
    shape = Shape(
        hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192, vocab=32000, max_positions=32768
    )
    params = Params(embed=32000 * 2048, head=32000 * 2048, linear=16 * 62_914_560, other=0)  # the random 1.1B
    spec = exl2.ENGINE.spec(bpw=4.0)
    one = int(memory.unit_gpu_bytes("quantize", spec, shape, params) * 1.2)
    processes = exl2_ranges.processes(shape.layers)
    assert processes == exl2_ranges.RANGES == memory.unit_cores("measure", "cuda")
    assert memory.unit_gpu_bytes("measure", spec, shape, params) == processes * one + (processes - 1) * CONTEXT_BYTES
    serial = memory.UNIT_SECONDS["measure"][0] + memory.UNIT_SECONDS["measure"][1] * 1.1
    assert memory.unit_seconds("measure", int(1.1e9), "cuda", 4) < 0.6 * serial  # the fixed part stays
