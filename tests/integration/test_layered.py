"""Scoring a model layer by layer (factory/evaluation/layered.py) gives what the whole model gives, for the FP16 source
and for AWQ's dequantized weights."""

from __future__ import annotations

import pytest

from factory.evaluation import evaluate, kld
from factory.evaluation.layered import ByLayer

WINDOWS = 3


@pytest.fixture(scope="module")
def stream(tiny):
    from calibration import builtin_text

    return evaluate.stream(evaluate.tokenize(tiny, builtin_text("wiki")), WINDOWS, 512, "builtin:wiki")


def _whole(folder):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return evaluate.transformers_logits(model, "cpu")


def test_the_source_is_walked_layer_by_layer_and_scores_as_the_whole_model(tiny, stream):
    model = evaluate.load_fp16(tiny, "cpu")
    assert isinstance(model, ByLayer)
    seen = []
    reference = kld.Reference()
    ppl, _ = evaluate.score(model, stream, lambda done, total, unit: seen.append((done, total, unit)), keep=reference)
    whole, divergence = evaluate.score(_whole(tiny), stream, reference=reference)
    assert ppl == pytest.approx(whole, rel=1e-5)
    assert divergence.mean == pytest.approx(0, abs=1e-5) and divergence.top1 == 1.0
    assert seen == [(1, 2, "layer"), (2, 2, "layer"), *((w, WINDOWS, "window") for w in range(1, WINDOWS + 1))]


def test_a_tied_head_is_read_from_the_embedding(tiny, tmp_path, stream):
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    tied = tmp_path / "tied"
    shutil.copytree(tiny, tied)
    tensors = load_file(tied / "model.safetensors")
    tensors["model.embed_tokens.weight"] = tensors.pop("lm_head.weight").clone()
    save_file(tensors, tied / "model.safetensors")
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    ppl = evaluate.perplexity(evaluate.load_fp16(tied, "cpu"), stream)
    assert ppl == pytest.approx(evaluate.perplexity(_whole(tied), stream), rel=1e-5)
    assert torch.isfinite(torch.tensor(ppl))


def test_an_awq_quant_is_unpacked_layer_by_layer_and_scores_as_the_whole_model(finished, stream):
    from factory.engines.awq import evaluate as awq

    qf, _ = finished
    [row] = qf.json("ls")
    folder = qf.home / "registry" / row["path"]
    model = awq.load(folder, "cpu")
    assert isinstance(model, ByLayer)
    ppl = evaluate.perplexity(model, stream)
    assert ppl == pytest.approx(evaluate.perplexity(awq.load_whole(folder, "cpu"), stream), rel=1e-5)
