"""The model limits of a cluster batch: one set for every node's gateway.

``--model-concurrency``, ``--model-rpm`` and ``--model-tpm`` are the batch's, whichever node a sandbox runs
on. So one :class:`ClusterLimits` actor, pinned to the driver's node (it lives as long as the batch), holds
the batch's :class:`~pvisor_host.gateway.limits.LocalLimits`; every node's gateway takes its slots there
through :class:`RemoteLimits`, an implementation of the gateway's
:class:`~pvisor_host.gateway.limits.Limits` protocol that awaits the actor's answers.

A node that dies with calls in flight would keep their slots for ever: the actor hands out slots as leases
named after the node, and gives back the leases of a node Ray has marked dead (checked every few seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from ...gateway.limits import LocalLimits, Slot

#: Seconds between two looks at which nodes are alive.
REAP_EVERY = 5.0


class ClusterLimits:
    """The batch's limits (made an async Ray actor by the driver; see the module docstring)."""

    def __init__(self, concurrency: int | None, requests_per_minute: int | None, tokens_per_minute: int | None) -> None:
        self._limits = LocalLimits(
            concurrency=concurrency, requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute
        )
        self._leases: dict[int, str] = {}
        self._numbers = itertools.count(1)
        self._reaper: asyncio.Task[None] | None = None

    async def acquire(self, node_id: str) -> tuple[int, float]:
        """Wait for a slot for a call on ``node_id``; returns its lease and the seconds waited."""
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())
        waited = await self._limits.acquire()
        lease = next(self._numbers)
        self._leases[lease] = node_id
        return lease, waited

    async def release(self, lease: int, tokens: int) -> None:
        """The call of ``lease`` ended, having used ``tokens`` (a lease already given back is ignored)."""
        if self._leases.pop(lease, None) is not None:
            await self._limits.release(tokens)

    def peak(self) -> int:
        """The most calls in flight at once so far, across the cluster."""
        return self._limits.peak

    async def _reap(self) -> None:
        import ray

        while True:
            await asyncio.sleep(REAP_EVERY)
            with contextlib.suppress(Exception):  # a busy control plane: look again next time
                alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}  # type: ignore[no-untyped-call]
                for lease, node in list(self._leases.items()):
                    if node not in alive:
                        await self.release(lease, 0)


class RemoteLimits:
    """A node gateway's way to the batch's :class:`ClusterLimits` (see the module docstring)."""

    def __init__(self, actor: Any, node_id: str) -> None:
        self._actor = actor
        self._node_id = node_id

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[Slot]:
        began = time.monotonic()
        lease, _ = await self._actor.acquire.remote(self._node_id)
        slot = Slot(time.monotonic() - began)
        try:
            yield slot
        finally:
            await self._actor.release.remote(lease, slot.tokens)
