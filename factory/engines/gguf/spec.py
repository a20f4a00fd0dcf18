"""GGUF specs: one of llama-quantize's types (its own names: Q4_K_M, IQ4_XS), the importance matrix's calibration
(chunks x tokens of the job's calibration text, as llama-imatrix's --chunks and -c), and the budget of RAM or VRAM a
type was chosen for (`--gguf fit --fit 16GB`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from factory.engines.base import QuantSpec, Targets
from factory.errors import SpecError
from factory.specs import Closed, asks_fit

# llama-quantize's QUANT_OPTIONS (tools/quantize/quantize.cpp of the pinned llama.cpp;
# tests/integration/test_engine_gguf.py checks each is in the built tool's list), with the bits per weight of its
# quantized tensors (the block formats'; the K mixes as llama.cpp reports them on Llama-3-8B): what `bits` and the size
# estimates read. Left out: its aliases (Q3_K, Q4_K, Q5_K), F32, COPY and MXFP4_MOE (MoE experts only).
TYPES: dict[str, tuple[float, int]] = {  # type -> (bits per weight, llama_ftype in the file's general.file_type)
    "F16": (16.0, 1), "BF16": (16.0, 32), "Q8_0": (8.5, 7), "Q6_K": (6.5625, 18), "Q5_K_M": (5.69, 17),
    "Q5_K_S": (5.54, 16), "Q5_1": (6.0, 9), "Q5_0": (5.5, 8), "Q4_K_M": (4.89, 15), "Q4_K_S": (4.58, 14),
    "Q4_1": (5.0, 3), "Q4_0": (4.5, 2), "IQ4_NL": (4.5, 25), "IQ4_XS": (4.25, 30), "Q3_K_L": (4.27, 13),
    "Q3_K_M": (3.91, 12), "Q3_K_S": (3.5, 11), "IQ3_M": (3.66, 27), "IQ3_S": (3.44, 26), "IQ3_XS": (3.3, 22),
    "IQ3_XXS": (3.06, 23), "Q2_K": (2.96, 10), "Q2_K_S": (2.96, 21), "IQ2_M": (2.7, 29), "IQ2_S": (2.5, 28),
    "IQ2_XS": (2.31, 20), "IQ2_XXS": (2.06, 19), "TQ2_0": (2.06, 37), "IQ1_M": (1.75, 31), "TQ1_0": (1.69, 36),
    "IQ1_S": (1.56, 24), "Q2_0": (2.25, 41), "Q1_0": (1.125, 40),
}  # fmt: skip
STANDARD = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "IQ4_XS")  # a recipe's `gguf: {}`: the set uploaders publish most
# What `--fit` and `qf plan` choose from, best first: the K- and I-quants uploaders recommend at each size (the 16-bit
# types are not quants; the legacy Q4_0/Q4_1/Q5_0/Q5_1 are bigger than a K-quant of their quality; TQ1_0/TQ2_0 and
# Q1_0/Q2_0 are for models trained ternary or binary).
LADDER = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "IQ4_XS", "Q3_K_M", "IQ3_M", "IQ3_XXS", "IQ2_M", "IQ2_XXS", "IQ1_M")


Cache = Literal["fp16", "q8", "q4"]  # llama.cpp's KV caches the memory model sizes: f16, q8_0 and q4_0


class Fit(Closed):
    """The budget a GGUF type was chosen for (`--gguf fit --fit 16GB`): RAM or VRAM in bytes (llama.cpp runs from
    either), and the context and KV cache it must hold beside the weights."""

    memory: int = Field(gt=0)
    ctx: int = Field(gt=0)
    cache: Cache = "fp16"


def check_type(value: object) -> str:
    """Rules: one of TYPES, any case. Valid: "Q4_K_M", "iq4_xs". Not valid: "Q4_K" (an alias), "q4km"."""
    name = str(value).strip().upper()
    if name not in TYPES:
        raise SpecError(f"GGUF type {value!r} is not one of llama-quantize's: {', '.join(TYPES)}")
    return name


class GgufSpec(QuantSpec):
    method: Literal["gguf"] = "gguf"
    type: str
    imatrix_chunks: int = Field(128, ge=1)  # llama-imatrix --chunks
    imatrix_ctx: int = Field(512, ge=16)  # llama-imatrix -c: tokens per chunk
    fit: Fit | None = None  # --gguf fit: the budget this type was chosen for
    mmproj: bool = False  # set by the engine's resolve: the model has a vision tower, whose projector file (mmproj,
    # converted once: a shared unit) is published beside the type's

    @field_validator("type", mode="before")
    @classmethod
    def _type(cls, v: object) -> str:
        return check_type(v)

    @property
    def tag(self) -> str:
        return f"gguf-{self.type.lower()}"

    @property
    def bits(self) -> float:
        return TYPES[self.type][0]

    @property
    def flag_value(self) -> str:
        return self.type


class GgufTargets(Targets):
    types: list[str] = Field(default_factory=lambda: list(STANDARD), min_length=1)
    imatrix_chunks: int = Field(128, ge=1)
    imatrix_ctx: int = Field(512, ge=16)
    fit: list[Fit] | None = None  # --gguf fit: the budget each type (same order) was chosen for

    @field_validator("types", mode="before")
    @classmethod
    def _types(cls, v: object) -> list[str]:
        return [check_type(t) for t in (v if isinstance(v, list) else [v])]

    @model_validator(mode="after")
    def _one_fit_per_type(self) -> GgufTargets:
        if self.fit is not None and len(self.fit) != len(self.types):
            raise SpecError(f"gguf fit lists {len(self.fit)} budgets for {len(self.types)} types; give one per type")
        return self

    def specs(self) -> list[GgufSpec]:
        fits: dict[str, Fit] = {}
        for t, f in zip(self.types, self.fit or [], strict=False):  # two budgets that chose one type: the smaller
            fits[t] = min(fits.get(t, f), f, key=lambda x: x.memory)
        return [
            GgufSpec(type=t, imatrix_chunks=self.imatrix_chunks, imatrix_ctx=self.imatrix_ctx, fit=fits.get(t))
            for t in sorted(set(self.types), key=lambda t: -TYPES[t][0])
        ]


def targets_from_flag(value: str, written: dict) -> dict:
    """`--gguf Q8_0,Q4_K_M` -> the recipe's gguf settings with those types."""
    if asks_fit(value):
        raise SpecError("--gguf fit takes its types from --fit's budgets: give them, e.g. --gguf fit --fit 16GB,8GB")
    types = [t for t in (p.strip() for p in value.split(",")) if t]
    if not types:
        raise SpecError("--gguf takes llama-quantize's type names, e.g. --gguf Q8_0,Q4_K_M,IQ4_XS")
    return {**written, "types": [check_type(t) for t in types]}
