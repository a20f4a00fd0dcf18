"""The tiny checkpoints the EXL3 coverage runs (benchmarks/coverage.py) are read by exllamav3 as its users' releases
are (issue 48), on the CPU: exllamav3's own Config, Model and Tokenizer classes read each one
(tests/support/exl3_reads.py, in a child process), and the calibration ids the factory makes from the checkpoint's
own tokenizer are ids exllamav3's conversion takes (below its tokenizer's vocabulary and the model's). A tokenizer
whose ids pass the model's vocabulary is refused before any engine runs.

CHECKED are the families whose checkpoints or tokens were once written otherwise; QF_COVERAGE=all checks every
family EXL3 claims (34: 8 minutes on 2 shared cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import calibration
from benchmarks import coverage
from factory import engines
from factory.evaluation import evaluate
from tests.support import ROOT
from tests.support.qf import Qf
from tests.support.tiny_archs import make_tiny
from tests.support.tiny_model import make_tiny_llama, make_tiny_tokenizer
from tests.support.tiny_vlms import FAMILIES, make_tiny_vlm

WIDTH = coverage.WIDTH["exl3"]
# Qwen2: transformers' AutoTokenizer gave ids past the vocabulary; the others' configs said other keys than releases
CHECKED = {"qwen2", "qwen3_moe", "exaone4", "nemotron_h", "qwen3_next"}
CLAIMED = [t for t in coverage.CANDIDATES["exl3"] if coverage.architecture(t) in engines.get("exl3").architectures]
FAMILIES_TRIED = [t for t in CLAIMED if t in CHECKED or os.environ.get("QF_COVERAGE") == "all"]


def _exllamav3_reads(folder: Path) -> dict:
    run = subprocess.run(
        [sys.executable, "-m", "tests.support.exl3_reads", str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("model_type", FAMILIES_TRIED)
def test_exllamav3_reads_the_tiny_checkpoint_and_takes_its_calibration(model_type, tmp_path):
    make = make_tiny_vlm if model_type in FAMILIES else make_tiny
    source = make(model_type, tmp_path / model_type, hidden=WIDTH)
    read = _exllamav3_reads(source)
    ids = evaluate.tokenize(source, calibration.builtin_text("mix"))
    assert max(ids) < min(read["tokenizer_vocab"], read["vocab_size"]), (max(ids), read)


def test_calibration_ids_are_the_checkpoints_own_tokenizers(tmp_path):
    """A Qwen2 checkpoint's ids are its tokenizer.json's, as exllamav3 reads them, not those of the tokenizer
    transformers' AutoTokenizer rebuilds for the model type (its own pre-tokenizer, and `<|endoftext|>` added past
    the vocabulary)."""
    from tokenizers import Tokenizer

    source = make_tiny("qwen2", tmp_path / "qwen2", hidden=WIDTH)
    text = calibration.builtin_text("mix")
    own = Tokenizer.from_file(str(source / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert evaluate.tokenize(source, text) == own
    assert max(own) < json.loads((source / "config.json").read_text())["vocab_size"]


def test_a_tokenizer_past_the_models_vocabulary_is_refused(tmp_path):
    """A checkpoint whose tokenizer has more tokens than the model's embedding rows: exit 3, one sentence, before
    any engine runs."""
    source = make_tiny_llama(tmp_path / "mismatched", vocab=512)
    make_tiny_tokenizer(source, 1024)
    qf = Qf(home=tmp_path / "home")
    result = qf("run", source, "--awq", "--eval-windows", 1)
    assert result.exit_code == 3, result.output
    assert "past the model's vocabulary of 512 (config.json vocab_size)" in result.output
    assert not list((tmp_path / "home" / "work").rglob("engine.log")), "no engine ran"
    assert qf.registry_files() == []
