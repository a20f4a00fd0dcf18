"""The EXL3 engine's CPU-side logic: its parser on output recorded from a real conversion on the H200
(tests/fixtures/convert_exl3_tiny.log: the 4-layer 256-wide tiny Llama at 4.0 bpw through `qf run --exl3`), its
resume rule, output checks, calibration file, names, and the models it refuses at submit."""

from __future__ import annotations

import glob
import json
import shutil
import sys
import threading
import types
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from factory import engines, settings
from factory.engines.exl3 import compat
from factory.engines.exl3 import engine as exl3
from factory.engines.exl3.spec import Exl3Spec
from factory.errors import JobFailed, ModelRefused, SpecError
from factory.factory import Factory
from factory.jobs.planning import Request
from factory.publish import hub
from factory.recipes import build_recipe
from factory.registry import naming
from tests.support import FIXTURES


def test_conversion_transcript_becomes_one_event_per_module():
    parse = exl3._parser(modules=4 + 3)
    events = [e for e in map(parse, (FIXTURES / "convert_exl3_tiny.log").read_text().splitlines(True)) if e]
    done = [e for e in events if "done" in e]
    assert [e["module"] for e in done] == [
        "model.embed_tokens",
        *(f"model.layers.{i}" for i in range(4)),
        "model.norm",
        "lm_head",
    ]
    assert [e["done"] for e in done] == list(range(1, 8)) and {e["total"] for e in done} == {7}
    etas = [e["eta"] for e in events if "eta" in e]
    assert etas[0] == "warming up (1/3 timed blocks)" and etas[-1] == "< 1 minute"
    assert events[-1] == {"event": "progress", "peak_gpu_bytes": 813491200}
    assert parse.errors == []


def test_a_refused_argument_is_a_failed_step_not_a_silent_success():
    parse = exl3._parser(modules=7)
    assert parse(" !! Error: --bits must be between 1 and 8\n") is None
    assert parse.errors == ["--bits must be between 1 and 8"]


def test_resume_only_a_job_that_parses(tmp_path):
    work = tmp_path / "convert"
    assert exl3._resume_or_wipe(work) == [] and work.is_dir()
    (work / "ckpt").mkdir()
    (work / "args.json").write_text(json.dumps({"bits": 4.0}))
    (work / "ckpt" / "job.json").write_text(json.dumps({"next_module_idx": 3}))
    assert exl3._resume_or_wipe(work) == ["-r"]
    (work / "ckpt" / "job.json").write_text('{"next_module_idx": 3')  # torn by a kill
    (work / "qtensors").mkdir()
    assert exl3._resume_or_wipe(work) == [] and list(work.iterdir()) == []  # started over, nothing stale left


def _quant(tmp_path: Path, qc: dict | None, finished: bool = True) -> Path:
    out = tmp_path / "out"
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"x")
    (out / "config.json").write_text(json.dumps({"quantization_config": qc} if qc else {}))
    if finished:
        (out / "quantization_config.json").write_text("{}")
    return out


@pytest.mark.parametrize(
    "qc, finished, problem",
    [
        ({"quant_method": "exl3", "bits": 4.12, "head_bits": 6}, True, None),
        ({"quant_method": "exl3", "bits": 4.0, "head_bits": 6}, True, None),
        ({"quant_method": "exl3", "bits": 3.0, "head_bits": 6}, True, "reached 3.0 bits per weight, not the 4.0"),
        ({"quant_method": "exl3", "bits": 4.0, "head_bits": 8}, True, "does not match the spec"),
        ({"quant_method": "exl2", "bits": 4.0, "head_bits": 6}, True, "does not match the spec"),
        (None, True, "wrote no quantization_config"),
        ({"quant_method": "exl3", "bits": 4.0, "head_bits": 6}, False, "did not finish writing"),
    ],
)
def test_outputs_are_checked(tmp_path, qc, finished, problem):
    out = _quant(tmp_path, qc, finished)
    spec = Exl3Spec(bpw=4.0)
    if problem is None:
        exl3.check_output(out, spec, tmp_path / "engine.log")
    else:
        with pytest.raises(JobFailed, match=problem):
            exl3.check_output(out, spec, tmp_path / "engine.log")


def test_calibration_is_the_jobs_token_rows_in_exllamav3s_format(tmp_path):
    rows = [[1, 2, 3, 4], [5, 6, 7, 8]]
    path = exl3.write_calibration(rows, tmp_path / "cal.safetensors")
    tensors = load_file(str(path))
    assert list(tensors) == ["input_ids"] and tensors["input_ids"].dtype.name == "int64"
    assert tensors["input_ids"].tolist() == rows


@pytest.mark.parametrize(
    "bpw, head, tag",
    [(4.0, 6, "exl3-4.0bpw"), (3.0, 8, "exl3-3.0bpw-h8"), (1.0, 6, "exl3-1.0bpw"), (2.25, 16, "exl3-2.25bpw-h16")],
)
def test_tags(bpw, head, tag):
    assert Exl3Spec(bpw=bpw, head_bits=head).tag == tag
    assert naming.parse(f"gemma-3-270m:{tag}").tag == tag
    assert engines.of_tag(tag).name == "exl3"
    place = hub.place("alice", "gemma-3-270m", tag, hub.templates({}))
    assert place.repo == "alice/gemma-3-270m-exl3" and engines.get("exl3").card.tag_of_branch(place.branch) == tag


@pytest.mark.parametrize("bpw", [0.5, 8.5])
def test_bits_refused(bpw):
    with pytest.raises(SpecError) as e:
        build_recipe(exl3=str(bpw))
    assert e.value.message == f"bpw {bpw} is outside [1.0, 8.0]"


def test_head_bits_refused():
    with pytest.raises(SpecError, match="use one of 1, 2, 3, 4, 5, 6, 7, 8, 16"):
        Exl3Spec(bpw=4.0, head_bits=10)


def test_calibration_rows_follow_the_text():
    engine = engines.get("exl3")
    assert engine.fit_calibration(Exl3Spec(bpw=4.0), 10**7, "cuda").rows == 250  # exllamav3's default
    assert engine.fit_calibration(Exl3Spec(bpw=4.0), 300_000, "cuda").rows == 146  # all the text has
    assert engine.fit_calibration(Exl3Spec(bpw=4.0, rows=20), 300_000, "cuda").rows == 20  # what the recipe says


@pytest.fixture
def factory(tmp_path, db_url, monkeypatch):
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FACTORY_DB_URL", db_url)
    return Factory(settings.load())


@pytest.fixture
def gemma3(tmp_path, tiny):
    """The tiny model as a text-only Gemma 3 checkpoint names itself (Gemma3ForCausalLM)."""
    folder = tmp_path / "gemma3"
    shutil.copytree(tiny, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma3ForCausalLM"]}))
    return folder


def test_a_hidden_size_exllamav3_cannot_pad_is_refused_at_submit(factory, tiny192):
    """exllamav3 1.6.5 pads to multiples of 128 and its MLP keeps the padding: SmolLM2 (576) fails at layer 0 on
    the H200; here the 192-wide tiny model, for the workers (FACTORY_WORKER_DEVICE=cuda), before any job exists."""
    request = Request(source=str(tiny192), recipe=build_recipe(exl3="4.0"), asked={"exl3"}, device="cuda")
    with pytest.raises(ModelRefused) as e:
        factory.submit(request)
    assert e.value.message == (
        "EXL3 cannot convert a model whose hidden size (192) is not a multiple of 128: "
        "exllamav3 pads it and its MLP does not crop the padding back"
    )
    assert e.value.exit_code == 3 and factory.catalog.jobs.states() == {}


def test_each_engine_says_which_architectures_it_takes(factory, gemma3):
    with pytest.raises(ModelRefused, match="^AWQ does not convert Gemma3ForCausalLM; it converts CohereForCausalLM, "):
        factory.submit(Request(source=str(gemma3), recipe=build_recipe(awq=True, exl3="4.0"), device="cuda"))
    job, created = factory.submit(Request(source=str(gemma3), recipe=build_recipe(exl3="4.0"), device="cuda"))
    assert created and [s.method for s in job.specs] == ["exl3"]


def test_no_cuda_is_one_sentence(qf, tiny):
    result = qf("run", tiny, "--exl3", "4.0")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: EXL3 (--exl3) needs a CUDA GPU and this machine has "
        "none; AWQ runs without one (--awq), AWQ-CT runs without "
        "one (--awqct), GGUF runs without one (--gguf)"
    )


def test_text_only_gemma3_sources_are_read_with_exllamav3s_dotted_names(tmp_path, tiny, gemma3):
    """exllamav3 1.6.5 asks a text-only Gemma 3 folder for `.model.…` (factory/engines/exl3/compat.py): its FP16
    source and its EXL3 quants are read renamed, other models as they are."""
    assert compat.needs_dots(gemma3) and not compat.needs_dots(tiny)
    header = {
        "model.embed_tokens.weight": {"dtype": "F16"},
        "lm_head.weight": {},
        ".model.norm.weight": {},
        "_header_offset": 8,
    }
    assert compat.dotted(header) == {
        ".model.embed_tokens.weight": {"dtype": "F16"},
        "lm_head.weight": {},
        ".model.norm.weight": {},
        "_header_offset": 8,
    }
    qtensors = tmp_path / "qtensors"  # what its conversion saves per module, hidden files for Gemma 3
    qtensors.mkdir()
    for name in (".model.layers.0.safetensors", "lm_head.safetensors"):
        (qtensors / name).write_bytes(b"")
    found = compat.WITH_HIDDEN.glob(str(qtensors / "*.safetensors"))
    assert sorted(Path(f).name for f in found) == [".model.layers.0.safetensors", "lm_head.safetensors"]


def test_a_model_read_beside_a_gemma3_one_keeps_its_names(tiny, gemma3, monkeypatch):
    """compat.reading renames exllamav3's loader module-wide: a second thread's reading waits for the first to end,
    so a model read beside a Gemma 3 one is not asked for `.model.…` names (benchmarks/coverage.py re-scores pulled
    quants in threads of one process)."""
    loader = types.ModuleType("exllamav3.loader")
    loader.safetensors = types.SimpleNamespace(read_header=lambda filename, fixes: {"model.norm.weight": {}}, glob=glob)
    monkeypatch.setitem(sys.modules, "exllamav3", types.ModuleType("exllamav3"))
    monkeypatch.setitem(sys.modules, "exllamav3.loader", loader)
    entered, read = threading.Event(), []

    def beside():
        with compat.reading(tiny):
            entered.set()
            read.append(loader.safetensors.read_header("model.safetensors", None))

    with compat.reading(gemma3):
        assert loader.safetensors.read_header("model.safetensors", None) == {".model.norm.weight": {}}
        thread = threading.Thread(target=beside)
        thread.start()
        assert not entered.wait(0.5), "a second reading ran inside the first"
    thread.join(10)
    assert read == [{"model.norm.weight": {}}]


def test_the_card_says_how_exllamav3_names_a_gemma3_quant(tiny, gemma3):
    from factory.publish import card
    from tests.support.quant_rows import quant_row

    engine = engines.get("exl3")
    assert "exllamav3 1.6.5 loads it as it is" in engine.card.load_note(gemma3)
    assert engine.card.load_note(tiny) is None
    row = quant_row("gemma3:exl3-4.0bpw", load_note=engine.card.load_note(gemma3))
    assert card._how_to_load(row).endswith(f"```\n\n{engine.card.load_note(gemma3)}\n")


def test_a_quant_without_its_layers_is_refused(tmp_path, tiny):
    """exllamav3 1.6.5 wrote Gemma 3 quants without a single layer and exited 0 (compat.py): the output check weighs
    the decoder layers against the source's linear weights at the bits asked."""
    import torch
    from safetensors.torch import save_file

    from factory.checkpoints import files, sources
    from factory.vram import Params, Shape

    config, tensors = sources.layout(str(tiny))
    staged = files.stage(tiny, tmp_path / "staged")  # what the engine is given: links to the source's files
    linear = Params.of(tensors, Shape.of(config)).linear
    spec = Exl3Spec(bpw=4.0)
    qc = {"quant_method": "exl3", "bits": 4.0, "head_bits": 6}
    out = _quant(tmp_path / "whole", qc, True)
    save_file(
        {
            ".model.embed_tokens.weight": torch.zeros(8, 8, dtype=torch.float16),
            ".model.layers.0.mlp.down_proj.trellis": torch.zeros(int(linear * 4.0 / 8) // 2, dtype=torch.int16),
        },
        str(out / "model.safetensors"),
    )
    exl3.check_output(out, spec, tmp_path / "engine.log", staged)
    empty = _quant(tmp_path / "empty", qc, True)
    save_file({".model.embed_tokens.weight": torch.zeros(8, 8, dtype=torch.float16)}, str(empty / "model.safetensors"))
    with pytest.raises(JobFailed, match="of decoder layers where 4.0 bpw takes about .*: the quant is incomplete"):
        exl3.check_output(empty, spec, tmp_path / "engine.log", staged)
