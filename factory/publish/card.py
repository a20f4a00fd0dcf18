"""The model card: README.md in every published folder, in the form the Hub and its users know.

YAML metadata (`base_model`, `base_model_relation: quantized`, `license` and `language` as the base model's card
says, `pipeline_tag`, `library_name`, `tags`, `quantized_by`), where the base model and its license are, the table of
this model's quants as known when this one was published (bits, size, perplexity, change vs FP16, KL divergence from
FP16 and top-1 agreement, the calibration used, eval protocol, tool versions, source identity), what each engine adds
(which size to pick for common GPUs, where each fits), the prompt format, and how to load each one (the engine's
snippet). A Hub repo's card shows two plots against size: perplexity, and KL divergence on a log scale.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from calibration import public_name
from factory import engines, tables
from factory.publish import prompt
from factory.publish.upstream import Upstream
from factory.registry.published import QuantRow

FILENAME = "README.md"
PLOT = "ppl_vs_size.png"  # beside the card of a Hub repo
KLD_PLOT = "kld_vs_size.png"
QUANTIZED_BY = "quantfactory"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _tools(r: QuantRow) -> str:
    """What made this quant: its engine's tools, torch, and transformers unless the engine names its own (AWQ-CT's
    child runs transformers 5.17, not the factory's)."""
    made_by = r.versions.get(r.method)
    tools = [f"{r.method} {made_by}"] if made_by else []
    tools += [f"{k} {r.versions[k]}" for k in ("torch", "transformers") if k in r.versions and k not in (made_by or "")]
    return ", ".join(tools)


def _how_to_load(row: QuantRow, place=None) -> str:
    ref, folder = row.ref, f"{row.name}-{row.tag}"
    get = f"qf pull {ref} -o {folder}"
    if place is not None:
        get = f"hf download {place.repo} --revision {place.branch} --local-dir {folder}\n# or: {get}"
    note = f"\n{row.load_note}\n" if row.load_note else ""
    return f"### {ref}\n\n```bash\n{get}\n```\n\n{engines.get(row.method).card.how_to_load(folder)}{note}"


def _kld(r: QuantRow) -> str:
    return "n/a" if r.kld is None else tables.kld(r.kld)


def _top1(r: QuantRow) -> str:
    return "n/a" if r.top1 is None else f"{r.top1 * 100:.1f}%"


def _calibration(r: QuantRow) -> str:
    """The calibration a quant was made with: the text set, and how much of it (its engine says)."""
    text = public_name(r.calibration)
    return engines.get(r.method).describe_calibration(r.spec, text)


def _sections(rows: list[QuantRow], places: dict) -> tuple[str, str]:
    """What each engine adds about its quants: before the prompt format, and after the load snippets; on a Hub repo's
    main card (`places`), each engine is told its repo."""
    parts = []
    for method in sorted({r.method for r in rows}):
        mine = [r for r in rows if r.method == method]
        repo = next((places[r.tag].repo for r in mine if r.tag in places), None)
        parts.append(engines.get(method).card.sections(mine, repo))
    return "".join(p[0] for p in parts), "".join(p[1] for p in parts)


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
    """The prompt format: the chat template applied to an example, rendered with bounds (factory/publish/prompt.py);
    without the example, one line saying why."""
    if not up.chat_template:
        return ""
    carried = "The quants carry the base model's chat template"
    shown = prompt.example(up.chat_template, image=up.vision is not None)
    if shown.text is None:
        return f"\n## Prompt format\n\n{carried}. No example is shown: {shown.why_not}.\n"
    messages = "a system message and a user message with an image" if up.vision else "a system and a user message"
    fence = _fence(shown.text)
    return f"\n## Prompt format\n\n{carried}; {messages} become:\n\n{fence}\n{shown.text.strip()}\n{fence}\n"


def _fence(text: str) -> str:
    """A code fence that `text` cannot close (longer than any run of backticks in it): what a template renders stays
    in its block, whatever headings or links it writes."""
    return "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", text)), default=0))


def _vision(up: Upstream) -> str:
    if up.vision is None:
        return ""
    return (
        f"\n## Images\n\nThe base model sees images: its vision tower (`{up.vision}`) and the projector into its "
        "language model are kept at 16 bits in every quant, as in the FP16 checkpoint; only the language model is "
        "quantized. The scores above are the language model's, on text. The processor's files travel with the "
        "quants, so a processor loads from the quant's folder as from the base model's (in transformers, below; "
        "where a quant's library reads images its own way, its section says how):\n\n```python\n"
        "from transformers import AutoModelForImageTextToText, AutoProcessor\n"
        'model = AutoModelForImageTextToText.from_pretrained("./quant")\n'
        'processor = AutoProcessor.from_pretrained("./quant")\n```\n'
    )


EVALUATIONS = "\n## Evaluations\n"  # the card's last section: the one a pull writes again (`with_evaluations`)


def _evaluations(rows: list[QuantRow]) -> str:
    """Every evaluation of each quant's files, as `qf show` lists them: the one it was published with and those of
    later jobs that reused its weights (on other windows or text)."""
    lines = []
    for r in rows:
        if not r.evaluations:
            continue
        lines.append(f"\n`{r.ref}@{r.rev}`, each evaluation of the same files:\n")
        lines += ["| eval | windows | perplexity | KLD | top-1 | job |", "|---|---|---|---|---|---|"]
        for e in r.evaluations:
            kld_text = "-" if e["kld"] is None else tables.kld(e["kld"])
            top1_text = "-" if e["top1"] is None else f"{e['top1'] * 100:.1f}%"
            lines.append(
                f"| {public_name(e['text'])}, {e['device']} | {e['windows']} x {e['window_length']} "
                f"| {e['ppl']:.4f} | {kld_text} | {top1_text} | {e['job']} |"
            )
    if not lines:
        return ""
    later = (
        "\nA quant's files never change; a later job that reuses them adds its evaluation here: `qf show` and "
        "`qf pull` give this section as the catalog has it then, and so does the Hub repo's main card.\n"
    )
    return EVALUATIONS + "\n".join(lines) + "\n" + later


def with_evaluations(text: str, row: QuantRow) -> str:
    """The card `text` of a quant's folder with its Evaluations section made again from `row.evaluations` (the
    catalog's now): what `qf pull` writes (the rest of the card, and every other file, are as published)."""
    return text.split(EVALUATIONS, 1)[0].rstrip("\n") + "\n" + _evaluations([row])


def render(
    name: str, upstream: Upstream, this: QuantRow, rows: list[QuantRow], places: dict | None = None, picks: str = ""
) -> str:
    """`this` is the quant the folder holds; `rows` every quant of the model, `this` included. `places` (tag ->
    hub.Place) makes the card of a Hub repo: where each variant is, how to download it, and the plot. `picks`: the
    section on which quant to pick, every format's (factory/publish/frontier.py)."""
    places = places or {}
    base_model = upstream.base_model
    meta = {
        "base_model": base_model,
        "base_model_relation": "quantized",
        **({"license": upstream.license} if upstream.license else {}),
        **({"license_link": upstream.license_link} if upstream.license_link else {}),
        **({"language": upstream.language} if upstream.language else {}),
        "pipeline_tag": "image-text-to-text" if upstream.vision else "text-generation",
        "library_name": engines.get(this.method).card.library_name,
        "tags": sorted({this.method, "quantized", QUANTIZED_BY}),
        "quantized_by": QUANTIZED_BY,
    }
    table = [
        "| quant | method | bits | size | perplexity | vs FP16 | KLD | top-1 | calibration | eval | tools | source |"
        + (" on the Hub |" if places else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if places else ""),
    ]
    ordered = sorted(rows, key=lambda r: (r.method, r.bits))
    for r in ordered:
        ev = r.eval
        mark = " (this folder)" if not places and (r.tag, r.rev) == (this.tag, this.rev) else ""
        table.append(
            f"| `{r.ref}`{mark} | {r.method} | {r.bits:g} | {_size(r.bytes)} | {r.ppl:.4f} "
            f"| {r.change * 100:+.2f}% | {_kld(r)} | {_top1(r)} | {_calibration(r)} | {public_name(ev['text'])}, "
            f"{ev['windows']} x {ev['window_length']} tokens, {ev['device']} (FP16 {r.fp16_ppl:.4f}) "
            f"| {_tools(r)} | `{r.source_identity}` |"
            + (f" `{places[r.tag].repo}` branch `{places[r.tag].branch}` |" if places else "")
        )
    loads = "\n".join(_how_to_load(r, places.get(r.tag)) for r in ordered)
    before, after = _sections(rows, places)
    picture = ""
    if places:
        picture = f"\n![perplexity against size]({PLOT})\n"
        picture += f"![KL divergence against size]({KLD_PLOT})\n" if has_kld(rows) else ""
    return f"""---
{yaml.safe_dump(meta, sort_keys=False).strip()}
---

# {name}: quantized {base_model}

{_about(upstream)}

Perplexity is measured on held-out text that calibration never saw, on the same token windows for the FP16 model
and every quant (no BOS, non-overlapping windows from the start of the text); "vs FP16" is the change against the
FP16 model on those windows. KLD is the mean KL divergence of the quant's next-token distribution from the FP16
model's at every position of those windows (nats per token; lower is closer), top-1 how often both pick the same
most likely next token.

{chr(10).join(table)}
{picture}{picks}
{_vision(upstream)}{before}{_prompt(upstream)}
## How to load

{loads}{chr(10) + after if after else ""}{_evaluations(ordered)}"""


def plot(rows: list[QuantRow], path: Path) -> Path:
    """Perplexity against size for every variant, the FP16 model as a dashed line (a PNG for the Hub card)."""
    return _plot(
        rows, path, lambda r: r.ppl, f"perplexity ({public_name(rows[0].eval['text'])})", fp16=rows[0].fp16_ppl
    )


def _with_kld(rows: list[QuantRow]) -> list[QuantRow]:
    """The variants with a KL divergence to plot on a log scale (measured, and above FP16's own 0)."""
    return [r for r in rows if r.kld is not None and r.kld > 0]


def has_kld(rows: list[QuantRow]) -> bool:
    return bool(_with_kld(rows))


def plot_kld(rows: list[QuantRow], path: Path) -> Path:
    """KL divergence from FP16 against size for every variant that has one, on a log scale (FP16 itself is 0)."""
    return _plot(
        _with_kld(rows),
        path,
        lambda r: r.kld,
        f"KL divergence from FP16 ({public_name(rows[0].eval['text'])})",
        log=True,
    )


def _plot(rows: list[QuantRow], path: Path, value, label: str, fp16: float | None = None, log: bool = False) -> Path:
    """`value(row)` against size, a line per method, each point named by its tag."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for method in sorted({r.method for r in rows}):
        engine, mine = engines.get(method), [r for r in rows if r.method == method]
        points = sorted((r.bytes / 2**20, value(r), r.tag) for r in mine)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=engine.card.plot_marker, label=engine.label)
        for x, y, tag in points:
            ax.annotate(tag, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if fp16 is not None:
        ax.axhline(fp16, linestyle="--", color="gray", label="FP16")
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("size (MiB)")
    ax.set_ylabel(label)
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
