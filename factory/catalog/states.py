"""A job's and a step's states, and the changes of a job's state that may happen."""

from __future__ import annotations

import enum
from datetime import UTC, datetime


class JobState(enum.StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


TERMINAL = frozenset({JobState.succeeded, JobState.failed, JobState.cancelled})


RETRYABLE = frozenset({JobState.failed, JobState.cancelled})  # `qf retry` queues these again


TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.queued: frozenset({JobState.queued, JobState.running, JobState.failed, JobState.cancelled}),
    # queued again: handed from the gpu queue to the publishing step, or its lease expired
    JobState.running: frozenset({JobState.queued, JobState.succeeded, JobState.failed, JobState.cancelled}),
    JobState.failed: frozenset({JobState.queued, JobState.running}),  # retried; `qf run` continues it
    JobState.cancelled: frozenset({JobState.queued}),  # retried
    # queued again only when a quant it published was removed (`qf rm`) and the same job is asked for again
    # (Quants.reopen, with only_from={succeeded}): it makes that quant again
    JobState.succeeded: frozenset({JobState.queued}),
}


class StepState(enum.StrEnum):
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    skipped = "skipped"
    interrupted = "interrupted"  # stopped by Ctrl-C or SIGTERM, or left running by an attempt that was killed
    superseded = "superseded"  # succeeded once, but what it made was removed (`qf rm`): made again, not done
    reused = "reused"  # done without its work: what an earlier job made or published is used (its note says which)


# a step that needs no running again (skipped: the publish of a quant the gate did not keep, factory/jobs/rivals.py)
DONE_STEPS = frozenset({StepState.succeeded, StepState.reused, StepState.skipped})


def now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)
