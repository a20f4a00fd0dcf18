"""What a job's units are expected to cost on this machine: each unit's GPU memory and cores (what packing admits
by), its seconds (jobs/eta.py), and the packer for the job's device. Predictions come from the catalog's history
(recorded peaks of the same source, finished units of the same family near the model's size), else from the
engines' first-principles estimates from the model's shape."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from factory import engines
from factory.catalog import Job, Steps
from factory.jobs import eta
from factory.jobs.graph import Unit
from factory.jobs.ledger import Ledger
from factory.jobs.packing import Need, Packer
from factory.settings import cpu_threads
from factory.vram import CONTEXT_BYTES, HEADROOM, Params, Shape

AUTOMATIC_MAX_UNITS = 8  # on a GPU without --max-units: beyond 8 conversion passes an H200's SMs are busy (8: 80%)
HISTORY_MARGIN = 1.1  # over the highest peak the catalog recorded for a unit of the same source
HISTORY_SECONDS = 30.0  # how old the unit history an ETA uses may be: a service submitting many jobs reads it once


@dataclass(frozen=True)
class Sized:
    """What the source's shape says about the cost of its units (memory, seconds)."""

    shape: Shape
    params: Params
    window_length: int  # of the eval windows
    walkable: bool = False  # its FP16 evaluation walks it a layer at a time (factory/evaluation/layered.py)

    @property
    def parameters(self) -> int:
        return self.params.total


def evaluation_bytes(model: Sized, windows: int, walked: bool) -> int:
    """An evaluation's GPU memory: the whole model in fp16 and a window's logits; walked a layer at a time, the
    largest of the embedding, the head and one decoder layer, every window's hidden states, and a window's logits
    with what scoring makes of them (log-probabilities, FP16's tail for its KL reference)."""
    logits = model.window_length * model.shape.vocab * 4
    if not walked:
        return 2 * model.parameters + 2 * logits
    p = model.params
    largest = max(p.embed, p.head, (p.linear + p.other) // max(1, model.shape.layers))
    return 2 * largest + windows * model.window_length * model.shape.hidden * 2 + 4 * logits


class Costs:
    def __init__(
        self, steps: Steps | None, max_units: int | None, ledger: Ledger | None = None, cores: int | None = None
    ):
        self.steps = steps  # None: no history here (`qf plan` where no catalog exists): the engines' estimates
        self.max_units = max_units  # None: as many units at once as fit
        self.ledger = ledger  # the units of other jobs on this machine's GPU and cores (qf worker's slots)
        self.machine_cores = cores  # None: this machine's
        self._history: dict[tuple[str, str], tuple[float, list]] = {}  # (family, device) -> (read at, rows)

    def measure_processes(self, engine: engines.Engine, job: Job, stage: str = "measure") -> int:
        """The processes a shared unit may run at once (EXL2's measurement in layer ranges): the cores its engine
        asks for on a GPU (one each), as many as this machine has; one with --max-units 1 (one after another, as
        before packing)."""
        if job.device != "cuda" or self.max_units == 1:
            return 1
        return min(engine.memory.unit_cores(stage, job.device), self.cores())

    def seconds(self, job: Job, model: Sized, unit: Unit) -> float:
        """A unit's expected seconds (jobs/eta.py): history of its family near this size, else an estimate."""
        if unit.kind in ("measure", "quantize"):
            engine, kind = engines.get(unit.spec.method), _engine_kind(unit)
            cores = engine.memory.unit_cores(kind, job.device)
            if unit.kind == "measure" and job.device == "cuda":
                cores = self.measure_processes(engine, job, kind)
            guess = engine.memory.unit_seconds(kind, model.parameters, job.device, cores, unit.spec)
        else:
            guess = eta.other_seconds(
                unit.kind, model.parameters, job.eval_windows * model.window_length, job.device, cpu_threads()
            )
            if unit.group:  # one evaluation per score of the group (EXL2's KV caches: fp16, q8, q4)
                loads = sum(e.group == unit.group for e in engines.get(unit.spec.method).evaluations(unit.spec))
                guess *= max(1, loads)
        family = eta.family(unit.name)
        past = [
            eta.Past(seconds, parameters)
            for name, seconds, parameters in self._unit_history(family, job.device)
            if eta.family(name) == family
        ]
        return eta.expected(past, model.parameters, guess)[0]

    def _unit_history(self, family: str, device: str) -> list:
        cached = self._history.get((family, device))
        if cached is None or time.monotonic() - cached[0] > HISTORY_SECONDS:
            rows = self.steps.history(family, device) if self.steps else []
            cached = self._history[(family, device)] = (time.monotonic(), rows)
        return cached[1]

    def needs(self, job: Job, model: Sized, units: list[Unit]) -> dict[str, Need]:
        """Each unit's predicted needs, from one read of the catalog's recorded peaks for this source."""
        peaks = self.steps.peaks(job.source_identity) if self.steps else {}
        return {unit.name: self._need(job, model, unit, peaks) for unit in units}

    def _need(self, job: Job, model: Sized, unit: Unit, peaks: dict[str, int]) -> Need:
        """What a unit is predicted to take: from the recorded peaks of earlier units of the same source (the
        same unit, else one of the same kind and engine), else its engine's estimate from the model's shape."""
        if unit.kind in ("gate", "publish", "push"):
            return Need(in_process=True)  # quick, and one at a time: each card lists the quants published before
        cuda = job.device == "cuda"
        if unit.kind == "evaluate":
            gpu = evaluation_bytes(model, job.eval_windows, walked=unit.spec is None and model.walkable)
            return Need(gpu if cuda else 0, 1 if cuda else min(cpu_threads(), self.cores()), in_process=True)
        engine, kind = engines.get(unit.spec.method), _engine_kind(unit)
        family = f"{unit.stage}:" if unit.kind == "measure" else f"quantize:{unit.spec.tag.split('-')[0]}-"
        seen = peaks.get(unit.name) or max((p for n, p in peaks.items() if n.startswith(family)), default=None)
        peak = (
            int(seen * HISTORY_MARGIN)
            if seen
            else engine.memory.unit_gpu_bytes(kind, unit.spec, model.shape, model.params)
        )
        cores = min(engine.memory.unit_cores(kind, job.device), self.cores())
        if self.max_units:  # asked for: the job's cores are shared among them
            cores = min(cores, max(1, self.cores() // self.max_units))
        return Need(peak + CONTEXT_BYTES if cuda else 0, cores)

    def cores(self) -> int:
        """The cores of the machine the job runs on: this one's, or what `qf plan --cores` says."""
        return self.machine_cores or os.cpu_count() or 1

    def packer(self, job: Job) -> Packer:
        """What this machine admits at once: its GPU's free memory less HEADROOM, its cores. With a ledger, the
        memory other jobs' running units are predicted to take counts as free here (the ledger counts it against
        them when a unit is admitted), up to the card's total."""
        cores = self.cores()
        if job.device != "cuda":
            return Packer(self.max_units or cores, None, cores)
        import torch

        free, total = torch.cuda.mem_get_info()
        if self.ledger is not None:
            free = min(total, free + sum(n.gpu_bytes for n in self.ledger.others()))
        return Packer(self.max_units or AUTOMATIC_MAX_UNITS, max(0, free - HEADROOM), cores)

    def estimate(self, job: Job, model: Sized, units: list[Unit]) -> tuple[float, float]:
        """(packed, one after another) expected seconds of a job planned for its workers' device."""
        packed = Packer(self.max_units or AUTOMATIC_MAX_UNITS, None, AUTOMATIC_MAX_UNITS * 2)
        projected = self.projection(job, model, units, packed)
        return projected.seconds, projected.serial_seconds

    def projection(self, job: Job, model: Sized, units: list[Unit], packer: Packer) -> Projection:
        """The whole job on a machine that admits what `packer` does (`qf plan`: a card of --vram, this machine's
        cores): when each unit runs, packed and one after another, and the units its end waits on."""
        seconds = {u.name: self.seconds(job, model, u) for u in units}
        needs = self.needs(job, model, units)

        def need(unit: Unit) -> Need:
            return needs[unit.name]

        slots = eta.schedule(units, seconds, need, packer)
        return Projection(
            max((s.end for s in slots), default=0.0), sum(seconds.values()), slots, eta.critical_path(units, slots)
        )


def _engine_kind(unit: Unit) -> str:
    """What the engine's Memory calls a unit: `quantize`, or its shared unit's stage (`measure`, `convert`, ...)."""
    return unit.stage if unit.kind == "measure" else unit.kind


@dataclass(frozen=True)
class Projection:
    seconds: float  # packed, to the last unit's end
    serial_seconds: float  # one unit after another
    slots: list[eta.Slot]
    critical_path: list[eta.Slot]
