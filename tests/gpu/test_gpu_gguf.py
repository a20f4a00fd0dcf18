"""On a CUDA machine with llama.cpp built for CUDA (`python -m factory.engines.gguf.build` where nvcc and a GPU exist;
benchmarks/gguf_sitting.sh carries the pinned sdist there): a GGUF job's importance matrix and scoring run on the
card (`-ngl 999`), the pulled file scores on the card to the published perplexity, and the same build on the CPU
gives the same numbers; on the tiny Llama and on the random 1.1B (tests/support/tiny_model.py LLAMA_1B, made on the
card in seconds), whose units' seconds are the CUDA side of GGUF's costs. Results: $QF_GPU_RESULTS."""

from __future__ import annotations

import subprocess
import time

import pytest
import torch

from calibration import builtin_text
from factory import engines
from factory.engines.gguf import evaluate as gguf_evaluate
from factory.engines.gguf import llama
from factory.evaluation import evaluate
from tests.support.gpu_results import RESULTS, save
from tests.support.qf import Qf
from tests.support.tiny_model import LLAMA_1B, make_tiny_llama

pytestmark = pytest.mark.gpu

ENGINE = engines.get("gguf")
WINDOWS = 4
MODELS = {"tiny-llama": dict(hidden=256, layers=4), "llama-1.1b": dict(device="cuda", **LLAMA_1B)}


def _on_the_card(pid: int) -> int:
    """MiB the process `pid` holds on the GPU (0: none), as nvidia-smi lists its compute processes."""
    listed = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum(
        int(mib) for p, mib in (line.split(",") for line in listed.splitlines() if line.strip()) if int(p) == pid
    )


@pytest.mark.parametrize("name", MODELS)
def test_a_gguf_job_runs_on_the_card_and_the_cpu_scores_it_the_same(name, tmp_path, monkeypatch):
    assert llama.flavour() == "cuda", "llama.cpp's CUDA build needs nvcc and nvidia-smi on PATH"
    assert (llama.built() / llama.DONE).read_text().splitlines()[1] == "cuda"
    model = make_tiny_llama(tmp_path / name, **MODELS[name])
    qf = Qf(home=tmp_path / "home")
    recipe = tmp_path / "gguf.yaml"
    recipe.write_text("gguf:\n  imatrix_chunks: 8\n  imatrix_ctx: 256\neval: builtin:wiki\nmax_ppl_ratio: 1.5\n")
    start = time.monotonic()
    result = qf("run", model, "--recipe", recipe, "--gguf", "Q4_K_M,IQ4_XS", "--eval-windows", WINDOWS, "--json")
    seconds = round(time.monotonic() - start, 1)
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in qf.json("ls")}
    assert set(rows) == {f"{name}:gguf-q4_k_m", f"{name}:gguf-iq4_xs"}
    for row in rows.values():
        assert row["fp16_ppl"] <= row["ppl"] * 1.01 < 1.5 * row["fp16_ppl"] and -1e-4 < row["kld"] < 0.5
    published = rows[f"{name}:gguf-q4_k_m"]
    steps = {s["name"]: s for s in qf.json("status", published["job"])["steps"]}
    found = {"seconds": seconds, "steps": {n: s.get("seconds") for n, s in steps.items()}}
    found["rows"] = {n: {k: r[k] for k in ("bytes", "ppl", "fp16_ppl", "kld", "top1")} for n, r in rows.items()}
    RESULTS["checks"].setdefault("gguf_cuda", {})[name] = found
    save()

    pulled = tmp_path / "pulled"
    assert qf("pull", f"{name}:gguf-q4_k_m", "-o", pulled).exit_code == 0
    ids = evaluate.tokenize(model, builtin_text("wiki"), WINDOWS * evaluate.WINDOW)
    data = evaluate.stream(ids, WINDOWS, None, "wiki")
    driver = ENGINE.load(pulled, "cuda")
    driver(torch.tensor(data.windows[:1]))  # started: every layer offloaded
    found["driver_mib_on_the_card"] = _on_the_card(driver.proc.pid)
    driver.close()
    assert found["driver_mib_on_the_card"] > 0, "llama.cpp's scoring did not run on the card"
    on_card = evaluate.evaluate(pulled, ENGINE.load, ENGINE.evaluator, data)
    monkeypatch.setattr(gguf_evaluate, "gpu_layers", lambda: [])  # the same build, every layer on the CPU
    on_cpu = evaluate.evaluate(pulled, ENGINE.load, ENGINE.evaluator, data)
    found["pulled"] = {"card_ppl": on_card.ppl, "cpu_ppl": on_cpu.ppl}
    save()
    assert on_card.ppl == pytest.approx(published["ppl"], rel=1e-5)
    assert on_cpu.ppl == pytest.approx(on_card.ppl, rel=1e-2)
