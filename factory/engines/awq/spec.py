"""AWQ specs: w4 GEMM with a group size, zero point, and the calibration AutoAWQ runs on."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from factory.engines.base import QuantSpec, Targets
from factory.errors import SpecError

GROUP_SIZES = (32, 64, 128)
CUDA_ROWS, CPU_ROWS = 128, 16  # AutoAWQ's default on CUDA; on a CPU 16 (8x cheaper there, without clipping)
MIN_ROWS = 16


class W4Spec(QuantSpec, Targets):
    """What both AWQ engines take (AutoAWQ's `awq`, llm-compressor's `awqct`): 4-bit weights in groups, calibrated on
    `calib_rows` x `calib_length` tokens. Defaults that depend on the model or the device (group size, calibration
    size) stay None in what the user wrote and are filled in by `resolve` before anything is hashed or run."""

    LABEL: ClassVar[str]  # the engine's name in sentences
    method: str
    w_bit: Literal[4] = 4
    group_size: int | None = None  # None: 128, or 64 where 128 does not divide the model's dims
    calib_rows: int | None = Field(None, ge=1)  # None: 128 on CUDA, 16 on CPU (fewer if the text is short)
    calib_length: int | None = Field(None, ge=16)  # None: 512 on CUDA, 128 on CPU

    @field_validator("group_size")
    @classmethod
    def _group(cls, v: int | None) -> int | None:
        if v is not None and v not in GROUP_SIZES:
            raise ValueError(f"group size {v} not allowed; use one of {', '.join(map(str, GROUP_SIZES))}")
        return v

    @property
    def tag(self) -> str:
        if self.group_size is None:
            raise ValueError(f"resolve the {self.LABEL} spec against the model before naming it")
        return f"{self.method}-w{self.w_bit}g{self.group_size}"

    @property
    def bits(self) -> float:
        return float(self.w_bit)

    def specs(self) -> list[W4Spec]:  # a recipe's key for the engine is one spec
        return [self]


class AwqSpec(W4Spec):
    """AutoAWQ's: GEMM kernels with a zero point; clipping on by default where there is CUDA."""

    LABEL = "AWQ"
    method: Literal["awq"] = "awq"
    zero_point: bool = True
    version: Literal["gemm"] = "gemm"
    clip: bool | None = None  # None: on with CUDA, off on CPU (8x slower there)


def group_size(label: str, wanted: int | None, in_features: list[int]) -> int:
    """The group size for these input dims: `wanted`, which must divide them all, or (None) 128, else 64; one
    sentence naming `label` (AWQ, AWQ-CT) when none does."""
    dims = sorted(set(in_features))
    if wanted is None:
        group = next((g for g in (128, 64) if all(d % g == 0 for d in dims)), None)
        if group is None:
            raise SpecError(
                f"neither {label} group size 128 nor 64 divides the model's input dims {dims}; "
                f"set group_size to one of {', '.join(map(str, GROUP_SIZES))} that does"
            )
        return group
    bad = [d for d in dims if d % wanted]
    if bad:
        raise SpecError(
            f"{label} group size {wanted} does not divide the model's input dims {bad}; use one that divides {dims}"
        )
    return wanted


def calibration_rows(asked: int | None, length: int, tokens: int, device: str) -> int:
    """The calibration rows: what the spec asked for, else the device's default, or as many windows as the text
    holds where that is fewer but at least MIN_ROWS (builtin:c4 holds 64,601 tokens of a 32k-token BPE, not the
    65,536 of 128 x 512); fewer than that is left for calibration.check_length to refuse in one sentence."""
    if asked is not None:
        return asked
    default, held = CUDA_ROWS if device == "cuda" else CPU_ROWS, tokens // length
    return default if held < MIN_ROWS else min(default, held)


def resolve(spec: AwqSpec, in_features: list[int], cuda: bool) -> AwqSpec:
    """Fill in the model- and device-dependent defaults but the calibration rows (calibration_rows, once the
    text is tokenized); refuse a group size that does not divide the dims."""
    return spec.model_copy(
        update={
            "group_size": group_size(spec.LABEL, spec.group_size, in_features),
            "calib_length": spec.calib_length or (512 if cuda else 128),
            "clip": cuda if spec.clip is None else spec.clip,
        }
    )
