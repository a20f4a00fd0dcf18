"""Which architectures each engine converts, proven end to end: for every architecture an engine may take, a tiny
seeded checkpoint made with transformers' own class (tests/support/tiny_archs.py) goes through `qf run` with that engine
(inspect, quantize, evaluate: ppl, KLD, top-1; publish), `qf pull`, and the pulled quant is loaded with the
engine's loader (the consumer's library: AutoAWQ's unpacking, exllamav2, exllamav3, transformers for
compressed-tensors) and scored again on the same windows, which must give the perplexity the factory published; a
vision-language quant is also given an image where SEES_IMAGES says how (EXL3: tests/support/exl3_image.py; GGUF:
tests/support/gguf_image.py, llama.cpp's llama-mtmd-cli, built on this machine when first asked for: minutes once).

    python benchmarks/coverage.py DIR [--engine awq] [--arch llama,qwen3] [--jobs N] [--out RESULTS.json]
    python benchmarks/coverage.py DIR --engine exl3 --claimed --jobs 10 --out benchmarks/results/coverage-h200.json
    python benchmarks/coverage.py --table        # the README's table, from every benchmarks/results/coverage-*.json
    python benchmarks/coverage.py --unproven exl3   # its claims the committed results do not prove, and why

`--claimed` tries the candidates whose architecture the engine claims, those the committed results do not prove
first, then `--arch`'s families the engine does not claim yet, then the proven ones again (benchmarks/exl3_sitting.sh
runs EXL3's so on the GPU). An engine's `architectures` must be exactly the set
that passed (tests/integration/test_coverage.py checks the committed
results against each engine, and the README's table against the results). To try an architecture the engine does
not claim yet, the `qf` of each run is this module (`--as-qf`), which adds it to the engine's claims in that
process only; nothing else changes.

Each engine lists its candidates below: the model types its upstream names that transformers builds without
custom code (AutoAWQ 0.2.9's awq/models/auto.py; exllamav2 0.3.2's architecture.py; exllamav3's architecture
files; GGUF's read from its converter's own registrations, gguf_candidates). One result per (engine, model type):
"quantized" with its numbers and seconds, or "refused" with the first line of why (the factory's refusal, or the
upstream's error).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the vision-language families of issue 33 (tests/support/tiny_vlms.py makes them, and Qwen3.5's)
VISION_LANGUAGE = ["gemma3", "mistral3", "qwen2_5_vl", "qwen3_vl", "llama4", "glm4v"]
# model types each engine's upstream maps, built into transformers (no auto_map); the vision-language ones are made
# by tests/support/tiny_vlms.py
CANDIDATES = {
    "awq": [
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "gemma",
        "gemma2",
        "phi3",
        "opt",
        "falcon",
        "bloom",
        "gptj",
        "gpt_bigcode",
        "gpt_neox",
        "mpt",
        "stablelm",
        "starcoder2",
        "cohere",
        "deepseek_v2",
        "deepseek_v3",
    ],
    "exl2": [
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "gemma",
        "gemma2",
        "starcoder2",
        "cohere",
        "cohere2",
        "dbrx",
        "phi3",
        "gpt_bigcode",
        "gpt2",
        "granite",
        "glm4",
    ],
    "exl3": [
        "afmoe",
        "apertus",
        "arcee",
        "cohere",
        "cohere2",
        "deepseek_v3",
        "dots1",
        "ernie4_5",
        "ernie4_5_moe",
        "exaone4",
        "gemma2",
        "gemma3_text",
        "glm4",
        "glm4_moe",
        "glm4_moe_lite",
        "gpt_oss",
        "lfm2",
        "lfm2_moe",
        "llama",
        "minimax_m2",
        "mistral",
        "mixtral",
        "nemotron_h",
        "olmo3",
        "olmo_hybrid",
        "phi3",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "qwen3_next",
        "seed_oss",
        "smollm3",
        "hy_v3",
        "kimi_linear",
        "laguna",
        "solar_open",
        # Qwen3.5's language models alone (exllamav3's qwen3_5.py; its gemma4.py has Gemma 4 as released only)
        "qwen3_5_text",
        "qwen3_5_moe_text",
        # the vision-language families of issue 33 exllamav3 has architecture files for, and Qwen3.5's and Gemma 4's
        # releases
        "gemma3",
        "mistral3",
        "qwen2_5_vl",
        "qwen3_vl",
        "glm4v",
        "qwen3_5",
        "qwen3_5_moe",
        "gemma4",
    ],
}
# llm-compressor 0.14.0.1's AWQ mappings name these (modifiers/transform/awq/mappings.py; text models built into
# transformers), and Llama-shaped families its default mapping may take
CANDIDATES["awqct"] = [
    "afmoe",
    "bloom",
    "cohere",
    "cohere2",
    "deepseek_v2",
    "deepseek_v3",
    "ernie4_5_moe",
    "exaone4",
    "gemma2",
    "gemma3_text",
    "glm4_moe",
    "glm4_moe_lite",
    "granite",
    "llama",
    "mistral",
    "mixtral",
    "olmo",
    "olmo3",
    "phi3",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "seed_oss",
    "apertus",
    "arcee",
    "ernie4_5",
    "gemma",
    "smollm3",
    "starcoder2",
    # and the families no engine had taken (2026-12-03): a hybrid its dynamic mappings name, new mixtures of experts
    "qwen3_next",
    "gpt_oss",
    "hy_v3",
    "laguna",
    "solar_open",
    "lfm2",
    "nemotron_h",
    "opt",
    "gpt2",
    "mpt",
    # GLM-4 with mappings of the factory's (its MLP fuses gate and up), the vision-language families of issue 33, and
    # Qwen3.5's releases (vision-language: their language model mixes linear and full attention, as Qwen3-Next's),
    "glm4",
    *VISION_LANGUAGE,
    "qwen3_5",
    "qwen3_5_moe",
    # and Gemma 4's, as released (vision-language) and its language model alone
    "gemma4",
    "gemma4_text",
]


def gguf_candidates() -> list[str]:
    """The families tiny_archs.py and tiny_vlms.py build whose architecture the pinned llama.cpp's converter registers:
    `@ModelBase.register("Arch", ...)` on a class of its conversion/*.py, a projector (mmproj) where the class derives
    from MmprojModel, as ModelBase.register sorts them; a vision-language family needs its language model and its
    projector registered. (conversion/__init__.py's maps index the same names for its lazy imports.)"""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from factory.engines.gguf import llama
    from tests.support.tiny_vlms import FAMILIES

    bases: dict[str, list[str]] = {}
    names: dict[str, list[str]] = {}
    for path in sorted((llama.source() / "conversion").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            bases[node.name] = [ast.unparse(b).split(".")[-1] for b in node.bases]
            for call in node.decorator_list:
                if isinstance(call, ast.Call) and ast.unparse(call.func) == "ModelBase.register":
                    names.setdefault(node.name, []).extend(arg.value for arg in call.args)

    def projector(cls: str, seen: frozenset = frozenset()) -> bool:
        return cls == "MmprojModel" or any(projector(b, seen | {cls}) for b in bases.get(cls, ()) if b not in seen)

    text = {n for cls, registered in names.items() if not projector(cls) for n in registered}
    mmproj = {n for cls, registered in names.items() if projector(cls) for n in registered}
    families = sorted(t for t, arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if t not in FAMILIES and arch in text)
    return families + [t for t, arch in FAMILIES.items() if arch in text and arch in mmproj]


# read when asked: the converter is on the machine once llama.cpp is built (factory/engines/gguf/llama.py)
CANDIDATES["gguf"] = gguf_candidates


def candidates(engine: str) -> list[str]:
    found = CANDIDATES[engine]
    return found() if callable(found) else found


# engine -> how its pulled quant of a vision-language model is given an image, as its users load it
def _exl3_image(folder: Path) -> dict:
    from tests.support.exl3_image import first_token

    return first_token(folder)


def _gguf_image(folder: Path) -> dict:
    from tests.support.gguf_image import first_token

    return first_token(folder)


SEES_IMAGES = {"exl3": _exl3_image, "gguf": _gguf_image}
FLAGS = {
    "awq": ["--awq"],
    "awqct": ["--awqct"],
    "exl2": ["--exl2", "4.0"],
    "exl3": ["--exl3", "4.0"],
    "gguf": ["--gguf", "Q4_K_M"],
}
WIDTH = {"exl2": 256, "exl3": 256}  # the GPU engines: heads of 64 (tests/support/tiny_archs.py); the others 128
WINDOWS = 2
# torch's seed is one per process: two threads (--jobs) building checkpoints at once would draw each other's weights
_BUILDING = threading.Lock()
RESULTS = ROOT / "benchmarks" / "results"


def _as_qf(engine: str, architecture: str, args: list[str]) -> None:
    """`qf ARGS` with `architecture` added to `engine`'s claims in this process."""
    from factory import engines
    from factory.cli import main

    found = engines.get(engine)
    type(found).architectures = frozenset(found.architectures | {architecture})
    sys.argv = ["qf", *args]
    main()


def _qf(engine: str, architecture: str, *args: str, env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--as-qf", engine, architecture, *args]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _why(run: subprocess.CompletedProcess) -> str:
    """The first line that says why a run failed: the factory's `error:` line, else the last line of output."""
    lines = [line.strip() for line in (run.stderr + run.stdout).splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("error:") or '"event": "failed"' in line]
    why = (said or lines or [f"exit {run.returncode}"])[-1]
    return re.sub(r" \(exit \d+; log: [^)]*\)|; log: \S+", "", why)[:400]  # the log's path is this machine's


def _rescore(engine_name: str, folder: Path, source: Path, device: str) -> float:
    """The pulled quant's perplexity through its engine's loader, on the windows `qf run` scored (the source's
    tokens: a GGUF quant carries its vocabulary inside the file, not a tokenizer folder)."""
    from factory import engines
    from factory.checkpoints.inspection import read_config
    from factory.evaluation import evaluate

    engine = engines.get(engine_name)
    ids = evaluate.tokenize(source, __import__("calibration").builtin_text("wiki"))
    data = evaluate.stream(ids, WINDOWS, read_config(source / "config.json").get("max_position_embeddings"), "wiki")
    return evaluate.perplexity(engine.load(folder, device), data)


def architecture(model_type: str) -> str | None:
    """The class a tiny checkpoint of `model_type` names (tests/support/tiny_archs.py, tests/support/tiny_vlms.py),
    without building it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from tests.support.tiny_vlms import FAMILIES

    return FAMILIES.get(model_type) or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


def claimed(engine: str, also: list[str] = ()) -> list[str]:
    """The candidates whose architecture `engine` claims, those its committed results do not prove first; `also`'s
    families it does not claim between those and the proven ones."""
    from factory import engines

    claims = engines.get(engine).architectures
    done = proven(results()[engine]) if engine in results() else frozenset()
    mine = [t for t in candidates(engine) if architecture(t) in claims]
    first = [t for t in mine if architecture(t) not in done]
    return first + [t for t in also if t not in mine] + [t for t in mine if t not in first]


def unproven(engine: str) -> dict[str, str]:
    """`engine`'s claims its committed results do not prove -> the result's reason (or "not run")."""
    from factory import engines

    rows = results()[engine]["architectures"]
    why = {architecture(t): r.get("reason", r["status"]) for t, r in rows.items() if r["status"] != "quantized"}
    return {a: why.get(a, "not run") for a in sorted(engines.get(engine).architectures - proven(results()[engine]))}


def _commit() -> str:
    """QF_COMMIT (a copy of the repo without .git, as on the GPU machine), else git's HEAD."""
    if os.environ.get("QF_COMMIT"):
        return os.environ["QF_COMMIT"]
    try:
        run = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    except OSError:  # no git
        return "unknown"
    return run.stdout.strip() or "unknown"


def run_one(engine: str, model_type: str, models: Path, work: Path, device: str) -> dict:
    from tests.support.tiny_archs import HIDDEN, make_tiny
    from tests.support.tiny_vlms import FAMILIES, make_tiny_vlm

    start = time.monotonic()
    hidden = WIDTH.get(engine, HIDDEN)
    make = make_tiny_vlm if model_type in FAMILIES else make_tiny
    try:
        with _BUILDING:
            source = make(model_type, models / f"{model_type}-{hidden}", hidden=hidden)
    except Exception as e:  # noqa: BLE001  (a survey: the failure is the result)
        return {"status": "refused", "reason": f"transformers cannot build it: {type(e).__name__}: {e}"[:400]}
    architecture = json.loads((source / "config.json").read_text())["architectures"][0]
    home = work / engine / model_type
    env = {
        **os.environ,
        "FACTORY_HOME": str(home),
        "FACTORY_DB_URL": f"sqlite:///{home / 'catalog.db'}",
        "COLUMNS": "200",
    }
    env.pop("FACTORY_SERVER", None)
    run = _qf(
        engine, architecture, "run", str(source), *FLAGS[engine], "--eval-windows", str(WINDOWS), "--json", env=env
    )
    result = {"architecture": architecture}
    if run.returncode != 0:
        return {**result, "status": "refused", "reason": _why(run), "seconds": round(time.monotonic() - start, 1)}
    listed = json.loads(_qf(engine, architecture, "ls", "--json", env=env).stdout)
    [quant] = [q for q in listed if q["method"] == engine]
    result["bytes"] = quant.get("bytes")
    pulled = work / "pulled" / engine / model_type
    pull = _qf(engine, architecture, "pull", quant["name"], "-o", str(pulled), env=env)
    if pull.returncode != 0:
        return {**result, "status": "refused", "reason": f"pull: {_why(pull)}"}
    try:
        again = _rescore(engine, pulled, source, device)
    except Exception as e:  # noqa: BLE001
        return {**result, "status": "refused", "reason": f"the pulled quant does not load: {_error(e)}"}
    if abs(again - quant["ppl"]) > 1e-3 * quant["ppl"]:
        return {
            **result,
            "status": "refused",
            "reason": f"the pulled quant scores ppl {again:.4f}, the factory published {quant['ppl']:.4f}",
        }
    if engine in SEES_IMAGES and model_type in FAMILIES:
        try:
            result["image"] = SEES_IMAGES[engine](pulled)
        except Exception as e:  # noqa: BLE001
            return {
                **result,
                "status": "refused",
                "reason": f"the pulled quant takes no image: {_error(e)}",
            }
    return {
        **result,
        "status": "quantized",
        "tag": quant["tag"],
        "ppl": quant["ppl"],
        "kld": quant["kld"],
        "top1": quant["top1"],
        "pulled_ppl": round(again, 4),
        "seconds": round(time.monotonic() - start, 1),
    }


def results() -> dict[str, dict]:
    """Every committed coverage result by engine: {engine: {"device", "versions", "architectures": {type: row}}}."""
    found: dict[str, dict] = {}
    for path in sorted(RESULTS.glob("coverage-*.json")):
        for engine, rows in json.loads(path.read_text()).items():
            found[engine] = rows
    return found


def proven(engine_results: dict) -> frozenset[str]:
    """The architectures (config.json `architectures[0]`) an engine's results prove it converts."""
    return frozenset(r["architecture"] for r in engine_results["architectures"].values() if r["status"] == "quantized")


def table(found: dict[str, dict]) -> str:
    """The README's table: one row per model type, one column per engine: quantized, refused or not run, with
    a numbered note below the table for each reason."""
    engines = sorted(found)
    types = sorted({t for e in engines for t in found[e]["architectures"]})
    head = ["model type", *(f"{e} ({found[e]['device']})" for e in engines)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    reasons: list[str] = []
    for t in types:
        cells = []
        for e in engines:
            row = found[e]["architectures"].get(t)
            if row is None or row["status"] == "quantized":
                cells.append("" if row is None else "quantized")
                continue
            why = _short_reason(row["reason"])
            if why not in reasons:
                reasons.append(why)
            cells.append(f"{row['status']} ({reasons.index(why) + 1})")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", *(f"{i}. {why}" for i, why in enumerate(reasons, 1))])


def _error(e: Exception) -> str:
    """An exception in one line, with where it was raised (the innermost frame, from its package's folder on), so a
    refusal seen only in the results can be looked up."""
    if not e.__traceback__:
        return f"{type(e).__name__}: {e}"
    frame = traceback.extract_tb(e.__traceback__)[-1]
    path = Path(frame.filename)
    if "site-packages" in path.parts:
        path = Path(*path.parts[path.parts.index("site-packages") + 1 :])
    elif path.is_relative_to(ROOT):
        path = path.relative_to(ROOT)
    return f"{type(e).__name__}: {e} (at {path}:{frame.lineno})"


def _short_reason(reason: str) -> str:
    """The reason without the factory's prefix, the log's path, the run's own paths and table-breaking characters."""
    reason = reason.removeprefix("error: ").split(" (exit ")[0].split("; log: ")[0]
    reason = re.sub(r"(?<=\s)/\w\S*", "<work>", reason)
    return reason.replace("|", "/").replace("\n", " ")[:200]


def main() -> None:
    if sys.argv[1:2] == ["--as-qf"]:
        _as_qf(sys.argv[2], sys.argv[3], sys.argv[4:])
        return
    if sys.argv[1:2] == ["--table"]:
        print(table(results()))
        return
    if sys.argv[1:2] == ["--unproven"]:
        print(json.dumps(unproven(sys.argv[2]), indent=2))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--engine", default=",".join(CANDIDATES))
    parser.add_argument("--arch", default=None, help="model types to try (default: each engine's candidates)")
    parser.add_argument(
        "--claimed",
        action="store_true",
        help="the candidates each engine claims: the unproven ones, then --arch's, then the proven ones again",
    )
    parser.add_argument("--jobs", type=int, default=1, help="architectures converted at once")
    parser.add_argument("--out", type=Path, default=RESULTS / "coverage-cpu.json")
    args = parser.parse_args()
    import importlib.metadata as md

    # transformers' lazy imports are not thread-safe: the classes the runs' threads build with, imported once here
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedTokenizerFast  # noqa: F401

    from factory import engines
    from factory.evaluation import evaluate

    device = evaluate.device()
    commit = _commit()
    written = json.loads(args.out.read_text()) if args.out.exists() else {}
    lock = threading.Lock()
    for engine in args.engine.split(","):
        asked = args.arch.split(",") if args.arch else []
        wanted = claimed(engine, asked) if args.claimed else asked or candidates(engine)
        found = written.setdefault(engine, {"device": device, "architectures": {}})
        found["versions"] = {
            "engine": engines.get(engine).version(),
            **{p: md.version(p) for p in ("transformers", "torch")},
        }
        found["command"] = " ".join(["python3 benchmarks/coverage.py DIR", *sys.argv[2:]])
        found["commit"] = commit
        if device == "cuda":
            import torch

            found["gpu"] = torch.cuda.get_device_name(0)

        def one(model_type: str, engine=engine, found=found) -> None:
            # each row names its commit: a sitting cut short leaves older runs' rows beside its own
            outcome = {**run_one(engine, model_type, args.dir / "models", args.dir / "work", device), "commit": commit}
            with lock:
                found["architectures"][model_type] = outcome
                print(engine, model_type, json.dumps(outcome), flush=True)
                args.out.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")

        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(one, wanted))


if __name__ == "__main__":
    main()
