"""One limit on the load a batch sends its model: calls in flight, calls started per minute, tokens per minute.

Every upstream call (each retry included) takes a slot first (:meth:`Limits.slot`) and gives it back with the
tokens the answer reported. A call that waits for its slot is not an error: the journal says how long it
waited. The limits are the batch's, not a sandbox's: one :class:`LocalLimits` serves every sandbox of a batch
on one host, and on a cluster every node's gateway asks the same one, held by a Ray actor on the driver's node
(:mod:`pvisor_host.backend.cluster.limits`), through the same :class:`Limits` protocol.

No library fits: asyncio's semaphore caps what is in flight, and the two sliding one-minute windows (calls
started, tokens used) are a few lines over a deque; rate-limit libraries count calls, not tokens known only
once an answer is in.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Protocol

from ..models.spec import ModelUpstream

#: Seconds the per-minute limits look back over.
WINDOW = 60.0


class Slot:
    """A call's place in the limits: how long it waited for it, and the tokens its answer reported."""

    def __init__(self, waited: float) -> None:
        self.waited = waited
        self.tokens = 0


class Limits(Protocol):
    """Where a gateway takes a slot before each upstream call."""

    def slot(self) -> contextlib.AbstractAsyncContextManager[Slot]:
        """Wait for a slot; give it back (with :attr:`Slot.tokens`) when the block ends."""
        ...


class NoLimits:
    """No limit: every call goes at once."""

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[Slot]:
        yield Slot(0.0)


class LocalLimits:
    """The limits of one event loop's calls (see the module docstring)."""

    def __init__(
        self,
        *,
        concurrency: int | None = None,
        requests_per_minute: int | None = None,
        tokens_per_minute: int | None = None,
        window: float = WINDOW,
    ) -> None:
        self.concurrency = concurrency
        self.requests_per_minute = requests_per_minute
        self.tokens_per_minute = tokens_per_minute
        self._window = window
        self._clock = time.monotonic
        self._in_flight = 0
        self._started: deque[float] = deque()
        self._used: deque[tuple[float, int]] = deque()
        self._changed = asyncio.Condition()
        self.peak = 0
        """The most calls in flight at once so far."""

    async def acquire(self) -> float:
        """Wait until a call may start; returns the seconds waited."""
        began = self._clock()
        async with self._changed:
            while (delay := self._delay()) != 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), delay)
            self._in_flight += 1
            self.peak = max(self.peak, self._in_flight)
            self._started.append(self._clock())
        return self._clock() - began

    async def release(self, tokens: int) -> None:
        """A call ended, having used ``tokens``."""
        async with self._changed:
            self._in_flight -= 1
            if tokens:
                self._used.append((self._clock(), tokens))
            self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[Slot]:
        slot = Slot(await self.acquire())
        try:
            yield slot
        finally:
            await self.release(slot.tokens)

    def _delay(self) -> float | None:
        """0 when a call may start now; else how long until that may change (None: until a call ends)."""
        now = self._clock()
        while self._started and self._started[0] <= now - self._window:
            self._started.popleft()
        while self._used and self._used[0][0] <= now - self._window:
            self._used.popleft()
        if self.concurrency is not None and self._in_flight >= self.concurrency:
            return None
        waits = []
        if self.requests_per_minute is not None and len(self._started) >= self.requests_per_minute:
            waits.append(self._started[0] + self._window - now)
        if self.tokens_per_minute is not None and sum(t for _, t in self._used) >= self.tokens_per_minute:
            waits.append(self._used[0][0] + self._window - now)
        return max(waits) if waits else 0


def local_limits(upstream: ModelUpstream) -> LocalLimits | NoLimits:
    """The limits ``upstream`` asks for, for the calls of one event loop (no limit when it asks for none)."""
    if upstream.concurrency is None and upstream.requests_per_minute is None and upstream.tokens_per_minute is None:
        return NoLimits()
    return LocalLimits(
        concurrency=upstream.concurrency,
        requests_per_minute=upstream.requests_per_minute,
        tokens_per_minute=upstream.tokens_per_minute,
    )
