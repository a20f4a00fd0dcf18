"""EXL2 through exllamav2's own conversion script, in a child process.

    measure:  python -m factory.engines.exl2.ranges REQUEST.json, once to prepare, then once per range of layers,
              all at once (ranges.py: exllamav2's own measure_quant on each range)
    quantize: python -m factory.engines.script exllamav2.conversion.convert_exl2 -i SRC -o WORK -c CAL.parquet
              -m MEASUREMENT.json -b BPW -hb HEAD -cf OUT ...
factory/engines/script.py runs the script as __main__ with exactly those arguments (runpy) and then reports the peak
GPU memory the conversion allocated (for VRAM planning).

What we add, and why:
- `-so` status lines (`[STATUS]{"stage": ..., "completion": ...}[/STATUS]`) become progress events;
- EXLLAMA_NO_SDPA=1 for every exllamav2 process: its SDPA path is wrong on torch 2.11 (FP16 ppl 351, not 12.38);
- the script exits 0 on bad arguments (it prints "## Error" and calls sys.exit()), so outputs are checked, not
  the exit code: `output*.safetensors` and a quantization_config with the requested bits;
- resume: the script continues from `job_new.json` in its work folder by itself; a work folder whose job file
  is unreadable or marked invalid is wiped (`-nr`) instead of crashing the step again;
- `-cf` copies every regular file beside the source's weights: the source it is given is the job's staging folder
  (factory/checkpoints/files.py), which holds only the allowlisted files; the FP16 `model.safetensors.index.json` it
  copies is removed;
- the measurement used is kept beside the quant (`measurement.json`), for whoever converts more sizes.
exllamav2 is never imported here: importing it builds its CUDA extension.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import sys
from pathlib import Path

from factory.engines import child
from factory.engines.base import Engine, Evaluation, Flag, QuantizeRequest, Shared, check_quant_folder
from factory.engines.exl2 import evaluate, ranges
from factory.engines.exl2.card import Exl2Card
from factory.engines.exl2.memory import Exl2Memory
from factory.engines.exl2.spec import Exl2Spec, Exl2Targets, targets_from_flag
from factory.errors import SpecError

SCRIPT = "exllamav2.conversion.convert_exl2"
STATUS = re.compile(r"\[STATUS\](.*)\[/STATUS\]")
ENV = {"EXLLAMA_NO_SDPA": "1"}


def parse_status(line: str) -> dict | None:
    """A `-so` status line -> a progress event; anything else -> None (it goes to the log)."""
    if line.startswith(child.PEAK):
        return {"event": "progress", "peak_gpu_bytes": int(line.removeprefix(child.PEAK))}
    match = STATUS.search(line)
    if not match:
        return None
    status = json.loads(match.group(1))
    return {
        "event": "progress",
        "stage": status["stage"],
        "done": round(status["completion"] * 100, 2),
        "total": 100,
        "unit": "%",
    }


def _resume_or_wipe(work_dir: Path) -> list[str]:
    job_file = work_dir / "job_new.json"
    if not job_file.exists():
        return []
    try:
        job = json.loads(job_file.read_text())
        if "invalid" not in job and job.get("progress") != "finished":
            return []
    except (OSError, ValueError):
        pass
    return ["-nr"]  # corrupt, invalid or finished-but-unchecked: start clean


# What benchmarks/coverage.py proved exllamav2 0.3.2 converts on the H200 (benchmarks/results/coverage-h200.json;
# tests/integration/test_coverage.py keeps the two equal).
ARCHITECTURES = frozenset({
    "Cohere2ForCausalLM", "CohereForCausalLM", "GPTBigCodeForCausalLM", "Gemma2ForCausalLM", "GemmaForCausalLM",
    "Glm4ForCausalLM", "GraniteForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM",
    "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
})  # fmt: skip


class Exl2Engine(Engine):
    name = "exl2"
    label = "EXL2"
    spec = Exl2Spec
    targets = Exl2Targets
    flag = Flag("EXL2 targets, e.g. 3.0,4.0,5.0 (needs CUDA).", takes_value=True)
    tag_pattern = r"exl2-\d+\.\d+bpw(-h[23458])?"
    tag_example = "exl2-4.0bpw"
    architectures = ARCHITECTURES
    requires_cuda = True
    shared = (Shared("measure", "measurement", ".json"),)  # one per model and calibration, for every size
    default_calibration = "builtin:mix"  # 100 x 2048 rows need ~205k tokens; c4 alone has ~80k
    outputs = ("output*.safetensors", "measurement.json")
    evaluator = "exllamav2"
    Memory = Exl2Memory
    Card = Exl2Card

    def targets_from_flag(self, value: str | dict, written: dict) -> dict:
        return value if isinstance(value, dict) else targets_from_flag(value, written)

    def calibration_lengths(self, spec: Exl2Spec) -> list[tuple[int, int]]:
        # exllamav2 reads the text file itself and takes its first rows x length tokens
        return [(spec.measurement_rows, spec.measurement_length), (spec.rows, spec.length)]

    def measurement_settings(self, spec: Exl2Spec, stage: str) -> tuple[int, int]:
        return spec.measurement_rows, spec.measurement_length

    def describe_calibration(self, spec: Exl2Spec, text: str) -> str:
        return (
            f"{text}, {spec.rows} x {spec.length} tokens (measured on {spec.measurement_rows} x "
            f"{spec.measurement_length})"
        )

    def load(self, folder: Path, device: str):
        return evaluate.load(folder)

    def evaluations(self, spec: Exl2Spec) -> list[Evaluation]:
        return [
            Evaluation("kv_cache", cache, evaluate.cached_loader(cache), f"{cache} cache window")
            for cache in evaluate.KV_EVAL_CACHES
        ]

    def version(self) -> str:
        try:
            return importlib.metadata.version("exllamav2")
        except importlib.metadata.PackageNotFoundError:
            raise SpecError("EXL2 needs the exllamav2 package: pip install exllamav2==0.3.2") from None

    def _run(self, args: list[str], work_dir: Path, log: Path, emit, what: str) -> None:
        work_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "factory.engines.script", SCRIPT, *args, *_resume_or_wipe(work_dir), "-so"]
        child.run_command(cmd, log, emit, what, parse=parse_status, env=ENV)

    def measure(
        self,
        stage: str,
        source_dir: Path,
        calibration_file: Path,
        rows: int,
        length: int,
        work_dir: Path,
        measurement: Path,
        earlier: dict[str, Path],
        emit,
        processes: int = 1,
    ) -> None:
        """Its layer ranges measured by up to `processes` processes at once (factory/engines/exl2/ranges.py)."""
        shutil.rmtree(work_dir, ignore_errors=True)  # a range killed midway starts over

        def tool(cmd: list[str], log: Path, emit, what: str) -> None:
            child.run_command(cmd, log, emit, what, parse=parse_status, env=ENV)

        ranges.measure(source_dir, calibration_file, rows, length, work_dir, measurement, emit, tool, processes)
        shutil.rmtree(work_dir, ignore_errors=True)

    def quantize(self, request: QuantizeRequest, emit) -> None:
        spec, work, log = request.spec, request.work_dir / "convert", request.work_dir / child.LOG_NAME
        shutil.rmtree(request.out_dir, ignore_errors=True)
        args = _flags(
            i=request.source_dir,
            o=work,
            c=request.calibration_file,
            m=request.measurements["measure"],
            b=spec.bpw,
            hb=spec.head_bits,
            r=spec.rows,
            l=spec.length,
            cf=request.out_dir,
        )
        self._run(args, work, log, emit, what=f"EXL2 conversion at {spec.bpw} bpw")
        check_output(request.out_dir, spec, log)
        (request.out_dir / "model.safetensors.index.json").unlink(missing_ok=True)
        shutil.copy2(request.measurements["measure"], request.out_dir / "measurement.json")
        shutil.rmtree(work, ignore_errors=True)


def _flags(**flags: object) -> list[str]:
    """_flags(i="a", mr=16) -> ["-i", "a", "-mr", "16"]: convert_exl2's short options."""
    return [item for name, value in flags.items() for item in (f"-{name}", str(value))]


def check_output(out_dir: Path, spec: Exl2Spec, log: Path) -> None:
    want = {"quant_method": "exl2", "bits": spec.bpw, "head_bits": spec.head_bits}
    check_quant_folder(out_dir, "output*.safetensors", want, "exllamav2", log)


ENGINE = Exl2Engine()
