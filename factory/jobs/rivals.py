"""Which quants a job keeps where its engine makes one to beat another (Engine.rival: EXL3's optimized size against the
uniform size of its bpw).

Rule: such a quant is kept only where its mean KL divergence from FP16 is lower than its rival's, both as this job's
evaluations recorded them (the catalog's rows: the same windows, the same FP16 reference), and its tensors take no
more bytes than its rival's (the same size or less: an optimized size is made to its uniform size's bits). A quant
not kept is not published: the gate drops it, its publish step is skipped with both numbers, and the job succeeds
(what it was made from is published as usual). Either way the gate says both numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from factory import engines
from factory.catalog import Catalog
from factory.engines import QuantSpec
from factory.vram import tensor_bytes


@dataclass(frozen=True)
class Decision:
    tag: str
    rival: str
    kept: bool
    numbers: str  # both KL divergences and both sizes, for people
    why: str = ""  # why it is not kept

    def __str__(self) -> str:
        return f"{self.tag} kept: {self.numbers}" if self.kept else f"{self.tag} not kept ({self.why}): {self.numbers}"


def decide(catalog: Catalog, job_id: str, specs: list[QuantSpec], folders: dict[str, Path]) -> list[Decision]:
    """The decision on each of `specs` that has a rival; `folders`: tag -> quant folder."""
    scores = {e.subject: e.kld for e in catalog.quants.evaluations(job_id)}  # the latest of each subject
    decisions = []
    for spec in specs:
        rival = engines.get(spec.method).rival(spec)
        if rival is None:
            continue
        mine, theirs = scores.get(spec.tag), scores.get(rival.tag)
        size, rival_size = _bytes(folders[spec.tag]), _bytes(folders[rival.tag])
        numbers = (
            f"KL divergence from FP16 {_kld(mine)} against {rival.tag}'s {_kld(theirs)}, "
            f"{size:,} bytes of tensors against {rival_size:,}"
        )
        why = ""
        if mine is None or theirs is None:
            why = "no KL divergence to compare"
        elif not mine < theirs:
            why = f"not below {rival.tag}'s"
        elif size > rival_size:
            why = f"larger than {rival.tag}"
        decisions.append(Decision(spec.tag, rival.tag, not why, numbers, why))
    return decisions


def _bytes(folder: Path) -> int:
    return sum(tensor_bytes(folder).values())


def _kld(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.5f}"
