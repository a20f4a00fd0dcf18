"""AWQ-CT specs: AWQ w4 with a zero point (W4A16 asymmetric) in compressed-tensors' pack-quantized format, a group
size, and the calibration llm-compressor's AWQModifier runs on."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from factory.engines.awq.spec import GROUP_SIZES, group_size
from factory.engines.base import QuantSpec, Targets


class AwqCtSpec(QuantSpec, Targets):
    """Defaults that depend on the model or the device (group size, calibration size) stay None in what the user
    wrote and are filled in by `resolve` before anything is hashed or run."""

    method: Literal["awqct"] = "awqct"
    w_bit: Literal[4] = 4
    group_size: int | None = None  # None: 128, or 64 where 128 does not divide the model's dims
    calib_rows: int | None = Field(None, ge=1)  # None: 128 on CUDA, 16 on CPU (fewer if the text is short)
    calib_length: int | None = Field(None, ge=16)  # None: 512 on CUDA, 128 on CPU
    duo_scaling: bool = True  # AWQModifier's: scales from activations and weights (False: activations only)

    @field_validator("group_size")
    @classmethod
    def _group(cls, v: int | None) -> int | None:
        if v is not None and v not in GROUP_SIZES:
            raise ValueError(f"group size {v} not allowed; use one of {', '.join(map(str, GROUP_SIZES))}")
        return v

    @property
    def tag(self) -> str:
        if self.group_size is None:
            raise ValueError("resolve the AWQ-CT spec against the model before naming it")
        return f"awqct-w{self.w_bit}g{self.group_size}"

    @property
    def bits(self) -> float:
        return float(self.w_bit)

    def specs(self) -> list[AwqCtSpec]:  # a recipe's `awqct:` key is one spec
        return [self]


def resolve(spec: AwqCtSpec, in_features: list[int], cuda: bool) -> AwqCtSpec:
    """Fill in the model- and device-dependent defaults but the calibration rows (awq.spec.calibration_rows, once
    the text is tokenized); refuse a group size that does not divide the dims."""
    return spec.model_copy(
        update={
            "group_size": group_size("AWQ-CT", spec.group_size, in_features),
            "calib_length": spec.calib_length or (512 if cuda else 128),
        }
    )
