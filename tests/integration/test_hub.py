"""The Hub as a source, a publish target and a place to pull from, against the local Hub stand-in
(tests/support/hub_server.py) driven through the real huggingface_hub client; tiny model, AWQ on the CPU. A test against
the real Hub runs only with HF_TOKEN, QF_TEST_REAL_HUB_OWNER and network."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from factory import engines, hubclient
from factory.publish import card
from factory.publish import hub as hub_api


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    """Retries without the waits: ours (BACKOFF_SECONDS) and huggingface_hub's own backoff (its only use of time)."""
    import types

    from huggingface_hub.utils import _http

    monkeypatch.setattr(hubclient, "BACKOFF_SECONDS", 0.01)
    monkeypatch.setattr(_http, "time", types.SimpleNamespace(sleep=lambda seconds: None))


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _events(result) -> list[dict]:
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_hub_source_is_pinned_fetched_once_and_verified(qf, tiny, hub):
    sha = hub.add_repo("meta/tiny-llama", {**_files(tiny), "README.md": b"---\nlicense: mit\n---\n# Tiny\n"})
    events = _events(qf("run", "meta/tiny-llama", "--awq", "--eval-windows", 1, "--json"))
    assert events[0]["source_identity"] == f"meta/tiny-llama@{sha}" and events[0]["name"] == "tiny-llama"
    steps = [e["step"] for e in events if e["event"] == "step" and e["state"] == "succeeded"]
    assert steps[:2] == ["fetch", "inspect"]
    [quant] = events[-1]["quants"]
    assert quant["rev"] == sha[:7]
    readme = (qf.home / "registry" / quant["path"] / card.FILENAME).read_text()
    assert card.metadata(readme)["base_model"] == "meta/tiny-llama"
    assert card.metadata(readme)["license"] == "mit"  # from the upstream card, which the fetch downloads too

    # a new upstream commit: naming the old one pins it, and its files are not downloaded again
    newer = hub.add_repo("meta/tiny-llama", {**_files(tiny), "generation_config.json": b'{"do_sample": false}'})
    assert newer != sha
    downloads = hub.count("GET", r"/resolve/")
    again = _events(qf("run", f"meta/tiny-llama@{sha}", "--awq", "--eval-windows", 2, "--json"))
    assert again[0]["source_identity"] == f"meta/tiny-llama@{sha}"
    assert hub.count("GET", r"/resolve/") == downloads
    from factory.checkpoints import sources

    assert sources.resolve("meta/tiny-llama", qf.home / "cache").identity == f"meta/tiny-llama@{newer}"


def test_fetch_takes_only_the_indexed_shards_at_the_top(qf, tiny, hub):
    """A repo with an index, its shard, a consolidated copy beside it and files in a subfolder: the fetch step
    downloads the config, tokenizer, index and the shard it names, nothing else."""
    files = _files(tiny)
    weights = files.pop("model.safetensors")
    from safetensors import safe_open

    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    index = {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}
    hub.add_repo(
        "meta/sharded",
        {
            **files,
            "model-00001-of-00001.safetensors": weights,
            "model.safetensors.index.json": json.dumps(index).encode(),
            "consolidated.safetensors": weights,
            "original/model.safetensors": weights,
        },
    )
    events = _events(qf("run", "meta/sharded", "--awq", "--eval-windows", 1, "--json"))
    assert events[-1]["state"] == "succeeded"
    fetched = {p.name for p in (qf.home / "cache" / "hub" / "meta--sharded").rglob("*.safetensors")}
    assert fetched == {"model-00001-of-00001.safetensors"}


def test_a_hub_that_fails_mid_download_is_unreachable_not_missing(qf, tiny, hub):
    hub.add_repo("meta/tiny-llama", _files(tiny))
    hub.fail("*", r"/resolve/[^/]+/model\.safetensors$", 503, times=100)
    result = qf("run", "meta/tiny-llama", "--awq", "--eval-windows", 1)
    assert result.exit_code == 5, result.output
    assert "cannot be reached" in result.stderr


@pytest.mark.parametrize(
    ("source", "code", "sentence"),
    [
        ("meta/missing", 4, "meta/missing does not exist on the Hub (or is private to another account)"),
        ("meta/tiny-llama@v9", 4, "meta/tiny-llama@v9: the Hub has no such revision"),
        ("meta/gated", 4, "meta/gated is gated and this token has no access"),
        ("meta/no-config", 3, "meta/no-config has no config.json; quantfactory takes transformers checkpoints"),
    ],
)
def test_hub_source_refusals(qf, tiny, hub, source, code, sentence):
    hub.add_repo("meta/tiny-llama", _files(tiny))
    hub.add_repo("meta/gated", _files(tiny))
    hub.set_gated("meta/gated")
    hub.add_repo("meta/no-config", {"notes.txt": b"not a model"})
    result = qf("run", source, "--awq")
    assert result.exit_code == code, result.output
    assert sentence in result.stderr and "Traceback" not in result.output
    assert qf.registry_files() == []


def test_unreachable_hub(qf, hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    result = qf("run", "meta/tiny-llama", "--awq")
    assert result.exit_code == 5
    assert "the Hub at http://127.0.0.1:9 cannot be reached" in result.stderr


@pytest.mark.parametrize(
    ("endpoint", "cause"),
    [
        ("http://127.0.0.1:9", "port 9 of 127.0.0.1 refuses connections"),
        ("http://no-such-hub.invalid", "its name 'no-such-hub.invalid' does not resolve: offline?"),
    ],
)
def test_an_unreachable_hub_is_named_at_once(qf, hub, monkeypatch, endpoint, cause):
    """No 25 s of huggingface_hub's retries and their log lines before the sentence: one connection says why."""
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    result = qf("ls", "--remote", "alice")
    assert result.exit_code == 5
    assert result.stderr.strip() == (
        f"error: the Hub at {endpoint} cannot be reached ({cause}); set HF_ENDPOINT for "
        "another Hub, or quantize local folders"
    )


def test_corrupted_download_fails_the_job(qf, tiny, hub):
    hub.add_repo("meta/tiny-llama", _files(tiny))
    hub.corrupt("meta/tiny-llama", "model.safetensors")
    result = qf("run", "meta/tiny-llama", "--awq", "--eval-windows", 1)
    assert result.exit_code == 1
    assert "model.safetensors does not match the Hub's checksum" in result.stderr
    assert qf.registry_files() == []


@pytest.fixture
def alice(monkeypatch):
    monkeypatch.setenv("FACTORY_HUB_OWNER", "alice")
    monkeypatch.setenv("HF_TOKEN", "hf_alice_write")


def test_publish_to_the_hub_then_pull_by_name_anywhere(qf, tiny, hub, alice, tmp_path, monkeypatch):
    events = _events(qf("run", tiny, "--awq", "--eval-windows", 1, "--json"))
    [quant] = events[-1]["quants"]
    assert "push:awq-w4g128" in [e["step"] for e in events if e["event"] == "step" and e["state"] == "succeeded"]
    local = qf.home / "registry" / quant["path"]
    branch = hub.files("alice/tiny-AWQ", "w4g128")
    assert {n: branch[n] for n in branch if n != ".gitattributes"} == _files(local)
    main = hub.files("alice/tiny-AWQ", "main")
    assert main["ppl_vs_size.png"].startswith(b"\x89PNG") and main["kld_vs_size.png"].startswith(b"\x89PNG")
    assert "![KL divergence against size](kld_vs_size.png)" in main["README.md"].decode()
    assert main["frontier.svg"].startswith(b"<svg") and b"<title>awq-w4g128</title>" in main["frontier.svg"]
    assert "![KL divergence from FP16 against size, every format](frontier.svg)" in main["README.md"].decode()
    meta = card.metadata(main["README.md"].decode())
    assert meta["base_model_relation"] == "quantized" and "awq" in meta["tags"] and meta["quantized_by"]
    assert "hf download alice/tiny-AWQ --revision w4g128" in main["README.md"].decode()
    assert main["model.safetensors"] == branch["model.safetensors"]  # vLLM loads main
    for path in qf.home.rglob("*"):  # the token stays out of the catalog (SQLite here), logs and work files
        assert not path.is_file() or b"hf_alice_write" not in path.read_bytes(), path

    # the same quant again changes nothing on the Hub
    commits = hub.count("POST", r"/commit/")
    _events(qf("run", tiny, "--awq", "--eval-windows", 1, "--json"))
    qf("retry", events[0]["job"])
    assert hub.count("POST", r"/commit/") == commits

    # anyone, without the catalog: a fresh FACTORY_HOME and a database that cannot be reached
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("FACTORY_HUB_OWNER")
    elsewhere = type(qf)(home=tmp_path / "elsewhere", db_url="postgresql://u:pw@127.0.0.1:9/none")
    result = elsewhere("pull", "tiny:awq-w4g128", "--hub", "alice", "-o", tmp_path / "pulled")
    assert result.exit_code == 0, result.output
    assert _files(tmp_path / "pulled") == _files(local)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    downloads = hub.count("GET", r"/resolve/")
    taken = elsewhere("pull", "tiny:awq-w4g128", "--hub", "alice", "-o", tmp_path / "full")
    assert taken.exit_code == 2 and "exists and is not an empty folder" in taken.stderr
    assert hub.count("GET", r"/resolve/") == downloads and (tmp_path / "full" / "x").read_text() == "mine"
    missing = elsewhere("pull", "tiny:exl2-4.0bpw", "--hub", "alice", "-o", tmp_path / "nope")
    assert missing.exit_code == 4
    assert "tiny:exl2-4.0bpw is not published under alice on the Hub; tags there: awq-w4g128" in missing.stderr
    listed = json.loads(elsewhere("ls", "--remote", "alice", "--json").stdout)
    assert [(r["name"], r["repo"], r["branch"]) for r in listed] == [("tiny:awq-w4g128", "alice/tiny-AWQ", "w4g128")]

    # a file corrupted on the Hub is caught, and nothing is left behind
    hub.corrupt("alice/tiny-AWQ", "model.safetensors", revision="w4g128")
    bad = elsewhere("pull", "tiny:awq-w4g128", "--hub", "alice", "-o", tmp_path / "bad")
    assert bad.exit_code == 1 and "does not match the Hub's checksum" in bad.stderr
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.partial-*"))


def test_a_later_evaluation_reaches_the_hub_repos_main_card_and_no_quant_file_changes(qf, tiny, hub, alice):
    """How a later evaluation of a published quant reaches the card a user reads on the Hub (issue 45): the job that
    reuses the quant pushes it again; its branch (the quant's files, its card as published) does not change, and
    the repo's main card is made again with every evaluation, one line each (`qf pull` does so for its own copy)."""
    assert qf("run", tiny, "--awq", "--eval-windows", 1).exit_code == 0
    branch = hub.files("alice/tiny-AWQ", "w4g128")
    again = qf("run", tiny, "--awq", "--eval-windows", 2)
    assert again.exit_code == 0, again.output
    assert hub.files("alice/tiny-AWQ", "w4g128") == branch
    main = hub.files("alice/tiny-AWQ", "main")["README.md"].decode()
    rows = [line for line in main.split("## Evaluations")[1].splitlines() if line.startswith("| builtin:")]
    assert [row.split("|")[2].strip().split()[0] for row in rows] == ["1", "2"], main


def test_a_new_source_revision_is_published_and_the_old_one_stays_pullable(qf, model_copy, hub, alice, tmp_path):
    model = model_copy("tiny")
    first = _events(qf("run", model, "--awq", "--eval-windows", 1, "--json"))[-1]["quants"][0]
    (model / "generation_config.json").write_text('{"do_sample": false}')
    second = _events(qf("run", model, "--awq", "--eval-windows", 1, "--json"))[-1]["quants"][0]
    assert first["rev"] != second["rev"]
    main = hub.files("alice/tiny-AWQ", "main")["README.md"].decode()
    assert second["source_identity"] in main and first["source_identity"] not in main
    elsewhere = type(qf)(home=tmp_path / "elsewhere")  # a machine without this catalog
    for quant in (first, second):
        result = elsewhere("pull", f"tiny:awq-w4g128@{quant['rev']}", "--hub", "alice", "-o", tmp_path / quant["rev"])
        assert result.exit_code == 0, result.output
        manifest = json.loads((tmp_path / quant["rev"] / "manifest.json").read_text())
        assert manifest["source_identity"] == quant["source_identity"]


@pytest.mark.parametrize(
    ("owner", "token", "sentence"),
    [
        ("alice", None, "publishing to the Hub needs a token with write access"),
        ("alice", "hf_alice_read", "the Hub token of alice is read-only"),
        ("bob", "hf_alice_write", "the Hub token of alice cannot publish under 'bob'"),
        ("alice", "hf_wrong", "the Hub rejected the token"),
    ],
)
def test_publishing_refusals_come_before_any_work(qf, tiny, hub, monkeypatch, owner, token, sentence):
    monkeypatch.setenv("FACTORY_HUB_OWNER", owner)
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    result = qf("run", tiny, "--awq")
    assert result.exit_code == 5, result.output
    assert sentence in result.stderr
    assert token is None or token not in result.output
    assert not (qf.home / "registry").exists()


def test_upload_retried_after_a_500_and_a_429(tmp_path, hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_alice_write")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(os.urandom(2 << 20))
    api = hub_api.writer("alice")
    hub.fail("PUT", r".*", 500)  # the LFS upload
    hub.fail("POST", r"/commit/", 429, headers={"Retry-After": "0"})
    commit = hub_api.put_branch(api, "alice/x-exl2", "4.0bpw", {"model.safetensors": weights}, "test")
    assert commit == hub.head("alice/x-exl2", "4.0bpw")
    assert hub.files("alice/x-exl2", "4.0bpw")["model.safetensors"] == weights.read_bytes()
    assert hub_api.put_branch(api, "alice/x-exl2", "4.0bpw", {"model.safetensors": weights}, "again") is None


def test_concurrent_publishes_to_one_branch(tmp_path, hub, monkeypatch):
    """Two publishers race for one branch: each commit is made against the head it read, so the loser reads the
    branch again; the branch ends holding one publisher's complete files, never a mix."""
    monkeypatch.setenv("HF_TOKEN", "hf_alice_write")
    api = hub_api.writer("alice")
    hub_api.put_branch(api, "alice/x-exl2", "4.0bpw", {}, "create")
    sets = []
    for i in range(2):
        a, b = tmp_path / f"a{i}.bin", tmp_path / f"b{i}.txt"
        a.write_bytes(os.urandom(1 << 20))
        b.write_text(f"publisher {i}\n")
        sets.append({"model.safetensors": a, "notes.txt": b})
    errors: list[BaseException] = []

    def publish(files):
        try:
            hub_api.put_branch(api, "alice/x-exl2", "4.0bpw", files, "race")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=publish, args=(files,)) for files in sets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    final = hub.files("alice/x-exl2", "4.0bpw")
    final.pop(".gitattributes", None)
    assert final in [{n: p.read_bytes() for n, p in files.items()} for files in sets]


@pytest.mark.skipif(
    not (os.environ.get("HF_TOKEN") and os.environ.get("QF_TEST_REAL_HUB_OWNER")),
    reason="needs HF_TOKEN, QF_TEST_REAL_HUB_OWNER and network to the real Hub",
)
def test_real_hub_round_trip(tmp_path):
    owner = os.environ["QF_TEST_REAL_HUB_OWNER"]
    api = hub_api.writer(owner)
    note = tmp_path / "generation_config.json"
    note.write_text('{"note": "quantfactory round trip"}\n')
    hub_api.put_branch(api, f"{owner}/quantfactory-test-exl2", "4.0bpw", {note.name: note}, "round trip")
    place = hub_api.Place(f"{owner}/quantfactory-test-exl2", "4.0bpw")
    files = hub_api.pull(place, engines.get("exl2").outputs, None, tmp_path / "out", lambda **_: None)
    assert note.name in files


HOSTILE_NAMES = ["../escaped.json", "/tmp/qf-hub-absolute.json", "nested/config.json", "install.sh", ".bashrc"]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=["dotdot", "absolute", "nested", "off-the-list", "hidden"])
def test_a_hub_pull_takes_only_the_files_a_quant_may_carry(qf, hub, tmp_path, name):
    """A branch that lists a file no quant carries (a path out of -o, a script) is refused in one sentence, as a
    pull from the factory's service refuses it; nothing is written, in -o or where the name points (issue 43)."""
    hub.add_repo("alice/tiny-AWQ", {"README.md": b"card"})
    hub.add_repo("alice/tiny-AWQ", {"config.json": b"{}", "model.safetensors": b"x" * 64, name: b"planted"}, "w4g128")
    out = tmp_path / "pulls" / "out"
    result = qf("pull", "tiny:awq-w4g128", "--hub", "alice", "-o", out)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: alice/tiny-AWQ@w4g128 holds {name!r}, a name no quant's file has; nothing was pulled"
    )
    assert not out.exists() and list((tmp_path / "pulls").iterdir()) == []
    assert not (tmp_path / "pulls" / "escaped.json").exists() and not Path("/tmp/qf-hub-absolute.json").exists()


DEEP = b"[" * 100_000 + b"]" * 100_000  # json.loads: RecursionError


def test_a_hub_answer_nested_100k_deep_is_one_sentence(qf, hub, tmp_path):
    """`qf pull --hub` from a Hub whose answer is JSON 100k deep (huggingface_hub's parser hit RecursionError; a
    traceback, issue 43)."""
    hub.add_repo("alice/tiny-AWQ", {"README.md": b"card"})
    hub.fail("GET", r"/api/models/alice/tiny-AWQ/refs", 200, times=10, body=DEEP)
    result = qf("pull", "tiny:awq-w4g128", "--hub", "alice", "-o", tmp_path / "out")
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: the Hub at {hub.url} answered for alice/tiny-AWQ with JSON nested too deeply to be read"
    )
    assert not (tmp_path / "out").exists()


def test_a_source_index_nested_100k_deep_fails_the_fetch_in_one_sentence(qf, tiny, hub):
    files = {p.name: p.read_bytes() for p in tiny.iterdir() if p.is_file()}
    hub.add_repo("meta/tiny", {**files, "model.safetensors.index.json": b'{"weight_map": ' + DEEP + b"}"})
    result = qf("run", "meta/tiny", "--awq")
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1] == (
        "error: model.safetensors.index.json is nested too deeply to be a model's metadata"
    )
