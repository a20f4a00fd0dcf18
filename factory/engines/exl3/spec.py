"""EXL3 specs: bits per weight (1.0-8.0), head bits, the calibration rows exllamav3 runs on, and whether the bits are
chosen per tensor (`opt`: exllamav3's measure and optimize, factory/engines/exl3/optimize.py).

An optimized size (`--exl3 4.0opt`, recipe `exl3: {opt: [4.0]}`, tag `exl3-4.0bpw-opt`) is made from the uniform
sizes around it, which the job makes, scores and publishes too: the whole bits below and above it and the size itself
(4.0opt: 3.0, 4.0 and 5.0; 4.5opt: 4.0, 4.5 and 5.0), so it needs 1.0 < bpw < 8.0.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_serializer, model_validator

from factory.engines.base import BpwSpec, BpwTargets
from factory.errors import SpecError
from factory.specs import check_bpw

BPW_MIN, BPW_MAX = 1.0, 8.0
ROWS = 250  # exllamav3's default calibration: 250 rows of 2048 tokens
MIN_ROWS = 16
OPT = "opt"  # `--exl3 4.0opt`; the tag's suffix (`exl3-4.0bpw-opt`)
MEASURE_ROWS, MEASURE_LENGTH = 10, 1024  # exllamav3's measure_model defaults (-cr, -cc)
MEASURE_KLD = "measure-kld"  # an optimized size's shared unit (its measurement) and its stage in the ETA's history


class Exl3Spec(BpwSpec):
    BPW_RANGE = (BPW_MIN, BPW_MAX)
    HEAD_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 16)  # convert_model's -hb: an integer 1-8, or 16 (unquantized)
    method: Literal["exl3"] = "exl3"
    rows: int | None = Field(None, ge=1)  # None: ROWS, or as many as the calibration text holds when fewer
    length: int = Field(2048, ge=16)
    opt: bool = False  # bits chosen per tensor (exllamav3's measure and optimize), to the size of the uniform bpw

    @model_validator(mode="after")
    def _room_around(self) -> Exl3Spec:
        if self.opt:
            check_opt(self.bpw)
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler) -> dict:
        """A uniform size is stored and hashed as it was before `opt` existed (its weights keys stay what they were)."""
        data = handler(self)
        if not self.opt:
            data.pop("opt", None)
        return data

    @property
    def tag(self) -> str:
        return f"{super().tag}-{OPT}" if self.opt else super().tag

    @property
    def flag_value(self) -> str:
        return f"{super().flag_value}{OPT}" if self.opt else super().flag_value

    def uniform(self, bpw: float | None = None) -> Exl3Spec:
        """The uniform size at `bpw` (its own by default) with this spec's head bits and calibration."""
        return self.model_copy(update={"bpw": self.bpw if bpw is None else bpw, "opt": False})


def check_opt(bpw: float) -> float:
    """Rules: an optimized size has a whole bit below and above it within [1.0, 8.0]. Valid: 4.0, 1.5, 7.5. Not
    valid: 1.0, 8.0."""
    if not BPW_MIN < bpw < BPW_MAX:
        raise SpecError(
            f"exl3 {bpw}{OPT} needs a uniform size a bit below and a bit above it; use a size between "
            f"{BPW_MIN} and {BPW_MAX}, both excluded"
        )
    return bpw


def sources(bpw: float) -> list[float]:
    """The uniform sizes an optimized size is made from, lowest first: the whole bits below and above it and itself
    (4.0 -> 3.0, 4.0, 5.0; 4.5 -> 4.0, 4.5, 5.0). exllamav3's measure takes the first as its base."""
    return [float(math.ceil(bpw) - 1), bpw, float(math.floor(bpw) + 1)]


class Exl3Targets(BpwTargets):
    spec_class = Exl3Spec
    bpw: list[float] = Field(default_factory=list)
    opt: list[float] = Field(default_factory=list)  # sizes whose bits exllamav3 chooses per tensor

    @field_validator("opt", mode="before")
    @classmethod
    def _opt(cls, v: object) -> list[float]:
        return [check_opt(check_bpw(b, BPW_MIN, BPW_MAX)) for b in (v if isinstance(v, list) else [v])]

    @model_validator(mode="after")
    def _some(self) -> Exl3Targets:
        if not self.bpw and not self.opt:
            raise SpecError("exl3 needs sizes: bpw: [4.0] (uniform), opt: [4.0] (bits chosen per tensor), or both")
        return self

    def specs(self) -> list[Exl3Spec]:
        """The uniform sizes (those asked for and those an optimized size is made from), then the optimized ones."""
        uniform = sorted({*self.bpw, *(b for t in self.opt for b in sources(t))})
        return [Exl3Spec(bpw=b, head_bits=self.head_bits) for b in uniform] + [
            Exl3Spec(bpw=b, head_bits=self.head_bits, opt=True) for b in sorted(set(self.opt))
        ]


def targets_from_flag(value: str, written: dict) -> dict:
    """`--exl3 3.0,4.0` -> the recipe's exl3 settings with those sizes; `4.0opt` asks for 4.0 with its bits chosen
    per tensor (and the uniform sizes it is made from)."""
    parts = [p.strip() for p in value.split(",")]
    if not any(parts):
        raise SpecError(
            f"--exl3 needs sizes in [{BPW_MIN}, {BPW_MAX}] separated by commas (4.0, or 4.0{OPT} for bits chosen "
            f"per tensor), got {value!r}"
        )
    opt = [p for p in parts if p.lower().endswith(OPT)]
    return {
        **written,
        "bpw": [check_bpw(p, BPW_MIN, BPW_MAX) for p in parts if p not in opt],
        "opt": [check_bpw(p[: -len(OPT)].strip(), BPW_MIN, BPW_MAX) for p in opt],
    }
