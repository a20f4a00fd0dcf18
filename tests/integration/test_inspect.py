"""Every refusal of inspection: exit 3, one sentence, nothing published, no job (a local folder is inspected
before its job is created)."""

import json
import struct

import pytest

from factory import engines
from factory.checkpoints import inspection
from factory.jobs import prepared


def _no_config(m):
    (m / "config.json").unlink()


def _bad_json(m):
    (m / "config.json").write_text("{not json")


def _auto_map(m):
    cfg = json.loads((m / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (m / "config.json").write_text(json.dumps(cfg))


def _already_quantized(m):
    cfg = json.loads((m / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gguf", "gguf_file": "model.Q4_1.gguf"}
    (m / "config.json").write_text(json.dumps(cfg))


def _pickle_only(m):
    (m / "model.safetensors").unlink()
    (m / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")


def _truncated(m):
    data = (m / "model.safetensors").read_bytes()
    (m / "model.safetensors").write_bytes(data[:-100])


def _unparsable_header(m):
    data = (m / "model.safetensors").read_bytes()
    (m / "model.safetensors").write_bytes(struct.pack("<Q", 20) + b"{this is not json...}" + data[29:])


def _index_names_missing_shard(m):
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (m / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_misplaces_tensor(m):
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model.safetensors", "not.there": "model.safetensors"}}
    (m / "model.safetensors.index.json").write_text(json.dumps(index))


def _unknown_architecture(m):
    cfg = json.loads((m / "config.json").read_text())
    cfg["architectures"] = ["BertForMaskedLM"]  # an encoder: no engine converts one
    (m / "config.json").write_text(json.dumps(cfg))


def _no_tokenizer(m):
    (m / "tokenizer.json").unlink()


CASES = [
    (_no_config, "no config.json in '{m}'; pass a Hugging Face checkpoint folder"),
    (
        _bad_json,
        "config.json is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
    ),
    (_auto_map, "the model needs custom code (auto_map); only architectures built into transformers are allowed"),
    (_already_quantized, "config.json says the model is already quantized (gguf); pass the FP16 checkpoint"),
    (_pickle_only, "the weights are only in pickle files (.bin/.pt); convert them to safetensors first"),
    (_truncated, "model.safetensors is truncated or padded: its tensors need {n} bytes of data, it holds {k}"),
    (_unparsable_header, "model.safetensors has an unparsable safetensors header"),
    (
        _index_names_missing_shard,
        "model.safetensors.index.json names shards that are not there: model-00002-of-00002.safetensors",
    ),
    (
        _index_misplaces_tensor,
        "model.safetensors.index.json puts tensor 'not.there' in model.safetensors, which does not hold it",
    ),
    (
        _unknown_architecture,
        "architecture 'BertForMaskedLM' is not supported; supported: "  # what some engine converts
        + ", ".join(sorted(engines.architectures())),
    ),
    (_no_tokenizer, "no tokenizer (tokenizer.json or tokenizer.model) beside the weights"),
]


@pytest.mark.parametrize("breaks, message", CASES, ids=[c[0].__name__.strip("_") for c in CASES])
def test_refused(qf, model_copy, breaks, message):
    model = model_copy()
    size = (model / "model.safetensors").stat().st_size
    breaks(model)
    result = qf("run", model, "--awq")
    assert result.exit_code == 3, result.output
    error = result.stderr.splitlines()[-1]
    if "{n}" in message:
        data = size - 8 - _header_len(model)
        message = message.format(n=data, k=data - 100)
    assert error == f"error: {message.format(m=model)}"
    assert "Traceback" not in result.output
    assert qf.registry_files() == [] and qf.json("jobs") == []


def _header_len(model):
    return struct.unpack("<Q", (model / "model.safetensors").read_bytes()[:8])[0]


def test_a_local_source_is_inspected_once_per_job(qf, tiny, tmp_path, round_engine, monkeypatch):
    """`qf run` of a folder: submit inspects it and keeps what it learned (inspection.inspected); the estimate and
    the inspect step, whose snapshot hashes to the same identity, read that back instead of inspecting again."""
    seen, real = [], inspection.inspect

    def counted(folder, architectures):
        seen.append(folder)
        return real(folder, architectures)

    for module in (inspection, prepared):
        monkeypatch.setattr(module, "inspect", counted)
    recipe = tmp_path / "round.yaml"
    recipe.write_text("round: {mantissa: [3]}\n")
    result = qf("run", tiny, "--recipe", recipe, "--eval-windows", 1)
    assert result.exit_code == 0, result.output
    assert seen == [tiny]
    assert "inspect" in {s["name"] for s in qf.json("status", qf.json("ls")[0]["job"])["steps"]}
