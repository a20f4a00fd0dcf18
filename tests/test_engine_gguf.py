"""The GGUF engine (llama.cpp's converter, llama-imatrix and llama-quantize at the pinned version), for real: `qf run
--gguf` end to end on the tiny Llama, the pulled file scored again through llama.cpp to the published numbers,
llama.cpp's tokenizer against the source's, `qf plan`'s sizes, the type names against llama-quantize's own list,
the architectures against the converter's registrations, a tool that fails, a converter killed mid-way, a machine
without the build, and the parsers of the tools' lines."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import psutil
import pytest

from calibration import builtin_text
from factory import engines, settings
from factory.engines.gguf import engine as gguf_engine
from factory.engines.gguf import evaluate as gguf_evaluate
from factory.engines.gguf import gguf_file, llama
from factory.engines.gguf.spec import TYPES
from factory.errors import JobFailed
from factory.evaluation import evaluate
from factory.jobs.planning import Request
from factory.pipeline import Factory
from factory.recipes import build_recipe

ENGINE = engines.get("gguf")


def stream(source, windows: int) -> evaluate.Stream:
    ids = evaluate.tokenize(source, builtin_text("wiki"), windows * evaluate.WINDOW)
    return evaluate.stream(ids, windows, None, "wiki")


def rescored(folder, source, windows: int) -> float:
    """The perplexity llama.cpp gives the .gguf in `folder` on the job's windows."""
    return evaluate.evaluate(folder, ENGINE.load, ENGINE.evaluator, stream(source, windows)).ppl


@pytest.fixture(scope="module")
def tiny_gguf(tiny, tmp_path_factory):
    """`qf run tiny --gguf Q8_0,Q4_K_M,IQ4_XS` with a small importance matrix, scored on 2 windows."""
    from tests.conftest import Qf, fresh_database

    with fresh_database() as url:
        qf = Qf(home=tmp_path_factory.mktemp("gguf") / "home", db_url=url)
        recipe = tmp_path_factory.mktemp("recipe") / "gguf.yaml"
        recipe.write_text("gguf:\n  imatrix_chunks: 8\n  imatrix_ctx: 256\neval: builtin:wiki\nmax_ppl_ratio: 1.5\n")
        result = qf("run", tiny, "--recipe", recipe, "--gguf", "Q8_0,Q4_K_M,IQ4_XS", "--eval-windows", 2, "--json")
        assert result.exit_code == 0, result.output
        rows = {row["name"]: row for row in qf.json("ls")}
        for name, row in rows.items():
            print(f"{name}: {row['bytes']} bytes, ppl {row['ppl']:.4f} ({row['fp16_ppl']:.4f}), KLD {row['kld']:.6f}")
        yield qf, rows


def test_qf_run_converts_once_quantizes_each_type_scores_and_publishes(tiny_gguf):
    qf, rows = tiny_gguf
    assert set(rows) == {"tiny:gguf-q8_0", "tiny:gguf-q4_k_m", "tiny:gguf-iq4_xs"}
    for row in rows.values():
        assert row["method"] == "gguf" and row["fp16_ppl"] <= row["ppl"] * 1.01 < 1.5 * row["fp16_ppl"]
        assert -1e-4 < row["kld"] < 0.5 and 0.5 < row["top1"] <= 1  # the compact reference's estimate: about 0 at Q8_0
    q8, q4 = rows["tiny:gguf-q8_0"], rows["tiny:gguf-q4_k_m"]
    assert q8["kld"] < q4["kld"] and q8["bytes"] > q4["bytes"]
    steps = [s["name"] for s in qf.json("status", q8["job"])["steps"]]
    assert len([s for s in steps if s.startswith("measure:")]) == 1  # the conversion and imatrix, shared
    assert {"quantize:gguf-q8_0", "quantize:gguf-iq4_xs", "evaluate:gguf-q4_k_m", "publish:gguf-q4_k_m"} <= set(steps)


def test_the_pulled_file_is_named_as_uploaders_do_and_llama_cpp_scores_it_to_the_published_numbers(
    tiny_gguf, tiny, tmp_path
):
    qf, rows = tiny_gguf
    result = qf("pull", "tiny:gguf-q4_k_m", "-o", tmp_path / "pulled")
    assert result.exit_code == 0, result.output
    pulled = tmp_path / "pulled"
    assert {"tiny-Q4_K_M.gguf", "tiny-imatrix.gguf"} <= {p.name for p in pulled.iterdir()}
    meta = gguf_file.metadata(pulled / "tiny-Q4_K_M.gguf")
    assert meta["general.file_type"] == TYPES["Q4_K_M"][1] and meta["general.architecture"] == "llama"
    assert rescored(pulled, tiny, 2) == pytest.approx(rows["tiny:gguf-q4_k_m"]["ppl"], rel=1e-5)
    card = (pulled / "README.md").read_text()
    assert "| `tiny-Q4_K_M.gguf` | Q4_K_M |" in card and "ollama run hf.co/" in card


def test_qf_plan_sizes_each_type_with_its_kv_cache(tiny_gguf, tiny):
    """Weights at the type's bits (the tiny model's Q8_0 file, its vocabulary included, within 10%), the f16 KV cache
    for the context exactly (2 layers x 2048 tokens x 2 KV heads x 32 x K and V x 2 bytes)."""
    qf, rows = tiny_gguf
    plan = qf.json("plan", tiny, "--engine", "gguf", "--vram", "1GB", "--ctx", 2048)["gguf"]
    by_type = {r["type"]: r for r in plan["rows"]}
    made = qf.home / "registry" / rows["tiny:gguf-q8_0"]["path"] / "tiny-Q8_0.gguf"
    assert by_type["Q8_0"]["weights"] == pytest.approx(made.stat().st_size, rel=0.1)
    assert by_type["Q8_0"]["cache"] == 2 * 2048 * 2 * 32 * 2 * 2
    assert by_type["Q8_0"]["weights"] > by_type["Q4_K_M"]["weights"] > by_type["IQ4_XS"]["weights"]
    assert plan["best_type"] == "F16"


def test_every_type_goes_on_the_hub_repos_main_as_uploaders_publish(qf, tiny, hub, monkeypatch, tmp_path):
    monkeypatch.setenv("FACTORY_HUB_OWNER", "alice")
    monkeypatch.setenv("HF_TOKEN", "hf_alice_write")
    recipe = tmp_path / "gguf.yaml"
    recipe.write_text("gguf:\n  types: [Q8_0, Q4_K_M]\n  imatrix_chunks: 4\n  imatrix_ctx: 256\n")
    result = qf("run", tiny, "--recipe", recipe, "--eval-windows", 1)
    assert result.exit_code == 0, result.output
    main = hub.files("alice/tiny-GGUF", "main")
    assert {"tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf", "tiny-imatrix.gguf", "README.md"} <= set(main)
    assert main["tiny-Q4_K_M.gguf"] == hub.files("alice/tiny-GGUF", "q4_k_m")["tiny-Q4_K_M.gguf"]
    text = main["README.md"].decode()
    assert "| `tiny-Q8_0.gguf` | Q8_0 |" in text and "| `tiny-Q4_K_M.gguf` | Q4_K_M |" in text
    assert "`ollama run hf.co/<this repository>:<TYPE>`" in text


def test_llama_cpp_tokenizes_the_eval_text_as_the_source_tokenizer_does(tiny_gguf, tiny, tmp_path):
    """The windows are the source tokenizer's ids; llama.cpp reads them as given, and its own vocabulary (the file's)
    gives the same ids for the same text."""
    qf, _ = tiny_gguf
    assert qf("pull", "tiny:gguf-q8_0", "-o", tmp_path / "q8").exit_code == 0
    text = builtin_text("wiki")[:20000]
    assert gguf_evaluate.tokenize(tmp_path / "q8" / "tiny-Q8_0.gguf", text) == evaluate.tokenize(tiny, text)


def test_every_type_is_one_llama_quantize_knows():
    done = subprocess.run([str(llama.tool("llama-quantize")), "--help"], capture_output=True, text=True)
    listed = set(re.findall(r"^\s+\d+\s+or\s+(\S+)\s+:", done.stdout + done.stderr, re.MULTILINE))
    assert set(TYPES) <= listed, sorted(set(TYPES) - listed)


def test_an_unknown_type_is_refused_at_submit_with_the_known_ones(qf, tiny):
    result = qf("run", tiny, "--gguf", "Q4_KM")
    assert result.exit_code == 2
    assert "GGUF type 'Q4_KM' is not one of llama-quantize's: F16, BF16, Q8_0" in result.output


def test_without_the_build_a_job_is_refused_naming_the_setup_command(qf, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))
    result = qf("run", tiny, "--gguf", "Q4_K_M")
    assert result.exit_code == 2
    assert f"GGUF needs llama.cpp built on this machine ({llama.folder()} is missing); run: {llama.SETUP}" in (
        result.output.replace("\n", " ")
    )


def test_each_architecture_is_one_the_converter_registers():
    registered = set()
    for path in (llama.source() / "conversion").glob("*.py"):
        for call in re.findall(r"register\(([^)]*)\)", path.read_text()):
            registered.update(re.findall(r'"(\w+)"', call))
    assert gguf_engine.ARCHITECTURES <= registered, sorted(gguf_engine.ARCHITECTURES - registered)


def test_a_tool_that_fails_fails_the_unit_with_its_last_line(tmp_path):
    broken = tmp_path / "broken.f16.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64)
    imatrix = tmp_path / "broken.imatrix.gguf"
    imatrix.write_bytes(broken.read_bytes())
    measurement = tmp_path / "broken.json"
    measurement.write_text('{"f16": "broken.f16.gguf", "imatrix": "broken.imatrix.gguf"}')
    request = engines.QuantizeRequest(
        source_dir=tmp_path, out_dir=tmp_path / "out", work_dir=tmp_path / "work", spec={"type": "Q4_K_M"}
    )
    request.measurement = measurement
    with pytest.raises(JobFailed, match=r"GGUF quantization to Q4_K_M failed: .*\(exit 1; log: .*engine.log\)"):
        ENGINE.quantize(request, lambda event: None)


def test_a_killed_converter_fails_the_shared_unit_and_the_job_runs_again(tiny, tmp_path, db_url, monkeypatch):
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FACTORY_DB_URL", db_url)
    monkeypatch.setenv("FACTORY_MAX_UNITS", "1")
    killed = []

    def kill_the_converter(event):
        if event["event"] == "progress" and event.get("stage") == "convert" and not killed:
            for child in psutil.Process().children():
                os.kill(child.pid, signal.SIGKILL)
                killed.append(child.pid)

    factory = Factory(settings.load(), kill_the_converter)
    recipe = build_recipe(gguf="Q8_0", eval_windows=1)
    job, _ = factory.submit(Request(source=str(tiny), recipe=recipe))
    with pytest.raises(JobFailed, match=r"GGUF conversion to f16 failed: the engine process was killed by SIGKILL"):
        factory.execute(job.id)
    assert killed and factory.catalog.quants.live() == []
    failed = factory.catalog.jobs.get(job.id)
    assert [s.state for s in failed.steps if s.name.startswith("measure:")] == ["failed"]
    done = factory.execute(job.id)
    assert done.state == "succeeded" and [q.tag for q in factory.catalog.quants.live()] == ["gguf-q8_0"]


# Lines the pinned tools print (recorded from the tiny model's run), and the events they become.
TRANSCRIPT = [
    ("INFO:hf-to-gguf:blk.1.attn_q.weight,       torch.float32 --> F16, shape = {128, 128}", "convert", 2, 2),
    ("compute_imatrix: computing over 8 chunks, n_ctx=256, batch_size=256, n_seq=1", "imatrix", 0, 8),
    (
        "[   3/  21]                  blk.0.attn_k.weight - [  128,    64,     1,     1], type =    f16, ",
        "quantize",
        3,
        21,
    ),
]


@pytest.mark.parametrize(("line", "stage", "done", "total"), TRANSCRIPT)
def test_the_tools_lines_become_progress_events(line, stage, done, total):
    parse = {
        "convert": gguf_engine._converter_parser(2),
        "imatrix": gguf_engine._imatrix_parser,
        "quantize": gguf_engine._quantize_parser,
    }[stage]
    event = parse(line)
    assert (event["stage"], event["done"], event["total"]) == (stage, done, total)
    assert parse("llama_model_loader: - kv   0: general.architecture str = llama") is None
