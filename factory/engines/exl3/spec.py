"""EXL3 specs: bits per weight (1.0-8.0), head bits, and the calibration rows exllamav3 runs on."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from factory.engines.base import BpwSpec, BpwTargets
from factory.specs import parse_bpw_list

BPW_MIN, BPW_MAX = 1.0, 8.0
ROWS = 250  # exllamav3's default calibration: 250 rows of 2048 tokens
MIN_ROWS = 16


class Exl3Spec(BpwSpec):
    BPW_RANGE = (BPW_MIN, BPW_MAX)
    HEAD_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 16)  # convert_model's -hb: an integer 1-8, or 16 (unquantized)
    method: Literal["exl3"] = "exl3"
    rows: int | None = Field(None, ge=1)  # None: ROWS, or as many as the calibration text holds when fewer
    length: int = Field(2048, ge=16)


class Exl3Targets(BpwTargets):
    spec_class = Exl3Spec


def targets_from_flag(value: str, written: dict) -> dict:
    """`--exl3 3.0,4.0` -> the recipe's exl3 settings with those sizes."""
    return {**written, "bpw": parse_bpw_list(value, "--exl3", BPW_MIN, BPW_MAX)}
