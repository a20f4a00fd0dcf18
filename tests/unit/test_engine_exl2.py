"""The EXL2 engine's CPU-side logic, on status output recorded from real conversions on the H200
(tests/fixtures/convert_exl2_*.log, written by tests/gpu/test_gpu.py::test_engine_transcripts)."""

import json
from pathlib import Path

import pytest

from factory.engines.exl2 import engine as exl2
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
    spec = {"bpw": 4.0, "head_bits": 6}
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
