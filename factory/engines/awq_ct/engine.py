"""AWQ through llm-compressor 0.14.0.1, written as compressed-tensors (W4A16 asymmetric, pack-quantized): what vLLM
and transformers load without AutoAWQ. It runs in a child process (`python -m factory.engines.awq_ct.quantize
request.json`, which says what it does beyond `oneshot` and why) with packages of its own first on its path
(env.py: llm-compressor needs transformers 5.17, the factory runs a newer one); the parent checks the outputs
instead of trusting the exit code, and copies the tokenizer and chat template, which the child does not write."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from factory.checkpoints.files import COMPANIONS
from factory.checkpoints.inspection import multimodal
from factory.engines import child
from factory.engines.awq.card import VllmCard
from factory.engines.awq.memory import VllmMemory
from factory.engines.awq.spec import CUDA_ROWS, calibration_rows
from factory.engines.awq_ct import env, evaluate
from factory.engines.awq_ct.spec import AwqCtSpec, resolve
from factory.engines.base import Engine, Flag, QuantizeRequest, check_quant_folder
from factory.errors import JobFailed

# What benchmarks/coverage.py proved llm-compressor 0.14.0.1's AWQ converts (benchmarks/results/coverage-cpu.json;
# tests/integration/test_coverage.py keeps the two equal); tests/integration/test_engine_awq_ct.py checks its mixtures
# of experts' layout.
ARCHITECTURES = frozenset({
    "Cohere2ForCausalLM", "CohereForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Ernie4_5ForCausalLM",
    "Ernie4_5_MoeForCausalLM", "Exaone4ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration", "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "GemmaForCausalLM",
    "Glm4ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "Glm4vForConditionalGeneration",
    "GraniteForCausalLM", "HYV3ForCausalLM", "LagunaForCausalLM", "LlamaForCausalLM",
    "Mistral3ForConditionalGeneration", "MistralForCausalLM", "MixtralForCausalLM", "Olmo3ForCausalLM",
    "OlmoForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
    "Qwen2_5_VLForConditionalGeneration", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
    "Qwen3VLForConditionalGeneration", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
    "SeedOssForCausalLM", "SmolLM3ForCausalLM", "SolarOpenForCausalLM",
})  # fmt: skip
MOE = frozenset({
    "Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "HYV3ForCausalLM",
    "LagunaForCausalLM", "Qwen3NextForCausalLM", "SolarOpenForCausalLM", "Qwen2MoeForCausalLM", "DeepseekV2ForCausalLM",
    "Ernie4_5_MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Glm4MoeLiteForCausalLM",
})  # fmt: skip
TOOLS = ("llmcompressor", "compressed-tensors", "transformers")  # what makes its quants: the child's, not the factory's


class AwqCtMemory(VllmMemory):  # vLLM's, as AutoAWQ's
    CPU_CORE_SECONDS_PER_B = 3300.0  # SmolLM2-135M, 16 x 128 calibration, 2 cores: 224 s (docs/measured.md)
    # the random 1.1B, 3B and 8B on an H100 beside other units (benchmarks/cost_growth.py): 174, 251 and 374 s;
    # like AutoAWQ's, its seconds follow the layers: 139 s at one billion, growing as the square root (-16%, -4%, 0%)
    UNIT_SECONDS = {"quantize": (0.0, 139.0)}
    GROWTH = 0.5


class AwqCtCard(VllmCard):
    hub_repo = "{owner}/{model}-AWQ-CT"
    plot_marker = "D"

    def how_to_load(self, folder: str) -> str:
        return f"""```bash
vllm serve ./{folder}        # vLLM reads compressed-tensors W4A16 (its Marlin kernels on CUDA)
```

```python
from transformers import AutoModelForCausalLM, AutoTokenizer  # 5.17 to 5.22, with compressed-tensors
model = AutoModelForCausalLM.from_pretrained("./{folder}")  # decompresses on load (the CPU works too)
tokenizer = AutoTokenizer.from_pretrained("./{folder}")
```
"""

    def load_note(self, folder: Path) -> str | None:
        config = json.loads((folder / "config.json").read_text())
        if (config.get("architectures") or [""])[0] in MOE:
            return (
                "transformers cannot load a mixture of experts with zero points in compressed-tensors (its expert "
                "decompression drops them: transformers PR #47430); serve it with vLLM"
            )
        said = (
            "transformers 5.17 to 5.22 load these weights with their zero points; 5.23 to 5.25 refuse the packed "
            "zero points (size mismatch)"
        )
        if multimodal(config):
            said += (
                "; a vision-language model loads whole with `AutoModelForImageTextToText` and its processor with "
                "`AutoProcessor` (the Images section), `AutoModelForCausalLM` would load its language model alone"
            )
        return said


class AwqCtEngine(Engine):
    name = "awqct"  # not awq-ct: the CLI makes a parameter of it (engine_<name>); FACTORY_HUB_<NAME>_REPO: [A-Z0-9]
    label = "AWQ-CT"
    spec = AwqCtSpec
    targets = AwqCtSpec
    flag = Flag(
        "AWQ w4 in compressed-tensors (llm-compressor), group 128 (64 where 128 does not divide).", takes_value=False
    )
    tag_pattern = r"awqct-w\d+g\d+"
    tag_example = "awqct-w4g128"
    architectures = ARCHITECTURES
    default_calibration = "builtin:c4"
    outputs = ("*.safetensors", "model.safetensors.index.json", "recipe.yaml")
    evaluator = "compressed-tensors"
    Memory = AwqCtMemory
    Card = AwqCtCard

    def version(self) -> str:  # what its packages' folder holds (env.py)
        return ", ".join(pin.replace("==", " ") for pin in env.PINS if pin.split("==")[0] in TOOLS)

    def resolve(self, spec: AwqCtSpec, info, device: str) -> AwqCtSpec:
        return resolve(spec, info.in_features, device == "cuda")

    def fit_calibration(self, spec: AwqCtSpec, tokens: int, device: str) -> AwqCtSpec:
        return spec.model_copy(
            update={"calib_rows": calibration_rows(spec.calib_rows, spec.calib_length, tokens, device)}
        )

    def calibration_windows(self, spec: AwqCtSpec) -> tuple[int, int]:
        return spec.calib_rows or CUDA_ROWS, spec.calib_length  # before fit_calibration: the most it takes

    def describe_calibration(self, spec: AwqCtSpec, text: str) -> str:
        return f"{text}, {spec.calib_rows} x {spec.calib_length} tokens"

    def load(self, folder: Path, device: str):
        return evaluate.load(folder, device)

    def quantize(self, request: QuantizeRequest, emit) -> None:
        shutil.rmtree(request.out_dir, ignore_errors=True)
        rows, length = len(request.calibration), len(request.calibration[0])
        payload = {
            "source_dir": str(request.source_dir),
            "out_dir": str(request.out_dir),
            "spec": request.spec.model_dump(),
            "calibration": request.calibration,
        }
        request.work_dir.mkdir(parents=True, exist_ok=True)
        (request.work_dir / "request.json").write_text(json.dumps(payload))
        child.run_command(
            [sys.executable, "-m", "factory.engines.awq_ct.quantize", str(request.work_dir / "request.json")],
            request.work_dir / child.LOG_NAME,
            emit,
            what=f"AWQ-CT quantization ({rows} x {length} calibration tokens)",
            env=env.child_path(emit),
        )
        check_output(request.out_dir, request.spec, request.work_dir / child.LOG_NAME)
        for name in COMPANIONS:  # the tokenizer, chat template, ...: save_pretrained writes config and weights
            if (request.source_dir / name).is_file() and not (request.out_dir / name).exists():
                shutil.copyfile(request.source_dir / name, request.out_dir / name)


def check_output(out_dir: Path, spec: AwqCtSpec, log: Path | None = None) -> None:
    """compressed-tensors' config, and the one group the spec asked for: 4-bit asymmetric int groups."""
    check_quant_folder(
        out_dir,
        "*.safetensors",
        {"quant_method": "compressed-tensors", "format": "pack-quantized"},
        "llm-compressor",
        log,
    )
    groups = json.loads((out_dir / "config.json").read_text())["quantization_config"]["config_groups"]
    want = {
        "num_bits": spec.w_bit,
        "group_size": spec.group_size,
        "symmetric": False,
        "strategy": "group",
        "type": "int",
    }
    got = [{k: (g.get("weights") or {}).get(k) for k in want} for g in groups.values()]
    if got != [want]:
        raise JobFailed(f"llm-compressor's quantization_config groups {got} do not match the spec {want}")


ENGINE = AwqCtEngine()
