"""Who follows a job's events (`GET /api/jobs/J/events`, server-sent) in this server process, within bounds.

A follower waits on the job's Redis channel in a thread of its own pool (a CapacityLimiter as large as the bound),
never in the pool the other routes answer from, so that followers at the bound leave every other answer as fast as
without them (benchmarks/followers.py). Past the bound, per user or for the process, a follower is refused with
OverQuota (HTTP 429) in one sentence, before its stream starts. When the client goes, its stream is closed once its
current wait returns (2 s at most: a generator cannot be closed while it runs), and with it its Redis connection.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
import anyio.to_thread
from fastapi.responses import StreamingResponse

from factory.errors import OverQuota

MAX_PER_PROCESS = 64  # followers of one server process, all users
MAX_PER_USER = 8  # of one user, in one server process


class Followers:
    def __init__(self, per_process: int = MAX_PER_PROCESS, per_user: int = MAX_PER_USER):
        self.per_process, self.per_user = per_process, per_user
        self.limiter = anyio.CapacityLimiter(per_process)  # bound to the server's event loop when first used
        self._by_user: Counter[str] = Counter()
        self._lock = threading.Lock()

    def response(self, user: str, events: Iterator[dict | None]) -> StreamingResponse:
        """`events` (None: a keep-alive) as a server-sent stream for `user`; OverQuota past a bound."""
        return _Following(
            self._lines(events),
            self._admit(user),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store"},
        )

    def _admit(self, user: str) -> Callable[[], None]:
        with self._lock:
            if self._by_user[user] >= self.per_user:
                raise OverQuota(
                    f"{user} follows {self._by_user[user]} jobs at once on this server, the most it "
                    "allows; stop one (Ctrl-C its `qf status --follow`) and follow again"
                )
            if self._by_user.total() >= self.per_process:
                raise OverQuota(
                    f"this server has {self._by_user.total()} followers, the most it allows; follow "
                    "again in a while, or read the job's state with `qf status JOB`"
                )
            self._by_user[user] += 1

        def release() -> None:
            with self._lock:
                self._by_user[user] -= 1
                if not self._by_user[user]:
                    del self._by_user[user]

        return release

    async def _lines(self, events: Iterator[dict | None]) -> AsyncIterator[str]:
        try:
            while (
                event := await anyio.to_thread.run_sync(next, events, StopIteration, limiter=self.limiter)
            ) is not StopIteration:
                yield ": keep-alive\n\n" if event is None else f"data: {json.dumps(event, default=str)}\n\n"
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(events.close, limiter=self.limiter)


class _Following(StreamingResponse):
    """A stream that, however it ends (its last event, an error, the client gone), closes its events and lets its
    place go: Starlette leaves an unfinished body iterator to the garbage collector."""

    def __init__(self, lines: AsyncIterator[str], release: Callable[[], None], **kwargs):
        super().__init__(lines, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
            self._release()
