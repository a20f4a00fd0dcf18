"""The CLI's tables, laid out for the terminal they are printed on: every table `qf` prints is made here.

A table is a list of columns, each with a header, its cells and a priority: 0 is an identifier a user copies or types
again (a `name:tag@rev`, a job id, a watch's target, a token id), never dropped nor cut; when the table is wider than
the terminal, the column with the highest priority goes first, until the rest fits, and one line under the table
names the columns that went and what shows them (`--wide`, `--json`). A column marked `flex` (an error message, a
recipe) takes the width left and is cut with an ellipsis. When the identifiers alone are wider than the terminal,
the lines are longer than it and the terminal wraps them: nothing is cut (the CLI's console prints with soft wrap,
so rich crops nothing either). No box: columns are two spaces apart, as in `docker ps` or `ollama list`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.text import Text

GAP = 2
FLEX_MIN = 12  # a flex column keeps this much (or all it has) before another column is dropped to make room
WIDE = "--wide or --json"  # what shows the hidden columns of a command that has --wide


@dataclass
class Col:
    header: str
    cells: list[str] = field(default_factory=list)
    priority: int = 0  # 0: an identifier, always shown whole; higher: dropped earlier when the terminal is narrow
    right: bool = False
    flex: bool = False  # takes the width left, cut with an ellipsis

    @property
    def width(self) -> int:
        return max([len(self.header), *map(len, self.cells)])


@dataclass(frozen=True)
class Table:
    """A table laid out for a width: its lines, and the one that says which columns it left out."""

    title: str | None
    header: str
    rows: list[str]
    note: str | None = None

    def __rich_console__(self, console, options):
        for line, style in [(self.title, ""), (self.header, "bold"), *((r, "") for r in self.rows), (self.note, "")]:
            if line is not None:
                yield Text(line, style=style, no_wrap=True, overflow="ignore")


def layout(columns: list[Col], width: int | None, title: str | None = None, shows: str = "--json") -> Table:
    """`columns` laid out for `width` characters (None: as wide as they are, nothing left out); `shows`: what the
    note under the table names for the columns it left out."""
    shown = list(range(len(columns)))
    if width is not None:
        while _needed([columns[i] for i in shown]) > width and any(columns[i].priority for i in shown):
            shown.remove(max((i for i in shown if columns[i].priority), key=lambda i: columns[i].priority))
    cols = [columns[i] for i in shown]
    widths = _widths(cols, width)

    def line(cells: tuple[str, ...] | list[str]) -> str:
        return (" " * GAP).join(_fit(cell, w, c) for cell, w, c in zip(cells, widths, cols, strict=True)).rstrip()

    hidden = [c.header for i, c in enumerate(columns) if i not in shown]
    note = None
    if hidden:
        note = f"{', '.join(hidden)} hidden at {width} columns: see {shows}"
    rows = [line(cells) for cells in zip(*(c.cells for c in cols), strict=True)] if cols else []
    return Table(title, line([c.header for c in cols]), rows, note)


def _needed(cols: list[Col]) -> int:
    return sum(min(c.width, FLEX_MIN) if c.flex else c.width for c in cols) + GAP * (len(cols) - 1)


def _widths(cols: list[Col], width: int | None) -> list[int]:
    """Each column's width: its own, and for the flex ones a share of what the others leave (the narrowest first,
    so that what one does not need goes to the next)."""
    widths = [c.width for c in cols]
    if width is None:
        return widths
    flex = sorted((i for i, c in enumerate(cols) if c.flex), key=lambda i: cols[i].width)
    rest = width - sum(w for i, w in enumerate(widths) if i not in flex) - GAP * (len(cols) - 1)
    for n, i in enumerate(flex):
        widths[i] = min(cols[i].width, max(rest // (len(flex) - n), len(cols[i].header)))
        rest -= widths[i]
    return widths


def _fit(cell: str, width: int, col: Col) -> str:
    if col.flex:
        cell = " ".join(cell.split())  # an error message's own line breaks would break the table's
        if len(cell) > width:
            cell = cell[: width - 1] + "…"
    return cell.rjust(width) if col.right else cell.ljust(width)


def size(n: float) -> str:
    """Bytes in binary units, as they are: 166.1 MiB, 1.20 GiB."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def kld(value: float, digits: int = 4) -> str:
    """A KL divergence as people read it. Its estimator's sampled tail term can dip a hair below zero for a quant
    that is almost FP16 (factory/evaluation/kld.py); a divergence is never negative, so the shown value stops at 0
    (never "-0.0000"), and the raw one stays in --json."""
    return f"{max(value, 0.0):.{digits}f}"


def duration(seconds: float) -> str:
    """under 1 s, 12 s, 4 min, 1.5 h."""
    if seconds < 0.5:
        return "under 1 s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def quants(rows: list, width: int | None, title: str | None = None, shows: str = WIDE) -> Table:
    """`rows`: the catalog's QuantRows. The method and the bits are in the tag, so they give way first (after the
    source); then top-1 agreement, then the KL divergence."""
    return layout(
        [
            Col("NAME:TAG", [f"{r.ref}@{r.rev}" for r in rows]),
            Col("METHOD", [r.method for r in rows], priority=4),
            Col("BITS", [f"{r.bits:g}" for r in rows], priority=3, right=True),
            Col("SIZE", [size(r.bytes) for r in rows], right=True),
            Col("PPL", [f"{r.ppl:.4f}" for r in rows], right=True),
            Col("VS FP16", [f"{r.change * 100:+.2f}%" for r in rows], right=True),
            Col("KLD", ["-" if r.kld is None else kld(r.kld) for r in rows], priority=1, right=True),
            Col("TOP-1", ["-" if r.top1 is None else f"{r.top1 * 100:.1f}%" for r in rows], priority=2, right=True),
            Col("SOURCE", [r.source_identity[:19] for r in rows], priority=5),
        ],
        width,
        title,
        shows,
    )


def ranking(rows: list, width: int | None, title: str | None = None) -> Table:
    """`rows`: factory/ranking.py's Ranked rows, best first. An expected row's KLD is marked `~` (read off its
    format's measured curve, not measured)."""
    return layout(
        [
            Col("#", [str(i) for i in range(1, len(rows) + 1)], right=True),
            Col("QUANT", [r.tag + (f"@{r.rev}" if r.rev else "") for r in rows]),
            Col("BITS", [f"{r.bits:g}" for r in rows], priority=3, right=True),
            Col("SIZE", [size(r.bytes) for r in rows], right=True),
            Col("NEEDS", ["-" if r.need is None else size(r.need) for r in rows], priority=2, right=True),
            Col("KLD", [("~" if r.kind == "expected" else "") + kld(r.kld) for r in rows], right=True),
            Col("TOP-1", ["-" if r.top1 is None else f"{r.top1 * 100:.1f}%" for r in rows], priority=4, right=True),
            Col("RUNTIME", [r.runtime for r in rows], priority=1),
            Col("KLD FROM", [r.kind for r in rows]),
        ],
        width,
        title,
    )


def _steps(row: dict) -> str:
    """A job's steps in a few words, from its `summary` (factory/catalog/status.py, what every view of a job says):
    the running ones, else how many of its steps are done and their seconds (a job that failed or was cancelled
    outside its steps, which are all done, says so instead of "2/2 done")."""
    summary = row["summary"]
    if summary["running"]:
        return f"{', '.join(summary['running'])} running"
    done, total, seconds = summary["done"], summary["total"], summary["seconds"]
    if row["state"] in ("failed", "cancelled") and done == total:
        return f"{row['state']} after {done} steps, {seconds:.0f}s"
    return f"{done}/{total} done, {seconds:.0f}s" if total else "-"


def jobs(rows: list[dict], width: int | None, title: str | None = None, shows: str = "--json") -> Table:
    return layout(
        [
            Col("JOB", [r["id"] for r in rows]),
            Col("NAME", [r["name"] for r in rows]),
            Col("STATE", [r["state"] for r in rows]),
            Col("STEPS", [_steps(r) for r in rows], priority=2),
            Col("CREATED", [r["created_at"].replace("T", " ") for r in rows], priority=3),
            Col("ERROR", [r["error"] or "" for r in rows], priority=1, flex=True),
        ],
        width,
        title,
        shows,
    )


def steps(row: dict, width: int | None, shows: str = "--json") -> Table:
    """One job's steps (`qf status JOB`): each with its state, seconds, peak GPU memory, and its error or note (a
    reused quant's name). A step superseded (its quant removed, the job queued to make it again) says so."""
    s = row["steps"]
    return layout(
        [
            Col("STEP", [x["name"] for x in s]),
            Col("STATE", ["to redo" if x["state"] == "superseded" else x["state"] for x in s]),
            Col("SECONDS", ["" if x["seconds"] is None else f"{x['seconds']:.1f}" for x in s], right=True),
            Col(
                "EXPECTED",
                ["" if x.get("expected_seconds") is None else f"{x['expected_seconds']:.0f}" for x in s],
                priority=2,
                right=True,
            ),
            Col(
                "PEAK GPU",
                [size(x["peak_gpu_bytes"]) if x.get("peak_gpu_bytes") else "" for x in s],
                priority=2,
                right=True,
            ),
            Col("ERROR / NOTE", [x["error"] or x.get("note") or "" for x in s], priority=1, flex=True),
        ],
        width,
        f"job {row['id']} ({row['name']}): {row['state']}",
        shows,
    )
