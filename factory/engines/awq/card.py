"""What the cards of quants vLLM serves share (AutoAWQ's and AWQ-CT's): transformers' library name, and the newest
variant's files on the Hub repo's main branch, which vLLM and transformers read."""

from __future__ import annotations

from pathlib import Path

from factory.engines.base import Card


class VllmCard(Card):
    library_name = "transformers"

    def main_files(self, newest: Path) -> list[str]:
        return sorted(p.name for p in newest.iterdir() if p.is_file())
