"""What to make: quant specs and recipes, typed and closed (unknown keys are refused).

A spec that cannot run fails here, at submit, with one sentence that says what is allowed (SpecError, exit 2).
Defaults that depend on the model or the device (AWQ group size, calibration size, clipping) stay None in
what the user wrote and are filled in by `resolve_awq` before anything is hashed or run.
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from factory import naming
from factory.errors import SpecError
from factory.vram import Cache

BPW_MIN, BPW_MAX = 2.0, 8.0
HEAD_BITS = (2, 3, 4, 5, 6, 8)
AWQ_GROUP_SIZES = (32, 64, 128)
DEFAULT_EVAL = "builtin:wiki"
STANDARD = "standard.yaml"  # in the `configs` package (package data, so a wheel has it too)


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def check_bpw(value: object) -> float:
    try:
        bpw = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise SpecError(f"bpw {value!r} is not a number; use a number in [{BPW_MIN}, {BPW_MAX}]") from None
    if not math.isfinite(bpw) or not BPW_MIN <= bpw <= BPW_MAX:
        raise SpecError(f"bpw {value} is outside [{BPW_MIN}, {BPW_MAX}]")
    return bpw


def check_head_bits(value: object) -> int:
    if isinstance(value, bool) or value not in HEAD_BITS:
        raise SpecError(f"head bits {value!r} not allowed; use one of {', '.join(map(str, HEAD_BITS))}")
    return int(value)  # type: ignore[arg-type]


class Fit(_Closed):
    """The budget an EXL2 size was chosen for (`--fit`): VRAM in bytes, the context and the KV cache it must hold."""

    vram: int = Field(gt=0)
    ctx: int = Field(gt=0)
    cache: Cache = "fp16"


class Exl2Spec(_Closed):
    method: Literal["exl2"] = "exl2"
    bpw: float
    head_bits: int = 6
    fit: Fit | None = None
    measurement_rows: int = Field(16, ge=1)
    measurement_length: int = Field(2048, ge=16)
    rows: int = Field(100, ge=1)
    length: int = Field(2048, ge=16)

    @field_validator("bpw", mode="before")
    @classmethod
    def _bpw(cls, v: object) -> float:
        return check_bpw(v)

    @field_validator("head_bits", mode="before")
    @classmethod
    def _head(cls, v: object) -> int:
        return check_head_bits(v)

    @property
    def tag(self) -> str:
        return naming.exl2_tag(self.bpw, self.head_bits)

    @property
    def bits(self) -> float:
        return self.bpw


class AwqSpec(_Closed):
    method: Literal["awq"] = "awq"
    w_bit: Literal[4] = 4
    group_size: int | None = None  # None: 128, or 64 where 128 does not divide the model's dims
    zero_point: bool = True
    version: Literal["gemm"] = "gemm"
    calib_rows: int | None = Field(None, ge=1)  # None: 128 on CUDA, 16 on CPU
    calib_length: int | None = Field(None, ge=16)  # None: 512 on CUDA, 128 on CPU
    clip: bool | None = None  # None: on with CUDA, off on CPU (8x slower there)

    @field_validator("group_size")
    @classmethod
    def _group(cls, v: int | None) -> int | None:
        if v is not None and v not in AWQ_GROUP_SIZES:
            raise ValueError(f"group size {v} not allowed; use one of {', '.join(map(str, AWQ_GROUP_SIZES))}")
        return v

    @property
    def tag(self) -> str:
        if self.group_size is None:
            raise ValueError("resolve the AWQ spec against the model before naming it")
        return naming.awq_tag(self.w_bit, self.group_size)

    @property
    def bits(self) -> float:
        return float(self.w_bit)


Spec = Annotated[Exl2Spec | AwqSpec, Field(discriminator="method")]


def resolve_awq(spec: AwqSpec, in_features: list[int], cuda: bool) -> AwqSpec:
    """Fill in the model- and device-dependent defaults; refuse a group size that does not divide the dims."""
    dims = sorted(set(in_features))
    if spec.group_size is None:
        group = next((g for g in (128, 64) if all(d % g == 0 for d in dims)), None)
        if group is None:
            raise SpecError(
                f"neither AWQ group size 128 nor 64 divides the model's input dims {dims}; "
                f"set group_size to one of {', '.join(map(str, AWQ_GROUP_SIZES))} that does"
            )
    else:
        group = spec.group_size
        bad = [d for d in dims if d % group]
        if bad:
            raise SpecError(
                f"AWQ group size {group} does not divide the model's input dims {bad}; use one that divides {dims}"
            )
    return spec.model_copy(
        update={
            "group_size": group,
            "calib_rows": spec.calib_rows or (128 if cuda else 16),
            "calib_length": spec.calib_length or (512 if cuda else 128),
            "clip": cuda if spec.clip is None else spec.clip,
        }
    )


class Exl2Targets(_Closed):
    bpw: list[float] = Field(min_length=1)
    head_bits: int = 6
    fit: list[Fit] | None = None  # --fit: the budget each bpw (same order) was chosen for

    @field_validator("bpw", mode="before")
    @classmethod
    def _bpw(cls, v: object) -> list[float]:
        return [check_bpw(b) for b in (v if isinstance(v, list) else [v])]

    @field_validator("head_bits", mode="before")
    @classmethod
    def _head(cls, v: object) -> int:
        return check_head_bits(v)

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


class Recipe(_Closed):
    exl2: Exl2Targets | None = None
    awq: AwqSpec | None = None
    calibration: str | None = None  # None: the engines' default (AWQ builtin:c4, EXL2 builtin:mix)
    eval: str = DEFAULT_EVAL
    eval_windows: int | None = Field(None, ge=1)
    max_ppl_ratio: float = Field(1.5, gt=0)

    def specs(self) -> list[Exl2Spec | AwqSpec]:
        exl2 = self.exl2.specs() if self.exl2 else []
        return [*exl2, *([self.awq] if self.awq else [])]


def parse_bpw_list(text: str) -> list[float]:
    """`--exl2 3.0,4.0,5.0` -> [3.0, 4.0, 5.0]."""
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise SpecError(f"--exl2 needs numbers in [{BPW_MIN}, {BPW_MAX}] separated by commas, got {text!r}")
    return [check_bpw(p) for p in parts]


def _sentence(where: str, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "recipe"
        if e["type"] == "extra_forbidden":
            parts.append(f"unknown key {loc!r}")
        else:
            parts.append(f"{loc}: {e['msg'].removeprefix('Value error, ')}")
    return f"{where}: " + "; ".join(parts)


def recipe_from_dict(data: object, where: str) -> Recipe:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{where}: a recipe is a YAML mapping with keys {', '.join(Recipe.model_fields)}")
    try:
        return Recipe.model_validate(data)
    except SpecError as e:
        raise SpecError(f"{where}: {e.message}") from None
    except ValidationError as e:
        allowed = ", ".join(Recipe.model_fields)
        raise SpecError(_sentence(where, e) + f" (recipe keys: {allowed})") from None


def load_recipe(path: Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"recipe {str(path)!r} does not exist; pass a YAML file such as configs/standard.yaml")
    return _recipe_from_yaml(path.read_text(encoding="utf-8"), f"recipe {str(path)!r}")


def _recipe_from_yaml(text: str, where: str) -> Recipe:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise SpecError(f"{where} is not valid YAML{at}") from None
    return recipe_from_dict(data, where)


def standard_recipe() -> Recipe:
    return _recipe_from_yaml(resources.files("configs").joinpath(STANDARD).read_text(encoding="utf-8"),
                             f"the standard recipe (configs/{STANDARD})")


def build_recipe(path: Path | None = None, exl2: str | None = None, awq: bool = False,
                 fit: list[tuple[float, dict]] | None = None, **overrides: object) -> Recipe:
    """The recipe a command line asks for: --recipe FILE, else the standard recipe; method flags replace its
    targets (keeping its settings for those methods); `fit` ((bpw, budget) pairs from `qf plan`'s arithmetic)
    stands for --exl2 with those sizes; options that are not None replace its keys."""
    data = (load_recipe(path) if path else standard_recipe()).model_dump(exclude_none=True)
    if fit is not None:
        exl2 = ",".join(str(b) for b, _ in fit)
    if exl2 is not None or awq:
        data["exl2"] = {**data.get("exl2", {}), "bpw": parse_bpw_list(exl2)} if exl2 is not None else None
        data["awq"] = data.get("awq", {}) if awq else None
    if fit is not None:
        data["exl2"]["fit"] = [f for _, f in fit]
    data.update({k: v for k, v in overrides.items() if v is not None})
    return recipe_from_dict(data, "options")
