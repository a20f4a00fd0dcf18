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


def files_table(rows: list[QuantRow], hub_repo: str | None = None) -> str:
    ordered = sorted(rows, key=lambda r: -r.bits)
    lines = [
        "## Files",
        "",
        "Each type's file, with its importance matrix (`*-imatrix.gguf`, computed once on the calibration text) beside "
        "it (the size counts both, and a vision-language model's `mmproj-*.gguf`). PPL, KLD and top-1 are llama.cpp's "
        "own inference on the factory's windows (no BOS, every position), against the FP16 source in transformers on "
        "the same windows, so they compare with the other formats' rows.",
        "",
        "| file | type | size | PPL | KLD | top-1 |",
        "|---|---|---|---|---|---|",
    ]
    for r in ordered:
        kld = "n/a" if r.kld is None else f"{r.kld:.4f}"
        top1 = "n/a" if r.top1 is None else f"{r.top1 * 100:.1f}%"
        size = f"{r.bytes / 2**30:.2f} GiB" if r.bytes >= 2**30 else f"{r.bytes / 2**20:.1f} MiB"
        lines.append(f"| `{file_name(r)}` | {r.spec.type} | {size} | {r.ppl:.4f} | {kld} | {top1} |")
    chosen = [made_to_fit(r) for r in ordered if r.fit]
    lines += ["", *chosen] if chosen else []
    lines += [
        "",
        f"A file over {gguf_split_bytes() / 1e9:g} GB is published in parts by llama.cpp's gguf-split "
        "(`...-00001-of-0000K.gguf` first: give llama.cpp that one, it finds the others beside it).",
        "",
        run_from(ordered, hub_repo),
    ]
    return "\n".join(lines) + "\n"


CACHE_FLAGS = {"fp16": "", "q8": " (`-ctk q8_0 -ctv q8_0`)", "q4": " (`-ctk q4_0 -ctv q4_0`)"}


def made_to_fit(row: QuantRow) -> str:
    """The budget `--gguf fit` chose the row's type for (its spec's `fit`), in one line."""
    f = row.fit
    cache = "f16" if f["cache"] == "fp16" else f"{f['cache']}_0"
    return (
        f"- {row.spec.type} was chosen for {human(f['memory'])} of RAM or VRAM holding {f['ctx']:,} tokens with its "
        f"KV cache in {cache}{CACHE_FLAGS[f['cache']]} (`--gguf fit --fit`)."
    )


def run_from(rows: list[QuantRow], hub_repo: str | None) -> str:
    """How ollama and llama.cpp run a type: from the Hub repo by its name (every type's file is on its main), or,
    for a registry folder's card, from the file."""
    types = [r.spec.type for r in rows]
    example = "Q4_K_M" if "Q4_K_M" in types else types[0]
    if hub_repo is None:
        return (
            "ollama runs a file through a Modelfile that names it: `FROM ./<file>.gguf` in `Modelfile`, then "
            "`ollama create NAME -f Modelfile` and `ollama run NAME`."
        )
    return (
        f"Every type's file is on this repository's main, where ollama and llama.cpp look for it (TYPE one of "
        f"{', '.join(types)}):\n\n```bash\nollama run hf.co/{hub_repo}:{example}\n"
        f"llama-cli -hf {hub_repo}:{example}\n```"
    )


def images(rows: list[QuantRow], hub_repo: str | None = None) -> str:
    """How llama.cpp gives a vision-language model's quants an image: its multimodal tools load the projector file
    (`mmproj-<Model>-F16.gguf`, the vision tower and projector at 16 bits, published beside every type) with the
    language model's file."""
    seeing = sorted((r for r in rows if getattr(r.spec, "mmproj", False)), key=lambda r: -r.bits)
    if not seeing:
        return ""
    shown = next((r for r in seeing if r.spec.type == "Q4_K_M"), seeing[0])
    mmproj, example = gguf_file.mmproj_name(Path(shown.source.split("@")[0].rstrip("/")).name), file_name(shown)
    lines = [
        "",
        "## Images in llama.cpp",
        "",
        f"`{mmproj}` is the vision tower and its projector at 16 bits (llama.cpp's `--mmproj`), the same file beside "
        "every type: the types quantize the language model only. llama.cpp's multimodal tools load both:",
        "",
        "```bash",
        f'llama-mtmd-cli -m {example} --mmproj {mmproj} --image photo.jpg -p "Describe this image."',
        f"llama-server -m {example} --mmproj {mmproj} --port 8080",
    ]
    if hub_repo is not None:
        lines.append(
            f"llama-server -hf {hub_repo}:{shown.spec.type}   # -hf fetches the mmproj file from this repository too"
        )
    return "\n".join([*lines, "```", ""])


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
# llama.cpp (the file is the one .gguf beside *-imatrix.gguf, and mmproj-*.gguf for images)
llama-cli -m "$(ls ./{folder}/*.gguf | grep -v -e -imatrix.gguf -e /mmproj- | head -1)" -cnv
llama-server -m "$(ls ./{folder}/*.gguf | grep -v -e -imatrix.gguf -e /mmproj- | head -1)" --port 8080
```
"""

    def sections(self, rows: list[QuantRow], hub_repo: str | None = None) -> tuple[str, str]:
        return files_table(rows, hub_repo) + images(rows, hub_repo), fits_in(rows)

    def main_files(self, newest: Path) -> list[str]:
        return sorted(p.name for p in newest.glob("*.gguf"))
