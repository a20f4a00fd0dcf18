"""How long a unit is expected to take, and so a job: the catalog's history of units of the same family (kind and
engine: `quantize:<engine>`, `measure`, `evaluate:fp16`, ...) on the same kind of device for models in the same size
bucket (within a factor of BUCKET in parameters), scaled by parameters; without such history, the engine's estimate
from first principles (Engine.memory.unit_seconds). Every step records what was expected of it, so `qf status` shows how
good the guess was."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from factory.jobs.graph import Unit
from factory.jobs.packing import Need, Packer

BUCKET = 2.0


@dataclass(frozen=True)
class Past:
    """One finished step of the same family: its seconds and its job's parameters."""

    seconds: float
    parameters: int


def family(name: str) -> str:
    """A step's family from its name: quantize:<engine>-<size> -> quantize:<engine>, evaluate:<engine>-<size>:kv
    -> evaluate:<engine>:kv, a shared unit <stage>:<key> -> <stage> (measure, convert, imatrix), publish:<tag> ->
    publish (tests/unit/test_eta.py: examples)."""
    kind, _, rest = name.partition(":")
    if kind in ("quantize", "evaluate") and rest and rest != "fp16":
        tag, _, group = rest.partition(":")
        return ":".join([kind, tag.split("-")[0], *([group] if group else [])])
    return name if name == "evaluate:fp16" else kind


def expected(past: list[Past], parameters: int, first_principles: float) -> tuple[float, str]:
    """(seconds, basis): the median of the family's seconds in the size bucket, each scaled to `parameters`
    (basis `history (N units)`), else `first_principles` (basis `estimate`)."""
    near = [p for p in past if p.parameters and 1 / BUCKET <= parameters / p.parameters <= BUCKET]
    if not near:
        return first_principles, "estimate"
    seconds = statistics.median(p.seconds * parameters / p.parameters for p in near)
    return seconds, f"history ({len(near)} unit{'s' if len(near) != 1 else ''})"


@dataclass(frozen=True)
class Slot:
    """When a unit runs in a simulated packing (seconds from the job's start)."""

    name: str
    start: float
    end: float


def wall_seconds(units: list[Unit], seconds: dict[str, float], need: Callable[[Unit], Need], packer: Packer) -> float:
    """How long the units take when packed by `packer` with those durations: packing.run's rule, simulated."""
    return packed(units, seconds, need, packer)[0]


def packed(
    units: list[Unit], seconds: dict[str, float], need: Callable[[Unit], Need], packer: Packer
) -> tuple[float, int]:
    """(seconds, the most units that run at once) when packed by `packer`: packing.run's rule, simulated. A unit
    of 0 seconds (done already) takes its place for no time and is not counted as running."""
    slots = schedule(units, seconds, need, packer)
    clock = max((s.end for s in slots), default=0.0)
    starts = sorted({s.start for s in slots})
    most = max((sum(1 for s in slots if s.start <= t < s.end) for t in starts), default=0)
    return clock, most


def schedule(units: list[Unit], seconds: dict[str, float], need: Callable[[Unit], Need], packer: Packer) -> list[Slot]:
    """When each unit starts and ends when packed by `packer` with those durations (packing.run's rule: a unit
    starts once the units it needs are done and its need fits beside the running ones), in the order they end."""
    clock, pending, done, slots = 0.0, list(units), set(), []
    running: list[tuple[float, float, str, Need]] = []  # (ends at, started at, unit, its need)
    while pending or running:
        for unit in [u for u in pending if u.needs <= done]:
            wanted = need(unit)
            if packer.admits(wanted, [n for _, _, _, n in running]):
                running.append((clock + seconds.get(unit.name, 0.0), clock, unit.name, wanted))
                pending.remove(unit)
        if not running:
            break  # units that wait for units that never run: packing.run says so
        running.sort(key=lambda r: r[0])
        clock, started, name, _ = running.pop(0)
        done.add(name)
        slots.append(Slot(name, started, clock))
    return slots


def critical_path(units: list[Unit], slots: list[Slot]) -> list[Slot]:
    """The units the job's end waited on, first to last: from the unit that ends last, back through what each one
    waited for when it started (the unit it needed that ended last, else the one whose end made room for it)."""
    if not slots:
        return []
    needs = {u.name: u.needs for u in units}
    by_name = {s.name: s for s in slots}
    path = [max(slots, key=lambda s: s.end)]
    while path[-1].start > 0:
        here = path[-1]
        before = [by_name[n] for n in needs.get(here.name, ()) if n in by_name]
        waited = max(before, key=lambda s: s.end, default=None)
        if waited is None or waited.end < here.start - 1e-6:  # it waited for room, not for a unit it needs
            waited = max(
                (s for s in slots if abs(s.end - here.start) < 1e-6 and s is not here),
                key=lambda s: s.start,
                default=waited,
            )
        if waited is None:
            break
        path.append(waited)
    return path[::-1]


# the units no engine runs: gate, publish and push are quick; an evaluation is a forward pass over the windows
OTHER_SECONDS = {"gate": 1.0, "publish": 2.0, "push": 30.0}
PUBLISH_SECONDS_PER_B = 1.3  # a publish copies and hashes the quant: 11-12 s for a 4-bit 8B (4 GB, 2026-12-06)
# what a forward pass reaches, fp16 on an H200 / fp32 on a CPU core: the random 8B's FP16 evaluation (48 x 2048
# tokens, walked a layer at a time) took 10.5 s and its AutoAWQ quant's 33 s (2026-12-06; 81 s expected at 2e13)
GPU_FLOPS, CPU_FLOPS_PER_CORE = 1e14, 2.5e10


def other_seconds(kind: str, parameters: int, tokens: int, device: str, cores: int) -> float:
    """First-principles seconds of a unit no engine runs (an evaluation: 2 x parameters FLOPs a token, a load)."""
    if kind == "publish":
        return OTHER_SECONDS[kind] + PUBLISH_SECONDS_PER_B * parameters / 1e9
    if kind != "evaluate":
        return OTHER_SECONDS.get(kind, 5.0)
    flops = 2.0 * parameters * tokens
    return 10.0 + flops / GPU_FLOPS if device == "cuda" else 5.0 + flops / (CPU_FLOPS_PER_CORE * max(cores, 1))


def conversion(
    engine, parameters: int, history: Callable[[str], list[Past]], device: str = "cuda", cores: int = 16
) -> dict:
    """What `qf plan` says a conversion with `engine` costs: its shared units (if it has any: `measure`; `convert`,
    `imatrix`) and each size, in seconds, with the basis of each guess. `history(family)` gives the finished units
    of a family on `device`."""
    out = {}
    for kind in (*(s.stage for s in engine.shared), "quantize"):
        family_name = kind if kind != "quantize" else f"quantize:{engine.name}"
        guess = engine.memory.unit_seconds(kind, parameters, device, min(cores, engine.memory.unit_cores(kind, device)))
        seconds, basis = expected(history(family_name), parameters, guess)
        out[kind] = {"seconds": round(seconds), "basis": basis}
    return out
