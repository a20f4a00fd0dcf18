"""The model card: README.md in every published folder, in the form the Hub and its users know.

YAML metadata (`base_model`, `base_model_relation: quantized`, `license` and `language` as the base model's card
says, `pipeline_tag`, `library_name`, `tags`, `quantized_by`), where the base model and its license are, the table of
this model's quants as known when this one was published (bits, size, perplexity, change vs FP16, the calibration
used, eval protocol, tool versions, source identity), which EXL2 size to pick for common GPUs, the prompt format,
and how to load each one.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from calibration import public_name
from factory.evaluate import KV_CHUNK
from factory.publish.upstream import Upstream
from factory.vram import HEADROOM, human

FILENAME = "README.md"
PLOT = "ppl_vs_size.png"  # beside the card of a Hub repo
KV_CHUNK_NOTE = f"each window fed {KV_CHUNK} tokens at a time, so every token reads the earlier ones from the cache"
LIBRARY = {"awq": "transformers", "exl2": "exllamav2"}
QUANTIZED_BY = "quantfactory"
PICK_CONTEXT = 8192  # "which to pick": the largest EXL2 size that holds this many tokens (or the model's most)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _versions(versions: dict) -> str:
    keep = ("awq", "exl2", "torch", "transformers")
    return ", ".join(f"{k} {versions[k]}" for k in keep if k in versions)


def _how_to_load(row: dict, place=None) -> str:
    ref, folder = row["name"], row["name"].replace(":", "-")
    get = f"qf pull {ref} -o {folder}"
    if place is not None:
        get = f"hf download {place.repo} --revision {place.branch} --local-dir {folder}\n# or: {get}"
    if row["method"] == "awq":
        return f"""### {ref}

```bash
{get}
vllm serve ./{folder} --quantization awq        # or any loader that reads AWQ GEMM checkpoints
```

```python
from transformers import AutoModelForCausalLM, AutoTokenizer  # needs a CUDA GPU and the autoawq kernels
model = AutoModelForCausalLM.from_pretrained("./{folder}", device_map="cuda")
tokenizer = AutoTokenizer.from_pretrained("./{folder}")
```
"""
    return f"""### {ref}

```bash
{get}
# then point TabbyAPI's model_dir at ./{folder}
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


def kv_scores(kv: dict[str, float | None]) -> str:
    """{"fp16": 16.6, "q4": None} -> "fp16 16.6000, q4 not finite"."""
    return ", ".join(f"{c} {p:.4f}" if p is not None else f"{c} not finite" for c, p in kv.items())


def _fits(row: dict) -> str:
    """How long a context each card size holds with this quant in exllamav2 (rows with a "fits" table)."""
    if not row.get("fits"):
        return ""
    caches = [k for k in row["fits"][0] if k != "budget"]
    lines = [f"### {row['name']}", ""]
    if kv := row.get("eval", {}).get("kv_cache"):
        lines += [f"Perplexity through exllamav2's KV cache ({KV_CHUNK_NOTE}): {kv_scores(kv)}.", ""]
    if row.get("fit"):
        f = row["fit"]
        lines += [f"Made to fit {f['vram'] / 2**30:.0f} GiB with {f['ctx']} tokens of {f['cache']} cache (--fit).",
                  ""]
    lines += ["| GPU | " + " | ".join(f"longest context, {c} cache" for c in caches) + " |",
              "|---|" + "---|" * len(caches)]
    for r in row["fits"]:
        cells = [f"{r[c]:,} tokens" if r[c] else "does not fit" for c in caches]
        lines.append(f"| {r['budget'] / 2**30:.0f} GB | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _calibration(r: dict) -> str:
    """The calibration a quant was made with: the text set, rows x length, and for AWQ whether it clipped."""
    spec, text = r.get("spec") or {}, public_name(r["calibration"])
    if spec.get("calib_rows"):
        clipping = "on" if spec["clip"] else "off"
        return f"{text}, {spec['calib_rows']} x {spec['calib_length']} tokens, clipping {clipping}"
    if spec.get("rows"):
        return (f"{text}, {spec['rows']} x {spec['length']} tokens (measured on {spec['measurement_rows']} x "
                f"{spec['measurement_length']})")
    return text


def _picks(rows: list[dict]) -> str:
    """For each GPU size of the fits tables: the largest EXL2 quant that holds PICK_CONTEXT tokens (or the longest
    context any quant reaches) with an fp16 cache, else with a q4 cache."""
    exl2 = sorted((r for r in rows if r.get("fits")), key=lambda r: -r["bits"])
    if not exl2:
        return ""
    longest = max(f[c] or 0 for r in exl2 for f in r["fits"] for c in ("fp16", "q4"))
    want = min(PICK_CONTEXT, longest)
    lines = ["## Which one to pick", "", f"The largest EXL2 size that holds {want:,} tokens of context with exllamav2 "
             "(an fp16 cache where it fits, else q4), by GPU memory:", "", "| GPU | pick | cache |", "|---|---|---|"]
    for i, budget in enumerate(f["budget"] for f in exl2[0]["fits"]):
        pick = next(((r, c) for c in ("fp16", "q4") for r in exl2 if (r["fits"][i][c] or 0) >= want), None)
        cell = f"`{pick[0]['name']}` | {pick[1]}" if pick else "none of these | -"
        lines.append(f"| {budget / 2**30:.0f} GB | {cell} |")
    return "\n".join(lines) + "\n"


def _about(up: Upstream) -> str:
    base = f"[`{up.base_model}`]({up.url})" if up.url else f"`{up.base_model}`"
    terms = f"the original card]({up.url})" if up.url else "the original model's card"
    if up.license:
        link = f" ({up.license_link})" if up.license_link else ""
        license = f"The base model's license applies to these quants: `{up.license}`{link}; read its terms on "
    else:
        license = "Read the base model's license on "
    license += f"[{terms}." if up.url else f"{terms}."
    note = f"\n\nThe FP16 checkpoint these were made from was {up.note}." if up.note else ""
    return f"Quants of {base} made by {QUANTIZED_BY}. {license}{note}"


def _prompt(up: Upstream) -> str:
    prompt = up.prompt()
    if prompt is None:
        return ""
    return (f"\n## Prompt format\n\nThe quants carry the base model's chat template (`chat_template.jinja`); a "
            f"system and a user message become:\n\n```\n{prompt.strip()}\n```\n")


def render(name: str, upstream: Upstream, this: dict, rows: list[dict], places: dict | None = None) -> str:
    """`this` is the quant the folder holds; `rows` every quant of the model, `this` included. `places` (quant
    name -> hub.Place) makes the card of a Hub repo: where each variant is, how to download it, and the plot."""
    places = places or {}
    base_model = upstream.base_model
    meta = {
        "base_model": base_model,
        "base_model_relation": "quantized",
        **({"license": upstream.license} if upstream.license else {}),
        **({"license_link": upstream.license_link} if upstream.license_link else {}),
        **({"language": upstream.language} if upstream.language else {}),
        "pipeline_tag": "text-generation",
        "library_name": LIBRARY[this["method"]],
        "tags": sorted({this["method"], "quantized", QUANTIZED_BY}),
        "quantized_by": QUANTIZED_BY,
    }
    table = [
        "| quant | method | bits | size | perplexity | vs FP16 | calibration | eval | tools | source |"
        + (" on the Hub |" if places else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if places else ""),
    ]
    for r in sorted(rows, key=lambda r: (r["method"], r["bits"])):
        ev = r["eval"]
        mark = " (this folder)" if not places and (r["name"], r["rev"]) == (this["name"], this["rev"]) else ""
        table.append(
            f"| `{r['name']}`{mark} | {r['method']} | {r['bits']:g} | {_size(r['bytes'])} | {r['ppl']:.4f} "
            f"| {r['change'] * 100:+.2f}% | {_calibration(r)} | {public_name(ev['text'])}, "
            f"{ev['windows']} x {ev['window_length']} tokens, {ev['device']} (FP16 {r['fp16_ppl']:.4f}) "
            f"| {_versions(r['versions'])} | `{r['source_identity']}` |"
            + (f" `{places[r['name']].repo}` branch `{places[r['name']].branch}` |" if places else "")
        )
    ordered = sorted(rows, key=lambda r: (r["method"], r["bits"]))
    loads = "\n".join(_how_to_load(r, places.get(r["name"])) for r in ordered)
    fits = "\n".join(_fits(r) for r in ordered if r.get("fits"))
    if fits:
        fits = ("\n## Fits on\n\nThe longest context (powers of two up to the model's maximum) that exllamav2 holds "
                f"with {human(HEADROOM)} of the card left free, as factory/vram.py predicts it (checked against real "
                "memory on an H200: benchmarks/results/vram_fit.json).\n\n" + fits)
    picture = f"\n![perplexity against size]({PLOT})\n" if places else ""
    return f"""---
{yaml.safe_dump(meta, sort_keys=False).strip()}
---

# {name}: quantized {base_model}

{_about(upstream)}

Perplexity is measured on held-out text that calibration never saw, on the same token windows for the FP16 model
and every quant (no BOS, non-overlapping windows from the start of the text); "vs FP16" is the change against the
FP16 model on those windows.

{chr(10).join(table)}
{picture}
{_picks(rows)}{_prompt(upstream)}
## How to load

{loads}{fits}"""


def plot(rows: list[dict], path: Path) -> Path:
    """Perplexity against size for every variant, the FP16 model as a dashed line (a PNG for the Hub card)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for method, marker in (("exl2", "o"), ("awq", "s")):
        mine = [r for r in rows if r["method"] == method]
        points = sorted((r["bytes"] / 2**20, r["ppl"], r["name"].split(":", 1)[1]) for r in mine)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, label=method.upper())
            for x, y, tag in points:
                ax.annotate(tag, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(rows[0]["fp16_ppl"], linestyle="--", color="gray", label="FP16")
    ax.set_xlabel("size (MiB)")
    ax.set_ylabel(f"perplexity ({public_name(rows[0]['eval']['text'])})")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def metadata(card: str) -> dict:
    """The YAML metadata block of a card."""
    _, block, _ = card.split("---\n", 2)
    return yaml.safe_load(block)
