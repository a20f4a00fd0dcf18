"""A published quant as its readers see it (the model card, the engines' card pieces, `qf ls`, `qf show`,
`--json`): a value, made by the catalog (`Quant.row()`), that keeps the model name, the tag and the revision apart.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from factory import specs
from factory.specs import QuantSpec


@dataclass(frozen=True)
class QuantRow:
    """A published quant as the card, the CLI and `--json` see it: its model name, tag and revision apart (`ref`
    is `name:tag`); `fits` and `load_note` are its engine's, added where a card or `qf show` wants them."""

    name: str
    tag: str
    rev: str
    method: str
    bits: float
    bytes: int
    ppl: float
    fp16_ppl: float
    kld: float | None  # mean KL(FP16 || quant) per token; None for a quant published before it was measured
    kld_p99: float | None
    top1: float | None  # share of positions where the quant's most likely next token is FP16's
    source: str
    source_identity: str
    calibration: str
    eval: dict  # text, sha256, windows, window_length, device, and the engine's other scores by group
    versions: dict
    job: str
    path: str  # relative to the registry folder
    spec: QuantSpec
    created_at: str
    fits: list[dict] | None = None  # the longest context that fits each budget (engines with a memory model)
    load_note: str | None = None
    # every evaluation of its weights (Quants.evaluations_of), where `qf show` or the Hub's main card wants them
    evaluations: list[dict] | None = None

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.tag}"

    @property
    def change(self) -> float:
        return self.ppl / self.fp16_ppl - 1

    @property
    def fit(self) -> dict | None:
        """The budget `--fit` chose this size for: EXL2's `{vram, ctx, cache}`, GGUF's `{memory, ctx, cache}` (RAM
        or VRAM)."""
        fit = getattr(self.spec, "fit", None)
        return fit.model_dump() if fit is not None else None

    def to_json(self) -> dict:
        """`name` as people type it (`name:tag`), with `tag` and `rev` apart too."""
        row = {
            "name": self.ref,
            "model": self.name,
            "tag": self.tag,
            "rev": self.rev,
            "method": self.method,
            "bits": self.bits,
            "bytes": self.bytes,
            "ppl": self.ppl,
            "fp16_ppl": self.fp16_ppl,
            "change": self.change,
            "kld": self.kld,
            "kld_p99": self.kld_p99,
            "top1": self.top1,
            "source": self.source,
            "source_identity": self.source_identity,
            "calibration": self.calibration,
            "eval": self.eval,
            "versions": self.versions,
            "job": self.job,
            "path": self.path,
            "spec": self.spec.model_dump(),
            "fit": self.fit,
            "created_at": self.created_at,
        }
        return {
            **row,
            **({"fits": self.fits} if self.fits else {}),
            **({"load_note": self.load_note} if self.load_note else {}),
            **({"evaluations": self.evaluations} if self.evaluations is not None else {}),
        }

    @classmethod
    def from_json(cls, row: dict) -> QuantRow:
        """The inverse of to_json (what a client of the service reads)."""
        names = {f.name for f in fields(cls)} - {"name", "spec"}
        return cls(name=row["model"], spec=specs.parse(row["spec"]), **{k: v for k, v in row.items() if k in names})
