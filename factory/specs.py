"""What specs are made of: closed pydantic models, the checks engines share (bits per weight, head bits), and
`QuantSpec`, the one typed value a quant's spec is from submit to the engine.

A spec that cannot run fails at submit with one sentence that says what is allowed (SpecError, exit 2). Each
engine's spec lives in its package (factory/engines/<method>/spec.py) and is registered here by its method when the
engine is (factory/engines/__init__.py), so the catalog reads its stored specs back as typed values (`parse`)
without knowing any engine; recipes, which combine specs, are in recipes.py.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from factory.errors import SpecError

BPW_MIN, BPW_MAX = 2.0, 8.0
FIT = "fit"  # an engine flag's value that asks `--fit` to choose its sizes (`--gguf fit --fit 16GB`)


def asks_fit(value: object) -> bool:
    """Whether an engine flag's value is FIT."""
    return isinstance(value, str) and value.strip().lower() == FIT


class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class QuantSpec(Closed):
    """One quant an engine makes: closed (unknown keys are refused), with `method` its engine's name. Modules pass
    it as it is; only the catalog (its JSON columns), the keys hashed from it and an engine's child process see it
    as a dict (`model_dump()`, read back with `parse`)."""

    method: str

    @property
    def tag(self) -> str:  # the name's tag: `exl2-4.0bpw`
        raise NotImplementedError

    @property
    def bits(self) -> float:
        raise NotImplementedError

    @property
    def flag_value(self) -> str | bool:
        """What its engine's flag takes to make it (`--exl2 4.0`: "4.0"); True: a switch (`--awq`)."""
        return True


class Unregistered(QuantSpec):
    """The spec of an engine this process has not registered (a FACTORY_ENGINES plugin not loaded here, or one no
    longer installed): its fields as stored, so the catalog still reads and lists every row; what needs the engine
    asks `engines.get`, which says it is missing."""

    model_config = ConfigDict(extra="allow", frozen=True)


_KINDS: dict[str, type[QuantSpec]] = {}  # method -> its engine's spec class (engines.register keeps it)


def register(method: str, kind: type[QuantSpec]) -> None:
    _KINDS[method] = kind


def unregister(method: str) -> None:
    _KINDS.pop(method, None)


def parse(data: dict) -> QuantSpec:
    """A spec as the catalog stores it (`{"method": NAME, ...}`: its engine's name and its fields) -> its engine's
    spec (Unregistered where this process has no engine of that name)."""
    return _KINDS.get(data.get("method"), Unregistered).model_validate(data)


def check_bpw(value: object, low: float = BPW_MIN, high: float = BPW_MAX) -> float:
    try:
        bpw = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise SpecError(f"bpw {value!r} is not a number; use a number in [{low}, {high}]") from None
    if not math.isfinite(bpw) or not low <= bpw <= high:
        raise SpecError(f"bpw {value} is outside [{low}, {high}]")
    return bpw


def check_head_bits(value: object, allowed: tuple[int, ...]) -> int:
    if isinstance(value, bool) or value not in allowed:
        raise SpecError(f"head bits {value!r} not allowed; use one of {', '.join(map(str, allowed))}")
    return int(value)  # type: ignore[arg-type]


def parse_bpw_list(text: str, flag: str, low: float = BPW_MIN, high: float = BPW_MAX) -> list[float]:
    """`3.0,4.0,5.0` (an engine's flag) -> [3.0, 4.0, 5.0]."""
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise SpecError(f"{flag} needs numbers in [{low}, {high}] separated by commas, got {text!r}")
    return [check_bpw(p, low, high) for p in parts]


def bpw_tag(method: str, bpw: float, head_bits: int, default_head: int = 6) -> str:
    """`<method>-4.0bpw`, `-4.25bpw`, `-3.0bpw-h8`: one decimal at least, head bits when not the default."""
    tag = f"{method}-{bpw:.2f}".rstrip("0")
    tag = (tag + "0" if tag.endswith(".") else tag) + "bpw"
    return tag if head_bits == default_head else f"{tag}-h{head_bits}"
