"""EXL2 specs: bits per weight, head bits, the calibration sizes, and the VRAM budget a size was chosen for."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from factory.engines.base import BpwSpec, BpwTargets
from factory.engines.exl2.memory import Cache
from factory.errors import SpecError
from factory.specs import BPW_MAX, BPW_MIN, Closed, parse_bpw_list


class Fit(Closed):
    """The budget an EXL2 size was chosen for (`--fit`): VRAM in bytes, the context and the KV cache it must hold."""

    vram: int = Field(gt=0)
    ctx: int = Field(gt=0)
    cache: Cache = "fp16"


class Exl2Spec(BpwSpec):
    BPW_RANGE = (BPW_MIN, BPW_MAX)
    HEAD_BITS = (2, 3, 4, 5, 6, 8)
    method: Literal["exl2"] = "exl2"
    fit: Fit | None = None
    measurement_rows: int = Field(16, ge=1)
    measurement_length: int = Field(2048, ge=16)
    rows: int = Field(100, ge=1)
    length: int = Field(2048, ge=16)


class Exl2Targets(BpwTargets):
    spec_class = Exl2Spec
    fit: list[Fit] | None = None  # --fit: the budget each bpw (same order) was chosen for

    @model_validator(mode="after")
    def _one_fit_per_size(self) -> Exl2Targets:
        if self.fit is not None and len(self.fit) != len(self.bpw):
            raise SpecError(f"exl2 fit lists {len(self.fit)} budgets for {len(self.bpw)} sizes; give one per size")
        return self

    def specs(self) -> list[Exl2Spec]:
        fits: dict[float, Fit] = {}
        for b, f in zip(self.bpw, self.fit or [], strict=False):  # two budgets that chose one size: the smaller
            fits[b] = min(fits.get(b, f), f, key=lambda x: x.vram)
        return [Exl2Spec(bpw=b, head_bits=self.head_bits, fit=fits.get(b)) for b in sorted(set(self.bpw))]


def targets_from_flag(value: str, written: dict) -> dict:
    """`--exl2 3.0,4.0` -> the recipe's exl2 settings with those sizes."""
    return {**written, "bpw": parse_bpw_list(value, "--exl2")}
