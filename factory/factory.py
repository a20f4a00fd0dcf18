"""The factory's front, `Factory` (the module is named for it), for the CLI, the service and the workers: `submit`
checks a request and creates the job or finds the same one, `estimate` says how long it should take, `execute` runs a
job (or its part a GPU worker runs) and `help` converts some of another worker's running job here. `qf run` calls
submit and execute in-process; a worker calls `execute` with a job id.

Each call builds the context of one attempt (factory/jobs/context.py's Run: the catalog, the settings, `emit`, the
lease's token, this process's holder name, the stop event) and hands it to factory/jobs/: planning.py (submit,
estimate), run.py (the unit loop), which calls prepared.py, conversions.py and evaluations.py. Nothing here prints:
progress goes to `emit` as events (factory/events.py) that the CLI renders.
"""

from __future__ import annotations

import copy

from factory import identity
from factory.catalog import Catalog, Job, Lease
from factory.events import Emit
from factory.jobs import conversions, planning, run
from factory.jobs.context import Run
from factory.jobs.costs import Costs
from factory.jobs.ledger import Ledger
from factory.jobs.planning import Request
from factory.publish import publishing
from factory.settings import Settings


class Factory:
    def __init__(self, settings: Settings, emit: Emit = lambda event: None):
        self.settings = settings
        self.catalog = Catalog(settings.db_url)
        self.emit = emit  # read at each call: `qf run` wraps it once the job is created
        self.publisher = publishing.Publisher(settings, self.catalog)
        self.costs = Costs(
            self.catalog.steps, settings.max_units, Ledger(settings.gpu_ledger) if settings.gpu_ledger else None
        )
        self.holder = identity.holder_name()  # this process, in the steps it runs and the claims it holds

    def emitting(self, emit: Emit) -> Factory:
        """This factory with its events going to `emit` (the service: each request its own, sharing the catalog)."""
        other = copy.copy(self)
        other.emit = emit
        return other

    def submit(self, request: Request) -> tuple[Job, bool]:
        """(the job, whether it needs running: created now, or a succeeded one queued again by remake_removed)."""
        return planning.submit(self.catalog, self.settings, self.emit, request)

    def remake_removed(self, job: Job) -> bool:
        """A succeeded job whose quants `qf rm` removed goes back to queued to make them again; True when it did."""
        return planning.remake_removed(self.catalog, self.emit, job)

    def estimate(self, job: Job) -> tuple[float, float] | None:
        """(packed, one after another) expected seconds of a job just submitted; None where its shape is unknown."""
        return planning.estimate(self.costs, self.settings, job)

    def execute(self, job_id: str, publish: bool = True, lease: Lease | None = None) -> Job:
        """Run the steps not done yet. publish=False (a GPU worker) stops after the gate and leaves the job queued
        for its publishing step, which runs `execute` again elsewhere: every finished step is reused there.
        With `lease`, every write is fenced by its token: once another holder has the job, this one stops (its
        engines too) at the next write or progress event, writes nothing more, and raises LeaseLost."""
        return run.execute(self._run(lease.token if lease else None), job_id, publish)

    def help(self, job_id: str) -> None:
        """Convert some of a running job's sizes here while its holder runs the rest (factory/jobs/conversions.py)."""
        conversions.help(self._run(None), job_id)

    def _run(self, token: int | None) -> Run:
        return Run(self.catalog, self.settings, self.emit, self.costs, self.publisher, self.holder, token)
