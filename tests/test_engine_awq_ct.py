"""The AWQ-CT engine (llm-compressor's AWQ, written as compressed-tensors), for real: `qf run --awqct` end to end on
the tiny Llama, then what transformers (5.17, from the engine's own packages) makes of the pulled quant; the child's
packages, made once; the mixtures of experts its mappings name, each a tiny checkpoint of tests/tiny_archs.py that the
engine quantizes and scores; SmolLM2-135M on the CPU against the AutoAWQ quant's numbers; a child that fails."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from calibration import builtin_text
from factory import engines
from factory.checkpoints.inspect import inspect
from factory.engines.awq_ct import env
from factory.engines.awq_ct.engine import ARCHITECTURES
from factory.errors import JobFailed
from factory.evaluation import evaluate
from tests.smollm2 import PPL_WIKI
from tests.tiny_archs import make_tiny

ENGINE = engines.get("awqct")


def _tensor_names(folder) -> set[str]:
    names = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def _windows(folder, rows: int, length: int) -> list[list[int]]:
    ids = evaluate.tokenize(folder, builtin_text("c4"))
    return [ids[i * length : (i + 1) * length] for i in range(rows)]


# transformers as the engine's child has it (factory/engines/awq_ct/env.py: 5.17), loading a pulled quant as a user
# would and writing its config and logits: the factory's own transformers (5.23 and later) refuses the zero points.
TRANSFORMERS_LOADS = """
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM
folder, ids, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
with torch.inference_mode():
    config = json.loads(model.config.to_json_string())["quantization_config"]
    torch.save({"version": transformers.__version__, "config": config, "logits": model(torch.tensor([ids])).logits},
               out)
"""


def test_qf_run_quantizes_scores_publishes_and_transformers_loads_the_pulled_quant(qf, tiny, tmp_path):
    result = qf("run", tiny, "--awqct", "--eval-windows", 2, "--json")
    assert result.exit_code == 0, result.output
    [row] = qf.json("ls")
    assert (row["name"], row["method"], row["bits"]) == ("tiny:awqct-w4g128", "awqct", 4.0)
    assert row["fp16_ppl"] < row["ppl"] < 1.5 * row["fp16_ppl"]
    assert row["kld"] is not None and 0 < row["kld"] < 0.5 and 0.5 < row["top1"] <= 1
    steps = {s["name"] for s in qf.json("status", row["job"])["steps"]}
    assert {"quantize:awqct-w4g128", "evaluate:fp16", "evaluate:awqct-w4g128", "publish:awqct-w4g128"} <= steps

    result = qf("pull", "tiny:awqct-w4g128", "-o", tmp_path / "pulled")
    assert result.exit_code == 0, result.output
    pulled = tmp_path / "pulled"
    assert {"recipe.yaml", "tokenizer.json", "README.md"} <= {p.name for p in pulled.iterdir()}
    ids = evaluate.tokenize(pulled, builtin_text("wiki"))[:256]
    out = tmp_path / "transformers.pt"
    done = subprocess.run(
        [sys.executable, "-c", TRANSFORMERS_LOADS, str(pulled), json.dumps(ids), str(out)],
        env={**os.environ, **env.child_path()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = torch.load(out)
    assert loaded["version"] == "5.17.0"
    qc = loaded["config"]
    [group] = qc["config_groups"].values()
    assert (qc["quant_method"], qc["format"], qc["ignore"]) == ("compressed-tensors", "pack-quantized", ["lm_head"])
    assert {k: group["weights"][k] for k in ("num_bits", "group_size", "symmetric", "strategy")} == {
        "num_bits": 4,
        "group_size": 128,
        "symmetric": False,
        "strategy": "group",
    }
    # what transformers decompresses is what the factory scored (the engine's own decompression, layer by layer)
    with torch.inference_mode():
        [ours] = ENGINE.load(pulled, "cpu").logits([ids])
    assert torch.allclose(loaded["logits"], ours, atol=1e-3)


def test_the_child_has_its_own_transformers_and_makes_its_packages_once():
    """The child's path starts with the engine's packages (transformers 5.17 for llm-compressor 0.14.0.1), made
    once in a folder keyed by the pins; the factory's own environment is left as it is."""
    first = env.ensure()
    assert first == env.folder() and (first / env.DONE).read_text().split() == list(env.PINS)
    stamp = (first / env.DONE).stat().st_mtime_ns
    path = env.child_path()["PYTHONPATH"].split(os.pathsep)
    assert path[0] == str(first) and (first / env.DONE).stat().st_mtime_ns == stamp  # not made again
    code = "import transformers, llmcompressor, compressed_tensors; print(transformers.__version__)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env.child_path()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.split()[-1] == "5.17.0", done.stderr[-2000:]
    assert ENGINE.version() == "llmcompressor 0.14.0.1, compressed-tensors 0.19.0, transformers 5.17.0"


# The mixtures of experts: tests/tiny_archs.py model type -> the router's name and an expert's linear names in the
# checkpoint (experts quantized, routers not; Mixtral keeps its own w1/w3/w2).
MOE = {
    "qwen3_moe": ("mlp.gate", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.gate", ("w1", "w3", "w2")),
    "deepseek_v3": ("mlp.gate", ("gate_proj", "up_proj", "down_proj")),
    "glm4_moe": ("mlp.gate", ("gate_proj", "up_proj", "down_proj")),
}


@pytest.fixture(scope="module")
def moe_quant(tmp_path_factory):
    """model type -> (its tiny FP16 checkpoint, the AWQ-CT quant the engine made of it)."""
    made = {}

    def make(model_type: str):
        if model_type not in made:
            base = tmp_path_factory.mktemp(model_type)
            source = make_tiny(model_type, base / "fp16")
            info = inspect(source, ENGINE.architectures)
            spec = ENGINE.resolve(ENGINE.spec(calib_rows=4, calib_length=64), info, "cpu")
            assert spec.tag == "awqct-w4g128"
            request = engines.QuantizeRequest(
                source, base / "quant", base / "work", spec.model_dump(), _windows(source, 4, 64)
            )
            ENGINE.quantize(request, lambda event: None)
            made[model_type] = source, base / "quant"
        return made[model_type]

    return make


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_a_mixture_of_experts_is_quantized_and_scores_like_its_source(moe_quant, model_type):
    source, quant = moe_quant(model_type)
    config = json.loads((quant / "config.json").read_text())
    assert config["architectures"][0] in ARCHITECTURES
    router, linears = MOE[model_type]
    names = _tensor_names(quant)
    assert f"model.layers.1.{router}.weight" in names  # the router stays as it was
    expert = f"model.layers.1.{router.rsplit('.', 1)[0]}.experts.0"
    assert {f"{expert}.{linear}.weight_packed" for linear in linears} <= names
    assert {f"{expert}.{linear}.weight_zero_point" for linear in linears} <= names
    assert not any(name.startswith(expert) and name.endswith(".weight") for name in names)
    # scored as the factory scores it: the engine's decompression against the FP16 source, on the same windows
    data = evaluate.Stream(_windows(source, 2, 256))
    fp16 = evaluate.perplexity(evaluate.load_fp16(source, "cpu"), data)
    ppl = evaluate.perplexity(ENGINE.load(quant, "cpu"), data)
    assert math.isfinite(ppl) and abs(ppl / fp16 - 1) < 0.05, (ppl, fp16)


def test_the_mixtures_of_experts_tested_here_are_claimed():
    """The engine's claims are what benchmarks/coverage.py proved (tests/test_coverage.py); the layouts checked
    here are among them."""
    names = {
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "deepseek_v3": "DeepseekV3ForCausalLM",
        "glm4_moe": "Glm4MoeForCausalLM",
    }
    assert {"LlamaForCausalLM"} | {names[t] for t in MOE} <= ARCHITECTURES


def test_a_failing_child_is_a_failed_step(tiny, tmp_path):
    spec = {"method": "awqct", "w_bit": 4, "group_size": 96, "calib_rows": 2, "calib_length": 32, "duo_scaling": True}
    request = engines.QuantizeRequest(tiny, tmp_path / "out", tmp_path / "work", spec, _windows(tiny, 2, 32))
    with pytest.raises(JobFailed) as e:
        ENGINE.quantize(request, lambda event: None)
    assert e.value.message.startswith("AWQ-CT quantization (2 x 32 calibration tokens) failed: ")
    assert e.value.message.endswith(f"(exit 1; log: {tmp_path / 'work' / 'engine.log'})")


@pytest.mark.smollm2
def test_smollm2_lands_where_autoawq_does(smollm2_job):
    """SmolLM2-135M, w4 g64 (128 does not divide 576), the same 8 x 128 calibration tokens and 8 windows as the
    AutoAWQ quant of the same job (tests/conftest.py), on the CPU."""
    qf, rows = smollm2_job
    row, autoawq = rows["awqct"], rows["awq"]
    assert row["name"] == "smollm2-135m-instruct:awqct-w4g64"
    assert row["fp16_ppl"] == autoawq["fp16_ppl"] == pytest.approx(PPL_WIKI[8], rel=0.005)
    print(
        f"SmolLM2: AWQ-CT ppl {row['ppl']:.3f}, KLD {row['kld']:.4f}, top-1 {row['top1']:.3f}; AutoAWQ ppl "
        f"{autoawq['ppl']:.3f}, KLD {autoawq['kld']:.4f}, top-1 {autoawq['top1']:.3f} (fp16 {row['fp16_ppl']:.3f})"
    )
    assert row["fp16_ppl"] < row["ppl"] < 1.05 * autoawq["ppl"]  # 2026-12-03: 14.390 against AutoAWQ's 14.353
    assert row["kld"] < 1.2 * autoawq["kld"]  # 0.1587 against 0.1546
    text = (qf.home / "registry" / row["path"] / "README.md").read_text()
    assert "builtin:c4, 8 x 128 tokens" in text and "vllm serve" in text
