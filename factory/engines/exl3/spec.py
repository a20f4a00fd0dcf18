"""EXL3 specs: bits per weight (1.0-8.0), head bits, and the calibration rows exllamav3 runs on."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from factory.engines.base import QuantSpec, Targets
from factory.specs import bpw_tag, check_bpw, check_head_bits, parse_bpw_list

BPW_MIN, BPW_MAX = 1.0, 8.0
HEAD_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 16)  # convert_model's -hb: an integer 1-8, or 16 (unquantized)
ROWS = 250  # exllamav3's default calibration: 250 rows of 2048 tokens
MIN_ROWS = 16


class Exl3Spec(QuantSpec):
    method: Literal["exl3"] = "exl3"
    bpw: float
    head_bits: int = 6
    rows: int | None = Field(None, ge=1)  # None: ROWS, or as many as the calibration text holds when fewer
    length: int = Field(2048, ge=16)

    @field_validator("bpw", mode="before")
    @classmethod
    def _bpw(cls, v: object) -> float:
        return check_bpw(v, BPW_MIN, BPW_MAX)

    @field_validator("head_bits", mode="before")
    @classmethod
    def _head(cls, v: object) -> int:
        return check_head_bits(v, HEAD_BITS)

    @property
    def tag(self) -> str:
        return bpw_tag("exl3", self.bpw, self.head_bits)

    @property
    def bits(self) -> float:
        return self.bpw


class Exl3Targets(Targets):
    bpw: list[float] = Field(min_length=1)
    head_bits: int = 6

    @field_validator("bpw", mode="before")
    @classmethod
    def _bpw(cls, v: object) -> list[float]:
        return [check_bpw(b, BPW_MIN, BPW_MAX) for b in (v if isinstance(v, list) else [v])]

    @field_validator("head_bits", mode="before")
    @classmethod
    def _head(cls, v: object) -> int:
        return check_head_bits(v, HEAD_BITS)

    def specs(self) -> list[Exl3Spec]:
        return [Exl3Spec(bpw=b, head_bits=self.head_bits) for b in sorted(set(self.bpw))]


def targets_from_flag(value: str, written: dict) -> dict:
    """`--exl3 3.0,4.0` -> the recipe's exl3 settings with those sizes."""
    return {**written, "bpw": parse_bpw_list(value, "--exl3", BPW_MIN, BPW_MAX)}
