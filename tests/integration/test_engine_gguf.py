"""The GGUF engine (llama.cpp's converter, llama-imatrix and llama-quantize at the pinned version), for real: `qf run
--gguf` end to end on the tiny Llama, the pulled file scored again through llama.cpp to the published numbers,
llama.cpp's tokenizer against the source's, `qf plan`'s sizes, the type names against llama-quantize's own list,
the architectures against the converter's registrations, a tool that fails, a converter killed mid-way, a machine
without the build, and the parsers of the tools' lines."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from calibration import builtin_text
from factory import engines, settings
from factory.checkpoints.inspection import inspect
from factory.engines.gguf import engine as gguf_engine
from factory.engines.gguf import evaluate as gguf_evaluate
from factory.engines.gguf import gguf_file, llama
from factory.engines.gguf import memory as gguf_memory
from factory.engines.gguf.spec import LADDER, TYPES
from factory.errors import JobFailed
from factory.evaluation import evaluate
from factory.factory import Factory
from factory.jobs.planning import Request
from factory.recipes import build_recipe
from factory.vram import Params, Shape
from tests.support import processes
from tests.support.llama_buffers import allocated
from tests.support.tiny_vlms import make_tiny_vlm

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
    from tests.support.qf import Qf, fresh_database

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
    assert [s.split(":")[0] for s in steps if s.startswith(("convert:", "imatrix:"))] == ["convert", "imatrix"]
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
    assert "| `tiny-Q4_K_M.gguf` | Q4_K_M |" in card
    # a registry folder's card names no Hub repo: ollama runs the file through a Modelfile
    assert "hf.co/" not in card and "`FROM ./<file>.gguf` in `Modelfile`" in card
    assert "## Images in llama.cpp" not in card and not list(pulled.glob("mmproj-*"))  # a text model: no projector
    # what fits which RAM or VRAM: the tiny model holds its 4096 positions in 4 GB with either cache
    assert "## Fits in" in card and "| Q4_K_M | 4,096 | 4,096 |" in card, card


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
    assert plan["best_type"] == "Q8_0"  # the best of the ladder --fit chooses from (F16 is not a quant)


@pytest.mark.parametrize("ctx", [256, 2048])
def test_the_memory_model_holds_what_llama_cpp_allocates(tiny_gguf, tiny, tmp_path, ctx):
    """qf plan's KV cache is llama.cpp's KV buffer to the byte, its weights the model buffer within 10% (an estimate
    from the FP16 checkpoint's tensors), its compute buffer within 10% (SmolLM2's, a real vocabulary, in
    tests/integration/test_smollm2.py)."""
    qf, rows = tiny_gguf
    plan = qf.json("plan", tiny, "--engine", "gguf", "--vram", "1GB", "--ctx", ctx)["gguf"]
    predicted = next(r for r in plan["rows"] if r["type"] == "Q8_0")
    made = allocated(qf.home / "registry" / rows["tiny:gguf-q8_0"]["path"] / "tiny-Q8_0.gguf", ctx, tmp_path)
    print(f"ctx {ctx}: predicted {predicted}, llama.cpp allocated {made}")
    rounding = 0.006 * 2**20  # the log prints MiB to two decimals (0.125 as 0.12)
    assert abs(predicted["cache"] - made["cache"]) <= rounding
    assert predicted["weights"] == pytest.approx(made["weights"], rel=0.1)
    assert predicted["compute"] == pytest.approx(made["compute"], rel=0.1)


def test_fit_picks_the_best_type_for_a_budget_and_reuses_the_conversion_on_another_calibration(tiny_gguf, tiny):
    """`--gguf fit --fit 1GB`: Q8_0 fits the tiny model (the top of the ladder); 520MB does not hold even the smallest
    type beside the 512 MiB left free (exit 2, one sentence); `--gguf fit` alone is refused. Its other calibration
    makes a new importance matrix from the 16-bit GGUF the first job converted (keyed without the calibration)."""
    qf, _ = tiny_gguf
    too_small = qf("run", tiny, "--gguf", "fit", "--fit", "520MB")
    assert too_small.exit_code == 2 and "--fit 520MB: no GGUF type fits 520 MiB with 4096 tokens" in (
        too_small.output.replace("\n", " ")
    ), too_small.output
    alone = qf("run", tiny, "--gguf", "fit")
    assert alone.exit_code == 2 and "--gguf fit takes its types from --fit's budgets" in alone.output
    recipe = qf.home.parent / "fit.yaml"
    recipe.write_text("gguf:\n  imatrix_chunks: 8\n  imatrix_ctx: 256\n")
    result = qf(
        "run", tiny, "--recipe", recipe, "--gguf", "fit", "--fit", "1GB", "--calibration", "builtin:code",
        "--eval-windows", 2, "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    notes = [json.loads(line).get("message", "") for line in result.stdout.splitlines()]
    assert "--fit 1GB: GGUF Q8_0 for 4096 tokens with a fp16 cache" in result.stderr
    assert any(n.startswith("reusing GGUF 16-bit conversion ") for n in notes), notes
    job = json.loads(result.stdout.splitlines()[-1])
    steps = [s["name"] for s in qf.json("status", job["job"])["steps"]]
    assert [s.split(":")[0] for s in steps if s.startswith(("convert:", "imatrix:"))] == ["imatrix"]
    assert [q["tag"] for q in job["quants"]] == ["gguf-q8_0"]
    # the budget it was chosen for is in its spec, and its card says so
    [row] = [r for r in qf.json("ls") if r["job"] == job["job"]]
    assert row["fit"] == {"memory": 2**30, "ctx": 4096, "cache": "fp16"} == row["spec"]["fit"]
    card = (qf.home / "registry" / row["path"] / "README.md").read_text()
    assert "- Q8_0 was chosen for 1.00 GiB of RAM or VRAM holding 4,096 tokens with its KV cache in f16" in card, card


def test_a_file_over_the_split_size_is_published_in_parts_pulled_back_and_loaded(qf, tiny, hub, monkeypatch, tmp_path):
    """FACTORY_GGUF_SPLIT_BYTES lowered to 1 MB: the tiny model's F16 file (1.1 MB) goes out in gguf-split's parts,
    to the registry and the Hub's main; pulled from the Hub by a machine without the catalog, llama.cpp loads the
    parts from the first and scores them to the published perplexity."""
    monkeypatch.setenv("FACTORY_HUB_OWNER", "alice")
    monkeypatch.setenv("HF_TOKEN", "hf_alice_write")
    monkeypatch.setenv("FACTORY_GGUF_SPLIT_BYTES", "1e6")
    recipe = tmp_path / "gguf.yaml"
    recipe.write_text("gguf:\n  types: [F16]\n  imatrix_chunks: 4\n  imatrix_ctx: 256\n")
    result = qf("run", tiny, "--recipe", recipe, "--eval-windows", 1)
    assert result.exit_code == 0, result.output
    [row] = qf.json("ls")
    parts = sorted(p.name for p in (qf.home / "registry" / row["path"]).glob("tiny-F16*.gguf"))
    assert len(parts) >= 2 and parts[0] == f"tiny-F16-00001-of-{len(parts):05d}.gguf", parts
    # gguf-split counts the tensors' bytes, not each part's metadata (13 kB here; the default leaves 2 GB for it)
    assert all((qf.home / "registry" / row["path"] / p).stat().st_size <= 1.05 * 10**6 for p in parts)
    assert set(parts) <= set(hub.files("alice/tiny-GGUF", "main"))
    elsewhere = type(qf)(home=tmp_path / "elsewhere")
    pulled = tmp_path / "pulled"
    got = elsewhere("pull", "tiny:gguf-f16", "--hub", "alice", "-o", pulled)
    assert got.exit_code == 0, got.output
    assert sorted(p.name for p in pulled.glob("tiny-F16*.gguf")) == parts
    assert rescored(pulled, tiny, 1) == pytest.approx(row["ppl"], rel=1e-5)


def test_the_best_type_for_a_budget_is_the_first_of_the_ladder_that_fits():
    """Llama-3-8B's shape at 8192 tokens: from 24 GB down to 4 GB each budget gets the first type of LADDER whose
    weights, cache and compute fit with 512 MiB free (the one above it does not), smaller as the budget shrinks."""
    shape = Shape(4096, 32, 32, 8, 128, 14336, 128256, 8192)
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    params = Params(embed=128256 * 4096, head=128256 * 4096, linear=32 * layer, other=65 * 4096)
    picked = []
    for gib in (24, 12, 8, 6, 5, 4):
        plan = gguf_memory.plan(shape, params, gib * 2**30, 8192, "fp16", 1).data
        total = {r["type"]: r["total"] for r in plan["rows"]}
        room = gib * 2**30 - 512 * 2**20
        best = plan["best_type"]
        assert total[best] <= room and all(total[t] > room for t in LADDER[: LADDER.index(best)]), (gib, best)
        picked.append(best)
    assert picked == sorted(picked, key=LADDER.index) and len(set(picked)) >= 4, picked


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
    # the repository's own name, where ollama and llama.cpp's -hf find every type's file
    assert "ollama run hf.co/alice/tiny-GGUF:Q4_K_M\nllama-cli -hf alice/tiny-GGUF:Q4_K_M" in text, text
    assert "TYPE one of Q8_0, Q4_K_M" in text and "<this repository>" not in text


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    """Gemma 3 with its SigLIP vision tower (tests/support/tiny_vlms.py; GGUF no longer claims Mistral 3, whose
    projector llama-mtmd-cli refuses)."""
    return make_tiny_vlm("gemma3", tmp_path_factory.mktemp("vlm") / "gemma3")


def test_a_vision_language_model_gets_its_projector_once_beside_every_type(qf, tiny_gemma3, hub, monkeypatch, tmp_path):
    """The tiny Gemma 3: its language model quantized to each type and scored; its vision tower and projector
    converted once (one `mmproj` unit for both types) into llama.cpp's projector file, published beside each type as
    `mmproj-<Model>-F16.gguf` and on the Hub repo's main, whose card says how llama.cpp's multimodal tools load it."""
    monkeypatch.setenv("FACTORY_HUB_OWNER", "alice")
    monkeypatch.setenv("HF_TOKEN", "hf_alice_write")
    recipe = tmp_path / "gguf.yaml"
    recipe.write_text("gguf:\n  types: [Q8_0, Q4_K_M]\n  imatrix_chunks: 4\n  imatrix_ctx: 256\n")
    result = qf("run", tiny_gemma3, "--recipe", recipe, "--eval-windows", 1, "--json")
    assert result.exit_code == 0, result.output
    job = json.loads(result.stdout.splitlines()[-1])["job"]
    steps = [s["name"].split(":")[0] for s in qf.json("status", job)["steps"]]
    assert [s for s in steps if s in ("convert", "imatrix", "mmproj")] == ["convert", "imatrix", "mmproj"]
    rows = {r["tag"]: r for r in qf.json("ls")}
    assert set(rows) == {"gguf-q8_0", "gguf-q4_k_m"} and all(r["spec"]["mmproj"] for r in rows.values())
    folders = {tag: qf.home / "registry" / r["path"] for tag, r in rows.items()}
    projectors = {(f / "mmproj-gemma3-F16.gguf").read_bytes() for f in folders.values()}
    assert len(projectors) == 1  # the one shared unit's file beside both
    meta = gguf_file.metadata(folders["gguf-q4_k_m"] / "mmproj-gemma3-F16.gguf")
    assert (meta["general.architecture"], meta["clip.projector_type"], meta["general.file_type"]) == (
        "clip",
        "gemma3",
        1,
    )
    assert gguf_file.metadata(folders["gguf-q4_k_m"] / "gemma3-Q4_K_M.gguf")["general.architecture"] == "gemma3"
    main = hub.files("alice/gemma3-GGUF", "main")
    assert {"gemma3-Q8_0.gguf", "gemma3-Q4_K_M.gguf", "mmproj-gemma3-F16.gguf"} <= set(main)
    card = main["README.md"].decode()
    assert "## Images in llama.cpp" in card
    assert "llama-mtmd-cli -m gemma3-Q4_K_M.gguf --mmproj mmproj-gemma3-F16.gguf --image photo.jpg" in card
    assert "llama-server -hf alice/gemma3-GGUF:Q4_K_M" in card
    plan = qf.json("plan", tiny_gemma3, "--engine", "gguf", "--vram", "1GB")["gguf"]
    assert plan["mmproj"] == 2 * inspect(tiny_gemma3, ENGINE.architectures).vision.params  # said apart, at 16 bits
    pulled = tmp_path / "pulled"
    assert qf("pull", "gemma3:gguf-q4_k_m", "-o", pulled).exit_code == 0
    assert gguf_evaluate.model_file(pulled).name == "gemma3-Q4_K_M.gguf"  # the projector is not the model
    assert rescored(pulled, tiny_gemma3, 1) == pytest.approx(rows["gguf-q4_k_m"]["ppl"], rel=1e-5)


def test_a_vision_language_family_the_converter_cannot_take_is_refused_in_one_sentence(qf, tmp_path):
    """Qwen3-VL's tiny checkpoint: llama.cpp registers the family, but llama-mtmd-cli aborts on the tiny tower's
    deepstack features (a failed ggml_can_repeat), so GGUF does not claim it (benchmarks/results/coverage-cpu.json)."""
    source = make_tiny_vlm("qwen3_vl", tmp_path / "qwen3_vl")
    result = qf("run", source, "--gguf", "Q4_K_M")
    assert result.exit_code == 3, result.output
    said = " ".join(result.output.split())
    assert "error: GGUF does not convert the vision-language Qwen3VLForConditionalGeneration; it converts " in said
    assert "Gemma3ForConditionalGeneration" in said and "Traceback" not in said, said
    assert qf.json("jobs") == []


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


@pytest.mark.parametrize("given", ["another", "missing"])
def test_a_local_sdist_that_is_not_the_pinned_one_is_refused_and_leaves_no_build(tmp_path, given):
    """FACTORY_LLAMA_CPP_SDIST (a machine without PyPI: the GPU sitting carries the sdist): only the pinned file is
    built, and a refusal is one sentence with nothing left in the cache."""
    sdist = tmp_path / llama.SDIST
    if given == "another":
        sdist.write_bytes(b"not llama.cpp")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "FACTORY_LLAMA_CPP_SDIST": str(sdist)}
    done = subprocess.run([sys.executable, "-m", "factory.engines.gguf.build"], env=env, capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stdout == f"{llama.PACKAGE} {llama.VERSION}'s sdist from {sdist} (FACTORY_LLAMA_CPP_SDIST)\n"
    assert done.stderr.strip() == (
        f"error: {llama.SDIST} does not have the pinned sha256 {llama.SDIST_SHA256[:12]}...; refusing to build it"
        if given == "another"
        else f"error: FACTORY_LLAMA_CPP_SDIST={sdist} cannot be read: No such file or directory"
    )
    assert [p.name for p in (tmp_path / "cache" / "quantfactory" / "llama.cpp").iterdir()] == [
        f"{llama.VERSION}-{llama.flavour()}.lock"
    ]


def test_each_architecture_is_one_the_converter_registers():
    registered = set()
    for path in (llama.source() / "conversion").glob("*.py"):
        for call in re.findall(r"register\(([^)]*)\)", path.read_text()):
            registered.update(re.findall(r'"(\w+)"', call))
    assert gguf_engine.ARCHITECTURES <= registered, sorted(gguf_engine.ARCHITECTURES - registered)
    # a vision-language one has an mmproj model too (the converter's MMPROJ_MODEL_MAP names it)
    maps = ast.parse((llama.source() / "conversion" / "__init__.py").read_text())
    [mmproj] = [
        ast.literal_eval(node.value)
        for node in maps.body
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "MMPROJ_MODEL_MAP"
    ]
    vision = {a for a in gguf_engine.ARCHITECTURES if a.endswith("ForConditionalGeneration")}
    assert vision and vision <= set(mmproj), sorted(vision - set(mmproj))


def test_a_checkpoint_without_the_draft_head_its_converter_exports_converts(tmp_path):
    """Qwen3.5's converter class exports a multi-token-prediction head and asserts the checkpoint holds one; a
    checkpoint saved by transformers has none (it drops those layers), so convert.py tells the converter `--no-mtp`."""
    import safetensors.torch
    import torch

    from factory.engines.gguf import convert
    from tests.support.tiny_archs import make_tiny

    source = make_tiny("qwen3_5_text", tmp_path / "qwen3_5")
    assert not convert.has_draft_layers(source)
    out = tmp_path / "qwen3_5.gguf"
    cmd = [sys.executable, "-m", "factory.engines.gguf.convert", str(llama.source()), str(source)]
    run = subprocess.run([*cmd, "--outtype", "f16", "--outfile", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert gguf_file.metadata(out)["general.architecture"] == "qwen35"
    # a release's head: `mtp.*` (Qwen) or a layer past num_hidden_layers (DeepSeek's and GLM's nextn layers)
    for name in ("mtp.fc.weight", "model.layers.2.eh_proj.weight"):
        safetensors.torch.save_file({name: torch.zeros(1)}, source / "model-draft.safetensors")
        assert convert.has_draft_layers(source), name


def test_a_granite_4_h_saved_by_transformers_5_converts_as_its_release_does(tmp_path):
    """Granite 4.0-H's releases name its layers "mamba" and "attention"; transformers 5 saves "linear_attention" and
    "full_attention" (a fine-tune's config), where the converter found no attention layer and wrote every layer as a
    Mamba one. Both forms of one seeded checkpoint give the same GGUF layers: one Mamba, one attention (2 KV heads)."""
    from tests.support.tiny_archs import make_tiny

    release = make_tiny("granitemoehybrid", tmp_path / "release")
    saved = make_tiny("granitemoehybrid", tmp_path / "saved")
    config = json.loads((saved / "config.json").read_text())
    config["layer_types"] = [
        {"mamba": "linear_attention", "attention": "full_attention"}[t] for t in config["layer_types"]
    ]
    (saved / "config.json").write_text(json.dumps(config))
    heads = []
    for source in (release, saved):
        out = tmp_path / f"{source.name}.gguf"
        cmd = [sys.executable, "-m", "factory.engines.gguf.convert", str(llama.source()), str(source)]
        run = subprocess.run([*cmd, "--outtype", "f16", "--outfile", str(out)], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        heads.append(gguf_file.metadata(out)["granitehybrid.attention.head_count_kv"])
    assert heads == [[0, 2], [0, 2]]


def test_a_tool_that_fails_fails_the_unit_with_its_last_line(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64)
    imatrix = tmp_path / "broken.imatrix.gguf"
    imatrix.write_bytes(broken.read_bytes())
    request = engines.QuantizeRequest(
        source_dir=tmp_path, out_dir=tmp_path / "out", work_dir=tmp_path / "work", spec=ENGINE.spec(type="Q4_K_M")
    )
    request.measurements = {"convert": broken, "imatrix": imatrix}
    with pytest.raises(JobFailed, match=r"GGUF quantization to Q4_K_M failed: .*\(exit 1; log: .*engine.log\)"):
        ENGINE.quantize(request, lambda event: None)


def test_a_killed_converter_fails_the_shared_unit_and_the_job_runs_again(tiny, tmp_path, db_url, monkeypatch):
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FACTORY_DB_URL", db_url)
    monkeypatch.setenv("FACTORY_MAX_UNITS", "1")
    killed = []

    def kill_the_converter(event):
        if event["event"] == "progress" and event.get("stage") == "convert" and not killed:
            for child in processes.engines(os.getpid()):
                os.kill(child.pid, signal.SIGKILL)
                killed.append(child.pid)

    factory = Factory(settings.load(), kill_the_converter)
    recipe = build_recipe(gguf="Q8_0", eval_windows=1)
    job, _ = factory.submit(Request(source=str(tiny), recipe=recipe))
    with pytest.raises(JobFailed, match=r"GGUF conversion to f16 failed: the engine process was killed by SIGKILL"):
        factory.execute(job.id)
    assert killed and factory.catalog.quants.live() == []
    failed = factory.catalog.jobs.get(job.id)
    assert [s.state for s in failed.steps if s.name.startswith("convert:")] == ["failed"]
    done = factory.execute(job.id)
    assert done.state == "succeeded" and [q.tag for q in factory.catalog.quants.live()] == ["gguf-q8_0"]


# Lines the pinned tools print (recorded from the tiny model's run), and the events they become.
TRANSCRIPT = [
    ("INFO:hf-to-gguf:blk.1.attn_q.weight,       torch.float32 --> F16, shape = {128, 128}", "convert", 2, 2),
    ("compute_imatrix: computing over 8 chunks, n_ctx=256, batch_size=256, n_seq=1", "imatrix", 0, 8),
    ("[69]33.2900,[70]33.3188,[71]33.2234,", "imatrix", 71, 128),
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
        "imatrix": gguf_engine._imatrix_parser(128),
        "quantize": gguf_engine._quantize_parser,
    }[stage]
    event = parse(line)
    assert (event["stage"], event["done"], event["total"]) == (stage, done, total)
    assert parse("llama_model_loader: - kv   0: general.architecture str = llama") is None
