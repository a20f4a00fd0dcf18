"""QuantRows for tests of what reads them (the card, the CLI's tables): a row with every field, some given."""

from __future__ import annotations

import factory.engines  # noqa: F401  (registers the engines' spec classes, which specs.parse reads)
from factory import specs
from factory.registry.published import QuantRow
from factory.specs import QuantSpec

DEFAULTS = dict(
    rev="abc1234",
    bits=4.0,
    bytes=2**30,
    ppl=8.0,
    fp16_ppl=7.6,
    kld=0.05,
    kld_p99=0.6,
    top1=0.9,
    source="s",
    source_identity="sha256:0",
    calibration="builtin:c4",
    eval={},
    versions={},
    job="j",
    path="p",
    created_at="2026-12-01T00:00:00",
)


def spec_of(tag: str, **fields) -> QuantSpec:
    """The spec a built-in engine's `tag` names (its sizes read off the tag), with `fields` besides."""
    method, size = tag.split("-")[:2]
    read = {
        "exl2": {"bpw": size.removesuffix("bpw")},
        "exl3": {"bpw": size.removesuffix("bpw")},
        "awq": {"group_size": size.split("g")[-1]},
        "awqct": {"group_size": size.split("g")[-1]},
        "gguf": {"type": size.upper()},
    }[method]
    return specs.parse({"method": method, **read, **fields})


def quant_row(ref: str, spec: dict | None = None, **fields) -> QuantRow:
    """`ref` is `name:tag`; the method is the tag's first word unless given; `spec`: fields of the tag's spec."""
    name, tag = ref.split(":")
    made = spec_of(tag, **(spec or {}))
    return QuantRow(**{**DEFAULTS, "name": name, "tag": tag, "method": tag.split("-")[0], "spec": made, **fields})
