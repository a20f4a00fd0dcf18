"""The events a job reports while it runs: what `qf run` renders, what `--json` prints one per line and what a
worker publishes for `qf status --follow`. Each is a JSON object whose "event" key says which of these it is; the
pipeline makes them with the functions here, so that every consumer can rely on their shape.

    job         a job was created or found:     job, created, state, name, source, source_identity
    note        a sentence for people:          message
    step        a step started or ended:        step, state (running|succeeded|failed), expected_seconds (when it
                                                starts), seconds and peak_gpu_bytes (when it succeeds), error
    progress    a running step moved on:        step; done, total, unit (a layer, a window, a module); eta (the
                                                tool's own words); peak_gpu_bytes; waiting_for; any other number
                                                its engine reports
    evaluation  a perplexity was measured:      subject (fp16, a tag, or tag:group:key), ppl; a quant's kld,
                                                kld_p99 and top1 against FP16 where they were measured
    waiting     units wait for others:          units (the units that wait), by (a helper: the job's process; a
                                                job: "other jobs' units on this machine", which hold the card)
    result      the job ended or was found done: job, state, error, exit_code, quants (QuantRow.to_json each)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NotRequired, TypedDict


class JobEvent(TypedDict):
    event: Literal["job"]
    job: str
    created: bool
    state: str
    name: str
    source: str
    source_identity: str


class Note(TypedDict):
    event: Literal["note"]
    message: str


class Step(TypedDict):
    event: Literal["step"]
    step: str
    state: str
    expected_seconds: NotRequired[float]
    seconds: NotRequired[float]
    peak_gpu_bytes: NotRequired[int | None]
    error: NotRequired[str]


class Progress(TypedDict, total=False):
    event: Literal["progress"]
    step: str
    done: float
    total: float
    unit: str
    eta: str
    peak_gpu_bytes: int
    waiting_for: str


class Evaluation(TypedDict):
    event: Literal["evaluation"]
    subject: str
    ppl: float
    kld: NotRequired[float]
    kld_p99: NotRequired[float]
    top1: NotRequired[float]


class Waiting(TypedDict):
    event: Literal["waiting"]
    units: list[str]
    by: str


class Result(TypedDict):
    event: Literal["result"]
    job: str
    state: str
    error: str | None
    exit_code: int
    quants: list[dict[str, Any]]


Event = JobEvent | Note | Step | Progress | Evaluation | Waiting | Result
Emit = Callable[[Event], None]


def job(job_id: str, created: bool, state: str, name: str, source: str, source_identity: str) -> JobEvent:
    return {
        "event": "job",
        "job": job_id,
        "created": created,
        "state": state,
        "name": name,
        "source": source,
        "source_identity": source_identity,
    }


def note(message: str) -> Note:
    return {"event": "note", "message": message}


def step_started(name: str, expected_seconds: float | None) -> Step:
    event: Step = {"event": "step", "step": name, "state": "running"}
    if expected_seconds is not None:
        event["expected_seconds"] = round(expected_seconds, 1)
    return event


def step_succeeded(name: str, seconds: float, peak_gpu_bytes: int | None) -> Step:
    return {"event": "step", "step": name, "state": "succeeded", "seconds": seconds, "peak_gpu_bytes": peak_gpu_bytes}


def step_failed(name: str, error: str) -> Step:
    return {"event": "step", "step": name, "state": "failed", "error": error}


def progress(name: str, fields: dict[str, Any]) -> Progress:
    """A step's progress: what its engine or evaluation reported (`fields`, without an "event" key of its own)."""
    return {**{k: v for k, v in fields.items() if k != "event"}, "event": "progress", "step": name}  # type: ignore[typeddict-item]


def evaluation(subject: str, ppl: float, divergence: tuple[float, float, float] | None = None) -> Evaluation:
    """`divergence`: a quant's (mean KLD, its 99th percentile, top-1 agreement) against FP16."""
    event: Evaluation = {"event": "evaluation", "subject": subject, "ppl": ppl}
    if divergence is not None:
        event.update(zip(("kld", "kld_p99", "top1"), divergence, strict=True))  # type: ignore[typeddict-item]
    return event


def waiting(units: list[str], by: str) -> Waiting:
    return {"event": "waiting", "units": units, "by": by}


def result(job_id: str, state: str, error: str | None, exit_code: int, quants: list[dict[str, Any]]) -> Result:
    return {"event": "result", "job": job_id, "state": state, "error": error, "exit_code": exit_code, "quants": quants}
