"""Engines: an FP16 folder + a spec + calibration tokens -> quant files in an output folder.

Each engine runs its tool in a child process (a crash or OOM fails the step, not `qf`), reports progress
events, and keeps no books: no catalog, no publishing. They are found by name in REGISTRY; see README.md to add one.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from factory.errors import JobFailed, SpecError

Emit = Callable[[dict], None]


@dataclass
class QuantizeRequest:
    source_dir: Path  # the job's staging folder: links to the source's allowlisted files only (factory/files.py)
    out_dir: Path  # empty; the engine fills it with the quant's files
    work_dir: Path  # the engine's scratch space, kept between attempts
    spec: dict
    calibration: list[list[int]] = field(default_factory=list)  # token windows, for engines that take tokens
    calibration_file: Path | None = None  # the calibration text as parquet ("text"), for engines that tokenize
    measurement: Path | None = None  # for engines with needs_measurement


class Engine(Protocol):
    name: str
    requires_cuda: bool
    needs_measurement: bool  # if so, it has measure(...) and the pipeline keeps and reuses measurements
    default_calibration: str  # the text set used when the recipe names none
    outputs: tuple[str, ...]  # glob patterns of the files it writes beyond files.COMPANIONS; nothing else is published

    def version(self) -> str: ...

    def quantize(self, request: QuantizeRequest, emit: Emit) -> None: ...


def check_quant_folder(out_dir: Path, weights: str, want: dict, tool: str, log: Path | None = None) -> None:
    """Outputs are checked, not trusted: weight files matching `weights`, and a config.json whose
    quantization_config says what the spec asked for (`want`)."""
    see = f"; see {log}" if log else ""
    if not list(out_dir.glob(weights)):
        raise JobFailed(f"{tool} wrote no {weights} into {out_dir}{see}")
    try:
        qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    except (OSError, ValueError, KeyError):
        raise JobFailed(f"{tool} wrote no quantization_config into {out_dir / 'config.json'}{see}") from None
    got = {k: qc.get(k) for k in want}
    if got != want:
        raise JobFailed(f"{tool}'s quantization_config {got} does not match the spec {want}")


# name -> the module that defines ENGINE; imported on first use, so `python -m factory.engines.<name>` (the
# engines' child processes) and `qf ls` import no engine they do not need.
REGISTRY = {"awq": "factory.engines.awq", "exl2": "factory.engines.exl2"}


def get(name: str) -> Engine:
    if name not in REGISTRY:
        raise SpecError(f"no engine named {name!r}; available: {', '.join(sorted(REGISTRY))}")
    return importlib.import_module(REGISTRY[name]).ENGINE


def available() -> list[str]:
    return sorted(REGISTRY)
