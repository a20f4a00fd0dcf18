"""What every part of a running job is handed: `Run`, the frozen context of one attempt (factory/jobs/run.py builds
the attempt from it; conversions.py, evaluations.py and prepared.py take it as their first argument). It holds the
catalog and settings, where events go, the lease's fencing token and this process's holder name, and the event that
stops the running units; its methods are the few operations every part shares: a step, a note, the lease check."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from factory import events
from factory.catalog import Catalog, Job, StepState
from factory.errors import Cancelled, FactoryError, LeaseLost, mask_url
from factory.events import Emit
from factory.jobs import packing
from factory.jobs.costs import Costs
from factory.publish.publishing import Publisher
from factory.settings import Settings

CANCEL_CHECK_SECONDS = 1.0  # how often a running step looks whether its job was cancelled or taken over


@dataclass(frozen=True)
class Run:
    """One attempt at a job (or at helping with one): every write it makes as a lease holder is fenced by `token`."""

    catalog: Catalog
    settings: Settings
    emit: Emit
    costs: Costs
    publisher: Publisher
    holder: str  # this process, in the steps it runs and the claims it holds
    token: int | None = None  # the fencing token of the lease the attempt runs under, if any
    stop: threading.Event = field(default_factory=threading.Event)  # set: the running units stop at their next progress
    expected: dict[str, float] = field(default_factory=dict)  # unit -> seconds, for its step

    def note(self, message: str) -> None:
        self.emit(events.note(message))

    def check_ours(self, job_id: str) -> None:
        """Raises Cancelled when the job was cancelled, LeaseLost when another holder has it."""
        self.catalog.leases.check(job_id, self.token)

    def _stopped(self, job_id: str) -> tuple[StepState, str]:
        """How a step that was stopped ends: Ctrl-C or SIGTERM (qf run turns it into a KeyboardInterrupt), or the
        job stopped its units (`stop`: a unit beside it failed or saw a cancel, or a unit's claim was taken over; its
        engine got SIGTERM too). The step is interrupted, or failed as the unit that saw the cancel first says, when
        that is why."""
        if self.stop.is_set():
            try:
                self.check_ours(job_id)
            except Cancelled as e:
                return StepState.failed, e.message
            except LeaseLost:  # the step is the new holder's: end_step says so
                pass
        return StepState.interrupted, "interrupted"

    def claimer(self, job: Job) -> str:
        """Who holds a claim this attempt takes: `job@host:pid`."""
        return f"{job.id}@{self.holder}"

    @contextmanager
    def step_once(self, job_id: str, name: str, done: set[str]):
        """`step`, unless this job did it already (`done`: an earlier pass, such as the GPU worker's before the
        publishing step, or an attempt before a retry): then it is done again as a re-read, with no record and no
        events, so that every view and follower sees each step once. Yields `progress(**fields)` as `step` does."""
        if name in done:
            self.check_ours(job_id)
            yield lambda **fields: None
            return
        with self.step(job_id, name) as progress:
            yield progress

    @contextmanager
    def step(
        self, job_id: str, name: str, claim: tuple[str, int] | None = None, on_success: Callable[[], None] | None = None
    ):
        """Record one attempt at a step; yields `progress(**fields)`, which forwards progress events and keeps
        the highest `peak_gpu_bytes` any of them reports. `claim` (key, token): the unit's claim, which fences the
        step's records besides the job's lease; `on_success` runs under those fences as the step succeeds."""
        self.check_ours(job_id)
        stopped_here = packing.Stopped(f"{name} stopped: the job stops")
        if self.stop.is_set():  # the job stopped its units: one more would start an engine nothing stops
            raise stopped_here
        expected = self.expected.get(name)
        self.emit(events.step_started(name, expected))
        step_id = self.catalog.steps.start(job_id, name, self.token, expected, self.holder, claim)
        start = time.monotonic()
        peak: list[int] = []
        checked = [start]

        def progress(**event) -> None:
            if event.get("peak_gpu_bytes") is not None:
                peak.append(event["peak_gpu_bytes"])
            self.emit(events.progress(name, event))
            if self.stop.is_set():
                raise stopped_here
            if time.monotonic() - checked[0] > CANCEL_CHECK_SECONDS:
                checked[0] = time.monotonic()
                self.check_ours(job_id)  # raising here stops the engine: its child gets SIGTERM

        try:
            yield progress
        except LeaseLost:  # the step is the new holder's now
            raise
        except BaseException as e:
            stopped = isinstance(e, KeyboardInterrupt) or self.stop.is_set()  # not failed: see `_stopped`
            if stopped:
                state, error = self._stopped(job_id)
            else:
                state = StepState.failed
                error = mask_url(e.message if isinstance(e, FactoryError) else f"{type(e).__name__}: {e}")
            self.catalog.steps.end(step_id, state, error, max(peak, default=None), self.token, claim)
            if state == StepState.failed:
                self.emit(events.step_failed(name, error))
            if stopped and not isinstance(e, KeyboardInterrupt):  # its engine died of the stop's SIGTERM
                raise stopped_here from e
            raise
        self.catalog.steps.end(
            step_id, StepState.succeeded, None, max(peak, default=None), self.token, claim, on_success
        )
        seconds = round(time.monotonic() - start, 3)
        self.emit(events.step_succeeded(name, seconds, max(peak, default=None)))
