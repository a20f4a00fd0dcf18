"""EXL2's parts of the model card: how to load a quant with exllamav2, and where it fits; its Card part."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from factory.engines.base import Card, format_scores
from factory.engines.exl2.evaluate import KV_CHUNK, KV_CHUNK_NOTE
from factory.vram import HEADROOM, human

if TYPE_CHECKING:
    from factory.registry.published import QuantRow


def how_to_load(folder: str) -> str:
    return f"""```bash
# point TabbyAPI's model_dir at ./{folder}
```

```python
from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
config = ExLlamaV2Config("./{folder}")
model = ExLlamaV2(config)
cache = ExLlamaV2Cache(model, lazy=True)
model.load_autosplit(cache)
tokenizer = ExLlamaV2Tokenizer(config)
```
"""


def fits(row: QuantRow) -> str:
    """How long a context each card size holds with this quant in exllamav2 (rows with a "fits" table)."""
    if not row.fits:
        return ""
    caches = [k for k in row.fits[0] if k != "budget"]
    lines = [f"### {row.ref}", ""]
    if kv := row.eval.get("kv_cache"):
        lines += [f"Perplexity through exllamav2's KV cache ({KV_CHUNK_NOTE}): {format_scores(kv)}.", ""]
    if (f := row.spec.fit) is not None:
        lines += [f"Made to fit {f.vram / 2**30:.0f} GiB with {f.ctx} tokens of {f.cache} cache (--fit).", ""]
    lines += [
        "| GPU | " + " | ".join(f"longest context, {c} cache" for c in caches) + " |",
        "|---|" + "---|" * len(caches),
    ]
    for r in row.fits:
        cells = [f"{r[c]:,} tokens" if r[c] else "does not fit" for c in caches]
        lines.append(f"| {r['budget'] / 2**30:.0f} GB | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


PICK_CONTEXT = 8192  # "which to pick": the largest EXL2 size that holds this many tokens (or the model's most)


def picks(rows: list[QuantRow]) -> str:
    """For each GPU size of the fits tables: the largest EXL2 quant that holds PICK_CONTEXT tokens (or the longest
    context any quant reaches) with an fp16 cache, else with a q4 cache."""
    exl2 = sorted((r for r in rows if r.fits), key=lambda r: -r.bits)
    if not exl2:
        return ""
    longest = max(f[c] or 0 for r in exl2 for f in r.fits for c in ("fp16", "q4"))
    want = min(PICK_CONTEXT, longest)
    lines = [
        "## Which one to pick",
        "",
        f"The largest EXL2 size that holds {want:,} tokens of context with exllamav2 "
        "(an fp16 cache where it fits, else q4), by GPU memory:",
        "",
        "| GPU | pick | cache |",
        "|---|---|---|",
    ]
    for i, budget in enumerate(f["budget"] for f in exl2[0].fits):
        pick = next(((r, c) for c in ("fp16", "q4") for r in exl2 if (r.fits[i][c] or 0) >= want), None)
        cell = f"`{pick[0].ref}` | {pick[1]}" if pick else "none of these | -"
        lines.append(f"| {budget / 2**30:.0f} GB | {cell} |")
    return "\n".join(lines) + "\n"


def fits_on(rows: list[QuantRow]) -> str:
    tables = "\n".join(fits(r) for r in rows if r.fits)
    if not tables:
        return ""
    return (
        "## Fits on\n\nThe longest context (powers of two up to the model's maximum) that exllamav2 holds "
        f"with {human(HEADROOM)} of the card left free, as quantfactory's memory model of exllamav2 predicts it "
        "(checked against real memory on an H200: benchmarks/results/vram_fit.json).\n\n" + tables
    )


class Exl2Card(Card):
    library_name = "exllamav2"
    hub_repo = "{owner}/{model}-exl2"
    scores_about = {"kv_cache": f"exllamav2's KV cache ({KV_CHUNK}-token forwards)"}
    plot_marker = "o"

    def how_to_load(self, folder: str) -> str:
        return how_to_load(folder)

    def sections(self, rows: list[QuantRow], hub_repo: str | None = None) -> tuple[str, str]:
        return picks(rows), fits_on(rows)

    def main_files(self, newest: Path) -> list[str]:
        return ["measurement.json"] if (newest / "measurement.json").is_file() else []
