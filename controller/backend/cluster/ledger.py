"""The ledger of a cluster batch: where each copy of an attempt started, and which copies should stop.

One :class:`Ledger` per batch runs as a Ray actor on the driver's own node, so it lives exactly as long as
the batch. Copies write to it (:meth:`Ledger.started`, before their sandbox starts) and ask it
(:meth:`Ledger.should_stop`, while it runs); the driver reads it (:meth:`Ledger.snapshot`) to see on which
node every copy runs, including the copy Ray ran again after its first node died, and writes to it
(:meth:`Ledger.stop`, :meth:`Ledger.stop_all`, :meth:`Ledger.forget`). It also tells the nodes which task
images the batch is done with (:meth:`Ledger.image_done`), so that a node's budget may let them go.
"""

from __future__ import annotations

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
    """The batch's ledger (made a Ray actor by the driver; plain data in and out)."""

    def __init__(self) -> None:
        self._starts: dict[str, list[dict[str, str]]] = {}
        self._stop: set[str] = set()
        self._stop_all = False
        self._done_images: set[str] = set()

    def started(self, copy_id: str, node_id: str, node: str, at: str, token: str) -> None:
        """Copy ``copy_id`` starts on ``node`` (again, if Ray retries it; a copy already told to stop is not
        followed any more, and stops at once)."""
        if copy_id not in self._stop:
            self._starts.setdefault(copy_id, []).append({"node_id": node_id, "node": node, "at": at, "token": token})

    def should_stop(self, copy_id: str) -> str | None:
        """Whether the copy should stop its sandbox, and why: ``"cancelled"`` (Ctrl-C on the driver) or
        ``"superseded"`` (another copy of its attempt finished first); None: go on."""
        if self._stop_all:
            return "cancelled"
        return "superseded" if copy_id in self._stop else None

    def stop(self, copy_id: str) -> None:
        """Ask one copy to stop (another copy of its attempt finished first)."""
        self._stop.add(copy_id)

    def stop_all(self) -> None:
        """Ask every copy to stop (Ctrl-C on the driver)."""
        self._stop_all = True

    def forget(self, copy_id: str) -> None:
        """The driver is done with this copy (if it was told to stop, it still is: Ray may run it again)."""
        self._starts.pop(copy_id, None)

    def image_done(self, image_id: str) -> None:
        """Every item of the task image ``image_id`` has ended: nodes may remove their copies of it."""
        self._done_images.add(image_id)

    def done_images(self) -> list[str]:
        """The task images whose items have all ended."""
        return sorted(self._done_images)

    def snapshot(self) -> dict[str, list[dict[str, str]]]:
        """Every start of every copy not yet forgotten."""
        return self._starts
