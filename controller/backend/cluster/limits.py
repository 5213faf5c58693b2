"""The model limits of a cluster batch: one set for every node's gateway.

``--model-concurrency``, ``--model-rpm`` and ``--model-tpm`` are the batch's, whichever node a sandbox runs
on. So one :class:`ClusterLimits` actor, pinned to the driver's node (it lives as long as the batch), holds
the batch's :class:`~pvisor_host.gateway.limits.LocalLimits`; every node's gateway takes its slots there
through :class:`RemoteLimits`, an implementation of the gateway's
:class:`~pvisor_host.gateway.limits.Limits` protocol that awaits the actor's answers.

A node that dies with calls in flight would keep their slots for ever: the actor hands out slots as leases
named after the node, and gives back the leases of a node Ray has marked dead (checked every few seconds;
:meth:`ClusterLimits.reap` is that giving back, for the nodes alive at one look).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ...gateway.limits import LocalLimits, Slot

#: Seconds between two looks at which nodes are alive.
REAP_EVERY = 5.0


class ClusterLimits:
    """The batch's limits (made an async Ray actor by the driver; see the module docstring). Every call runs on
    the actor's one event loop (its :class:`LocalLimits` is not thread-safe: Ray's concurrency groups would
    give each group a loop and a thread of its own), and the actor takes calls by the hundred thousand, so
    a thousand waiting ``acquire`` calls cannot keep a ``release`` from coming in."""

    def __init__(self, concurrency: int | None, requests_per_minute: int | None, tokens_per_minute: int | None) -> None:
        self._limits = LocalLimits(
            concurrency=concurrency, requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute
        )
        self._leases: dict[int, tuple[str, str]] = {}
        """Lease → (node, owner): the gateway that holds it."""
        self._gone: set[str] = set()
        """Owners (gateways) that closed: a slot that reaches one of them is given back at once."""
        self._numbers = itertools.count(1)
        self._reaper: asyncio.Task[None] | None = None

    async def acquire(self, node_id: str, owner: str) -> tuple[int, float]:
        """Wait for a slot for a call of the gateway ``owner`` on ``node_id``; returns its lease and the seconds
        waited (lease 0: the gateway closed meanwhile, and holds nothing)."""
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())
        waited = await self._limits.acquire()
        if owner in self._gone:
            await self._limits.release(0)
            return 0, waited
        lease = next(self._numbers)
        self._leases[lease] = (node_id, owner)
        return lease, waited

    async def release(self, lease: int, tokens: int) -> None:
        """The call of ``lease`` ended, having used ``tokens`` (a lease already given back is ignored)."""
        if self._leases.pop(lease, None) is not None:
            await self._limits.release(tokens)

    async def release_owner(self, owner: str) -> None:
        """The gateway ``owner`` closed: every slot it holds, or is still waiting for, is given back."""
        self._gone.add(owner)
        for lease, (_, holder) in list(self._leases.items()):
            if holder == owner:
                await self.release(lease, 0)

    def peak(self) -> int:
        """The most calls in flight at once so far, across the cluster."""
        return self._limits.peak

    async def _reap(self) -> None:
        """Every :data:`REAP_EVERY` seconds, :meth:`reap` the nodes Ray does not list as alive."""
        import ray

        while True:
            await asyncio.sleep(REAP_EVERY)
            try:  # a busy control plane: look again next time
                nodes = await asyncio.to_thread(ray.nodes)
            except Exception:  # noqa: BLE001
                continue
            await self.reap({n["NodeID"] for n in nodes if n.get("Alive")})

    async def reap(self, alive: set[str]) -> int:
        """Give back the leases of every node not in ``alive`` (their calls will never end); how many."""
        given = 0
        for lease, (node, _) in list(self._leases.items()):
            if node not in alive and lease in self._leases:  # not released meanwhile (release pops before awaiting)
                given += 1
                await self.release(lease, 0)
        return given


#: Calls the actor takes at once (waiting ``acquire`` calls included; see :class:`ClusterLimits`).
MAX_CALLS = 100_000


def limits_actor(ray: Any, node_id: str, upstream: Any, pinned: Any) -> Any:
    """Start the batch's :class:`ClusterLimits` actor on the driver's node."""
    actor = ray.remote(num_cpus=0, max_concurrency=MAX_CALLS)(ClusterLimits)
    return actor.options(scheduling_strategy=pinned).remote(
        upstream.concurrency, upstream.requests_per_minute, upstream.tokens_per_minute
    )


class RemoteLimits:
    """A node gateway's way to the batch's :class:`ClusterLimits` (see the module docstring): its slots carry the
    gateway's own name, and :meth:`close` gives back whatever it still holds or waits for."""

    def __init__(self, actor: Any, node_id: str) -> None:
        self._actor = actor
        self._node_id = node_id
        self._owner = uuid.uuid4().hex

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[Slot]:
        began = time.monotonic()
        pending = self._actor.acquire.remote(self._node_id, self._owner)
        try:
            lease, _ = await pending
        except asyncio.CancelledError:
            # The wait is over for us, not for the actor: release what it hands out later.
            pending.future().add_done_callback(lambda done: self._release_later(done))
            raise
        slot = Slot(time.monotonic() - began)
        try:
            yield slot
        finally:
            await self._actor.release.remote(lease, slot.tokens)

    def _release_later(self, done: Any) -> None:
        with contextlib.suppress(Exception):
            lease, _ = done.result()
            self._actor.release.remote(lease, 0)

    def close(self) -> None:
        """The gateway closes: its slots go back to the batch."""
        with contextlib.suppress(Exception):
            self._actor.release_owner.remote(self._owner)
