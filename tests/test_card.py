"""The model card as a Hugging Face user reads one: license and language from the base model's card, where that
card is, the calibration used, which EXL2 size to pick for a GPU, the prompt format."""

from __future__ import annotations

from pathlib import Path

from factory.publish import card, upstream
from factory.registry.published import QuantRow
from tests.quant_rows import quant_row

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


def _card(tmp_path: Path, rows: list[QuantRow], card_text: str | None = UPSTREAM_CARD) -> str:
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
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
