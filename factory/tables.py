"""The CLI's tables, laid out for the terminal they are printed on.

A table is a list of columns, each with a header, its cells and a priority: 0 is never dropped nor cut (the
`name:tag` a user copies, a job id); when the table is wider than the terminal, the column with the highest
priority goes first, until the rest fits; a column marked `flex` (an error message) takes what width is left and is
cut with an ellipsis. No box: columns are two spaces apart, as in `docker ps` or `ollama list`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.table import Table

GAP = 2


@dataclass
class Col:
    header: str
    cells: list[str] = field(default_factory=list)
    priority: int = 0  # 0: always shown; higher: dropped earlier when the terminal is narrow
    right: bool = False
    flex: bool = False  # takes the width left, cut with an ellipsis

    @property
    def width(self) -> int:
        return max([len(self.header), *map(len, self.cells)])


def layout(columns: list[Col], width: int, title: str | None = None) -> Table:
    shown = list(columns)

    def needed(cols: list[Col]) -> int:
        return sum(min(c.width, 12) if c.flex else c.width for c in cols) + GAP * (len(cols) - 1)

    while needed(shown) > width and any(c.priority for c in shown):
        shown.remove(max((c for c in shown if c.priority), key=lambda c: c.priority))
    table = Table(title=title, title_justify="left", box=None, pad_edge=False, padding=(0, GAP // 2),
                  header_style="bold")
    rest = width - sum(c.width for c in shown if not c.flex) - GAP * (len(shown) - 1)
    for c in shown:
        if c.flex:
            table.add_column(c.header, no_wrap=True, overflow="ellipsis", max_width=max(rest, len(c.header)))
        else:
            table.add_column(c.header, no_wrap=True, min_width=c.width, justify="right" if c.right else "left")
    for row in zip(*(c.cells for c in shown), strict=True):
        table.add_row(*row)
    return table


def size(n: float) -> str:
    """Bytes in binary units, as they are: 166.1 MiB, 1.20 GiB."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def kld(value: float, digits: int = 4) -> str:
    """A KL divergence as people read it. Its estimator's sampled tail term can dip a hair below zero for a quant
    that is almost FP16 (factory/kld.py); a divergence is never negative, so the shown value stops at 0 (never
    "-0.0000"), and the raw one stays in --json."""
    return f"{max(value, 0.0):.{digits}f}"


def duration(seconds: float) -> str:
    """12 s, 4 min, 1.5 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def quants(rows: list, width: int, title: str | None = None) -> Table:
    """`rows`: the catalog's QuantRows."""
    return layout([
        Col("NAME:TAG", [f"{r.ref}@{r.rev}" for r in rows]),
        Col("METHOD", [r.method for r in rows], priority=2),
        Col("BITS", [f"{r.bits:g}" for r in rows], right=True),
        Col("SIZE", [size(r.bytes) for r in rows], right=True),
        Col("PPL", [f"{r.ppl:.4f}" for r in rows], right=True),
        Col("VS FP16", [f"{r.change * 100:+.2f}%" for r in rows], right=True),
        Col("KLD", ["-" if r.kld is None else kld(r.kld) for r in rows], priority=1, right=True),
        Col("TOP-1", ["-" if r.top1 is None else f"{r.top1 * 100:.1f}%" for r in rows], priority=1, right=True),
        Col("SOURCE", [r.source_identity[:19] for r in rows], priority=3),
    ], width, title)


def _steps(steps: list[dict]) -> str:
    """A job's steps in a few words: the running one, else how many ended how, and their seconds."""
    running = [s["name"] for s in steps if s["state"] == "running"]
    if running:
        return f"{', '.join(running)} running"
    done = sum(s["state"] == "succeeded" for s in steps)
    seconds = sum(s["seconds"] or 0 for s in steps)
    return f"{done}/{len(steps)} done, {seconds:.0f}s" if steps else "-"


def jobs(rows: list[dict], width: int, title: str | None = None) -> Table:
    return layout([
        Col("JOB", [r["id"] for r in rows]),
        Col("NAME", [r["name"] for r in rows]),
        Col("STATE", [r["state"] for r in rows]),
        Col("STEPS", [_steps(r["steps"]) for r in rows], priority=2),
        Col("CREATED", [r["created_at"].replace("T", " ") for r in rows], priority=3),
        Col("ERROR", [r["error"] or "" for r in rows], priority=1, flex=True),
    ], width, title)


def steps(row: dict, width: int) -> Table:
    """One job's steps (`qf status JOB`): each with its state, seconds, peak GPU memory and error."""
    s = row["steps"]
    return layout([
        Col("STEP", [x["name"] for x in s]),
        Col("STATE", [x["state"] for x in s]),
        Col("SECONDS", ["" if x["seconds"] is None else f"{x['seconds']:.1f}" for x in s], right=True),
        Col("EXPECTED", ["" if x.get("expected_seconds") is None else f"{x['expected_seconds']:.0f}" for x in s],
            priority=2, right=True),
        Col("PEAK GPU", [size(x["peak_gpu_bytes"]) if x.get("peak_gpu_bytes") else "" for x in s], priority=2,
            right=True),
        Col("ERROR", [x["error"] or "" for x in s], priority=1, flex=True),
    ], width, title=f"job {row['id']} ({row['name']}): {row['state']}")
