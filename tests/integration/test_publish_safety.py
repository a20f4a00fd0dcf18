"""Publishing cannot be burnt by a chat template, and what it leaves agrees with itself: a job's state, `qf ls` and
the registry folder tell the same story after an interrupt or a kill at any moment of publishing; what the job
inspected is what it publishes."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from factory.checkpoints import sources
from factory.publish import folder as registry
from factory.publish import prompt
from tests.support.processes import events_until, qf_process, stopped_at
from tests.support.qf import Qf

RUN = ("--awq", "--eval-windows", 1)
BOMB = "{% for a in range(99999) %}{% for b in range(99999) %}x{% endfor %}{% endfor %}"  # 80 bytes, 10^10 x
SLOW = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"  # no output, ~400 s
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _agree(qf: Qf) -> tuple[dict, list[dict]]:
    """The one job's status and `qf ls`, after checking that they and the registry folder agree: every quant listed
    has its folder, which matches its manifest; the registry holds no other quant folder; a job with a published
    quant is not failed nor cancelled (this job has one quant and no push: published means succeeded once it
    ended)."""
    [job] = qf.json("status")  # the recent jobs, this one alone
    listed = qf.json("ls")
    folders = {
        str(p.relative_to(qf.home / "registry"))
        for p in (qf.home / "registry").glob("*/*")
        if p.is_dir() and not p.name.startswith(registry.STAGING)
    }
    assert folders == {q["path"] for q in listed}, (folders, listed)
    for q in listed:
        registry.verify(qf.home / "registry" / q["path"])
    if listed:
        assert job["state"] in ("succeeded", "running"), job
    if job["state"] == "succeeded":
        assert [q["name"] for q in listed] == ["tiny:awq-w4g128"]
    return job, listed


def _steps(job: dict) -> dict[str, str]:
    """Each step's state in its last attempt."""
    return {s["name"]: s["state"] for s in job["steps"]}


def _card(qf: Qf) -> str:
    [quant] = qf.json("ls")
    return (qf.home / "registry" / quant["path"] / "README.md").read_text()


# -- a chat template cannot burn the publish step ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "example", "why_not"),
    [
        (
            CHATML,
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is the capital of "
            "France?<|im_end|>\n<|im_start|>assistant\n",
            None,
        ),
        ("{{ tools[0].name }}", None, "jinja2's sandbox cannot render it (UndefinedError)"),  # needs `tools`
        (BOMB, None, "it renders to more than 64 KiB"),
        (SLOW, None, "rendering it took longer than 5 s"),
        ("{{ 'x' * 2000000000 }}", None, "rendering it needed more than 512 MiB"),
    ],
    ids=["chatml", "other-variables", "output-bomb", "loop-bomb", "memory-bomb"],
)
def test_the_prompt_example_is_rendered_with_bounds(template, example, why_not):
    start = time.monotonic()
    assert prompt.example(template) == prompt.Example(example, why_not)
    assert time.monotonic() - start < prompt.SECONDS + 2


# -- interrupts and kills at any moment of publishing --------------------------------------------------------------


def test_sigterm_while_publishing_leaves_a_state_that_says_what_was_published(qf, model_copy):
    """SIGTERM while a publish unit (in its thread) renders a slow template: once the quant is published the job is
    succeeded, and a job that is not succeeded published nothing; running it again ends it succeeded."""
    model = model_copy("tiny")
    (model / "chat_template.jinja").write_text(SLOW.replace("99999", "9000"))  # ~3 s in process
    args = ("run", model, *RUN)
    proc = qf_process(qf, *args, "--json", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    events_until(proc, "publish:awq-w4g128")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    job, listed = _agree(qf)
    assert (job["state"] == "succeeded") == bool(listed), (job, listed)
    again = qf(*args)
    assert again.exit_code == 0, again.output
    job, listed = _agree(qf)
    assert job["state"] == "succeeded" and len(listed) == 1


def _killed_at(qf: Qf, moment: str, *args) -> None:
    proc = stopped_at(qf, moment, *args)
    proc.kill()
    proc.wait(30)


def test_a_kill_at_any_moment_of_publishing_leaves_status_ls_and_registry_agreeing(qf, model_copy):
    """SIGKILL before the card, with the registry folder in place but its row not recorded, with the row recorded, and
    with the publish step ended, and SIGTERM with the folder in place: each time `qf status`, `qf ls` and the registry
    agree (a killed job stays `running` until it runs again; a folder whose row was not recorded is not published: `qf
    ls` and pull do not see it, and the next attempt adopts it), and the same command then ends the job succeeded."""
    model = model_copy("tiny")
    (model / "chat_template.jinja").write_text(CHATML)

    _killed_at(qf, "card", model, *RUN)
    job, listed = _agree(qf)
    assert (job["state"], listed, _steps(job)["publish:awq-w4g128"]) == ("running", [], "running")

    # SIGTERM inside the row's transaction (units one at a time: in the main thread): the folder goes again
    proc = stopped_at(qf, "placed", model, *RUN, FACTORY_MAX_UNITS="1")
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    assert proc.wait(60) == 130
    job, listed = _agree(qf)
    assert (job["state"], job["error"].split(" ")[0], listed) == ("failed", "interrupted", [])

    _killed_at(qf, "placed", model, *RUN)
    [placed] = (qf.home / "registry" / "tiny").glob("awq-w4g128@*")
    [job] = qf.json("status")
    assert (job["state"], qf.json("ls")) == ("running", [])  # in place, not published
    registry.verify(placed)

    _killed_at(qf, "recorded", model, *RUN)
    job, [quant] = _agree(qf)
    assert (job["state"], quant["path"], _steps(job)["publish:awq-w4g128"]) == (
        "running",
        f"tiny/{placed.name}",
        "running",
    )

    _killed_at(qf, "ended", model, *RUN)
    job, [_] = _agree(qf)
    assert (job["state"], _steps(job)["publish:awq-w4g128"]) == ("running", "succeeded")

    again = qf("run", model, *RUN)
    assert again.exit_code == 0, again.output
    job, [quant] = _agree(qf)
    assert job["state"] == "succeeded" and quant["path"] == f"tiny/{placed.name}"
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in _card(qf)
    assert not list((qf.home / "registry").glob(f"*/{registry.STAGING}*"))


# -- a hostile source: a template bomb, files swapped after inspect ------------------------------------------------


def _swapped_after(qf: Qf, model, step: str, name: str, secret, timeout: float = 120) -> subprocess.CompletedProcess:
    """`qf run` of `model`, whose `name` becomes a link to `secret` (outside the folder) once `step` has started."""
    proc = qf_process(qf, "run", model, *RUN, "--json", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        events_until(proc, step)
        (model / name).unlink()
        (model / name).symlink_to(secret)
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _holds(qf: Qf, data: bytes) -> list:
    return [p for p in qf.home.rglob("*") if p.is_file() and not p.is_symlink() and data in p.read_bytes()]


def test_a_template_bomb_and_a_companion_swapped_after_inspect(qf, model_copy, tmp_path):
    """Two attacks of one hostile source folder in one run (CI's time is short): its chat_template.jinja is the
    80-byte template that ran 272 s at publish, and its tokenizer_config.json becomes a link to a secret outside the
    folder while the quant is made (after inspect staged the source). The run succeeds in well under a minute; the
    card says why it shows no prompt example; the quant carries the tokenizer_config.json that inspect hashed, and
    no file under FACTORY_HOME holds the secret."""
    model = model_copy("tiny")
    (model / "chat_template.jinja").write_text(BOMB)
    inspected = (model / "tokenizer_config.json").read_bytes()
    secret = tmp_path / "id_rsa"
    secret.write_text('{"secret": "-----BEGIN OPENSSH PRIVATE KEY----- s3cret"}')
    done = _swapped_after(qf, model, "quantize:awq-w4g128", "tokenizer_config.json", secret, timeout=60)
    assert done.returncode == 0, done.stderr
    job, [quant] = _agree(qf)
    assert job["state"] == "succeeded"
    text = _card(qf)
    assert (
        "The quants carry the base model's chat template. No example is shown: it renders to more than 64 KiB.\n"
    ) in text
    assert "xxxx" not in text
    assert (qf.home / "registry" / quant["path"] / "tokenizer_config.json").read_bytes() == inspected
    assert _holds(qf, b"s3cret") == []


def test_weights_swapped_for_a_link_after_inspect_do_not_reach_the_job(qf, model_copy, tmp_path):
    """model.safetensors becomes a link to a private file outside the folder once the quantize step started: the
    engines read the job's own snapshot, made and hashed at inspect, so the job publishes the quant of the weights it
    inspected, under their identity, and the private file reaches nothing under FACTORY_HOME."""
    model = model_copy("tiny")
    submitted = sources.folder_identity(model, tmp_path / "cache")
    other = tmp_path / "private.safetensors"
    other.write_bytes(b"s3cret" * 1000)
    done = _swapped_after(qf, model, "quantize:awq-w4g128", "model.safetensors", other)
    assert done.returncode == 0, done.stderr
    job, [quant] = _agree(qf)
    assert job["state"] == "succeeded"
    manifest = json.loads((qf.home / "registry" / quant["path"] / "manifest.json").read_text())
    assert manifest["source_identity"] == submitted
    assert _holds(qf, b"s3cret") == []
