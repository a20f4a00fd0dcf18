"""The job queue, as `qf` and the service see it: what they ask of the fleet (submit, retry, follow, the watchlist
check, a reconciler pass, the commands that start a worker or beat). factory/ names no implementation: workers/
(Celery on Redis) knows factory/, never the reverse, and plugs its Queue in through the `quantfactory.queue` entry
point of pyproject.toml, which `get` loads in any process (`qf`, `python -m factory.cli`, each server process of
`qf serve`, a test's CliRunner). An installation without one refuses with one sentence, exit 5, like a broker that
cannot be reached; so does one that does not load or is not a Queue (a missing name, a class in place of its
object, a method that takes other arguments), before any of it is called. `qf run` needs no queue.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from factory.errors import ServiceUnavailable

if TYPE_CHECKING:
    from factory.catalog import Catalog, Job
    from factory.factory import Factory
    from factory.jobs.planning import Request

GROUP = "quantfactory.queue"


@runtime_checkable
class Queue(Protocol):
    def check_broker(self) -> None:
        """Raises ServiceUnavailable (exit 5) when the broker cannot be reached."""

    def submit(self, factory: Factory, request: Request) -> Job:
        """Create the job (or find the same one) and queue it unless it is queued, running or done already."""

    def retry(self, factory: Factory, job_id: str) -> Job:
        """Queue a failed or cancelled job again; its finished steps are kept."""

    def follow(self, catalog: Catalog, broker_url: str, job_id: str) -> Iterator[dict | None]:
        """The job's events until its result or its end; None every few seconds without one (a keep-alive)."""

    def watch_check(self, dry_run: bool) -> dict:
        """One watchlist check: {"planned": [...], "errors": [...]} ("busy": True when another check runs)."""

    def reconcile(self) -> list[str]:
        """One reconciler pass: the jobs queued again."""

    def worker_command(self, node: str, queues: str) -> list[str]:
        """The argv of one worker process named `node` taking `queues` (comma-separated)."""

    def beat_command(self, schedule: Path) -> list[str]:
        """The argv of the periodic scheduler (the reconciler, the watchlist check), its state in `schedule`."""


@functools.cache
def get() -> Queue:
    """The installed queue (loaded once per process)."""
    found = sorted(entry_points(group=GROUP), key=lambda e: e.name)
    if len(found) != 1:
        names = ", ".join(e.value for e in found) or "none"
        raise ServiceUnavailable(
            f"this installation has no single job queue for `qf submit` and the fleet (entry point group {GROUP!r}: "
            f"{names}); reinstall quantfactory (`pip install -e .`), or run the job here with `qf run`"
        )
    try:
        queue = found[0].load()
    except Exception as e:  # noqa: BLE001  (whatever a plugin raises while it loads: its name and words, one line)
        reason = str(e).splitlines()[0] if str(e) else ""
        stale = "; reinstall quantfactory (`pip install -e .`)" if isinstance(e, ModuleNotFoundError) else ""
        raise ServiceUnavailable(
            f"the job queue {found[0].value!r} cannot be loaded: {type(e).__name__}{': ' if reason else ''}{reason}"
            + stale  # an installation made before the module was renamed names the old one
        ) from None
    if (problem := _mismatch(queue)) is not None:
        raise ServiceUnavailable(f"the job queue {found[0].value!r} is not a Queue (factory/fleet.py): {problem}")
    return queue


def _mismatch(queue: object) -> str | None:
    """What makes `queue` not a Queue that can be called (None: nothing): isinstance only asks whether the names
    exist, so a class in place of its instance, or a member that is no method or takes other arguments, passed it
    and failed later, inside a request."""
    if isinstance(queue, type):
        return f"it is the class {queue.__name__}, not a Queue object"
    for name, member in vars(Queue).items():
        if name.startswith("_") or not callable(member):
            continue
        found = getattr(queue, name, None)
        if not callable(found):
            return f"it has no method {name}"
        wanted = len(inspect.signature(member).parameters) - 1  # but self
        try:
            inspect.signature(found).bind(*range(wanted))
        except TypeError:
            return f"its {name} does not take the {wanted} arguments of Queue.{name}"
        except ValueError:  # no signature to read (a builtin): called as it is
            continue
    return None
