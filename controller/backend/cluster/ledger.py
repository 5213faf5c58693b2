"""The ledger of a cluster batch: where each copy of an attempt started, and which copies should stop.

One :class:`Ledger` per batch runs as an async Ray actor on the driver's own node, so it lives exactly as
long as the batch. Copies write to it (:meth:`Ledger.started`, before their sandbox starts) and wait on it
(:meth:`Ledger.wait_stop`, while it runs: one call that answers when there is a reason to stop, not a poll a
second, which cost every item Ray calls for nothing). The driver reads it (:meth:`Ledger.snapshot`) to see
on which node every copy runs, including the copy Ray ran again after its first node died, and writes to it
(:meth:`Ledger.stop`, :meth:`Ledger.give_up`, :meth:`Ledger.stop_all`, :meth:`Ledger.forget`). It also tells
the nodes which task images the batch is done with (:meth:`Ledger.image_done`), so that a node's budget may let
them go.
"""

from __future__ import annotations

import asyncio
import contextlib

from pydantic import BaseModel


class Start(BaseModel):
    """One start of one copy: Ray runs a copy again, on another node, when its node dies."""

    node_id: str
    node: str
    at: str
    """When it started (ISO 8601, UTC)."""
    token: str
    """The copy's scratch folder on that node."""


class Ledger:
    """The batch's ledger (made an async Ray actor by the driver; plain data in and out; every method runs on
    the actor's one event loop, so none needs a lock)."""

    def __init__(self) -> None:
        self._starts: dict[str, list[dict[str, str]]] = {}
        self._stop: set[str] = set()
        self._given_up: set[str] = set()
        self._stop_all = False
        self._done_images: set[str] = set()
        self._waiting: dict[str, asyncio.Event] = {}

    def started(self, copy_id: str, node_id: str, node: str, at: str, token: str) -> int:
        """Copy ``copy_id`` starts on ``node`` (again, if Ray retries it). Returns how many starts of it the
        ledger knows: more than one tells the driver, in the copy's reply, to read where the others were (Ray
        may run a copy again before the driver sees a node die, or with no node dead at all when only its
        worker died); 0 when the driver gave the copy up or told it (or every copy) to stop before this start:
        it is not followed, and runs nothing."""
        if self._stop_all or copy_id in self._stop or copy_id in self._given_up:
            return 0
        self._starts.setdefault(copy_id, []).append({"node_id": node_id, "node": node, "at": at, "token": token})
        return len(self._starts[copy_id])

    def give_up(self, copy_id: str, lost: list[str]) -> bool:
        """The driver gives the copy up, unless it runs on a node the driver has not lost. True when it has not
        started, or last started on one of the ``lost`` node ids: if Ray starts it later, it runs nothing (a
        start already under way on a node cut off from the head runs on, and may still finish first). False
        when it last started elsewhere (the driver's view of the starts was behind it, and a cancel would
        interrupt a copy that runs well): nothing changes.

        One call, so that nothing can start between the driver's look and its decision."""
        starts = self._starts.get(copy_id)
        if starts and starts[-1]["node_id"] not in lost:
            return False
        self._given_up.add(copy_id)
        return True

    def should_stop(self, copy_id: str) -> str | None:
        """Whether the copy should stop its sandbox, and why: ``"cancelled"`` (Ctrl-C on the driver) or
        ``"superseded"`` (another copy of its attempt finished first, or the attempt ended without it); None: go
        on."""
        if self._stop_all:
            return "cancelled"
        return "superseded" if copy_id in self._stop else None

    async def wait_stop(self, copy_id: str, seconds: float) -> str | None:
        """:meth:`should_stop`, waiting up to ``seconds`` for a reason; None also when the driver forgot the copy
        meanwhile (its watcher then sees that the copy ended, or asks again)."""
        reason = self.should_stop(copy_id)
        if reason is None:
            event = self._waiting.setdefault(copy_id, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), seconds)
            reason = self.should_stop(copy_id)
        return reason

    def stop(self, copy_id: str) -> bool:
        """Ask one copy to stop (another copy of its attempt finished first, or the attempt ended without it;
        see also :meth:`give_up`). Returns whether it had started (if not, it never runs anything)."""
        self._stop.add(copy_id)
        self._wake(copy_id)
        return bool(self._starts.get(copy_id))

    def stop_all(self) -> None:
        """Ask every copy to stop (Ctrl-C on the driver)."""
        self._stop_all = True
        for copy_id in list(self._waiting):
            self._wake(copy_id)

    def forget(self, copy_id: str) -> None:
        """The driver is done with this copy (if it was told to stop or given up, it still is: Ray may run it
        again)."""
        self._starts.pop(copy_id, None)
        self._wake(copy_id)

    def _wake(self, copy_id: str) -> None:
        event = self._waiting.pop(copy_id, None)
        if event is not None:
            event.set()

    def image_done(self, image_id: str) -> None:
        """Every item of the task image ``image_id`` has ended: nodes may remove their copies of it."""
        self._done_images.add(image_id)

    def done_images(self) -> list[str]:
        """The task images whose items have all ended."""
        return sorted(self._done_images)

    def snapshot(self) -> dict[str, list[dict[str, str]]]:
        """Every start of every copy not yet forgotten (a copy: the reply is packed off the event loop)."""
        return {copy_id: list(starts) for copy_id, starts in self._starts.items()}
