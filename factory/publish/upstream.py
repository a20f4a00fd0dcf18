"""What a quant's card says about the model it was made from: the base model's license, language and its own card,
how the FP16 checkpoint was made when it is not the original release, and the prompt format of its chat template.

Read from the source folder: its README.md's YAML front matter (the upstream model card; a Hub fetch downloads it
beside the weights, and it is never part of the source's identity nor published) and the chat template the quant
carries (`chat_template.jinja`, or `chat_template` in tokenizer_config.json), which the card renders with bounds
(factory/publish/prompt.py). A front matter key `quantfactory_note` describes a checkpoint that is not the original
release (tests/support/smollm2.py writes one: its FP16 weights are dequantized from a GGUF).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from factory.checkpoints.inspection import COMPANION_BOUNDS, MAX_CONFIG, multimodal, read_config, read_json, tower_kind
from factory.errors import ModelRefused


@dataclass(frozen=True)
class Upstream:
    base_model: str
    license: str | None = None
    license_link: str | None = None
    language: list[str] | None = None
    note: str | None = None
    chat_template: str | None = None
    vision: str | None = None  # a vision-language model's vision tower (its config's model_type), kept at 16 bits

    @property
    def url(self) -> str | None:
        """The base model's page on the Hub, when base_model is a Hub repo (org/name)."""
        return f"https://huggingface.co/{self.base_model}" if self.base_model.count("/") == 1 else None


def read(base_model: str, card: str | None, staged: Path) -> Upstream:
    meta = _front_matter(card) if card else {}
    language = meta.get("language")
    return Upstream(
        base_model=base_model,
        license=_text(meta.get("license")),
        license_link=_text(meta.get("license_link")),
        language=[language] if isinstance(language, str) else language if _texts(language) else None,
        note=_text(meta.get("quantfactory_note")),
        chat_template=_chat_template(staged),
        vision=_vision(staged),
    )


def _vision(staged: Path) -> str | None:
    """The vision tower's kind, where the staged config is a vision-language model's."""
    try:
        config = read_config(staged / "config.json", check_numbers=False)
    except (OSError, ModelRefused):
        return None
    return (_text(tower_kind(config)) or "vision") if multimodal(config) else None


def _front_matter(card: str) -> dict:
    if not card.startswith("---"):
        return {}
    try:
        meta = yaml.safe_load(card.split("---", 2)[1])
    except (yaml.YAMLError, IndexError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value and len(value) <= 2000 else None


def _texts(value: object) -> bool:
    return isinstance(value, list) and 0 < len(value) <= 50 and all(_text(v) for v in value)


def _chat_template(staged: Path) -> str | None:
    """The template transformers applies: chat_template.jinja, else a processor's chat_template.json, else the
    tokenizer's config."""
    path = staged / "chat_template.jinja"
    if path.is_file():
        with open(path, "rb") as f:
            return f.read(MAX_CONFIG).decode("utf-8", errors="replace")
    for name, (most, what) in ((n, COMPANION_BOUNDS[n]) for n in ("chat_template.json", "tokenizer_config.json")):
        try:
            found = read_json(staged / name, most, what)
        except (OSError, ModelRefused):
            continue
        if isinstance(found, dict) and isinstance(found.get("chat_template"), str):
            return found["chat_template"]
    return None
