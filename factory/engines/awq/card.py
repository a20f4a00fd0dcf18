"""What the cards of quants vLLM serves share (AutoAWQ's and AWQ-CT's): transformers' library name, where each
quant fits with vLLM (the memory part's estimate, as EXL2's cards say it for exllamav2), and the newest variant's
files on the Hub repo's main branch, which vLLM and transformers read."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from factory.engines.base import Card
from factory.vram import HEADROOM, human

if TYPE_CHECKING:
    from factory.registry.published import QuantRow


def fits_on(rows: list[QuantRow]) -> str:
    """The longest context each card size holds with each quant in vLLM (rows with a "fits" table)."""
    tables = []
    for row in (r for r in rows if r.fits):
        caches = [k for k in row.fits[0] if k != "budget"]
        lines = [f"### {row.ref}", "", "| GPU | " + " | ".join(f"longest context, {c} KV cache" for c in caches) + " |"]
        lines.append("|---|" + "---|" * len(caches))
        for f in row.fits:
            cells = [f"{f[c]:,} tokens" if f[c] else "does not fit" for c in caches]
            lines.append(f"| {f['budget'] / 2**30:.0f} GB | " + " | ".join(cells) + " |")
        tables.append("\n".join(lines) + "\n")
    if not tables:
        return ""
    return (
        "## Fits on\n\nThe longest context (powers of two up to the model's maximum) that vLLM holds at "
        f"gpu_memory_utilization 0.9 with {human(HEADROOM)} of the card left free: an estimate from the quant's "
        "weight files and the model's shape (KV cache, CUDA graphs, activations), not measured.\n\n" + "\n".join(tables)
    )


class VllmCard(Card):
    library_name = "transformers"

    def sections(self, rows: list[QuantRow], hub_repo: str | None = None) -> tuple[str, str]:
        return "", fits_on(rows)

    def main_files(self, newest: Path) -> list[str]:
        return sorted(p.name for p in newest.iterdir() if p.is_file())
