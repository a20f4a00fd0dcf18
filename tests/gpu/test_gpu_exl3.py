"""EXL3 on the GPU (exllamav3 1.6.5; scripts/gpu_suite installs it from .whl/exl3 and builds its extension).

Gemma-3-270M (tests/support/gemma.py, from the GGUF parts in $QF_GEMMA_PARTS) at 2.0-6.0 bpw in one job on the same 48
windows as its FP16; FP16 through exllamav3 against transformers; a tiny random Llama end to end (convert, score
through the quantized cache, publish, pull), and at 4.0 with its bits chosen per tensor (exllamav3's measure and
optimize), a tiny Gemma 3 vision-language checkpoint given an image after, and a conversion killed and resumed.
Results: $QF_GPU_RESULTS.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import calibration
from benchmarks import exl3_opt
from factory import engines
from factory.checkpoints.inspection import VISION_PART
from factory.engines.exl3 import optimize
from factory.engines.exl3.engine import write_calibration
from factory.evaluation import evaluate
from tests.support import ROOT
from tests.support.exl3_image import first_token
from tests.support.gemma import convert
from tests.support.gpu_results import RESULTS, rows, run_events, save
from tests.support.qf import Qf
from tests.support.tiny_model import LLAMA_1B, make_tiny_llama
from tests.support.tiny_vlms import make_tiny_vlm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("exllamav3") is None, reason="needs exllamav3"),
]
GEMMA_BPWS = os.environ.get("QF_GEMMA_BPWS", "2.0,3.0,4.0,5.0,6.0")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("exl3") / "tiny-llama", hidden=256, layers=4)


@pytest.fixture(scope="session")
def gemma(tmp_path_factory) -> Path:
    """$QF_GEMMA_DIR (made there once, reused) or a session folder; the tokenizer from $QF_GEMMA_TOKENIZER where
    the machine's transformers misreads the GGUF's (tests/support/gemma.py)."""
    parts, made, tokenizer = (os.environ.get(k) for k in ("QF_GEMMA_PARTS", "QF_GEMMA_DIR", "QF_GEMMA_TOKENIZER"))
    out = Path(made) if made else tmp_path_factory.mktemp("gemma") / "gemma-3-270m"
    return convert(out, Path(parts) if parts else None, Path(tokenizer) if tokenizer else None)


def test_exl3_end_to_end_on_a_tiny_llama(tiny_llama, tmp_path):
    qf = Qf(home=tmp_path / "home")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("exl3: {bpw: [4.0]}\nmax_ppl_ratio: 3.0\n")
    events = run_events(qf("run", tiny_llama, "--recipe", recipe, "--json"))
    rows("tiny-llama", events)
    [quant] = events[-1]["quants"]
    assert (quant["name"], quant["method"]) == ("tiny-llama:exl3-4.0bpw", "exl3")
    assert set(quant["eval"]["kv_cache"]) == {"q8", "q4"}
    RESULTS["checks"]["exl3_tiny_kv_cache"] = quant["eval"]["kv_cache"]
    out = tmp_path / "pulled"
    assert qf("pull", "tiny-llama:exl3-4.0bpw", "-o", out).exit_code == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "exl3" and 4.0 <= qc["bits"] <= 4.25 and qc["head_bits"] == 6
    assert (out / "quantization_config.json").is_file()
    log = next((tmp_path / "home" / "work").rglob("engine.log"), None)  # removed after success: the job is done
    assert log is None
    save()


def test_exl3_bits_chosen_per_tensor_on_a_tiny_llama(tiny_llama, tmp_path):
    """`--exl3 4.0opt` on CUDA (issue 49, item 4): exllamav3's measure of the uniform 3.0, 4.0 and 5.0 (made first, in
    the same job) against the FP16 model, its optimize to the uniform 4.0's bits, both scored on the same windows, and
    the gate's decision the rule's (factory/jobs/rivals.py): kept only where its KLD is lower in no more bytes."""
    qf = Qf(home=tmp_path / "home")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("exl3: {opt: [4.0]}\nmax_ppl_ratio: 3.0\n")
    events = run_events(qf("run", tiny_llama, "--recipe", recipe, "--eval-windows", "2", "--json"))
    rows("tiny-llama", events)
    made_from = ["exl3-3.0bpw", "exl3-4.0bpw", "exl3-5.0bpw"]
    found = exl3_opt.summarize(events, "exl3-4.0bpw", "exl3-4.0bpw-opt", made_from)
    RESULTS["checks"]["exl3_opt_tiny"] = found
    save()
    at = {(e["step"], e["state"]): i for i, e in enumerate(events) if e["event"] == "step"}
    [measure] = [m["step"] for m in found["measurements"]]
    assert all(at[f"quantize:{t}", "succeeded"] < at[measure, "running"] for t in made_from)  # each made before it
    assert at[measure, "succeeded"] < at["quantize:exl3-4.0bpw-opt", "running"]
    [measurement] = (tmp_path / "home" / "measurements").glob("*.json")  # kept for any later job with these inputs
    measured = optimize.check_measurement(measurement, 3, tmp_path / "engine.log")
    assert len(measured["groups"]) == 2 * 4  # level 2: a layer's attention and its MLP, 4 layers
    opt, uniform = found["optimized"], found["uniform"]
    assert opt["tensor_bytes"] <= uniform["tensor_bytes"]  # optimized to the uniform size's own bits
    assert found["kept"] == (opt["kld"] < uniform["kld"])
    published = {q["name"] for q in events[-1]["quants"]}
    assert {f"tiny-llama:{t}" for t in made_from} <= published
    assert ("tiny-llama:exl3-4.0bpw-opt" in published) == found["kept"]
    # The measurement once more from the published quants, its transcript kept beside the results (a job's is removed
    # with its work folder): tests/fixtures/exl3_measure_tiny.log's real counterpart, read by the engine's parser.
    inputs = [tmp_path / "pulled" / tag for tag in made_from]
    for tag, folder in zip(made_from, inputs, strict=True):
        assert qf("pull", f"tiny-llama:{tag}", "-o", folder).exit_code == 0
    ids = evaluate.tokenize(tiny_llama, calibration.resolve("builtin:mix").text)
    cal = write_calibration(calibration.token_windows(ids, 10, 1024, "builtin:mix"), tmp_path / "cal.safetensors")
    seen: list[dict] = []
    work = tmp_path / "measured-again"
    optimize.measure(tiny_llama, inputs, cal, 10, 1024, work, tmp_path / "again.json", seen.append)
    transcript = (work / "engine.log").read_text()
    results = Path(os.environ.get("QF_GPU_RESULTS", ROOT / "benchmarks" / "results" / "gpu_suite.json"))
    results.with_name("exl3_measure_tiny.log").write_text(transcript)
    modules = [e["module"] for e in seen if "module" in e]
    assert modules[:2] == ["model.embed_tokens", "model.layers.0"] and modules[-1] == "lm_head"
    done = [e for e in seen if "done" in e]
    assert done[-1]["done"] == done[-1]["total"] and any(e.get("peak_gpu_bytes") for e in seen)


def test_a_vision_language_exl3_quant_keeps_its_tower_and_takes_an_image(tmp_path):
    """Issue 33 on exllamav3: a tiny Gemma 3 vision-language checkpoint as released (tests/support/tiny_vlms.py) through
    `qf run --exl3`: its language model quantized, its tower and projector copied at 16 bits, its processor's files
    published; the pulled quant loads with its vision model and generates a token for a prompt with an image."""
    source = make_tiny_vlm("gemma3", tmp_path / "tiny-gemma3-vl", hidden=256)
    qf = Qf(home=tmp_path / "home")
    events = run_events(qf("run", source, "--exl3", "4.0", "--eval-windows", 2, "--json"))
    rows("tiny-gemma3-vl", events)
    [quant] = events[-1]["quants"]
    assert quant["name"] == "tiny-gemma3-vl:exl3-4.0bpw"
    out = tmp_path / "pulled"
    assert qf("pull", quant["name"], "-o", out).exit_code == 0
    assert {"preprocessor_config.json", "processor_config.json", "chat_template.jinja"} <= {
        p.name for p in out.iterdir()
    }
    fp16, quantized = _tensors(source), _tensors(out)
    vision = {k for k in fp16 if VISION_PART.match(k)}
    # exllamav3 copies them under the names it reads them by (Gemma 3's mm_input_projection_weight gains a dot)
    copied = {k.replace("mm_input_projection_weight", "mm_input_projection.weight"): k for k in vision}
    assert set(copied) <= set(quantized), sorted(set(copied) - set(quantized))
    assert all(torch.equal(quantized[new].cpu(), fp16[old].cpu()) for new, old in copied.items())
    assert "language_model.model.layers.0.mlp.up_proj.trellis" in quantized  # the language model, in EXL3
    seen = first_token(out)
    RESULTS["checks"]["exl3_vlm_image"] = seen
    assert seen["image_embeddings"] == 4 and seen["prompt_tokens"] > seen["image_embeddings"]
    save()


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    found = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            found.update({k: f.get_tensor(k) for k in f.keys()})
    return found


def test_exl3_conversion_killed_and_resumed(tiny_llama, tmp_path):
    """SIGKILL the whole `qf run` while exllamav3 converts; the same command resumes its work folder (-r) and
    finishes."""
    env = {**os.environ, "FACTORY_HOME": str(tmp_path / "home"), "FACTORY_DB_URL": ""}
    cmd = [
        sys.executable,
        "-m",
        "factory.cli",
        "run",
        str(tiny_llama),
        "--exl3",
        "3.0",
        "--eval-windows",
        "2",
        "--json",
    ]
    first = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 300
    log = None
    while time.monotonic() < deadline:
        log = next((tmp_path / "home" / "work").rglob("engine.log"), None) if (tmp_path / "home").exists() else None
        if log and "Quantized: model.layers.1" in log.read_text(errors="replace"):
            break
        time.sleep(0.5)
    assert log is not None, "the conversion never got to layer 1"
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    again = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    events = [json.loads(line) for line in again.stdout.splitlines()]
    assert events[-1]["state"] == "succeeded"
    RESULTS["checks"]["exl3_resumed_after_sigkill"] = True
    save()


def test_gemma_exl3_sizes_one_job(gemma, tmp_path):
    qf = Qf(home=tmp_path / "home")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"exl3: {{bpw: [{GEMMA_BPWS}]}}\nmax_ppl_ratio: 10.0\n")
    events = run_events(qf("run", gemma, "--recipe", recipe, "--json"))
    rows("gemma-3-270m", events)
    quants = sorted(events[-1]["quants"], key=lambda q: q["bits"])
    assert [q["bits"] for q in quants] == [float(b) for b in GEMMA_BPWS.split(",")]
    ppls = [q["ppl"] for q in quants]
    assert ppls == sorted(ppls, reverse=True), ppls  # perplexity falls as bits rise
    assert all(q["eval"]["windows"] == 48 for q in quants)


def test_gemma_fp16_through_exllamav3_agrees_with_transformers(gemma):
    tokens = evaluate.tokenize(gemma, calibration.resolve("builtin:wiki").text)
    data = evaluate.stream(tokens, 48, 32768, "builtin:wiki")
    exl3 = engines.get("exl3")
    theirs = evaluate.evaluate(gemma, evaluate.load_fp16, evaluate.FP16_EVALUATOR, data)
    ours = evaluate.evaluate(gemma, exl3.load, exl3.evaluator, data)
    RESULTS["rows"] += [
        {
            "model": "gemma-3-270m",
            "method": "fp16",
            "evaluator": r.evaluator,
            "bits": 16,
            "ppl": r.ppl,
            "eval_windows": 48,
            "seconds": {"evaluate": r.seconds},
            "peak_gpu_bytes": r.peak_gpu_bytes,
        }
        for r in (theirs, ours)
    ]
    RESULTS["checks"]["gemma_fp16_exllamav3_vs_transformers"] = ours.ppl / theirs.ppl - 1
    save()
    assert abs(ours.ppl / theirs.ppl - 1) < 0.001, (ours.ppl, theirs.ppl)


def test_exl3_against_exl2_at_equal_bits_on_the_random_1b_llama(tmp_path):
    """The random 1.1B Llama (LLAMA_1B), which both engines convert, at 4.0 bpw each in one job: sizes and seconds (its
    perplexity says nothing, the weights being random; the distance from FP16 will)."""
    model = make_tiny_llama(tmp_path / "llama-1.1b", device="cuda", **LLAMA_1B)
    qf = Qf(home=tmp_path / "home")
    bpw = os.environ.get("QF_LLAMA_BPWS", "4.0")
    events = run_events(
        qf("run", model, "--exl2", bpw, "--exl3", bpw, "--calibration", "builtin:mix", "--eval-windows", "8", "--json")
    )
    rows("llama-1.1b-random", events)
    quants = {(q["method"], q["bits"]): q for q in events[-1]["quants"]}
    for bits in map(float, bpw.split(",")):
        exl2, exl3 = quants[("exl2", bits)], quants[("exl3", bits)]
        RESULTS["checks"][f"llama_1b_exl3_over_exl2_bytes_{bits}"] = exl3["bytes"] / exl2["bytes"]
        assert 0.9 < exl3["bytes"] / exl2["bytes"] < 1.1  # the same bits per weight make the same size
    save()
