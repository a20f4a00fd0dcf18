"""QuantRows for tests of what reads them (the card, the CLI's tables): a row with every field, some given."""

from __future__ import annotations

from factory.registry.published import QuantRow

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
    spec={},
    created_at="2026-12-01T00:00:00",
)


def quant_row(ref: str, **fields) -> QuantRow:
    """`ref` is `name:tag`; the method is the tag's first word unless given."""
    name, tag = ref.split(":")
    return QuantRow(**{**DEFAULTS, "name": name, "tag": tag, "method": tag.split("-")[0], **fields})
