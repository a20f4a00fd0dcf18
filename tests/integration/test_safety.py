"""Nothing leaves the factory that its user did not mean to publish, and no small input hangs or exhausts it: source
folders read as regular files only, validated headers and configs, the allowlist of published files, scrubbed
engine environments, manifests without local paths, pulls that touch only what they create, interrupted work
cleaned up or resumable, names that say what they mean."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from factory.checkpoints import files
from factory.engines import child
from factory.errors import JobFailed, mask_url
from factory.publish import folder as registry
from tests.support import processes
from tests.support.processes import qf_process, wait_until
from tests.support.qf import Qf

PUBLISHABLE = {*files.COMPANIONS, "model.safetensors", "README.md", "manifest.json"}


def last_line(result) -> str:
    return result.stderr.splitlines()[-1]


# -- a source folder is what it says ------------------------------------------------------------------------------


def _secret(m: Path) -> Path:
    secret = m.parent / "id_rsa"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nsecret\n")
    return secret.resolve()


def _link_out(name):
    def breaks(m):
        secret = _secret(m)
        (m / name).unlink(missing_ok=True)
        (m / name).symlink_to(secret)
        return (
            f"{name} is a link to '{secret}', outside the model folder; copy the file into the folder if it "
            "belongs to the model"
        )

    breaks.__name__ = f"link_{name}"
    return breaks


def _weights_link_out(m):
    elsewhere = (m.parent / "big-disk").resolve()
    elsewhere.mkdir()
    (m / "model.safetensors").rename(elsewhere / "model.safetensors")
    (m / "model.safetensors").symlink_to(elsewhere / "model.safetensors")
    return (
        f"model.safetensors is a link to '{elsewhere / 'model.safetensors'}', outside the model folder; copy the "
        "file into the folder if it belongs to the model"
    )


def _dangling(m):
    (m / "tokenizer.model").symlink_to("/nowhere/tokenizer.model")
    return "tokenizer.model is a link to nothing ('/nowhere/tokenizer.model'); replace it with the file"


def _config_is_a_folder(m):
    (m / "config.json").unlink()
    (m / "config.json").mkdir()
    return "config.json is a folder, not a regular file; the factory reads only regular files"


LINKS = [
    _link_out("tokenizer.model"),
    _link_out("special_tokens_map.json"),
    _link_out("chat_template.jinja"),
    _weights_link_out,
    _dangling,
    _config_is_a_folder,
]


@pytest.mark.parametrize("command", ["run", "plan"])
@pytest.mark.parametrize("breaks", LINKS, ids=[b.__name__.strip("_") for b in LINKS])
def test_source_files_are_regular_files_of_the_folder(qf, model_copy, breaks, command):
    model = model_copy()
    message = breaks(model)
    args = ["--awq"] if command == "run" else ["--vram", "24GB"]
    result = qf(command, model, *args)
    assert (result.exit_code, last_line(result)) == (3, f"error: {message}"), result.output
    assert "Traceback" not in result.output
    assert qf.registry_files() == [] and qf.json("jobs") == []  # refused before any job exists
    for path in qf.home.rglob("*"):
        assert not path.is_file() or b"OPENSSH" not in path.read_bytes(), path


@pytest.mark.parametrize("command", ["run", "plan"])
def test_a_fifo_does_not_hang_it(qf, model_copy, command):
    model = model_copy()
    os.mkfifo(model / "model-00001.safetensors")
    args = ["--awq"] if command == "run" else ["--vram", "24GB"]
    proc = qf_process(qf, command, model, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert err.splitlines()[-1] == (
        "error: model-00001.safetensors is a FIFO, not a regular file; the factory reads only regular files"
    )
    assert qf.json("jobs") == []


def test_a_hugging_face_cache_snapshot_works(qf, tiny, tmp_path):
    """`qf run ~/.cache/huggingface/hub/models--org--name/snapshots/<sha>`: its files are links into blobs/."""
    repo = tmp_path / "hub" / "models--meta--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in tiny.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("../..") / "blobs" / blob.name)
    result = qf("run", snapshot, "--awq", "--eval-windows", 1, "--name", "tiny-snapshot", "--json")
    assert result.exit_code == 0, result.output
    [quant] = json.loads(result.stdout.splitlines()[-1])["quants"]
    published = qf.home / "registry" / quant["path"]
    assert all(p.is_file() and not p.is_symlink() for p in published.iterdir())
    assert (published / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()


# -- headers and configs are validated before anything is allocated -----------------------------------------------


def _safetensors(header: dict | bytes, data: bytes = b"\0\0") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _tensor(**fields) -> dict:
    return {"w": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2], **fields}}


F = "model.safetensors"
SHAPE = "; a shape is a list of at most 8 non-negative integers"
OFFSETS = "; they must be two non-negative integers, begin <= end"
HEADERS = [
    # the header that made inspection repeat a string a billion times (4 to 12 GB) and die of MemoryError
    ("string_in_shape", _tensor(shape=["AAAA", 1000000000]), f"{F}: tensor 'w' has shape ['AAAA', 1000000000]{SHAPE}"),
    ("bool_in_shape", _tensor(shape=[True, 1]), f"{F}: tensor 'w' has shape [True, 1]{SHAPE}"),
    ("negative_dim", _tensor(shape=[-1]), f"{F}: tensor 'w' has shape [-1]{SHAPE}"),
    ("rank_nine", _tensor(shape=[1] * 9), f"{F}: tensor 'w' has shape [1, 1, 1, 1, 1, 1, 1, 1, 1]{SHAPE}"),
    ("huge_shape", _tensor(shape=[2**40, 2**40]), f"{F}: tensor 'w' has 2 bytes, its shape needs {2 * 2**80}"),
    ("string_offsets", _tensor(data_offsets=["0", "2"]), f"{F}: tensor 'w' has data_offsets ['0', '2']{OFFSETS}"),
    ("offsets_backwards", _tensor(data_offsets=[2, 0]), f"{F}: tensor 'w' has data_offsets [2, 0]{OFFSETS}"),
    ("unknown_dtype", _tensor(dtype="Q4"), f"{F}: tensor 'w' has unknown dtype 'Q4'"),
    (
        "offsets_past_the_data",
        _tensor(shape=[2], data_offsets=[0, 4]),
        f"{F} is truncated or padded: its tensors need 4 bytes of data, it holds 2",
    ),
    ("nested", b"[" * 200_000 + b"]" * 200_000, f"the header of {F} is nested too deeply to be a model's metadata"),
    ("not_utf8", b'{"\xff": 1}', f"the header of {F} is not UTF-8 text"),
    ("not_an_object", b"[1, 2]", f"{F} has an unparsable safetensors header"),
    ("entry_not_an_object", {"w": 5}, f"{F} has an unparsable entry for tensor 'w'"),
    (
        "bad_metadata",
        {"__metadata__": {"a": {"b": 1}}, **_tensor()},
        f"{F} has an unparsable __metadata__ entry (it must map names to strings)",
    ),
]


@pytest.mark.parametrize("command", ["run", "plan"])
@pytest.mark.parametrize("header, message", [h[1:] for h in HEADERS], ids=[h[0] for h in HEADERS])
def test_safetensors_headers_are_validated(qf, model_copy, header, message, command):
    model = model_copy()
    (model / F).write_bytes(_safetensors(header))
    args = ["--awq"] if command == "run" else ["--vram", "24GB"]
    result = qf(command, model, *args)
    assert (result.exit_code, last_line(result)) == (3, f"error: {message}"), result.output
    assert "Traceback" not in result.output and "internal error" not in result.output
    assert qf.registry_files() == []


def _config(**changes):
    def breaks(m):
        config = json.loads((m / "config.json").read_text())
        config.update(changes)
        for key in [k for k, v in changes.items() if v is ...]:
            del config[key]
        (m / "config.json").write_text(json.dumps(config))

    return breaks


def _config_bytes(data: bytes):
    return lambda m: (m / "config.json").write_bytes(data)


CONFIGS = [
    ("not_utf8", _config_bytes(b'{"hidden_size": "\xff"}'), "config.json is not UTF-8 text"),
    (
        "nested",
        _config_bytes(b"[" * 200_000 + b"]" * 200_000),
        "config.json is nested too deeply to be a model's metadata",
    ),
    (
        "zero_heads",
        _config(num_attention_heads=0),
        "config.json: num_attention_heads is 0; it must be between 1 and 4096",
    ),
    ("float_hidden", _config(hidden_size=128.0), "config.json: hidden_size must be an integer, not 128.0"),
    ("string_layers", _config(num_hidden_layers="2"), "config.json: num_hidden_layers must be an integer, not '2'"),
    (
        "huge_vocab",
        _config(vocab_size=10**12),
        "config.json: vocab_size is 1000000000000; it must be between 1 and 16777216",
    ),
    (
        "heads_do_not_divide",
        _config(num_attention_heads=3),
        "config.json: hidden_size 128 is not divisible by num_attention_heads 3",
    ),
    (
        "kv_heads_do_not_divide",
        _config(num_key_value_heads=3),
        "config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3",
    ),
    ("no_vocab", _config(vocab_size=...), "config.json has no vocab_size; the factory needs it to size the model"),
    (
        "vocab_disagrees",
        _config(vocab_size=2048),
        "config.json says vocab_size x hidden_size is 2048 x 128, but model.embed_tokens.weight has shape [1024, 128]",
    ),
    (
        "layers_disagree",
        _config(num_hidden_layers=3),
        "config.json says 3 layers (num_hidden_layers), the weights hold 2 (numbered 0 to 1)",
    ),
]


@pytest.mark.parametrize("command", ["run", "plan"])
@pytest.mark.parametrize("breaks, message", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_configs_are_validated(qf, model_copy, breaks, message, command):
    model = model_copy()
    breaks(model)
    args = ["--awq"] if command == "run" else ["--vram", "24GB"]
    result = qf(command, model, *args)
    assert (result.exit_code, last_line(result)) == (3, f"error: {message}"), result.output
    assert "Traceback" not in result.output and "internal error" not in result.output


# -- a quant holds an allowlist -----------------------------------------------------------------------------------

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"


def _strays(model: Path) -> None:
    """What a user's checkout holds beside the model: none of it may leave."""
    (model / ".env").write_text("HF_TOKEN=hf_stray_secret\n")
    (model / "README.md").symlink_to("/etc/passwd")  # a card out of the folder: not read, and not refused
    (model / "notes.txt").symlink_to("/etc/passwd")
    (model / "optimizer.pt").write_bytes(b"\x80\x04pickle")
    (model / "modeling_evil.py").write_text("import os\n")
    (model / "chat_template.jinja").write_text(TEMPLATE)


def test_the_exl2_staging_folder_holds_only_the_allowlist(model_copy, tmp_path):
    """convert_exl2 -cf copies every regular file beside the weights: it gets this folder, not the source. A user's
    folder is staged as the job's snapshot (read-only copies, each hashed as it is), a folder the factory owns as
    copies of the companions and links to the weights."""
    from factory.identity import file_sha256

    model = model_copy("tiny")
    _strays(model)
    snapshot = tmp_path / "snapshot"
    hashes = files.snapshot(model, snapshot)
    assert set(hashes) == {p.name for p in snapshot.iterdir()}
    for p in snapshot.iterdir():
        assert not p.is_symlink() and p.read_bytes() == (model / p.name).read_bytes(), p.name
        assert (p.stat().st_mode & 0o777, hashes[p.name]) == (0o444, file_sha256(p)), p.name
    staged = files.stage(model, tmp_path / "staged")
    assert (
        {p.name for p in snapshot.iterdir()}
        == {p.name for p in staged.iterdir()}
        == {
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "model.safetensors",
        }
    )
    for p in staged.iterdir():  # the companions copied (what inspect hashed), the weights linked
        copied = not p.is_symlink() and p.read_bytes() == (model / p.name).read_bytes()
        assert p.resolve().parent == model.resolve() if p.name == "model.safetensors" else copied, p.name


@pytest.mark.parametrize(
    "stranger, message",
    [
        ("notes.txt", "notes.txt in {f} is not on the list of files a quant may carry; nothing was published"),
        ("optimizer.pt", "optimizer.pt in {f} is not on the list of files a quant may carry; nothing was published"),
        ("link", "tokenizer.model in {f} is not a regular file; nothing was published"),
    ],
)
def test_publishing_checks_the_folder_against_the_allowlist(tmp_path, stranger, message):
    folder = tmp_path / "out"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "README.md"):
        (folder / name).write_text("{}")
    if stranger == "link":
        (folder / "tokenizer.model").symlink_to("/etc/passwd")
    else:
        (folder / stranger).write_text("x")
    with pytest.raises(JobFailed) as refused:
        files.check_publishable(folder, ("*.safetensors",))
    assert refused.value.message == message.format(f=folder)


# -- children get only what they need; what is printed or published names no secret or path ----------------------


def test_engine_children_get_a_scrubbed_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token")
    monkeypatch.setenv("FACTORY_DB_URL", "postgresql://qf:dbpass@db:5432/catalog")
    monkeypatch.setenv("FACTORY_BROKER_URL", "redis://:brokerpass@redis:6379/0")
    monkeypatch.setenv("HF_ENDPOINT", "https://user:endpointpass@hub.example")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    dump = (
        "import json; env = dict(v.split('=', 1) for v in open('/proc/self/environ').read().split('\\0') if v);"
        " print(json.dumps({'event': 'env', 'env': env}))"
    )
    events = []
    child.run_command(
        [sys.executable, "-c", dump], tmp_path / "log", events.append, "env", env={"EXLLAMA_NO_SDPA": "1"}
    )
    env = events[0]["env"]
    assert not {"HF_TOKEN", "FACTORY_DB_URL", "FACTORY_BROKER_URL", "HF_ENDPOINT"} & set(env)
    assert not [v for v in env.values() if "pass" in v or "hf_secret" in v]
    assert (env["HF_HUB_OFFLINE"], env["EXLLAMA_NO_SDPA"], env["CUDA_VISIBLE_DEVICES"]) == ("1", "1", "1")
    assert env["PATH"] == os.environ["PATH"]


@pytest.mark.parametrize(
    "url, masked",
    [
        ("postgresql://qf:s3cret@db:5432/catalog", "postgresql://qf:***@db:5432/catalog"),
        ("https://user:s3cret@hub.example/api", "https://user:***@hub.example/api"),
        ("redis://:s3cret@redis:6379/0", "redis://:***@redis:6379/0"),
        ("https://hub.example/api?token=s3cret&x=1", "https://hub.example/api?token=***&x=1"),
        ("postgresql://root@127.0.0.1:5432/test", "postgresql://root@127.0.0.1:5432/test"),
    ],
)
def test_mask_url(url, masked):
    assert mask_url(url) == masked


def test_an_endpoint_with_credentials_is_printed_masked(qf, hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://user:s3cret@127.0.0.1:9")
    result = qf("run", "meta/tiny-llama", "--awq")
    assert result.exit_code == 5
    assert last_line(result) == (
        "error: the Hub at http://user:***@127.0.0.1:9 cannot be reached (port 9 of "
        "127.0.0.1 refuses connections); set HF_ENDPOINT for another Hub, or quantize local "
        "folders"
    )
    assert "s3cret" not in result.output


def test_nothing_published_that_was_not_meant_to_be(qf, model_copy, hub, monkeypatch, tmp_path):
    """A publish to the registry and the Hub stand-in of a checkout with stray files beside the model, with a token,
    a broker password and a calibration file: only allowlisted files are published, the chat template among them;
    the token, the password and the strays' secret are in no file under FACTORY_HOME and on no branch; no
    published file names a local path; the manifest names the text by its file name and sha256."""
    monkeypatch.setenv("FACTORY_HUB_OWNER", "alice")
    monkeypatch.setenv("HF_TOKEN", "hf_alice_write")
    monkeypatch.setenv("FACTORY_BROKER_URL", "redis://:brokerpass@127.0.0.1:9/0")
    from calibration import builtin_text

    text = tmp_path / "private" / "support-tickets.txt"
    text.parent.mkdir()
    text.write_text(builtin_text("c4"))
    model = model_copy("tiny")
    _strays(model)
    result = qf("run", model, "--awq", "--eval-windows", 1, "--calibration", f"file:{text}", "--json")
    assert result.exit_code == 0, result.output
    [quant] = json.loads(result.stdout.splitlines()[-1])["quants"]
    published = {p.name: p.read_bytes() for p in (qf.home / "registry" / quant["path"]).iterdir()}
    assert set(published) <= PUBLISHABLE and published["chat_template.jinja"] == TEMPLATE.encode()
    on_hub = {**hub.files("alice/tiny-AWQ", "w4g128"), **hub.files("alice/tiny-AWQ", "main")}
    assert set(on_hub) - {".gitattributes", "ppl_vs_size.png", "kld_vs_size.png", "frontier.svg"} <= PUBLISHABLE
    for name, data in [*published.items(), *on_hub.items()]:
        assert str(tmp_path).encode() not in data and b"/private/" not in data, name
    for path in qf.home.rglob("*"):
        secrets = (b"hf_alice_write", b"brokerpass", b"hf_stray_secret")
        assert not path.is_file() or not [w for w in secrets if w in path.read_bytes()], path
    manifest = json.loads(published["manifest.json"])
    assert manifest["calibration"] == "file:support-tickets.txt" and len(manifest["calibration_sha256"]) == 64

    # a pull from the Hub leaves the user's own `out.partial/` alone
    monkeypatch.delenv("FACTORY_HUB_OWNER")
    (tmp_path / "out.partial").mkdir()
    (tmp_path / "out.partial" / "mine.txt").write_text("mine")
    elsewhere = Qf(home=tmp_path / "elsewhere")
    pulled = elsewhere("pull", "tiny:awq-w4g128", "--hub", "alice", "-o", tmp_path / "out")
    assert pulled.exit_code == 0, pulled.output
    assert (tmp_path / "out.partial" / "mine.txt").read_text() == "mine"
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == TEMPLATE
    assert not list(tmp_path.glob(".out.partial-*"))


# -- pull never touches what it did not create --------------------------------------------------------------------


def test_pull_refuses_outputs_it_must_not_touch(finished, tmp_path):
    qf, _ = finished
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "a-file").write_text("mine")
    cases = [
        (tmp_path / "link", f"-o '{tmp_path / 'link'}' is a symbolic link; pass a real folder"),
        (tmp_path / "dangling", f"-o '{tmp_path / 'dangling'}' is a symbolic link; pass a real folder"),
        (tmp_path / "a-file", f"-o '{tmp_path / 'a-file'}' is a file; pass a new or empty folder"),
        (
            qf.home / "registry" / "x",
            f"-o '{qf.home / 'registry' / 'x'}' is inside FACTORY_HOME ({qf.home}); pull into a folder outside it",
        ),
    ]
    for output, message in cases:
        result = qf("pull", "tiny:awq-w4g128", "-o", output)
        assert (result.exit_code, last_line(result)) == (2, f"error: {message}"), result.output
    assert (tmp_path / "a-file").read_text() == "mine" and list((tmp_path / "real").iterdir()) == []
    assert not (qf.home / "registry" / "x").exists()


# -- interrupted work is cleaned up or resumable ------------------------------------------------------------------


def _quantizing(qf: Qf, proc: subprocess.Popen) -> psutil.Process:
    """Wait until `qf run` (proc) is in its quantize step with the engine's child running; returns the child."""
    for line in proc.stdout:
        event = json.loads(line)
        if event["event"] == "progress" and event["step"].startswith("quantize:") and event.get("unit") == "layer":
            break
    return wait_until(lambda: next(iter(processes.engines(proc.pid)), None))


def _gone(engine: psutil.Process) -> bool:
    return not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE


@pytest.mark.database
def test_interrupted_runs_continue(qf, tiny):
    """SIGTERM stops `qf run` like Ctrl-C (exit 130, step interrupted, job failed "interrupted", engine stopped);
    SIGKILL leaves a running step that the next attempt marks interrupted; the same command then finishes."""
    # one unit at a time: FP16's evaluation would otherwise run beside the quantization and be stopped with it
    args = ("run", tiny, "--awq", "--eval-windows", 1, "--max-units", 1, "--json")
    proc = qf_process(qf, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    engine = _quantizing(qf, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.splitlines()[-1] == "interrupted"
    wait_until(lambda: _gone(engine), 30)
    [job] = qf.json("jobs")
    assert (job["state"], job["exit_code"]) == ("failed", 130) and job["error"].startswith("interrupted")
    steps = [("inspect", "succeeded"), ("quantize:awq-w4g128", "interrupted")]
    assert [(s["name"], s["state"]) for s in job["steps"]] == steps

    proc = qf_process(qf, *args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    engine = _quantizing(qf, proc)
    proc.kill()
    proc.wait(30)
    wait_until(lambda: _gone(engine), 30)  # the engine got SIGTERM when its parent died
    [job] = qf.json("jobs")
    assert [(s["name"], s["state"]) for s in job["steps"]] == [  # inspect is read again, not recorded again
        *steps,
        ("quantize:awq-w4g128", "running"),
    ]

    again = qf(*args)
    assert again.exit_code == 0, again.output
    [job] = qf.json("jobs")
    assert job["state"] == "succeeded"
    assert [(s["name"], s["state"]) for s in job["steps"]][:3] == [*steps, ("quantize:awq-w4g128", "interrupted")]


def _two_silent_conversions(qf: Qf, tiny: Path, tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`qf run` of the round engine's conversions to 3 and 5 mantissa bits side by side (one core a unit on two
    cores), each tensor of the tiny model taking about two minutes, silent meanwhile."""
    recipe = tmp_path / "round.yaml"
    recipe.write_text("round: {mantissa: [3, 5]}\n")
    env = {
        "FACTORY_ENGINES": "tests.support.round_engine:ENGINE",
        "QF_TEST_ROUND_SECONDS": "3000",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    args = ("run", tiny, "--recipe", recipe, "--eval-windows", 1, "--max-units", 2)
    return qf_process(qf, *args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_sigterm_stops_every_engine_of_units_running_side_by_side_at_once(qf, tiny, tmp_path):
    """Two conversions run at once, each in a thread waiting on its engine's next line (here minutes away, as a
    layer on a CPU can be): SIGTERM stops both engines at once, and both steps say interrupted."""
    proc = _two_silent_conversions(qf, tiny, tmp_path)
    try:

        def both_converting():
            steps = [s for j in qf.json("jobs") for s in j["steps"] if s["name"].startswith("quantize:")]
            kids = [p for p in processes.engines(proc.pid) if "tests.support.round_engine" in p.cmdline()]
            return len(kids) == 2 and [s["state"] for s in steps] == ["running"] * 2 and kids

        engines = wait_until(both_converting)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)  # without stopping its engines it would wait minutes on them
        assert proc.returncode == 130 and err.splitlines()[-1] == "interrupted"
        gone, alive = psutil.wait_procs(engines, timeout=15)
        assert alive == []
    finally:
        proc.kill()  # a failure leaves nothing behind: the engines get SIGTERM when their parent dies
    [job] = qf.json("jobs")
    assert (job["state"], job["exit_code"]) == ("failed", 130)
    stopped = {(s["name"], s["state"], s["error"]) for s in job["steps"] if s["name"].startswith("quantize:")}
    assert stopped == {(f"quantize:round-m{m}", "interrupted", "interrupted") for m in (3, 5)}


def test_a_unit_that_fails_stops_the_engine_beside_it_at_once(qf, tiny, tmp_path):
    """Of two conversions side by side, one fails after its first tensor while the other's engine is silent for
    minutes: the run ends in seconds, failed with the first one's reason; the other step says interrupted."""
    proc = _two_silent_conversions(qf, tiny, tmp_path, {"QF_TEST_ROUND_FAILS": "3"})
    try:
        _, err = proc.communicate(timeout=60)  # the other engine alone would take minutes more
    finally:
        proc.kill()
    [job] = qf.json("jobs")
    assert proc.returncode == job["exit_code"] == 1, err
    assert job["error"].startswith("rounding to 3 bits failed: RuntimeError: asked to fail"), job["error"]
    quantized = {s["name"]: (s["state"], s["error"]) for s in job["steps"] if s["name"].startswith("quantize:")}
    assert quantized == {
        "quantize:round-m3": ("failed", job["error"]),
        "quantize:round-m5": ("interrupted", "interrupted"),
    }


@pytest.mark.database
def test_two_runs_of_one_job_run_it_once(qf, tiny):
    """`qf run` holds its job as a worker does: a second `qf run` of it while the first is alive names the holder
    and exits 1; the first finishes."""
    args = ("run", tiny, "--awq", "--eval-windows", 1, "--json")
    first = qf_process(qf, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _quantizing(qf, first)
    [job] = qf.json("jobs")
    held = qf.json("status", job["id"])
    assert (held["holder"], held["attempts"]) == (f"{socket.gethostname()}:{first.pid}", 1)
    second = qf(*args)
    assert second.exit_code == 1
    assert last_line(second) == (
        f"error: job {job['id']} is running on {socket.gethostname()} pid {first.pid}; "
        f"`qf status {job['id']} --follow` follows it"
    )
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    [job] = qf.json("jobs")
    assert job["state"] == "succeeded" and [s["name"] for s in job["steps"]].count("quantize:awq-w4g128") == 1


def test_publish_sweeps_its_own_stale_staging(tmp_path):
    reg = tmp_path / "registry"
    model = reg / "tiny"
    model.mkdir(parents=True)
    stale, young, held = (model / f"{registry.STAGING}awq-w4g128@abc-{n}" for n in ("stale", "young", "held"))
    for folder in (stale, young, held):
        folder.mkdir()
        (folder / "model.safetensors").write_text("partial")
    (model / f"{stale.name}.old").mkdir()
    (model / f"{stale.name}.lock").write_text("")
    lock = open(model / f"{held.name}.lock", "w")  # a publisher still at work
    fcntl.flock(lock, fcntl.LOCK_EX)
    hour_ago = time.time() - registry.STALE_SECONDS - 60
    for path in (stale, model / f"{stale.name}.old", model / f"{stale.name}.lock", held, model / f"{held.name}.lock"):
        os.utime(path, (hour_ago, hour_ago))
    not_ours = model / "awq-w4g64@abc"  # a published quant is never touched
    not_ours.mkdir()
    os.utime(not_ours, (hour_ago, hour_ago))
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    registry.publish(reg, "tiny", "awq-w4g128", "def4567", src, {"job": "x"})
    left = sorted(p.name for p in model.iterdir())
    assert left == sorted(["awq-w4g128@def4567", young.name, held.name, f"{held.name}.lock", not_ours.name])
    lock.close()


# -- names say what they mean -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "tiny:awq-w4g64",
            "--name 'tiny:awq-w4g64' holds a tag or revision; use --name NAME; tags come from the spec and "
            "revisions from the source",
        ),
        (
            "x@deadbeef",
            "--name 'x@deadbeef' holds a tag or revision; use --name NAME; tags come from the spec and "
            "revisions from the source",
        ),
        (
            "\u212aiwi",
            "not a valid quant name '\u212aiwi': name '\u212aiwi' must be 1-96 of [a-z0-9._-], start with a "
            "letter or digit, no '..'",
        ),
    ],
)
def test_name_refusals(qf, tiny, name, message):
    result = qf("run", tiny, "--awq", "--name", name)
    assert (result.exit_code, last_line(result)) == (2, f"error: {message}")
    assert qf.json("jobs") == []


@pytest.mark.database
def test_a_name_that_differs_from_the_catalogs_is_an_error(finished, tiny):
    qf, _ = finished
    result = qf("run", tiny, "--awq", "--eval-windows", 2, "--name", "other")
    assert result.exit_code == 2
    assert last_line(result) == (
        f"error: '{tiny}' is already named 'tiny' in the catalog, not 'other'; drop --name "
        "(its quants are published as 'tiny')"
    )
    assert len(qf.json("jobs")) == 1
    assert qf("run", tiny, "--awq", "--eval-windows", 2, "--name", "TINY").exit_code == 0  # the same name: fine


def test_a_source_identity_follows_its_files_and_rewrites_its_cache_only_when_it_hashed(model_copy, tmp_path):
    """The identity names every file's content: a file changed in place is hashed again (size and mtime moved) and
    changes the identity; a call that finds every file in the hash cache leaves the cache file as it was."""
    from factory.checkpoints import sources

    model, cache = model_copy(), tmp_path / "cache"
    first = sources.folder_identity(model, cache)
    written = (cache / "file-sha256.json").stat().st_mtime_ns
    assert sources.folder_identity(model, cache) == first
    assert (cache / "file-sha256.json").stat().st_mtime_ns == written
    (model / "config.json").write_text((model / "config.json").read_text() + "\n")
    assert sources.folder_identity(model, cache) != first
    assert (cache / "file-sha256.json").stat().st_mtime_ns != written
