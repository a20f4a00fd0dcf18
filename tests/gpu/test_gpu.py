"""The GPU suite: `pytest -m gpu` on a CUDA machine with exllamav2 (scripts/gpu_suite runs it on the H200).

EXL2 at 3.0/4.0/5.0/6.0 bpw and AWQ on the tiny model and SmolLM2-135M-Instruct (one measurement, four passes),
measurement reuse (4.31 bpw with an 8-bit head, the size of AWQ w4g64), resume after a killed conversion child
and a killed `qf`, a corrupt work folder, and the guard that exllamav2's FP16 perplexity matches transformers'.
Results go to $QF_GPU_RESULTS (default benchmarks/results/gpu_suite.json) in the shape docs/measured.md gives; the
raw status output of one conversion goes to $QF_GPU_TRANSCRIPTS (for the CPU parsing tests' fixture).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from factory import engines, settings
from factory.checkpoints import files
from factory.errors import JobFailed
from factory.evaluation import evaluate
from factory.factory import Factory
from factory.jobs.planning import Request
from factory.recipes import build_recipe
from tests.support import ROOT, processes
from tests.support.gpu_results import RESULTS, rows, run_events, save
from tests.support.qf import Qf
from tests.support.smollm2 import convert
from tests.support.tiny_model import make_tiny_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BPWS = os.environ.get("QF_GPU_BPWS", "3.0,4.0,5.0,6.0")  # fewer for a quick rerun of one check


class _Made(dict):
    """Models made on first use, so that `-k tiny-llama` runs without SmolLM2's GGUF."""

    def __init__(self, makers: dict):
        super().__init__()
        self.makers = makers

    def __missing__(self, name: str) -> Path:
        self[name] = self.makers[name]()
        return self[name]


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("models")
    gguf = os.environ.get("QF_SMOLLM2_GGUF")
    return _Made(
        {
            "tiny-llama": lambda: make_tiny_llama(base / "tiny-llama", hidden=256, layers=4),
            "smollm2-135m-instruct": lambda: convert(base / "SmolLM2-135M-Instruct", Path(gguf) if gguf else None),
        }
    )


@pytest.fixture(scope="session", params=["tiny-llama", "smollm2-135m-instruct"])
def standard(request, models, tmp_path_factory):
    """EXL2 3.0/4.0/5.0/6.0 + AWQ in one job (48 eval windows on CUDA). The gate is opened to 3 x FP16: SmolLM2
    at 3.0 bpw is 2.47 x FP16 (H200, 2026-11-30), which the default 1.5 rightly refuses; here we want its number."""
    name = request.param
    home = tmp_path_factory.mktemp(name)
    recipe = home / "suite.yaml"
    recipe.write_text(f"exl2: {{bpw: [{BPWS}]}}\nawq: {{}}\nmax_ppl_ratio: 3.0\n")
    qf = Qf(home=home / "home")
    events = run_events(qf("run", models[name], "--recipe", recipe, "--json"))
    rows(name, events)
    return name, qf, events


def test_one_measurement_four_passes(standard):
    name, _, events = standard
    done = [e["step"] for e in events if e["event"] == "step" and e["state"] == "succeeded"]
    assert len([s for s in done if s.startswith("measure:")]) == 1
    assert [s for s in done if s.startswith("quantize:exl2")] == [f"quantize:exl2-{b}bpw" for b in BPWS.split(",")]
    assert events[-1]["state"] == "succeeded" and len(events[-1]["quants"]) == len(BPWS.split(",")) + 1


def test_exl2_outputs_are_complete(standard):
    _, qf, events = standard
    for q in events[-1]["quants"]:
        if q["method"] != "exl2":
            continue
        folder = qf.home / "registry" / q["path"]
        assert list(folder.glob("output*.safetensors")) and (folder / "measurement.json").is_file()
        files.check_publishable(folder, engines.get("exl2").outputs)
        assert not (folder / "model.safetensors.index.json").exists()
        qc = json.loads((folder / "config.json").read_text())["quantization_config"]
        assert (qc["quant_method"], qc["bits"], qc["head_bits"]) == ("exl2", q["bits"], 6)


def test_quality_falls_with_fewer_bits(standard):
    name, _, events = standard
    if name != "smollm2-135m-instruct":
        pytest.skip("a random model's perplexity does not order by bits")
    exl2 = sorted((q for q in events[-1]["quants"] if q["method"] == "exl2"), key=lambda q: q["bits"])
    ppls, klds = [q["ppl"] for q in exl2], [q["kld"] for q in exl2]
    RESULTS["checks"]["smollm2_exl2_ppl_by_bpw"] = dict(zip(BPWS.split(","), ppls, strict=True))
    RESULTS["checks"]["smollm2_exl2_kld_by_bpw"] = dict(zip(BPWS.split(","), klds, strict=True))
    RESULTS["checks"]["smollm2_exl2_6bpw_change"] = exl2[-1]["change"]
    save()
    assert ppls == sorted(ppls, reverse=True)
    assert klds == sorted(klds, reverse=True) and klds[-1] > 0  # KL divergence from FP16 falls as bits rise
    assert exl2[-1]["change"] < 0.03


def test_kv_cache_perplexities(standard):
    """Every EXL2 quant is also scored through exllamav2's fp16, q8 and q4 caches (128-token forwards)."""
    name, _, events = standard
    found = {}
    for q in events[-1]["quants"]:
        if q["method"] == "exl2":
            kv = q["eval"]["kv_cache"]
            assert set(kv) == {"fp16", "q8", "q4"} and all(v > 1 for v in kv.values())
            found[q["name"].split(":", 1)[1]] = kv
            if name == "smollm2-135m-instruct":  # through an fp16 cache, in chunks: the same as one full forward
                assert kv["fp16"] == pytest.approx(q["ppl"], rel=0.005)
    RESULTS["checks"][f"{name}_kv_cache_ppl"] = found
    save()


def test_measurement_is_reused_for_another_size(standard, tmp_path):
    """4.31 bpw with an 8-bit head: the size of AWQ w4g64 (4 + 20/64 bits per weight, FP16 head)."""
    name, qf, _ = standard
    recipe = tmp_path / "equal-size.yaml"
    recipe.write_text("exl2: {bpw: [4.31], head_bits: 8}\n")
    events = run_events(qf("run", _source_of(standard), "--recipe", recipe, "--json"))
    notes = [e["message"] for e in events if e["event"] == "note"]
    assert any(n.startswith("reusing EXL2 measurement") for n in notes)
    assert not [e for e in events if e["event"] == "step" and e["step"].startswith("measure:")]
    rows(name, events)


def _source_of(standard) -> str:
    return standard[2][0]["source"]


def test_exllamav2_fp16_matches_transformers(standard):
    name, _, events = standard
    source = Path(_source_of(standard))
    fp16 = next(e["ppl"] for e in events if e["event"] == "evaluation" and e["subject"] == "fp16")
    windows = events[-1]["quants"][0]["eval"]["windows"]
    import calibration

    ids = evaluate.tokenize(source, calibration.resolve("builtin:wiki").text)
    exl2 = engines.get("exl2")
    result = evaluate.evaluate(source, exl2.load, exl2.evaluator, evaluate.stream(ids, windows, None, "builtin:wiki"))
    RESULTS["rows"].append(
        {
            "model": name,
            "method": "fp16",
            "evaluator": "exllamav2",
            "bits": 16,
            "ppl": result.ppl,
            "eval_windows": windows,
            "seconds": {"evaluate": result.seconds},
            "peak_gpu_bytes": result.peak_gpu_bytes,
        }
    )
    save()
    assert result.ppl == pytest.approx(fp16, rel=0.001)


def test_exl2_publishes_only_the_allowlist(models, tmp_path):
    """convert_exl2 -cf copies every regular file beside the source's weights: with the staging folder, a stray
    .env, a link to /etc/passwd and an optimizer state stay behind, and the chat template comes along."""
    model = tmp_path / "tiny-strays"
    shutil.copytree(models["tiny-llama"], model)
    (model / ".env").write_text("HF_TOKEN=hf_stray_secret\n")
    (model / "notes.txt").symlink_to("/etc/passwd")
    (model / "optimizer.pt").write_bytes(b"\x80\x04pickle")
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    qf = Qf(home=tmp_path / "home")
    events = run_events(qf("run", model, "--exl2", "4.0", "--eval-windows", 4, "--json"))
    [quant] = events[-1]["quants"]
    folder = qf.home / "registry" / quant["path"]
    names = sorted(p.name for p in folder.iterdir())
    files.check_publishable(folder, engines.get("exl2").outputs)
    assert "chat_template.jinja" in names and not {".env", "notes.txt", "optimizer.pt"} & set(names), names
    RESULTS["checks"]["exl2_published_files"] = names
    save()


# -- resume ------------------------------------------------------------------------------------------------------


def _stages(events: list[dict]) -> list[str]:
    return [e["stage"] for e in events if e.get("stage")]


def _quantizing(event: dict) -> bool:
    return event.get("stage") == "Quantizing" and event.get("done", 0) >= 30


def _kill_conversion_once():
    """An emit callback that SIGKILLs this process's engines once the conversion is 30% into quantizing."""
    killed: list[int] = []

    def kill(event: dict) -> None:
        if event["event"] == "progress" and _quantizing(event) and not killed:
            for proc in processes.engines(os.getpid()):
                proc.send_signal(signal.SIGKILL)
                killed.append(proc.pid)

    return kill


def test_resume_after_kills(models, tmp_path, monkeypatch):
    """Kill the conversion child, then the whole `qf` process: the third run continues from job_new.json."""
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FACTORY_DB_URL", raising=False)
    source = str(models["tiny-llama"])
    recipe = build_recipe(exl2="3.5", eval_windows=4)

    factory = Factory(settings.load(), _kill_conversion_once())
    job, _ = factory.submit(Request(source=source, recipe=recipe, asked={"exl2"}))
    with pytest.raises(JobFailed, match="killed by SIGKILL"):
        factory.execute(job.id)
    job_file = tmp_path / "home" / "work" / job.id / "exl2-3.5bpw" / "convert" / "job_new.json"
    assert json.loads(job_file.read_text())["progress"] == "quant"

    # now the whole qf process, while its conversion runs
    proc = subprocess.Popen(
        [sys.executable, "-m", "factory.cli", "run", source, "--exl2", "3.5", "--eval-windows", "4", "--json"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    for line in proc.stdout:
        if _quantizing(json.loads(line)):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    time.sleep(3)
    ours = str(tmp_path)  # only this test's conversions: other suites may share the GPU
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if ours in " ".join(p.info["cmdline"] or [])]
    assert leftovers == [], "a conversion outlived its killed qf"

    seen: list[dict] = []
    done = Factory(settings.load(), seen.append).execute(job.id)
    assert done.state == "succeeded"
    stages = _stages(seen)
    assert stages[0] == "Quantizing" and "Tokenizing (2)" not in stages, stages
    RESULTS["checks"]["resume_first_stage_after_kill"] = stages[0]
    save()


def test_corrupt_work_folder_restarts_clean(models, tmp_path, monkeypatch):
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FACTORY_DB_URL", raising=False)
    factory = Factory(settings.load(), _kill_conversion_once())
    job, _ = factory.submit(
        Request(source=str(models["tiny-llama"]), recipe=build_recipe(exl2="2.5", eval_windows=4), asked={"exl2"})
    )
    with pytest.raises(JobFailed):
        factory.execute(job.id)
    job_file = tmp_path / "home" / "work" / job.id / "exl2-2.5bpw" / "convert" / "job_new.json"
    job_file.write_text('{"progress": "quant", "trunc')
    seen: list[dict] = []
    assert Factory(settings.load(), seen.append).execute(job.id).state == "succeeded"
    assert "Tokenizing (2)" in _stages(seen)


# -- the engine alone: a real transcript for the CPU parsing tests -------------------------------------------------


def test_engine_transcripts(models, tmp_path):
    import calibration

    source = models["tiny-llama"]
    engine = engines.get("exl2")
    cal = calibration.write_parquet(calibration.resolve("builtin:mix"), tmp_path / "cal.parquet")
    events: list[dict] = []
    measurement = tmp_path / "measurement.json"
    engine.measure("measure", source, cal, 16, 2048, tmp_path / "measure", measurement, {}, events.append)
    spec = engines.get("exl2").spec(bpw=4.0)
    request = engines.QuantizeRequest(
        source, tmp_path / "out", tmp_path / "quant", spec, calibration_file=cal, measurements={"measure": measurement}
    )
    engine.quantize(request, events.append)
    assert {e["stage"] for e in events if "stage" in e} >= {"Quantizing", "Compiling"}
    assert all(0 <= e["done"] <= 100 for e in events if "stage" in e)
    assert any(e.get("peak_gpu_bytes") for e in events)
    out = Path(os.environ.get("QF_GPU_TRANSCRIPTS", tmp_path / "transcripts"))
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(tmp_path / "measure.log", out / "convert_exl2_measure.log")
    shutil.copy(tmp_path / "quant" / "engine.log", out / "convert_exl2_quantize.log")
