"""GGUF's parts of the model card: the table uploaders publish (file, type, size, and here PPL, KLD and top-1 on the
factory's windows against FP16), and how to run a file with llama.cpp or ollama; its Card part."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from factory.engines.base import Card
from factory.engines.gguf import gguf_file
from factory.settings import gguf_split_bytes
from factory.vram import HEADROOM, human

if TYPE_CHECKING:
    from factory.registry.published import QuantRow


def file_name(row: QuantRow) -> str:
    return gguf_file.name(Path(row.source.split("@")[0].rstrip("/")).name, row.spec.type)


def files_table(rows: list[QuantRow]) -> str:
    lines = [
        "## Files",
        "",
        "Each type's file, with its importance matrix (`*-imatrix.gguf`, computed once on the calibration text) beside "
        "it (the size counts both). PPL, KLD and top-1 are llama.cpp's own inference on the factory's windows (no BOS, "
        "every position), against the FP16 source in transformers on the same windows, so they compare with the "
        "other formats' rows.",
        "",
        "| file | type | size | PPL | KLD | top-1 |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: -r.bits):
        kld = "n/a" if r.kld is None else f"{r.kld:.4f}"
        top1 = "n/a" if r.top1 is None else f"{r.top1 * 100:.1f}%"
        size = f"{r.bytes / 2**30:.2f} GiB" if r.bytes >= 2**30 else f"{r.bytes / 2**20:.1f} MiB"
        lines.append(f"| `{file_name(r)}` | {r.spec.type} | {size} | {r.ppl:.4f} | {kld} | {top1} |")
    types = ", ".join(r.spec.type for r in sorted(rows, key=lambda r: -r.bits))
    lines += [
        "",
        f"A file over {gguf_split_bytes() / 1e9:g} GB is published in parts by llama.cpp's gguf-split "
        "(`...-00001-of-0000K.gguf` first: give llama.cpp that one, it finds the others beside it).",
        "",
        f"From this repository, every type's file on main (TYPE one of {types}): `ollama run "
        "hf.co/<this repository>:<TYPE>`, or llama.cpp's `llama-cli -hf <this repository>:<TYPE>`.",
    ]
    return "\n".join(lines) + "\n"


def fits_in(rows: list[QuantRow]) -> str:
    """The longest context each type holds in each budget of RAM or VRAM (rows with a "fits" table)."""
    fitted = sorted((r for r in rows if r.fits), key=lambda r: -r.bits)
    if not fitted:
        return ""
    budgets = [f["budget"] for f in fitted[0].fits]
    lines = [
        "## Fits in",
        "",
        "The longest context (powers of two up to the model's maximum) each file holds in llama.cpp with its default "
        "f16 KV cache (in parentheses where longer: a q8_0 cache, `-ctk q8_0 -ctv q8_0`), in RAM, or in VRAM with "
        f"every layer offloaded (`-ngl 999`), {human(HEADROOM)} left free: quantfactory's estimate of the weights "
        "(the file), the KV cache and llama.cpp's compute buffer, checked against what llama.cpp allocates.",
        "",
        "| type | " + " | ".join(f"{b / 2**30:.0f} GB" for b in budgets) + " |",
        "|---|" + "---|" * len(budgets),
    ]
    for r in fitted:
        cells = []
        for f in r.fits:
            cell = f"{f['fp16']:,}" if f["fp16"] else "-"
            if (f.get("q8") or 0) > (f["fp16"] or 0):
                cell += f" ({f['q8']:,})"
            cells.append(cell)
        lines.append(f"| {r.spec.type} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


class GgufCard(Card):
    library_name = "gguf"
    hub_repo = "{owner}/{model}-GGUF"
    plot_marker = "s"
    every_variant_on_main = True  # as uploaders publish: every type's file on main, where ollama and llama.cpp's
    # `-hf REPO:TYPE` look for it

    def how_to_load(self, folder: str) -> str:
        return f"""```bash
# llama.cpp (the file is the one .gguf beside *-imatrix.gguf)
llama-cli -m "$(ls ./{folder}/*.gguf | grep -v -- -imatrix.gguf | head -1)" -cnv
llama-server -m "$(ls ./{folder}/*.gguf | grep -v -- -imatrix.gguf | head -1)" --port 8080
```
"""

    def sections(self, rows: list[QuantRow]) -> tuple[str, str]:
        return files_table(rows), fits_in(rows)

    def main_files(self, newest: Path) -> list[str]:
        return sorted(p.name for p in newest.glob("*.gguf"))
