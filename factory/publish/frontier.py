"""The card's frontier: KL divergence from FP16 against size for every published quant of a model, every format on one
plot (an SVG written here, no plotting library), and the card's section around it: the quants on the frontier and which
to pick for the common budgets (factory/ranking.py's picks)."""

from __future__ import annotations

import math
from html import escape

from factory import engines, ranking, tables, vram
from factory.registry.published import QuantRow

FILENAME = "frontier.svg"  # beside the card of a Hub repo's main branch
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 720, 440, 70, 30, 40, 50
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")


def _scored(rows: list[QuantRow]) -> list[QuantRow]:
    return [r for r in rows if r.kld is not None and r.kld > 0]


def svg(name: str, rows: list[QuantRow]) -> str:
    """KLD (log scale) against size (MiB) of every quant with a KLD, a colour per format, the frontier as a line."""
    points = _scored(rows)
    if not points:
        raise ValueError("no quant with a KLD to plot")
    mib = [r.bytes / 2**20 for r in points]
    logs = [math.log10(r.kld) for r in points]
    x0, x1 = min(mib), max(mib)
    pad = (x1 - x0) * 0.08 or x0 * 0.1
    x0, x1 = x0 - pad, x1 + pad
    y0, y1 = math.floor(min(logs)), math.ceil(max(logs))
    y1 = y1 if y1 > y0 else y0 + 1
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def at(size: float, kld: float) -> tuple[float, float]:
        return LEFT + (size - x0) / (x1 - x0) * w, TOP + (y1 - math.log10(kld)) / (y1 - y0) * h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
        'font-size="11">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" font-size="14">{escape(name)}: KL divergence from FP16 '
        "against size, every format</text>",
        f'<rect x="{LEFT}" y="{TOP}" width="{w}" height="{h}" fill="none" stroke="#444"/>',
    ]
    for decade in range(y0, y1 + 1):
        for m in (1, 2, 5) if decade < y1 else (1,):
            y = at(x0, m * 10.0**decade)[1]
            out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + w}" y2="{y:.1f}" stroke="#ddd"/>')
            out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{m * 10.0**decade:g}</text>')
    for i in range(6):
        size = x0 + (x1 - x0) * i / 5
        x = at(size, 1.0)[0]
        out.append(f'<line x1="{x:.1f}" y1="{TOP + h}" x2="{x:.1f}" y2="{TOP + h + 5}" stroke="#444"/>')
        out.append(f'<text x="{x:.1f}" y="{TOP + h + 18}" text-anchor="middle">{size:.0f}</text>')
    out.append(f'<text x="{LEFT + w / 2}" y="{HEIGHT - 10}" text-anchor="middle">size (MiB)</text>')
    out.append(
        f'<text x="16" y="{TOP + h / 2}" text-anchor="middle" transform="rotate(-90 16 {TOP + h / 2})">'
        "KLD from FP16 (nats per token, log scale)</text>"
    )
    line = " ".join("{:.1f},{:.1f}".format(*at(r.bytes / 2**20, r.kld)) for r in ranking.frontier(points))
    out.append(f'<polyline points="{line}" fill="none" stroke="#888" stroke-dasharray="5,4"/>')
    methods = sorted({r.method for r in points})
    labels: list[tuple[float, float]] = []  # where each label starts: one that would run into another goes below
    for i, method in enumerate(methods):
        colour = COLOURS[i % len(COLOURS)]
        for r in (r for r in points if r.method == method):
            x, y = at(r.bytes / 2**20, r.kld)
            out.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{colour}"><title>{escape(r.tag)}</title></circle>'
            )
            ly = y - 6
            if any(abs(lx - x - 6) < 6.5 * len(r.tag) and abs(lyy - ly) < 12 for lx, lyy in labels):
                ly = y + 16
            labels.append((x + 6, ly))
            out.append(f'<text x="{x + 6:.1f}" y="{ly:.1f}" fill="{colour}">{escape(r.tag)}</text>')
        ly = TOP + 14 + 16 * i
        out.append(f'<circle cx="{LEFT + w - 110}" cy="{ly - 4}" r="4" fill="{colour}"/>')
        out.append(f'<text x="{LEFT + w - 100}" y="{ly}">{escape(engines.get(method).label)}</text>')
    ly = TOP + 14 + 16 * len(methods)
    out.append(
        f'<line x1="{LEFT + w - 116}" y1="{ly - 4}" x2="{LEFT + w - 104}" y2="{ly - 4}" stroke="#888" '
        'stroke-dasharray="5,4"/>'
    )
    out.append(f'<text x="{LEFT + w - 100}" y="{ly}">frontier</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def section(name: str, rows: list[QuantRow], model: ranking.Model | None, plot: bool = False) -> str:
    """The card's "Which quant to pick": the quants on the frontier, and for each common budget and context the
    published quant with the lowest KLD whose runtime fits (without the FP16 checkpoint's shape, `model` None, the
    picks are left out with one line saying so). `plot`: the card carries FILENAME beside it (a Hub repo's main)."""
    scored = _scored(rows)
    if not scored:
        return ""
    on = ranking.frontier(scored)
    lines = [
        "\n## Which quant to pick\n",
        "Every quant here was scored on the same windows against the same FP16 model, so their KLDs compare across "
        "formats. On the frontier (no smaller quant has a lower KLD): "
        + ", ".join(f"`{r.tag}` ({tables.size(r.bytes)}, KLD {tables.kld(r.kld)})" for r in on)
        + ".\n",
    ]
    if plot:
        lines.append(f"![KL divergence from FP16 against size, every format]({FILENAME})\n")
    if model is None:
        lines.append("The picks by budget need the FP16 checkpoint's shape, which this card was made without.\n")
        return "\n".join(lines)
    chosen = ranking.picks(name, model, rows)
    contexts = sorted({ctx for _, ctx in chosen})
    lines.append(
        "The published quant with the lowest KLD whose runtime fits each card (its memory model: weights, KV cache "
        f"in fp16, the runtime's own; {tables.size(vram.HEADROOM)} left free):\n"
    )
    lines.append("| memory | " + " | ".join(f"{ctx // 1024}k tokens" for ctx in contexts) + " |")
    lines.append("|---|" + "---|" * len(contexts))
    for gib in ranking.BUDGETS:
        cells = []
        for ctx in contexts:
            pick = chosen[gib, ctx]
            cells.append(
                pick if isinstance(pick, str) else f"`{pick.tag}` (KLD {tables.kld(pick.kld)}, {pick.runtime})"
            )
        lines.append(f"| {gib} GB | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
