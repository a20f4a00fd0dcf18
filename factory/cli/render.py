"""Pipeline events as `qf run`, `qf status --follow` and `qf watch check` show them: JSON lines, live progress
on a terminal, or plain lines."""

from __future__ import annotations

import json
import threading
import time

from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from factory import tables
from factory.cli.shared import err
from factory.events import Event

HEARTBEAT_SECONDS = 60  # without a terminal, a progress line at least this often, so a long step does not look hung


class Renderer:
    """Pipeline events -> JSON lines (--json), or rich progress on a terminal, or plain lines otherwise (a line per
    step, and one with the step's progress when nothing was printed for HEARTBEAT_SECONDS)."""

    def __init__(self, as_json: bool):
        self.as_json = as_json
        self.live = not as_json and err.is_terminal
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[count]}"),
            TimeElapsedColumn(),
            console=err,
        )
        self.tasks: dict[str, int] = {}
        self.last_line = time.monotonic()
        self.lock = threading.Lock()  # units running at once emit from their threads

    def __enter__(self):
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.live:
            self.progress.stop()

    def __call__(self, event: Event) -> None:
        with self.lock:
            self._render(event)

    def _render(self, event: Event) -> None:
        if self.as_json:
            print(json.dumps(event, default=str), flush=True)
            return
        kind = event["event"]
        if kind == "job":
            what = "new job" if event["created"] else "existing job"
            self._line(
                f"{what} {event['job']}: {event['name']} from {event['source']} ({event['source_identity'][:19]})"
            )
        elif kind == "note":
            self._line(event["message"])
        elif kind == "step":
            self._step(event)
        elif kind == "progress":
            if self.live and event["step"] not in self.tasks:  # following a step that started before we looked
                self.tasks[event["step"]] = self.progress.add_task(event["step"], total=None, count="")
            task = self.tasks.get(event["step"])
            if task is not None and "total" in event:
                self.progress.update(task, total=event["total"], completed=event["done"], count=_count(event))
            elif not self.live and "total" in event and time.monotonic() - self.last_line > HEARTBEAT_SECONDS:
                self._line(f"{event['step']}: {_count(event)}")
        elif kind == "evaluation":
            divergence = (
                f", KL divergence from FP16 {tables.kld(event['kld'])} (p99 "
                f"{tables.kld(event['kld_p99'], 3)}), top-1 {event['top1'] * 100:.1f}%"
                if "kld" in event
                else ""
            )
            self._line(f"perplexity {event['subject']}: {event['ppl']:.4f}{divergence}")

    def _step(self, event: dict) -> None:
        name, state = event["step"], event["state"]
        if state == "running":
            if self.live:
                self.tasks[name] = self.progress.add_task(name, total=None, count="")
            else:
                self._line(f"{name} ...")
            return
        task = self.tasks.pop(name, None)
        if task is not None:
            self.progress.update(
                task,
                completed=self.progress.tasks[task].total or 1,
                total=self.progress.tasks[task].total or 1,
                description=f"{name} [{'green' if state == 'succeeded' else 'red'}]{state}[/]",
            )
            self.progress.stop_task(task)
        elif not self.live:
            self._line(f"{name} {state}")

    def _line(self, text: str) -> None:
        self.last_line = time.monotonic()
        (self.progress.console if self.live else err).print(text, markup=False, highlight=False)


def _count(event: dict) -> str:
    """A progress event's count as people say it: "layer 3 of 30", "window 5 of 48", "37.5%", "1.2 MiB of 4.0 MiB"."""
    done, total, unit = event["done"], event["total"], event.get("unit", "")
    if unit == "%":
        return f"{100 * done / total:.3g}%" if total else f"{done:g}%"
    if unit == "B":
        return f"{tables.size(done)} of {tables.size(total)}"
    return f"{unit} {done:g} of {total:g}".strip()
