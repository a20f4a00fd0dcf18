"""GGUF through llama.cpp's own converter and tools (pinned and built once per machine: llama.py), in child processes.

    convert (a shared unit: one per model, for every type and calibration):
      python -m factory.engines.gguf.convert LLAMA SRC --outtype f16|bf16 --outfile KEY.gguf    the 16-bit GGUF
        (convert_hf_to_gguf.py; convert.py says what it adds)
    imatrix (a shared unit: one per model and calibration, for every type; after convert):
      llama-imatrix -m KEY.gguf -f CAL.txt -c CTX --chunks N -o KEY.imatrix.gguf    the importance matrix
    mmproj (a shared unit of a vision-language model only: one per model, for every type and calibration):
      python -m factory.engines.gguf.convert LLAMA SRC --mmproj --outtype f16 --outfile KEY.mmproj.gguf
        the vision tower and its projector, as llama.cpp's multimodal tools (llama-mtmd-cli, llama-server
        --mmproj) load them beside the language model's file
    quantize (one unit per type):
      llama-quantize --imatrix KEY.imatrix.gguf KEY.gguf <Model>-<TYPE>.gguf TYPE THREADS
      llama-gguf-split --split --split-max-size NM ...   where the file is over FACTORY_GGUF_SPLIT_BYTES (the Hub's
        largest file is 50 GB): <Model>-<TYPE>-00001-of-0000K.gguf, ..., which llama.cpp loads from the first

What we add, and why:
- the 16-bit type is the source's (bf16 for a bfloat16 checkpoint: float16 would clip its range);
- the importance matrix is computed once on the job's calibration text, for every type (the IQ types need one,
  the K-quants are better with one, Q8_0 ignores it); it is published beside each quant, as uploaders do, and so is
  a vision-language model's projector, `mmproj-<Model>-F16.gguf` (the types quantize its language model only);
- outputs are checked, not trusted: each file must be GGUF with `general.file_type` the type asked for;
- the tools print to stderr too: their lines are read for progress (`blk.N` of the converter, `[i/n]` tensors of
  llama-quantize, `computing over N chunks` and each chunk's `[i]` of llama-imatrix);
- quants are scored by llama.cpp's own inference (evaluate.py) on the factory's windows, never llama-perplexity's.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import calibration
from factory.checkpoints.inspection import read_config
from factory.engines import child
from factory.engines.base import Engine, Flag, QuantizeRequest, Shared
from factory.engines.gguf import evaluate, gguf_file, llama
from factory.engines.gguf.card import GgufCard
from factory.engines.gguf.memory import GgufMemory
from factory.engines.gguf.spec import TYPES, GgufSpec, GgufTargets, targets_from_flag
from factory.errors import JobFailed
from factory.settings import cpu_threads, gguf_split_bytes

CONVERTED = re.compile(r"\bblk\.(\d+)\.")
CHUNKS = re.compile(r"computing over (\d+) chunks")
CHUNK_DONE = re.compile(r"\[(\d+)\]-?[\d.]+(?:e[+-]?\d+)?,")
TENSOR = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")

# What benchmarks/coverage.py proved llama.cpp's converter, tools and inference take on the CPU
# (benchmarks/results/coverage-cpu.json; tests/integration/test_coverage.py keeps the two equal).
ARCHITECTURES = frozenset({
    "AfmoeForCausalLM", "ApertusForCausalLM", "ArceeForCausalLM", "BambaForCausalLM", "BloomForCausalLM",
    "Cohere2ForCausalLM", "Cohere2MoeForCausalLM", "CohereForCausalLM", "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM", "Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM", "Exaone4ForCausalLM",
    "FalconForCausalLM", "FalconH1ForCausalLM", "FalconMambaForCausalLM", "GPT2LMHeadModel", "GPTBigCodeForCausalLM",
    "GPTNeoXForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3nForCausalLM", "Gemma4ForCausalLM",
    "GemmaForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "GlmForCausalLM",
    "GlmMoeDsaForCausalLM", "GptOssForCausalLM", "GraniteForCausalLM", "GraniteMoeForCausalLM",
    "GraniteMoeHybridForCausalLM", "GraniteMoeSWAForCausalLM", "GraniteMoeSharedForCausalLM", "GraniteSWAForCausalLM",
    "HYV3ForCausalLM", "HunYuanDenseV1ForCausalLM", "Jais2ForCausalLM", "JambaForCausalLM", "LagunaForCausalLM",
    "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "LlamaForCausalLM", "MambaForCausalLM", "MellumForCausalLM",
    "MiniCPM3ForCausalLM", "MiniMaxM2ForCausalLM", "Ministral3ForCausalLM", "MistralForCausalLM", "MixtralForCausalLM",
    "NemotronForCausalLM", "NemotronHForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "OlmoForCausalLM",
    "OlmoeForCausalLM", "Phi3ForCausalLM", "PhiForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
    "SarvamMoEForCausalLM", "SeedOssForCausalLM", "SmolLM3ForCausalLM", "SolarOpenForCausalLM", "StableLmForCausalLM",
    "Starcoder2ForCausalLM", "YoutuForCausalLM",
    # vision-language: the language model's GGUF and the projector's (mmproj), which llama-mtmd-cli loads with an
    # image (not Mistral 3's: the converter's mmproj lacks the [IMG_BREAK] row it needs)
    "Gemma3ForConditionalGeneration", "Gemma4ForConditionalGeneration", "Glm4vForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
})  # fmt: skip


def _converter_parser(layers: int):
    def parse(line: str) -> dict | None:
        if match := CONVERTED.search(line):
            done = min(int(match.group(1)) + 1, layers)
            return {"event": "progress", "stage": "convert", "done": done, "total": layers, "unit": "layer"}
        return None

    return parse


def _imatrix_parser(chunks: int):
    """llama-imatrix says how many chunks it computes over, then each chunk's running perplexity (`[7]33.29,`),
    several to a line: the last of a line is how far it got (a model that takes hours must not look stalled)."""
    total = [chunks]

    def parse(line: str) -> dict | None:
        if match := CHUNKS.search(line):
            total[0] = int(match.group(1))
            return {"event": "progress", "stage": "imatrix", "done": 0, "total": total[0], "unit": "chunk"}
        if done := CHUNK_DONE.findall(line):
            return {"event": "progress", "stage": "imatrix", "done": int(done[-1]), "total": total[0], "unit": "chunk"}
        return None

    return parse


def _quantize_parser(line: str) -> dict | None:
    if match := TENSOR.match(line):
        done, total = int(match.group(1)), int(match.group(2))
        return {"event": "progress", "stage": "quantize", "done": done, "total": total, "unit": "tensor"}
    return None


def check_gguf(path: Path, type_: str, log: Path, *, converted: bool = False) -> None:
    """The file is GGUF and says it holds `type_` (general.file_type, llama.cpp's ftype). A `converted` file may say
    nothing: some of the converter's classes write no file type (GPT-NeoX's), and llama-quantize reads each tensor's
    own type; a file type that is there must be the one asked for."""
    try:
        got = gguf_file.metadata(path).get("general.file_type")
    except (OSError, ValueError) as e:
        raise JobFailed(f"llama.cpp wrote no readable GGUF {path.name}: {e}; see {log}") from None
    if got != TYPES[type_][1] and not (converted and got is None):
        raise JobFailed(f"{path.name} has file type {got}, not {type_}'s {TYPES[type_][1]}; see {log}")


def check_mmproj(path: Path, log: Path) -> None:
    """The file is a GGUF vision projector (llama.cpp's `clip` architecture, with a vision encoder)."""
    try:
        meta = gguf_file.metadata(path)
    except (OSError, ValueError) as e:
        raise JobFailed(
            f"llama.cpp's converter wrote no readable vision projector {path.name}: {e}; see {log}"
        ) from None
    if meta.get("general.architecture") != "clip" or not meta.get("clip.has_vision_encoder"):
        raise JobFailed(
            f"{path.name} is not a vision projector (architecture {meta.get('general.architecture')}); see {log}"
        )


class GgufEngine(Engine):
    name = "gguf"
    label = "GGUF"
    spec = GgufSpec
    targets = GgufTargets
    flag = Flag(
        "GGUF types in llama-quantize's names, e.g. Q8_0,Q6_K,Q5_K_M,Q4_K_M,IQ4_XS; or fit: the best type for each "
        "--fit budget.",
        takes_value=True,
    )
    tag_pattern = r"gguf-[a-z0-9_]+"
    tag_example = "gguf-q4_k_m"
    architectures = ARCHITECTURES
    shared = (  # every type of a model reads both; the conversion serves every calibration too
        Shared("convert", "16-bit conversion", ".gguf"),
        Shared("imatrix", "importance matrix", ".imatrix.gguf"),
        Shared("mmproj", "vision projector", ".mmproj.gguf"),  # a vision-language model's only (shared_units)
    )
    default_calibration = "builtin:c4"
    outputs = ("*.gguf",)
    evaluator = "llama.cpp"
    Memory = GgufMemory
    Card = GgufCard

    def version(self) -> str:
        llama.built()  # refused at submit, naming the setup command, where llama.cpp is not built
        return llama.version()

    def resolve(self, spec: GgufSpec, info, device: str) -> GgufSpec:
        gguf_split_bytes()  # a bad FACTORY_GGUF_SPLIT_BYTES is refused at submit, not after the conversion
        return spec.model_copy(update={"mmproj": info.vision is not None})

    def shared_units(self, spec: GgufSpec) -> tuple[Shared, ...]:
        return tuple(s for s in self.shared if s.stage != "mmproj" or spec.mmproj)

    def targets_from_flag(self, value: str | dict, written: dict) -> dict:
        return value if isinstance(value, dict) else targets_from_flag(value, written)

    def measurement_settings(self, spec: GgufSpec, stage: str) -> tuple[int, int]:
        return (spec.imatrix_chunks, spec.imatrix_ctx) if stage == "imatrix" else (0, 0)

    def calibration_lengths(self, spec: GgufSpec) -> list[tuple[int, int]]:
        return [(spec.imatrix_chunks, spec.imatrix_ctx)]

    def describe_calibration(self, spec: GgufSpec, text: str) -> str:
        return f"{text}, importance matrix on {spec.imatrix_chunks} x {spec.imatrix_ctx} tokens"

    def load(self, folder: Path, device: str):
        return evaluate.load(folder, device)

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
        work_dir.mkdir(parents=True, exist_ok=True)
        log = work_dir.parent / f"{work_dir.name}.log"
        made = work_dir / out.name
        config = read_config(source_dir / "config.json", check_numbers=False)
        convert = [sys.executable, "-m", "factory.engines.gguf.convert", str(llama.source()), str(source_dir)]
        if stage == "convert":
            outtype = "bf16" if child.saved_dtype(config.get("text_config", config)) == "bfloat16" else "f16"
            layers = int(config.get("text_config", config).get("num_hidden_layers") or 1)
            cmd = [*convert, "--outtype", outtype, "--outfile", str(made)]
            child.run_command(cmd, log, emit, f"GGUF conversion to {outtype}", _converter_parser(layers), merge=True)
            check_gguf(made, outtype.upper(), log, converted=True)
        elif stage == "mmproj":  # the vision tower and projector at 16 bits, as uploaders publish them
            layers = int(config["vision_config"].get("num_hidden_layers") or config["vision_config"].get("depth") or 1)
            cmd = [*convert, "--mmproj", "--outtype", "f16", "--outfile", str(made)]
            what = f"GGUF vision projector of {config['architectures'][0]}"
            child.run_command(cmd, log, emit, what, _converter_parser(layers), merge=True)
            check_mmproj(made, log)
        else:  # imatrix, on the job's calibration text, with the 16-bit GGUF the stage before made
            text = work_dir / "calibration.txt"
            text.write_text(calibration.read_file(calibration_file, "calibration"))
            cmd = [str(llama.tool("llama-imatrix")), "-m", str(earlier["convert"]), "-f", str(text), "-o", str(made)]
            cmd += ["-c", str(length), "--chunks", str(rows), "-t", str(cpu_threads()), *evaluate.gpu_layers()]
            what = f"GGUF importance matrix ({rows} x {length} tokens)"
            child.run_command(cmd, log, emit, what, _imatrix_parser(rows), merge=True)
            try:
                gguf_file.metadata(made)
            except (OSError, ValueError):
                raise JobFailed(f"llama-imatrix wrote no importance matrix; see {log}") from None
        made.replace(out)
        shutil.rmtree(work_dir, ignore_errors=True)

    def quantize(self, request: QuantizeRequest, emit) -> None:
        spec, log = request.spec, request.work_dir / child.LOG_NAME
        f16, imatrix = request.measurements["convert"], request.measurements["imatrix"]
        shutil.rmtree(request.out_dir, ignore_errors=True)
        request.out_dir.mkdir(parents=True)
        quant = request.work_dir / gguf_file.name(request.model, spec.type)
        cmd = [str(llama.tool("llama-quantize")), "--imatrix", str(imatrix), str(f16), str(quant), spec.type]
        cmd.append(str(cpu_threads()))
        child.run_command(cmd, log, emit, f"GGUF quantization to {spec.type}", _quantize_parser, merge=True)
        check_gguf(quant, spec.type, log)
        if quant.stat().st_size > (largest := gguf_split_bytes()):
            split = [str(llama.tool("llama-gguf-split")), "--split", "--split-max-size", f"{largest // 10**6}M"]
            child.run_command([*split, str(quant), str(request.out_dir / quant.stem)], log, emit, "gguf-split")
            quant.unlink()
        else:
            quant.replace(request.out_dir / quant.name)
        shutil.copy2(imatrix, request.out_dir / gguf_file.name(request.model, "imatrix"))
        if mmproj := request.measurements.get("mmproj"):
            shutil.copy2(mmproj, request.out_dir / gguf_file.mmproj_name(request.model))


ENGINE = GgufEngine()
