"""What every unit of a job works from: the inspect step's findings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from factory import evaluate
from factory.engines import QuantSpec
from factory.jobs.costs import Sized
from factory.publish import upstream


@dataclass
class Prepared:
    """What the inspect step learns, kept in memory for the later units of this attempt (Factory._read)."""

    folder: Path  # the staging folder: links to the source's allowlisted files
    specs: list[QuantSpec]
    calibration: dict[str, list[list[int]]]  # tag -> token windows, for engines that take tokens
    calibration_file: Path  # the calibration text as parquet, for engines that tokenize it themselves
    stream: evaluate.Stream
    upstream: upstream.Upstream  # what the card says about the base model
    model: Sized
