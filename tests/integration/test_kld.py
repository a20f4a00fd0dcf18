"""KL divergence from FP16 and top-1 agreement (factory/evaluation/kld.py): against itself, against perturbed copies,
the saved reference, and the compact reference against the exact full-vocabulary KL on SmolLM2."""

from __future__ import annotations

import math

import pytest

from factory.evaluation import evaluate, kld

WINDOWS = 2


@pytest.fixture(scope="module")
def stream(tiny):
    from calibration import builtin_text

    ids = evaluate.tokenize(tiny, builtin_text("wiki"))
    return evaluate.stream(ids, WINDOWS, 512, "builtin:wiki")


def _perturbed(folder, scale: float):
    """The tiny model with seeded noise of `scale` x each decoder weight's spread added to it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".layers." in name and param.dim() == 2:
                param += scale * param.std() * torch.randn(param.shape, generator=generator)
    return lambda ids: model(ids).logits


def _reference(tiny, stream) -> kld.Reference:
    reference = kld.Reference()
    evaluate.score(evaluate.load_fp16(tiny, "cpu"), stream, keep=reference)
    return reference


def test_a_model_against_itself_diverges_by_nothing(tiny, stream):
    reference = _reference(tiny, stream)
    ppl, divergence = evaluate.score(evaluate.load_fp16(tiny, "cpu"), stream, reference=reference)
    assert math.isfinite(ppl)
    assert divergence.mean == pytest.approx(0, abs=1e-6) and divergence.p99 == pytest.approx(0, abs=1e-5)
    assert divergence.top1 == 1.0


def test_divergence_grows_with_the_perturbation(tiny, stream):
    reference = _reference(tiny, stream)
    scores = [evaluate.score(_perturbed(tiny, scale), stream, reference=reference)[1] for scale in (0.05, 0.2, 0.8)]
    means = [s.mean for s in scores]
    assert 0 < means[0] < means[1] < means[2], means
    assert all(s.p99 > s.mean for s in scores)
    assert scores[0].top1 > scores[2].top1 and scores[2].top1 < 1.0


def test_the_reference_survives_saving_and_loading(tiny, stream, tmp_path):
    reference = _reference(tiny, stream)
    reference.save(tmp_path / "ref.safetensors")
    loaded = kld.Reference.load(tmp_path / "ref.safetensors")
    assert len(loaded.windows) == WINDOWS
    model = _perturbed(tiny, 0.2)
    assert evaluate.score(model, stream, reference=loaded) == evaluate.score(model, stream, reference=reference)
    positions = WINDOWS * (stream.window_length - 1)
    per_position = (tmp_path / "ref.safetensors").stat().st_size / positions
    assert per_position == pytest.approx(2 * (kld.TOP_K * 8) + 4, rel=0.01)  # what the docs say it costs


def test_the_same_stream_makes_the_same_reference(tiny, stream):
    first, second = _reference(tiny, stream), _reference(tiny, stream)
    for a, b in zip(first.windows, second.windows, strict=True):
        assert all((a[k] == b[k]).all() for k in kld.KEYS)


def test_kld_is_published_falls_as_bits_rise_and_the_gate_can_refuse_on_it(qf, tiny, tmp_path, round_engine):
    """Quants that keep 2 and 7 mantissa bits: each row carries its divergence (--json, manifest, card); a later job
    reuses FP16's reference and refuses the coarser one on `max_kld` with both numbers."""
    import json

    recipe = tmp_path / "round.yaml"
    recipe.write_text("round: {mantissa: [2, 7]}\n")
    result = qf("run", tiny, "--recipe", recipe, "--eval-windows", 1, "--json")
    assert result.exit_code == 0, result.output
    rows = {row["tag"]: row for row in qf.json("ls")}
    coarse, fine = rows["round-m2"], rows["round-m7"]
    assert coarse["kld"] > fine["kld"] > 0 and coarse["kld_p99"] > coarse["kld"]
    assert coarse["top1"] < fine["top1"] <= 1
    folder = qf.home / "registry" / coarse["path"]
    manifest = json.loads((folder / "manifest.json").read_text())["eval"]
    assert {k: manifest[k] for k in ("kld", "kld_p99", "top1")} == {k: coarse[k] for k in ("kld", "kld_p99", "top1")}
    card_line = next(line for line in (folder / "README.md").read_text().splitlines() if "`tiny:round-m2`" in line)
    assert f"| {coarse['kld']:.4f} | {coarse['top1'] * 100:.1f}% |" in card_line
    assert len(list((qf.home / "references").iterdir())) == 1

    limit = coarse["kld"] / 2
    recipe.write_text(f"round: {{mantissa: [2]}}\nmax_kld: {limit}\n")
    result = qf("run", tiny, "--recipe", recipe, "--eval-windows", 1, "--calibration", "builtin:code", "--json")
    assert result.exit_code == 1, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    reused = [e["message"] for e in events if e["event"] == "note" and "reused" in e["message"]]
    assert any("FP16 perplexity" in m for m in reused), reused
    [scored] = [e for e in events if e["event"] == "evaluation" and e["subject"] == "round-m2"]
    assert scored["kld"] == pytest.approx(coarse["kld"], rel=1e-6)  # the same reference, the same positions
    message = (
        f"quality gate refused round-m2: KL divergence from FP16 {scored['kld']:.4g}, allowed at most "
        f"{limit:g} (max_kld)"
    )
    assert result.stderr.strip().splitlines()[-1] == f"error: {message}"
