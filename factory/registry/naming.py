"""Quant names: `name:tag[@rev]`, e.g. `smollm2-135m-instruct:<tag>` or `tiny:<tag>@1a2b3c4`.

Rules:
    name  the source repo's name part or folder name, lowercased; characters [a-z0-9._-]; starts with a letter
          or digit; at most 96 characters; never `..`. Whatever a user types is lowercased first (ASCII letters
          only: `K` (the Kelvin sign) stays what it is, and is refused, instead of becoming `k`).
    tag   the grammar of a registered engine (factory.engines registers each engine's `tag_pattern`, with its
          `tag_example`), matched case-insensitively; the engines' grammars are listed in factory/engines/.
    rev   the first 7 (or more) hex digits of the source commit or content hash; without it, the newest.
Not valid whatever the tag: `../etc:<tag>` (`..`), `-x:<tag>` (leading -), `\u212aiwi:<tag>` (not ASCII).
Examples of valid and refused names, engine by engine: tests/unit/test_naming.py.
A valid name never reaches outside the registry folder: it has no `/` and no `..`.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

from factory.errors import SpecError

NAME_MAX = 96
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,95}")
_TAGS: dict[str, tuple[re.Pattern, str]] = {}  # engine name -> (its tag grammar, an example); see register_tag
_REV = re.compile(r"[0-9a-f]{7,64}")
_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def ascii_lower(text: str) -> str:
    """Lowercase ASCII letters only: str.lower() folds some non-ASCII letters into ASCII ones (the Kelvin sign)."""
    return text.translate(_ASCII_LOWER)


def model_name(label: str) -> str:
    """A valid name from a repo or folder name: `SmolLM2 135M (copy)` -> `smollm2-135m-copy`."""
    name = re.sub(r"[^a-z0-9._-]+", "-", ascii_lower(label))
    name = re.sub(r"\.{2,}", ".", name).strip(".-_")[:NAME_MAX].rstrip(".-_")
    if not _NAME.fullmatch(name):
        raise SpecError(f"cannot make a quant name from {label!r}; pass --name with letters, digits, '.', '_' or '-'")
    return name


def register_tag(method: str, pattern: str, example: str) -> None:
    """An engine's tags: they start with `<method>-` and match `pattern` in full."""
    if not pattern.startswith(f"{method}-"):
        raise ValueError(f"the tags of engine {method!r} must start with {method}-")
    _TAGS[method] = (re.compile(pattern), example)


def unregister_tag(method: str) -> None:
    _TAGS.pop(method, None)


def tag_matches(method: str, tag: str) -> bool:
    return method in _TAGS and _TAGS[method][0].fullmatch(tag) is not None


def tag_examples() -> str:
    examples = [example for _, example in sorted(_TAGS.values(), key=lambda t: t[1])]
    return ", ".join(examples[:-1]) + (" or " if len(examples) > 1 else "") + examples[-1] if examples else "none"


@dataclass(frozen=True)
class QuantRef:
    name: str
    tag: str | None = None
    rev: str | None = None

    def __str__(self) -> str:
        text = self.name if self.tag is None else f"{self.name}:{self.tag}"
        return text if self.rev is None else f"{text}@{self.rev}"


def parse(text: str, *, tag_required: bool = False) -> QuantRef:
    """`name[:tag][@rev]` -> QuantRef, lowercased; SpecError (exit 2) with the rules when it is not valid."""
    raw = ascii_lower(text.strip())
    rest, _, rev = raw.partition("@")
    name, sep, tag = rest.partition(":")
    problems = []
    if not _NAME.fullmatch(name) or ".." in name:
        problems.append(f"name {name!r} must be 1-96 of [a-z0-9._-], start with a letter or digit, no '..'")
    if sep and not any(tag_matches(method, tag) for method in _TAGS):
        problems.append(f"tag {tag!r} must look like {tag_examples()}")
    if tag_required and not sep:
        problems.append("a tag is required (NAME:TAG)")
    if "@" in raw and not _REV.fullmatch(rev):
        problems.append(f"revision {rev!r} must be 7 to 64 hex digits")
    if problems:
        raise SpecError(f"not a valid quant name {text!r}: " + "; ".join(problems))
    return QuantRef(name=name, tag=tag or None, rev=rev or None)
