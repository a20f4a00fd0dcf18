"""`qf run` end to end on the tiny model with the real AutoAWQ, and every bad input's exit code and sentence."""

import json
import shutil

import pytest
import torch

from factory.factory import Factory
from factory.identity import file_sha256
from factory.jobs.planning import Request
from factory.publish import card
from factory.publish.folder import MANIFEST
from factory.recipes import build_recipe
from factory.settings import Settings
from tests.support.qf import Qf

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")


def last_line(result) -> str:
    return result.stderr.splitlines()[-1]


# -- one finished run, read many ways ----------------------------------------------------------------------------


def test_run_events_and_result(finished, tiny):
    qf, events = finished
    kinds = [e["event"] for e in events]
    assert kinds[0] == "job" and kinds[-1] == "result"
    steps = [(e["step"], e["state"]) for e in events if e["event"] == "step"]
    succeeded = [s for s, state in steps if state == "succeeded"]
    assert sorted(succeeded) == sorted(
        ["inspect", "quantize:awq-w4g128", "evaluate:fp16", "evaluate:awq-w4g128", "gate", "publish:awq-w4g128"]
    )
    # FP16's evaluation needs no quant: with a core per unit (OMP_NUM_THREADS=1) it runs beside the quantization
    at = succeeded.index
    assert at("inspect") < at("quantize:awq-w4g128") < at("evaluate:awq-w4g128") < at("gate") < at("publish:awq-w4g128")
    assert at("evaluate:fp16") < at("evaluate:awq-w4g128")  # the quant's KL divergence reads FP16's reference
    # step -> the layers it reported: AutoAWQ's, then each evaluation's walk (factory/evaluation/layered.py)
    layers = {}
    for e in events:
        if e["event"] == "progress" and e.get("unit") == "layer":
            layers.setdefault(e["step"], []).append((e["done"], e["total"]))
    assert layers == {
        "quantize:awq-w4g128": [(0, 2), (1, 2), (2, 2)],
        "evaluate:fp16": [(1, 2), (2, 2)],
        "evaluate:awq-w4g128": [(1, 2), (2, 2)],
    }
    result = events[-1]
    assert (result["state"], result["exit_code"], result["error"]) == ("succeeded", 0, None)
    [row] = result["quants"]
    assert row["name"] == "tiny:awq-w4g128" and row["method"] == "awq" and row["bits"] == 4
    assert row["source"] == str(tiny) and row["source_identity"].startswith("sha256:")
    assert 1.0 < row["ppl"] < 1.5 * row["fp16_ppl"]


def test_ls_json(finished):
    qf, events = finished
    [row] = qf.json("ls")
    assert set(row) >= {"name", "method", "bits", "bytes", "ppl", "fp16_ppl", "source"}
    quant_dir = qf.home / "registry" / "tiny" / f"awq-w4g128@{row['rev']}"
    assert row["path"] == f"tiny/awq-w4g128@{row['rev']}"
    files = [p for p in quant_dir.iterdir() if p.name not in (MANIFEST, "README.md")]  # bytes: the quant, not its card
    assert row["bytes"] == sum(p.stat().st_size for p in files)
    assert {p.name for p in files} >= {"config.json", "model.safetensors", "tokenizer.json"}
    result = qf("ls")
    assert result.exit_code == 0 and "tiny:awq-w4g128" in result.stdout


def test_manifest(finished, tiny):
    qf, _ = finished
    [row] = qf.json("ls")
    manifest = json.loads((qf.home / "registry" / "tiny" / f"awq-w4g128@{row['rev']}" / MANIFEST).read_text())
    assert manifest["source_identity"] == row["source_identity"] and manifest["base_model"] == "tiny"
    assert "source" not in manifest  # the local folder's path stays on this machine (the catalog has it)
    assert manifest["spec"] == {
        "method": "awq",
        "w_bit": 4,
        "group_size": 128,
        "zero_point": True,
        "version": "gemm",
        "calib_rows": 16,
        "calib_length": 128,
        "clip": False,
    }
    assert manifest["calibration"] == "builtin:c4" and len(manifest["calibration_sha256"]) == 64
    assert set(manifest["versions"]) >= {"torch", "transformers", "awq"}
    assert manifest["eval"]["windows"] == 2 and manifest["eval"]["window_length"] == 2048
    assert manifest["eval"]["ppl"] == row["ppl"] and manifest["eval"]["fp16_ppl"] == row["fp16_ppl"]
    folder = qf.home / "registry" / "tiny" / f"awq-w4g128@{row['rev']}"
    for name, entry in manifest["files"].items():
        assert file_sha256(folder / name) == entry["sha256"]
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (folder, *folder.iterdir())}
    assert modes.pop(folder.name) == "0o755" and set(modes.values()) == {"0o444"}, modes  # AutoAWQ writes 0600


def test_jobs_and_show(finished):
    qf, events = finished
    [job] = qf.json("jobs")
    assert job["id"] == events[0]["job"] and job["state"] == "succeeded"
    assert all(s["seconds"] is not None and s["state"] == "succeeded" for s in job["steps"])
    shown = qf.json("show", "tiny")
    assert [q["name"] for q in shown["quants"]] == ["tiny:awq-w4g128"] and shown["jobs"][0]["id"] == job["id"]
    assert qf("show", "TINY:AWQ-W4G128").exit_code == 0


def test_same_job_again_returns_it(finished, tiny):
    qf, events = finished
    again = qf("run", tiny, "--awq", "--eval-windows", 2, "--json")
    assert again.exit_code == 0, again.output
    replay = [json.loads(line) for line in again.stdout.splitlines()]
    assert replay[0] == {**events[0], "created": False, "state": "succeeded"}
    assert replay[-1]["quants"] == events[-1]["quants"]
    assert len(qf.json("jobs")) == 1 and len(qf.json("jobs")[0]["steps"]) == 6


def test_pull(finished, tmp_path):
    qf, _ = finished
    result = qf("pull", "tiny:awq-w4g128", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    for name, entry in manifest["files"].items():
        assert file_sha256(tmp_path / "out" / name) == entry["sha256"]
    again = qf("pull", "tiny:awq-w4g128", "-o", tmp_path / "out")
    assert again.exit_code == 2
    assert (
        last_line(again)
        == f"error: output folder '{tmp_path / 'out'}' exists and is not empty; pass -o with a new or empty folder"
    )


def test_pull_refuses_a_corrupted_registry(finished, tmp_path):
    qf, _ = finished
    broken = type(qf)(home=tmp_path / "home", db_url=qf.db_url)  # same catalog, a copy of the registry
    shutil.copytree(qf.home, broken.home)
    [row] = broken.json("ls")
    weights = broken.home / "registry" / row["path"] / "model.safetensors"
    weights.chmod(0o644)  # registry files are read-only
    with open(weights, "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    result = broken("pull", "tiny:awq-w4g128", "-o", tmp_path / "out")
    assert result.exit_code == 1
    assert last_line(result) == (
        f"error: model.safetensors in {broken.home / 'registry' / row['path']} "
        "does not match its sha256 in the manifest"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["show", "nosuch"], 4, "error: no model named 'nosuch'; known names: tiny"),
        (["show", "tiny:awq-w4g64"], 4, "error: tiny:awq-w4g64 does not exist; tags of tiny: awq-w4g128@{rev}"),
        (["pull", "tiny:exl2-4.0bpw"], 4, "error: tiny:exl2-4.0bpw does not exist; tags of tiny: awq-w4g128@{rev}"),
        (["pull", "nosuch:awq-w4g64"], 4, "error: no model named 'nosuch'; known names: tiny"),
        (["pull", "tiny"], 2, "error: not a valid quant name 'tiny': a tag is required (NAME:TAG)"),
        (
            ["pull", "../x:awq-w4g64"],
            2,
            "error: not a valid quant name '../x:awq-w4g64': name '../x' must be 1-96 "
            "of [a-z0-9._-], start with a letter or digit, no '..'",
        ),
    ],
)
def test_not_found_lists_what_exists(finished, args, code, message):
    qf, events = finished
    result = qf(*args)
    assert result.exit_code == code
    assert last_line(result) == message.format(rev=events[-1]["quants"][0]["rev"])


# -- bad input: refused before or inside the job, nothing published ------------------------------------------------


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--exl2", "9"], 2, "bpw 9 is outside [2.0, 8.0]"),
        (["--exl2", "4.0,abc"], 2, "bpw 'abc' is not a number; use a number in [2.0, 8.0]"),
        (
            ["--awq", "--calibration", "builtin:pile"],
            2,
            "unknown text set 'builtin:pile'; use one of builtin:c4, builtin:code, builtin:multilingual, "
            "builtin:technical, builtin:tiny, builtin:wiki, builtin:mix or file:<path to a .txt, .jsonl or .parquet "
            "file>",
        ),
        (
            ["--awq", "--eval", "c4"],
            2,
            "unknown text set 'c4'; use one of builtin:c4, builtin:code, builtin:multilingual, "
            "builtin:technical, builtin:tiny, builtin:wiki, builtin:mix or file:<path to a .txt, .jsonl or .parquet "
            "file>",
        ),
        (
            ["--awq", "--eval", "builtin:c4"],
            2,
            "calibration 'builtin:c4' and eval 'builtin:c4' are the same text; evaluate on held-out text",
        ),
        (
            ["--awq", "--name", "../up"],
            2,
            "not a valid quant name '../up': name '../up' must be 1-96 of "
            "[a-z0-9._-], start with a letter or digit, no '..'",
        ),
    ],
)
def test_refused_before_a_job(qf, tiny, args, code, message):
    result = qf("run", tiny, *args)
    assert result.exit_code == code, result.output
    assert last_line(result) == f"error: {message}"
    assert qf.registry_files() == [] and qf.json("jobs") == []


@no_cuda
def test_exl2_without_cuda(qf, tiny):
    result = qf("run", tiny, "--exl2", "4.0")
    assert result.exit_code == 2
    assert last_line(result) == (
        "error: EXL2 (--exl2, --fit) needs a CUDA GPU and this machine has none; AWQ runs "
        "without one (--awq), AWQ-CT runs without one (--awqct), GGUF runs without one (--gguf)"
    )


def test_recipe_with_unknown_keys(qf, tiny, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("awq: {w_bit: 4, clipping: true}\n")
    result = qf("run", tiny, "--recipe", recipe)
    assert result.exit_code == 2
    assert last_line(result) == (
        f"error: recipe '{recipe}': unknown key 'awq.clipping' "
        "(recipe keys: awq, awqct, exl2, exl3, gguf, calibration, eval, eval_windows, max_ppl_ratio, max_kld, fit)"
    )


def test_source_not_found(qf, tmp_path):
    missing = qf("run", tmp_path / "nope", "--awq")
    assert missing.exit_code == 4
    assert last_line(missing) == (
        f"error: source '{tmp_path / 'nope'}' does not exist; "
        "pass a local folder with config.json and safetensors weights"
    )
    assert qf.json("jobs") == []  # Hub sources: tests/integration/test_hub.py


def _failed_job(qf, code, message):
    [job] = qf.json("jobs")
    assert (job["state"], job["exit_code"], job["error"]) == ("failed", code, message)
    assert qf.registry_files() == []


def test_calibration_too_short(qf, tiny, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("a few words of calibration text. " * 20)
    result = qf("run", tiny, "--awq", "--calibration", f"file:{small}")
    assert result.exit_code == 2
    message = last_line(result).removeprefix("error: ")
    assert message.startswith(f"text set 'file:{small}' has ") and "fewer than the 16 x 128 = 2048 requested" in message
    _failed_job(qf, 2, message)


def test_eval_text_too_short(qf, tiny):
    result = qf("run", tiny, "--awq", "--eval", "builtin:tiny", "--eval-windows", 500)
    assert result.exit_code == 2
    message = last_line(result).removeprefix("error: ")
    assert message.startswith("eval text 'builtin:tiny' holds ") and "fewer than the 500 requested" in message
    _failed_job(qf, 2, message)


def test_group_size_that_does_not_divide(qf, tiny192, tmp_path):
    recipe = tmp_path / "g128.yaml"
    recipe.write_text("awq: {group_size: 128}\n")
    result = qf("run", tiny192, "--recipe", recipe)
    assert result.exit_code == 2
    message = "AWQ group size 128 does not divide the model's input dims [192]; use one that divides [192, 384]"
    assert last_line(result) == f"error: {message}"
    assert qf.registry_files() == [] and qf.json("jobs") == []  # refused at submit


def test_quality_gate_refuses(qf, tiny192, tmp_path):
    """A real quant of the hidden-192 model (group 64 chosen) against a gate no quant can pass."""
    recipe = tmp_path / "strict.yaml"
    recipe.write_text("awq: {}\nmax_ppl_ratio: 0.5\n")
    result = qf("run", tiny192, "--recipe", recipe, "--eval-windows", 1, "--json")
    assert result.exit_code == 1, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    ppl = {e["subject"]: e["ppl"] for e in events if e["event"] == "evaluation"}
    message = (
        f"quality gate refused awq-w4g64: perplexity {ppl['awq-w4g64']:.4g} vs FP16 {ppl['fp16']:.4g} "
        f"(ratio {ppl['awq-w4g64'] / ppl['fp16']:.3f}), allowed at most 0.5 x FP16"
    )
    assert last_line(result) == f"error: {message}"
    assert events[-1]["state"] == "failed" and events[-1]["quants"] == []
    _failed_job(qf, 1, message)


def test_model_card(finished):
    qf, _ = finished
    [row] = qf.json("ls")
    text = (qf.home / "registry" / row["path"] / "README.md").read_text()
    assert card.metadata(text) == {
        "base_model": "tiny",
        "base_model_relation": "quantized",
        "pipeline_tag": "text-generation",
        "library_name": "transformers",
        "tags": ["awq", "quantfactory", "quantized"],
        "quantized_by": "quantfactory",
    }
    assert "| `tiny:awq-w4g128` (this folder) | awq | 4 |" in text
    assert (
        f"{row['ppl']:.4f} | {row['change'] * 100:+.2f}% | {row['kld']:.4f} | {row['top1'] * 100:.1f}% | "
        "builtin:c4, 16 x 128 tokens, clipping off | builtin:wiki, 2 x 2048 tokens, cpu"
    ) in text
    assert "Read the base model's license on the original model's card." in text
    assert "qf pull tiny:awq-w4g128 -o tiny-awq-w4g128" in text and row["source_identity"] in text
    manifest = json.loads((qf.home / "registry" / row["path"] / MANIFEST).read_text())
    assert "README.md" in manifest["files"]


def test_calib_ls(qf):
    texts = qf.home / "texts"
    texts.mkdir(parents=True)
    (texts / "support.jsonl").write_text('{"text": "How do I reset my password?"}\n')
    rows = qf.json("calib", "ls")
    assert [r["name"] for r in rows][-2:] == ["builtin:mix", f"file:{texts / 'support.jsonl'}"]
    assert all(len(r["sha256"]) == 64 and r["chars"] > 0 for r in rows)


@pytest.mark.parametrize("command", [["ls"], ["jobs"], ["run", "{tiny}", "--awq"]])
def test_catalog_unreachable(tmp_path, tiny, command):
    qf = Qf(home=tmp_path / "home", db_url="postgresql://qf:s3cret@127.0.0.1:1/catalog")
    result = qf(*[c.format(tiny=tiny) for c in command])
    assert result.exit_code == 5
    assert (
        last_line(result) == "error: the catalog database at postgresql://qf:***@127.0.0.1:1/catalog cannot be reached"
    )
    assert "s3cret" not in result.output and "Traceback" not in result.output


def test_names_of_different_sources(qf, tiny, tmp_path):
    """Two folders with the same name: the second is called owner-name; --name picks one; a taken one is refused."""
    twin = tmp_path / "elsewhere" / "tiny"
    shutil.copytree(tiny, twin)
    (twin / "generation_config.json").write_text('{"do_sample": false}')  # another model, another identity
    home = Settings(home=qf.home, db_url=qf.db_url or f"sqlite:///{qf.home / 'catalog.db'}")
    factory = Factory(home)
    first, _ = factory.submit(Request(source=str(tiny), recipe=build_recipe(awq=True)))
    second, _ = factory.submit(Request(source=str(twin), recipe=build_recipe(awq=True)))
    assert (first.name, second.name) == ("tiny", "elsewhere-tiny")
    again, _ = factory.submit(Request(source=str(twin), recipe=build_recipe(awq=True, eval_windows=3)))
    assert again.name == "elsewhere-tiny"
    third = tmp_path / "third" / "tiny"
    shutil.copytree(twin, third)
    result = qf("run", third, "--awq", "--name", "tiny")
    assert result.exit_code == 2
    assert last_line(result) == f"error: the name 'tiny' already belong(s) to '{tiny}'; pass another --name"


def test_catalog_of_another_schema_is_refused(tmp_path):
    import sqlite3

    from factory.catalog import SCHEMA_VERSION

    home = tmp_path / "home"
    home.mkdir()
    with sqlite3.connect(home / "catalog.db") as db:  # a catalog from before schema versions
        db.execute("CREATE TABLE jobs (id TEXT PRIMARY KEY)")
    result = Qf(home=home)("ls")
    assert result.exit_code == 5
    assert last_line(result) == (
        f"error: the catalog at sqlite:///{home / 'catalog.db'} has schema version 0, this "
        f"quantfactory needs {SCHEMA_VERSION}; point FACTORY_DB_URL at a new database "
        "(no migration from it exists)"
    )


def test_a_catalog_of_schema_4_gains_the_divergence_columns_in_place(finished):
    """A catalog made before KL divergence (schema 4): its quants list with `kld` unknown, and new ones get it; it
    gains the service's tables (schema 6) and their later columns (7, 8) too."""
    import sqlite3

    from factory.catalog import MIGRATIONS, SCHEMA_VERSION

    qf, _ = finished
    home = qf.home.parent / "schema4"
    shutil.copytree(qf.home, home)
    with sqlite3.connect(home / "catalog.db") as db:
        for table, column in [
            ("evaluations", "kld"),
            ("evaluations", "kld_p99"),
            ("evaluations", "top1"),
            ("quants", "kld"),
            ("quants", "kld_p99"),
            ("quants", "top1"),
            ("jobs", "max_kld"),
        ]:
            db.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
        db.execute("DROP TABLE tokens")
        db.execute("DROP TABLE submissions")
        db.execute("UPDATE meta SET value = '4' WHERE key = 'schema'")
    assert "4" in MIGRATIONS and SCHEMA_VERSION == 8
    [row] = Qf(home=home).json("ls")
    assert row["kld"] is None and row["ppl"] > 0
    with sqlite3.connect(home / "catalog.db") as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == ("8",)
        assert db.execute("SELECT count(*) FROM tokens").fetchone() == (0,)


def test_a_catalog_of_schema_6_gains_the_withdrawn_column_in_place(finished):
    """A catalog made before a user could withdraw from a shared job (schema 6): `submissions` gains the column."""
    import sqlite3

    qf, _ = finished
    home = qf.home.parent / "schema6"
    shutil.copytree(qf.home, home)
    with sqlite3.connect(home / "catalog.db") as db:
        db.execute("ALTER TABLE submissions DROP COLUMN withdrawn_at")
        db.execute("UPDATE meta SET value = '6' WHERE key = 'schema'")
    assert len(Qf(home=home).json("ls")) == 1
    with sqlite3.connect(home / "catalog.db") as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == ("8",)
        assert "withdrawn_at" in [row[1] for row in db.execute("PRAGMA table_info(submissions)")]
