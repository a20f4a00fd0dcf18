"""EXL3 through exllamav3's own conversion script, in a child process.

    python -m factory.engines.exl3.compat exllamav3.conversion.convert_model -i SRC -o OUT -w WORK -b BPW
        -hb HEAD -vb 16 -cd CAL.safetensors -cr ROWS -cc LENGTH [-r]
factory/engines/script.py runs the script as __main__ with those arguments (runpy) and then reports the peak GPU
memory the conversion allocated; compat.py first lets exllamav3 read text-only Gemma 3 checkpoints.

What we add, and why (facts of exllamav3 1.6.5):
- calibration is the job's text set, never exllamav3's built-in mix (it holds wiki.utf8, the default eval text):
  token rows of the source's tokenizer, written as `-cd` safetensors (`input_ids`, rows x length, int64);
- its progress bars print nothing into a pipe: the ` -- Quantized: <module> ...` line of each finished module
  becomes a progress event, the ` -- Estimated remaining time: ...` line its ETA;
- it exits 0 when an argument is refused (` !! Error: ...`), so the outputs are checked, not the exit code:
  weights, a config.json whose quantization_config says exl3 with the bits asked for, and quantization_config.json
  (the last file it writes);
- resume: `-r` when the work folder holds a job (args.json and ckpt/job.json that parse); anything else there is
  wiped and the conversion starts over (without `-r` it would mix a new job with the old job's tensors);
- the output folder is emptied first: exllamav3 only warns about stale shards in it;
- a vision-language model's tower and projector are copied at 16 bits (`-vb 16`): by default exllamav3 quantizes
  the towers it has validated (Qwen3-VL's, GLM-4V's) to 6 bits;
- exllamav3 pads every dimension to a multiple of 128 and its gated MLP does not crop the padding of its output:
  a hidden size that is not a multiple of 128 fails at layer 0 (SmolLM2-135M: 576), so `refuse` says so at submit.
An optimized size (`--exl3 4.0opt`, tag `exl3-4.0bpw-opt`: bits chosen per tensor by exllamav3's measure and
optimize, from the uniform sizes the job makes around it) is optimize.py's.
exllamav3 is never imported here: importing it builds its CUDA extension.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import sys
from pathlib import Path

import calibration
from factory.checkpoints.inspection import read_config, read_header
from factory.engines import child
from factory.engines.base import Engine, Evaluation, Flag, QuantizeRequest, Shared, check_quant_folder
from factory.engines.exl3 import evaluate, optimize
from factory.engines.exl3.card import Exl3Card
from factory.engines.exl3.memory import Exl3Memory
from factory.engines.exl3.spec import (
    MEASURE_KLD,
    MEASURE_LENGTH,
    MEASURE_ROWS,
    MIN_ROWS,
    ROWS,
    Exl3Spec,
    Exl3Targets,
    sources,
    targets_from_flag,
)
from factory.errors import JobFailed, SpecError
from factory.evaluation.evaluate import tokenize
from factory.vram import Params, Shape, human, tensor_bytes

SCRIPT = "exllamav3.conversion.convert_model"
PAD = 128  # exllamav3 pads linear layers to multiples of this (modules/linear.py)
MODULE = re.compile(r"^ -- (?:Quantized|Unquantized): (?P<key>\S+)\s+(?!.*g_sc:)")  # a whole module, not a linear
ETA = re.compile(r"^ -- Estimated remaining time: (?P<eta>.+?)(?: \(avg over last \d+ blocks\))?$")
ERROR = re.compile(r"^ !! Error: (?P<message>.*)$")
CAL_TENSOR = "input_ids"
VISION_BITS = 16  # a vision-language model's tower and projector stay as they are (exllamav3 quantizes some at 6)

# What benchmarks/coverage.py proved exllamav3 1.6.5 converts on the GPU (benchmarks/results/coverage-h200.json: each
# family quantized by `qf run`, pulled, and the pulled quant re-scored by exllamav3; test_coverage.py checks it).
ARCHITECTURES = frozenset({
    "AfmoeForCausalLM", "ApertusForCausalLM", "ArceeForCausalLM", "Cohere2ForCausalLM", "CohereForCausalLM",
    "DeepseekV3ForCausalLM", "Dots1ForCausalLM", "Ernie4_5_MoeForCausalLM", "Exaone4ForCausalLM", "Gemma2ForCausalLM",
    "Gemma3ForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "GptOssForCausalLM",
    "HYV3ForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "LlamaForCausalLM", "MiniMaxM2ForCausalLM",
    "MistralForCausalLM", "MixtralForCausalLM", "NemotronHForCausalLM", "Olmo3ForCausalLM", "Phi3ForCausalLM",
    "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "SeedOssForCausalLM",
    "SmolLM3ForCausalLM",
    # vision-language: the language model converted, the vision tower and projector kept at 16 bits (-vb 16)
    "Gemma3ForConditionalGeneration", "Gemma4ForConditionalGeneration", "Glm4vForConditionalGeneration",
    "Mistral3ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
})  # fmt: skip


def _parser(modules: int):
    """A parse function that counts finished modules: exllamav3 prints one line per module, none per percent."""
    done = [0]
    error: list[str] = []

    def parse(line: str) -> dict | None:
        if line.startswith(child.PEAK):
            return {"event": "progress", "peak_gpu_bytes": int(line.removeprefix(child.PEAK))}
        if match := MODULE.match(line):
            done[0] += 1
            return {
                "event": "progress",
                "done": min(done[0], modules),
                "total": modules,
                "unit": "module",
                "module": match["key"],
            }
        if match := ETA.match(line):
            return {"event": "progress", "eta": match["eta"]}
        if match := ERROR.match(line):
            error.append(match["message"])
        return None

    parse.errors = error  # type: ignore[attr-defined]
    return parse


def _resume_or_wipe(work_dir: Path) -> list[str]:
    try:
        json.loads((work_dir / "args.json").read_text())
        json.loads((work_dir / "ckpt" / "job.json").read_text())
        return ["-r"]
    except (OSError, ValueError):
        shutil.rmtree(work_dir, ignore_errors=True)  # nothing, or a job we cannot trust: start over
        work_dir.mkdir(parents=True)
        return []


def write_calibration(rows: list[list[int]], path: Path) -> Path:
    """Token rows as exllamav3 reads `-cd`: a safetensors file with `input_ids` of shape (rows, length)."""
    import numpy as np
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({CAL_TENSOR: np.asarray(rows, dtype=np.int64)}, str(path))
    return path


class Exl3Engine(Engine):
    name = "exl3"
    label = "EXL3"
    spec = Exl3Spec
    targets = Exl3Targets
    flag = Flag(
        "EXL3 targets, e.g. 3.0,4.0,5.0 (exllamav3; needs CUDA); 4.0opt: 4.0's size with its bits chosen per tensor "
        "by KL divergence (made from 3.0, 4.0, 5.0; kept where it beats 4.0).",
        takes_value=True,
    )
    tag_pattern = r"exl3-\d+\.\d+bpw(-h(1|2|3|4|5|7|8|16))?(-opt)?"
    tag_example = "exl3-4.0bpw"
    architectures = ARCHITECTURES
    requires_cuda = True
    shared = (Shared(MEASURE_KLD, "per-tensor KL divergence measurement (for a size with opt)", ".json"),)
    default_calibration = "builtin:mix"  # no wiki: that is the default eval text
    outputs = ("model*.safetensors", "model.safetensors.index.json", "quantization_config.json")
    evaluator = "exllamav3"
    Memory = Exl3Memory
    Card = Exl3Card

    def version(self) -> str:
        try:
            return importlib.metadata.version("exllamav3")
        except importlib.metadata.PackageNotFoundError:
            raise SpecError("EXL3 needs the exllamav3 package: pip install exllamav3==1.6.5") from None

    def targets_from_flag(self, value: str, written: dict) -> dict:
        return targets_from_flag(value, written)

    def refuse(self, info) -> str | None:
        if reason := super().refuse(info):
            return reason
        hidden = info.config["hidden_size"]
        if hidden % PAD:
            return (
                f"EXL3 cannot convert a model whose hidden size ({hidden}) is not a multiple of {PAD}: exllamav3 "
                "pads it and its MLP does not crop the padding back"
            )
        act = info.config.get("hidden_act", "silu")
        if info.architecture == "LlamaForCausalLM" and act != "silu":
            return f"EXL3 converts Llama models with the silu activation only, not {act}"
        return None

    def fit_calibration(self, spec: Exl3Spec, tokens: int, device: str) -> Exl3Spec:
        if spec.rows is not None:
            return spec
        return spec.model_copy(update={"rows": max(MIN_ROWS, min(ROWS, tokens // spec.length))})

    def calibration_windows(self, spec: Exl3Spec) -> tuple[int, int] | None:
        return None if spec.opt else (spec.rows or ROWS, spec.length)  # an optimized size converts nothing itself

    def calibration_lengths(self, spec: Exl3Spec) -> list[tuple[int, int]]:
        return [(MEASURE_ROWS, MEASURE_LENGTH)] if spec.opt else [self.calibration_windows(spec)]

    def describe_calibration(self, spec: Exl3Spec, text: str) -> str:
        if spec.opt:
            made = ", ".join(s.tag for s in self.made_from(spec))
            return (
                f"{text}, {spec.rows} x {spec.length} tokens; bits chosen per tensor from {made} by KL divergence "
                f"on {MEASURE_ROWS} x {MEASURE_LENGTH} tokens"
            )
        return f"{text}, {spec.rows} x {spec.length} tokens"

    # an optimized size (spec.opt): its shared measurement and its quant, from the uniform sizes around it --------
    def shared_units(self, spec: Exl3Spec) -> tuple[Shared, ...]:
        return self.shared if spec.opt else ()

    def made_from(self, spec: Exl3Spec) -> list[Exl3Spec]:
        return [spec.uniform(b) for b in sources(spec.bpw)] if spec.opt else []

    def rival(self, spec: Exl3Spec) -> Exl3Spec | None:
        return spec.uniform() if spec.opt else None

    def measurement_settings(self, spec: Exl3Spec, stage: str) -> tuple[int, int]:
        return MEASURE_ROWS, MEASURE_LENGTH

    def measure(
        self,
        stage: str,
        source_dir: Path,
        calibration_file: Path,
        rows: int,
        length: int,
        work_dir: Path,
        out: Path,
        earlier: dict[str, Path],
        emit,
        processes: int = 1,
    ) -> None:
        """exllamav3's measurement of the uniform quants an optimized size is made from (`earlier`, by tag, lowest
        bits first) on `rows` x `length` tokens of the job's calibration text."""
        shutil.rmtree(work_dir, ignore_errors=True)  # a measurement killed midway starts over
        work_dir.mkdir(parents=True)
        ids = tokenize(source_dir, calibration.read_parquet(calibration_file))
        cal = write_calibration(
            calibration.token_windows(ids, rows, length, "the calibration text"), work_dir / "calibration.safetensors"
        )
        optimize.measure(source_dir, list(earlier.values()), cal, rows, length, work_dir, out, emit)
        shutil.rmtree(work_dir, ignore_errors=True)

    def _optimize(self, request: QuantizeRequest, emit) -> None:
        """The optimized quant, assembled from the uniform ones (`request.quants`) at the size of the one of its own
        bpw (the bits measure recorded for it), then checked as a quant between the lowest of them and that."""
        spec, log = request.spec, request.work_dir / child.LOG_NAME
        measurement, inputs = request.measurements[MEASURE_KLD], list(request.quants.values())
        same = list(request.quants).index(spec.uniform().tag)
        bits = optimize.measured_bits(measurement, same)
        optimize.optimize(measurement, inputs, bits, request.out_dir, log, emit)
        low = min(s.bpw for s in self.made_from(spec))
        check_output(request.out_dir, spec, log, request.source_dir, bits=(low, bits))

    def quantize(self, request: QuantizeRequest, emit) -> None:
        if request.spec.opt:
            return self._optimize(request, emit)
        spec, work, log = request.spec, request.work_dir / "convert", request.work_dir / child.LOG_NAME
        shutil.rmtree(request.out_dir, ignore_errors=True)
        resume = _resume_or_wipe(work)
        cal = write_calibration(request.calibration, request.work_dir / "calibration.safetensors")
        config = read_config(request.source_dir / "config.json", check_numbers=False)  # Nemotron-H: no layer count
        modules = config["num_hidden_layers"] + 3  # the embedding, every layer, the final norm, the head
        args = [
            "-i",
            request.source_dir,
            "-o",
            request.out_dir,
            "-w",
            work,
            "-b",
            spec.bpw,
            "-hb",
            spec.head_bits,
            "-vb",
            VISION_BITS,
            "-cd",
            cal,
            "-cr",
            len(request.calibration),
            "-cc",
            len(request.calibration[0]),
            *resume,
        ]
        parse = _parser(modules)
        cmd = [sys.executable, "-u", "-m", "factory.engines.exl3.compat", SCRIPT, *map(str, args)]
        child.run_command(cmd, log, emit, f"EXL3 conversion at {spec.bpw} bpw", parse=parse)
        if parse.errors:
            raise JobFailed(f"exllamav3 refused the conversion: {parse.errors[-1]}; see {log}")
        check_output(request.out_dir, spec, log, request.source_dir)
        shutil.rmtree(work, ignore_errors=True)

    def load(self, folder: Path, device: str):
        return evaluate.load(folder)

    def evaluations(self, spec: Exl3Spec) -> list[Evaluation]:
        return [
            Evaluation("kv_cache", cache, evaluate.cached_loader(cache), f"{cache} cache window")
            for cache in evaluate.KV_EVAL_CACHES
        ]


MIN_LAYER_SHARE = 0.9  # of the layers' linear weights at the bits asked; what exllamav3 adds (scales, norms) is more
BITS_OVER = 0.25  # what exllamav3 may add to the bits asked for: its layers' sign vectors and scales


def check_output(
    out_dir: Path,
    spec: Exl3Spec,
    log: Path,
    source_dir: Path | None = None,
    bits: tuple[float, float] | None = None,
) -> None:
    """exllamav3 writes the bits it reached beside the head bits asked for: a little over the bits asked, for the
    layers' sign vectors and scales (4.12 at -b 4.0 on a 256-wide test model, tests/fixtures/convert_exl3_tiny.log);
    an optimized quant (`bits`: the range it may reach) the storage bits of its layers, from the lowest of its inputs
    to the budget. With the source, the weights are weighed too: exllamav3 1.6.5 can write a quant without its layers
    and exit 0 (compat.py), so the decoder layers must hold at least MIN_LAYER_SHARE of their linear weights at the
    bits asked (the lowest of the range)."""
    check_quant_folder(
        out_dir, "model*.safetensors", {"quant_method": "exl3", "head_bits": spec.head_bits}, "exllamav3", log
    )
    if bits is None:
        low, high, asked = spec.bpw, spec.bpw + BITS_OVER, f"{spec.bpw}"
    else:
        low, high, asked = bits[0], bits[1] + 0.01, f"{bits[0]} to {bits[1]:.2f}"  # written rounded to 2 decimals
    reached = json.loads((out_dir / "config.json").read_text())["quantization_config"].get("bits")
    if not isinstance(reached, (int, float)) or not low - 0.01 <= reached <= high:
        raise JobFailed(f"exllamav3 reached {reached} bits per weight, not the {asked} asked for; see {log}")
    if not (out_dir / "quantization_config.json").is_file():
        raise JobFailed(f"exllamav3 did not finish writing {out_dir} (no quantization_config.json); see {log}")
    if source_dir is not None:
        config = read_config(source_dir / "config.json", check_numbers=False)  # staged: links to the source's files
        tensors = {n: i["shape"] for f in sorted(source_dir.glob("*.safetensors")) for n, i in read_header(f).items()}
        wanted = Params.of(tensors, Shape.of(config)).linear * low / 8
        got = tensor_bytes(out_dir).get("layers", 0)
        if got < MIN_LAYER_SHARE * wanted:
            raise JobFailed(
                f"exllamav3 wrote {human(got)} of decoder layers where {low} bpw takes about "
                f"{human(wanted)}: the quant is incomplete; see {log}"
            )


ENGINE = Exl3Engine()
