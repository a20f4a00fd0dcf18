"""Inputs too large, too deep or malformed to be real are refused with one sentence before any job exists (issue 30,
item 8): an eval window count beyond what an evaluation can reach (exit 2), a config.json nested 900 deep or larger
than a config can be (exit 3), Hub ids that are not owner/name (exit 2, before any Hub call), and safetensors
headers that list more tensors or bytes than a real shard (exit 3, without building the table). Issue 43: tensors
that overlap or leave gaps, processor and template files bounded and validated like config.json, another user's
private file through a hard link (exit 3), `~nouser/x` (exit 4)."""

import json
import os
import struct
import subprocess
import sys

import pytest

from factory.checkpoints.sources import is_hub_name
from factory.recipes import build_recipe
from tests.support import ROOT
from tests.support.fleet import BROKER
from tests.support.qf import Qf


def last_line(result) -> str:
    return result.stderr.splitlines()[-1]


def qf_process(qf: Qf, *args) -> subprocess.CompletedProcess:
    """The real CLI in its own process: a traceback shows as it would to a user."""
    return subprocess.run(
        [sys.executable, "-m", "factory.cli", *map(str, args)],
        env={**os.environ, **qf.env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def refused(result, code: int, message: str) -> None:
    """Exit `code` with `message` as the last line and no traceback: a CliRunner result or a finished process."""
    if isinstance(result, subprocess.CompletedProcess):
        exit_code, output = result.returncode, result.stdout + result.stderr
    else:
        exit_code, output = result.exit_code, result.output
    assert exit_code == code, output
    assert "Traceback" not in output
    assert output.strip().splitlines()[-1] == f"error: {message}"


# --- eval_windows: bounded where a recipe's settings are validated (flags, recipe files, the service) ---

WINDOWS_REFUSED = (
    "options: eval_windows: must be between 1 and 100000 (2048-token windows of the eval text), not "
    "3000000000 (recipe keys: awq, awqct, exl2, exl3, gguf, calibration, eval, eval_windows, max_ppl_ratio, "
    "max_kld, fit)"
)


@pytest.mark.parametrize("command", ["run", "submit"])
def test_eval_windows_beyond_any_evaluation_is_refused(qf, tiny, monkeypatch, command):
    # nothing may reach a broker; in a process of its own, as the Celery app takes the broker it first sees
    monkeypatch.setenv("FACTORY_BROKER_URL", "redis://127.0.0.1:1/0")
    result = qf_process(qf, command, tiny, "--awq", "--eval-windows", 3_000_000_000)
    refused(result, 2, WINDOWS_REFUSED)
    assert qf.json("jobs") == []


def test_eval_windows_in_a_recipe_is_refused(qf, tiny, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("awq: {w_bit: 4}\neval_windows: 3000000000\n")
    result = qf_process(qf, "run", tiny, "--recipe", recipe)
    refused(result, 2, WINDOWS_REFUSED.replace("options", f"recipe {str(recipe)!r}"))
    assert qf.json("jobs") == []


def test_eval_windows_bound_itself_is_allowed():
    from factory.recipes import MAX_EVAL_WINDOWS

    assert MAX_EVAL_WINDOWS == 100_000
    assert build_recipe(awq=True, eval_windows=MAX_EVAL_WINDOWS).eval_windows == MAX_EVAL_WINDOWS
    assert build_recipe(awq=True, eval_windows=1).eval_windows == 1


# --- config.json: bounded in depth and size before any job exists ---


def _nest(model, depth: int) -> None:
    config = json.loads((model / "config.json").read_text())
    text = json.dumps(config)[:-1] + ', "a": ' + '{"a": ' * depth + "1" + "}" * depth + "}"
    (model / "config.json").write_text(text)


def test_a_config_nested_900_deep_is_refused_before_a_job(qf, model_copy):
    model = model_copy()
    _nest(model, 900)
    refused(qf_process(qf, "run", model, "--awq"), 3, "config.json is nested too deeply to be a model's metadata")
    assert qf.json("jobs") == []
    refused(qf("plan", model, "--vram", "24GB"), 3, "config.json is nested too deeply to be a model's metadata")


def test_a_config_as_deep_as_real_ones_is_read(qf, model_copy):
    model = model_copy()
    _nest(model, 30)  # + the config itself and the innermost value: within the bound
    assert qf("plan", model, "--vram", "24GB").exit_code == 0


def test_a_config_larger_than_a_config_can_be_is_refused(qf, model_copy):
    model = model_copy()
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "padding": "x" * (2 << 20)}))
    size = (model / "config.json").stat().st_size
    refused(qf("plan", model, "--vram", "24GB"), 3, f"config.json is {size} bytes; a model's config is at most 1048576")


@pytest.mark.parametrize(
    "name, what",
    [("model.safetensors.index.json", "a safetensors index"), ("tokenizer_config.json", "a tokenizer's config")],
)
def test_other_metadata_larger_than_real_is_refused_before_a_job(qf, model_copy, name, what):
    model = model_copy()
    with open(model / name, "wb") as f:
        f.truncate((64 << 20) + 1)  # sparse: no disk used
    refused(qf("run", model, "--awq"), 3, f"{name} is {(64 << 20) + 1} bytes; {what} is at most {64 << 20}")
    assert qf.json("jobs") == []


# --- Hub ids: owner/name in the Hub's own grammar, refused before any Hub call ---

HUB_ID = (
    "neither a folder here nor a Hub repo owner/name[@revision] (ASCII letters, digits, '-', '_' and '.', "
    "at most 96 each, no '--' or '..')"
)


@pytest.mark.parametrize(
    "command, source",
    [
        (("run",), "alice/.."),
        (("submit",), "alice/mödel"),
        (("plan", "--vram", "24GB"), "alice/.."),
    ],
)
def test_hub_ids_that_are_not_owner_name_are_refused_by_the_cli(qf, hub, command, source):
    result = qf_process(qf, command[0], source, *(["--awq"] if command[0] != "plan" else command[1:]))
    refused(result, 2, f"source {source!r} is {HUB_ID}")
    assert hub.requests == []


@pytest.mark.parametrize(
    "source",
    [
        "alice/.",
        "alice/x/y",
        "alice/x--y",
        "alice/-x",
        "alice/x.",
        "alice/x.git",
        "alice/x@../main",
        "alice/x@",
        "al ice/x",
        "alice/" + "x" * 97,
    ],
)
def test_more_hub_ids_that_are_not_owner_name(qf, hub, source):
    refused(qf("run", source, "--awq"), 2, f"source {source!r} is {HUB_ID}")
    assert hub.requests == [] and qf.json("jobs") == []


def test_paths_that_do_not_exist_stay_not_found(qf, tmp_path):
    for missing in (tmp_path / "nope", "../nope-not-here", "~/nope-not-here"):
        refused(
            qf("run", missing, "--awq"),
            4,
            f"source {str(missing)!r} does not exist; pass a local folder with config.json and safetensors weights",
        )


@pytest.mark.parametrize("command", [("run", "--awq"), ("submit", "--awq"), ("plan", "--vram", "24GB")])
def test_the_home_of_a_user_that_does_not_exist_is_not_found(qf, monkeypatch, command):
    """`~nouser/x` made pathlib raise RuntimeError: a traceback (issue 43)."""
    monkeypatch.setenv("FACTORY_BROKER_URL", BROKER)  # qf submit asks the broker first; nothing reaches it
    result = qf_process(qf, command[0], "~nouser/x", *command[1:])
    refused(
        result,
        4,
        "source '~nouser/x' does not exist (there is no user 'nouser'); pass a local folder with config.json and "
        "safetensors weights",
    )
    assert qf.json("jobs") == []


@pytest.mark.parametrize(
    "name",
    [
        "meta-llama/Llama-3.1-8B",
        "HuggingFaceTB/SmolLM2-135M-Instruct@main",
        "org/name@refs/pr/1",
        "a/b@0123abc",
        "Qwen/Qwen2.5-0.5B@v1.0",
        "x_/_y",
    ],
)
def test_real_hub_ids_are_hub_names(name):
    assert is_hub_name(name)


# --- safetensors headers: bounded in bytes and tensor count before the table is built ---


def _empty_tensors_header(path, count: int, prefix: str = "e") -> int:
    """A safetensors file whose header lists `count` empty tensors (no data), written directly; its header's size."""
    entry = '"' + prefix + '%d":{"dtype":"F16","shape":[0],"data_offsets":[0,0]}'
    header = ("{" + ",".join([entry % i for i in range(count)]) + "}").encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    return len(header)


def test_the_issues_header_of_96_mib_is_refused(qf, model_copy):
    model = model_copy()
    n = _empty_tensors_header(model / "extra.safetensors", 1_700_000)
    assert n > 90 << 20
    refused(
        qf("plan", model, "--vram", "24GB"),
        3,
        f"extra.safetensors has a header of {n} bytes; a safetensors shard's header is at most 67108864",
    )


# Runs a command and prints its exit code and peak RSS (KiB). A child's peak counts the memory of the process it was
# forked from (pytest's, here), so the command is started from this small process instead.
PEAK = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL); "
    "_, status, usage = os.wait4(p.pid, 0); print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)"
)


def test_a_header_of_a_million_tensors_is_refused_without_building_it(qf, model_copy):
    """1M empty tensors in 56 MiB (under the byte bound): refused by count before parsing. Parsed, the table
    took 700 MiB and 7 s in `qf plan`; refused, the process stays near its baseline (about 40 MiB) plus the header."""
    model = model_copy()
    _empty_tensors_header(model / "extra.safetensors", 1_000_000)
    result = subprocess.run(
        [sys.executable, "-c", PEAK, sys.executable, "-m", "factory.cli", "plan", model, "--vram", "24GB"],
        env={**os.environ, **qf.env},
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    code, peak = map(int, result.stdout.split())
    assert code == 3, result.stderr
    assert result.stderr.strip() == (
        "error: extra.safetensors lists more than 262144 tensors in its header; a real "
        "model's shard lists at most tens of thousands"
    )
    assert peak < 300 << 10, f"peak {peak >> 10} MiB"


def test_more_tensors_over_all_shards_than_a_model_has_are_refused(qf, model_copy):
    model = model_copy()
    for i, count in enumerate([1 << 18, 1 << 18, 1]):  # each shard within its bound, one more than 512k in all
        _empty_tensors_header(model / f"extra-{i}.safetensors", count, prefix=f"s{i}.")
    refused(
        qf("plan", model, "--vram", "24GB"),
        3,
        "the model's safetensors headers list more than 524288 tensors in all; a real model lists at most a few "
        "hundred thousand",
    )


# --- safetensors data: tensors tile it (issue 43: overlapping offsets turned an 888 KB source into a 2.1 GB quant) ---


def _shard(path, spans: list[tuple[int, int]], data: int) -> None:
    """A shard of U8 tensors at these data_offsets over `data` bytes of data."""
    header = {
        f"t{i}": {"dtype": "U8", "shape": [end - begin], "data_offsets": [begin, end]}
        for i, (begin, end) in enumerate(spans)
    }
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))


@pytest.mark.parametrize(
    "spans, data, message",
    [
        ([(0, 64), (0, 64), (0, 64)], 64, "'t1' starts at byte 0 of the data, where 64 was expected"),
        ([(0, 64), (32, 96)], 96, "'t1' starts at byte 32 of the data, where 64 was expected"),
        ([(0, 32), (64, 96)], 96, "'t1' starts at byte 64 of the data, where 32 was expected"),
        ([(8, 40)], 40, "'t0' starts at byte 8 of the data, where 0 was expected"),
    ],
    ids=["the-same-bytes-thrice", "overlapping", "a-gap", "a-gap-first"],
)
def test_tensors_that_overlap_or_leave_gaps_are_refused_before_a_job(qf, model_copy, spans, data, message):
    model = model_copy()
    _shard(model / "extra.safetensors", spans, data)
    refused(
        qf_process(qf, "run", model, "--awq"),
        3,
        f"extra.safetensors: tensor {message}; a safetensors file's tensors follow one another without overlap or gap",
    )
    assert qf.json("jobs") == []


# --- processor and template files: bounded and validated like config.json (issue 43) ---


def _deep(depth: int) -> str:
    return '{"chat_template": "{{ messages }}", "a": ' + '{"a": ' * depth + "1" + "}" * depth + "}"


def _write(name: str, text: str):
    return lambda model: (model / name).write_text(text)


def _sparse(name: str, size: int):
    def change(model):
        with open(model / name, "wb") as f:
            f.truncate(size)

    return change


COMPANIONS_REFUSED = [
    (  # the issue's: a 1 GiB sparse preprocessor_config.json reached the registry
        "sparse-processor-config",
        _sparse("preprocessor_config.json", 1 << 30),
        f"preprocessor_config.json is {1 << 30} bytes; a processor's config is at most 1048576",
    ),
    (
        "large-chat-template",
        _sparse("chat_template.jinja", (1 << 20) + 1),
        f"chat_template.jinja is {(1 << 20) + 1} bytes; a chat template is at most 1048576",
    ),
    (
        "processor-auto-map",
        _write("preprocessor_config.json", json.dumps({"auto_map": {"AutoImageProcessor": "evil.Processor"}})),
        "the model needs custom code (auto_map in preprocessor_config.json); only architectures built into "
        "transformers are allowed",
    ),
    (
        "video-processor-auto-map",
        _write("video_preprocessor_config.json", json.dumps({"auto_map": {"AutoVideoProcessor": "evil.Processor"}})),
        "the model needs custom code (auto_map in video_preprocessor_config.json); only architectures built into "
        "transformers are allowed",
    ),
    (  # 100k deep: json.loads itself hits the recursion limit
        "deep-chat-template",
        _write("chat_template.json", _deep(100_000)),
        "chat_template.json is nested too deeply to be a model's metadata",
    ),
    (
        "chat-template-nested-900",
        _write("chat_template.json", _deep(900)),
        "chat_template.json is nested too deeply to be a model's metadata",
    ),
    (
        "processor-not-json",
        _write("processor_config.json", "{not json"),
        "processor_config.json is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
        "(char 1))",
    ),
    (
        "generation-config-a-list",
        _write("generation_config.json", "[1, 2]"),
        "generation_config.json is not a JSON object",
    ),
]


@pytest.mark.parametrize(
    ("breaks", "message"), [c[1:] for c in COMPANIONS_REFUSED], ids=[c[0] for c in COMPANIONS_REFUSED]
)
def test_processor_and_template_files_are_refused_before_a_job(qf, model_copy, breaks, message):
    model = model_copy()
    breaks(model)
    refused(qf_process(qf, "run", model, "--awq"), 3, message)
    assert qf.json("jobs") == [] and qf.registry_files() == []


def test_a_processor_config_as_real_ones_are_is_published(qf, model_copy, tmp_path):
    model = model_copy()
    processor = {"image_processor_type": "SiglipImageProcessor", "size": {"height": 896, "width": 896}}
    (model / "preprocessor_config.json").write_text(json.dumps(processor))
    (model / "chat_template.json").write_text(_deep(20))
    result = qf("run", model, "--awq", "--eval-windows", 1)
    assert result.exit_code == 0, result.output
    [row] = qf.json("ls")
    assert qf("pull", row["name"], "-o", tmp_path / "pulled").exit_code == 0
    assert json.loads((tmp_path / "pulled" / "preprocessor_config.json").read_text()) == processor


NOBODY = 65534  # another user: the files below are chowned to it (the tests run as root)


@pytest.mark.parametrize("link", ["hard-link", "own-file"])
def test_a_file_only_its_owner_may_read_is_not_published_for_another(qf, model_copy, tmp_path, link):
    """A hard link to another user's 0600 file was published 0444 (issue 43). A file not every user may read is
    taken only from its owner, through its only name: another user's, or a hard link, is refused."""
    model = model_copy()
    private = tmp_path / "private.json"
    private.write_text('{"secret": "of another user"}')
    private.chmod(0o600)
    if link == "hard-link":
        os.chown(private, NOBODY, NOBODY)
        os.link(private, model / "preprocessor_config.json")
        why = f"belongs to another user (uid {NOBODY})"
    else:  # root's own private file, linked in: whoever made the link, it is the same file under two names
        os.link(private, model / "preprocessor_config.json")
        why = "is a hard link (2 names)"
    refused(
        qf_process(qf, "run", model, "--awq"),
        3,
        f"preprocessor_config.json {why} and not every user may read it (mode 0600); a quant's files are readable "
        "by all, so make it readable (chmod a+r) or copy it into the folder as its owner",
    )
    assert qf.json("jobs") == [] and qf.registry_files() == []
