"""AWQ through AutoAWQ 0.2.9, in a child process (`python -m factory.engines.awq.quantize request.json`, which
does what AutoAWQ needs and why: see that module). The parent checks the outputs instead of trusting the exit code,
and copies the tokenizer and chat template AutoAWQ does not write."""

from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path

from factory.checkpoints.files import COMPANIONS
from factory.engines import child
from factory.engines.awq import evaluate
from factory.engines.awq.card import VllmCard
from factory.engines.awq.memory import AwqMemory
from factory.engines.awq.spec import CUDA_ROWS, AwqSpec, calibration_rows, resolve
from factory.engines.base import Engine, Flag, QuantizeRequest, check_quant_folder

# What benchmarks/coverage.py proved AutoAWQ 0.2.9 converts with our transformers (benchmarks/results/
# coverage-cpu.json; tests/integration/test_coverage.py keeps the two equal); its other model types fail there, with
# why.
ARCHITECTURES = frozenset({
    "CohereForCausalLM", "FalconForCausalLM", "GPTJForCausalLM", "GPTNeoXForCausalLM", "Gemma2ForCausalLM",
    "GemmaForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
    "Qwen3ForCausalLM", "StableLmForCausalLM", "Starcoder2ForCausalLM",
})  # fmt: skip


class AwqCard(VllmCard):
    hub_repo = "{owner}/{model}-AWQ"
    plot_marker = "s"

    def how_to_load(self, folder: str) -> str:
        return f"""```bash
vllm serve ./{folder} --quantization awq        # or any loader that reads AWQ GEMM checkpoints
```

```python
from transformers import AutoModelForCausalLM, AutoTokenizer  # needs a CUDA GPU and the autoawq kernels
model = AutoModelForCausalLM.from_pretrained("./{folder}", device_map="cuda")
tokenizer = AutoTokenizer.from_pretrained("./{folder}")
```
"""


class AwqEngine(Engine):
    name = "awq"
    label = "AWQ"
    spec = AwqSpec
    targets = AwqSpec
    flag = Flag("AWQ w4, group 128 (64 where 128 does not divide).", takes_value=False)
    tag_pattern = r"awq-w\d+g\d+"
    tag_example = "awq-w4g128"
    architectures = ARCHITECTURES
    default_calibration = "builtin:c4"
    outputs = ("*.safetensors", "model.safetensors.index.json")
    evaluator = "autoawq"
    Memory = AwqMemory
    Card = AwqCard

    def version(self) -> str:
        return importlib.metadata.version("autoawq")

    def resolve(self, spec: AwqSpec, info, device: str) -> AwqSpec:
        return resolve(spec, info.in_features, device == "cuda")

    def fit_calibration(self, spec: AwqSpec, tokens: int, device: str) -> AwqSpec:
        return spec.model_copy(
            update={"calib_rows": calibration_rows(spec.calib_rows, spec.calib_length, tokens, device)}
        )

    def calibration_windows(self, spec: AwqSpec) -> tuple[int, int]:
        return spec.calib_rows or CUDA_ROWS, spec.calib_length  # before fit_calibration: the most it takes

    def describe_calibration(self, spec: AwqSpec, text: str) -> str:
        clipping = "on" if spec.clip else "off"
        return f"{text}, {spec.calib_rows} x {spec.calib_length} tokens, clipping {clipping}"

    def load(self, folder: Path, device: str):
        return evaluate.load(folder, device)

    def quantize(self, request: QuantizeRequest, emit) -> None:
        shutil.rmtree(request.out_dir, ignore_errors=True)
        child.run(
            "factory.engines.awq.quantize",
            {
                "source_dir": str(request.source_dir),
                "out_dir": str(request.out_dir),
                "spec": request.spec.model_dump(),
                "calibration": request.calibration,
            },
            request.work_dir,
            emit,
            what=f"AWQ quantization ({len(request.calibration)} x {len(request.calibration[0])} calibration tokens)",
        )
        check_output(request.out_dir, request.spec)
        for name in COMPANIONS:  # the tokenizer, chat template, ...: AutoAWQ writes only config and weights
            if (request.source_dir / name).is_file() and not (request.out_dir / name).exists():
                shutil.copyfile(request.source_dir / name, request.out_dir / name)


def check_output(out_dir: Path, spec: AwqSpec) -> None:
    want = {"quant_method": "awq", "bits": spec.w_bit, "group_size": spec.group_size}
    check_quant_folder(out_dir, "*.safetensors", want, "AutoAWQ")


ENGINE = AwqEngine()
