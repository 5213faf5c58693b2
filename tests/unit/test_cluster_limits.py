"""The batch's model limits on a cluster, without Ray: :class:`ClusterLimits` (the actor's class) driven directly on
an event loop, its leases taken, given back, given back for a closed gateway and for a dead node; and
:class:`RemoteLimits` (a node gateway's side) over a fake actor whose calls run on that same :class:`ClusterLimits`.

No test waits on a clock: :class:`~pvisor_host.gateway.limits.LocalLimits` reads a fake one, concurrency limits
only (no per-minute window), and a waiting ``acquire`` is a task that the test lets run with ``asyncio.sleep(0)``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
from collections.abc import Coroutine, Generator
from types import SimpleNamespace
from typing import Any

import pytest
from fakecache import Clock

from pvisor_host.backend.cluster import limits as cluster_limits_module
from pvisor_host.backend.cluster.limits import REAP_EVERY, ClusterLimits, RemoteLimits


async def _no_reaper() -> None:
    """Stands in for ``ClusterLimits._reap`` (see :func:`cluster_limits`)."""


def cluster_limits(concurrency: int | None = 1, clock: Clock | None = None) -> ClusterLimits:
    """A :class:`ClusterLimits` on ``clock`` (call it inside the test's event loop)."""
    limits = ClusterLimits(concurrency, None, None)
    # The first acquire starts the reaper: the real one imports ray and asks it for the nodes every REAP_EVERY
    # seconds. A no-op stands in for it; tests give back dead nodes' leases through `reap` themselves.
    limits._reap = _no_reaper  # type: ignore[method-assign]
    limits._limits._clock = clock or Clock()
    return limits


def in_flight(limits: ClusterLimits) -> int:
    """Slots taken from the batch's limits and not given back."""
    return limits._limits._in_flight


async def settle() -> None:
    """Let every task that can run do so (a woken ``acquire``, a release sent without being awaited)."""
    for _ in range(50):
        await asyncio.sleep(0)


# -- ClusterLimits ---------------------------------------------------------------------------------------------


def test_each_acquire_gets_a_lease_of_its_own_named_after_its_node_and_gateway():
    async def run() -> tuple[list[tuple[int, float]], dict[int, tuple[str, str]]]:
        limits = cluster_limits(concurrency=3)
        got = [await limits.acquire("n1", "g1"), await limits.acquire("n1", "g1"), await limits.acquire("n2", "g2")]
        return got, dict(limits._leases)

    got, leases = asyncio.run(run())
    assert got == [(1, 0.0), (2, 0.0), (3, 0.0)]
    assert leases == {1: ("n1", "g1"), 2: ("n1", "g1"), 3: ("n2", "g2")}


def test_a_release_gives_the_slot_to_a_waiting_acquire_which_says_how_long_it_waited():
    clock = Clock()

    async def run() -> tuple[bool, tuple[int, float], int]:
        limits = cluster_limits(concurrency=1, clock=clock)
        lease, _ = await limits.acquire("n1", "g1")
        waiting = asyncio.create_task(limits.acquire("n2", "g2"))
        await settle()
        held_back = not waiting.done()
        clock.now += 3.0
        await limits.release(lease, 10)
        await settle()
        return held_back, waiting.result(), in_flight(limits)

    held_back, second, taken = asyncio.run(run())
    assert held_back
    assert second == (2, 3.0)
    assert taken == 1


def test_a_release_of_a_lease_unknown_or_already_given_back_is_ignored():
    async def run() -> tuple[int, bool]:
        limits = cluster_limits(concurrency=1)
        lease, _ = await limits.acquire("n1", "g1")
        await limits.release(lease, 5)
        await limits.release(lease, 5)  # again: must not free a second slot
        await limits.release(99, 5)  # never handed out
        await limits.acquire("n1", "g1")
        third = asyncio.create_task(limits.acquire("n1", "g1"))
        await settle()
        return in_flight(limits), third.done()

    taken, third_went = asyncio.run(run())
    assert taken == 1
    assert not third_went  # the one slot is taken: only one release counted


def test_release_owner_gives_back_every_lease_of_the_gateway_and_a_slot_reaching_it_later_at_once():
    async def run() -> tuple[tuple[int, float], tuple[int, float], tuple[int, float], dict[int, tuple[str, str]], int]:
        limits = cluster_limits(concurrency=3)
        await limits.acquire("n1", "g1")
        await limits.acquire("n1", "g1")
        await limits.acquire("n2", "g2")
        closed_waiting = asyncio.create_task(limits.acquire("n1", "g1"))
        other_waiting = asyncio.create_task(limits.acquire("n3", "g3"))
        await settle()
        assert not closed_waiting.done() and not other_waiting.done()
        await limits.release_owner("g1")
        await settle()
        late = await limits.acquire("n1", "g1")  # the gateway is gone: nothing is held for it
        return closed_waiting.result(), other_waiting.result(), late, dict(limits._leases), in_flight(limits)

    closed_waiting, other_waiting, late, leases, taken = asyncio.run(run())
    assert closed_waiting == (0, 0.0)
    assert other_waiting == (4, 0.0)
    assert late == (0, 0.0)
    assert leases == {3: ("n2", "g2"), 4: ("n3", "g3")}
    assert taken == 2


def test_reap_gives_back_exactly_the_leases_of_the_nodes_not_alive():
    async def run() -> tuple[int, dict[int, tuple[str, str]], tuple[int, float], int, int]:
        limits = cluster_limits(concurrency=4)
        for node in ("n1", "n2", "n1", "n3"):
            await limits.acquire(node, f"gateway-{node}")
        waiting = asyncio.create_task(limits.acquire("n2", "gateway-n2"))
        await settle()
        given = await limits.reap({"n2", "n4"})  # n1 and n3 are dead; n4 holds nothing
        await settle()
        again = await limits.reap({"n2", "n4"})
        return given, dict(limits._leases), waiting.result(), again, in_flight(limits)

    given, leases, waiting, again, taken = asyncio.run(run())
    assert given == 3
    assert leases == {2: ("n2", "gateway-n2"), 5: ("n2", "gateway-n2")}
    assert waiting == (5, 0.0)  # a slot freed by the reap went to the waiting call
    assert again == 0
    assert taken == 2


def test_a_late_release_of_a_reaped_lease_is_ignored():
    async def run() -> tuple[int, bool]:
        limits = cluster_limits(concurrency=1)
        lease, _ = await limits.acquire("n1", "g1")
        await limits.reap(set())
        await limits.release(lease, 0)  # the node was only slow: its release comes after the reap
        await limits.acquire("n2", "g2")
        third = asyncio.create_task(limits.acquire("n2", "g2"))
        await settle()
        return in_flight(limits), third.done()

    taken, third_went = asyncio.run(run())
    assert taken == 1
    assert not third_went


def test_peak_is_the_most_calls_in_flight_at_once():
    async def run() -> tuple[int, int]:
        limits = cluster_limits(concurrency=5)
        first, _ = await limits.acquire("n1", "g1")
        second, _ = await limits.acquire("n2", "g2")
        before = limits.peak()
        await limits.release(first, 0)
        await limits.release(second, 0)
        await limits.acquire("n1", "g1")
        return before, limits.peak()

    assert asyncio.run(run()) == (2, 2)


def test_the_reaper_looks_every_reap_every_seconds_skipping_a_round_the_control_plane_fails(monkeypatch):
    class Stop(Exception):
        """Ends the reaper's endless loop."""

    answers: list[Any] = [
        RuntimeError("the GCS is busy"),
        [{"NodeID": "n1", "Alive": True}, {"NodeID": "n2", "Alive": False}],  # n3: not listed at all
    ]
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 3:
            raise Stop

    async def to_thread(call: Any) -> Any:
        return call()

    def nodes() -> list[dict[str, Any]]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def run() -> dict[int, tuple[str, str]]:
        limits = cluster_limits(concurrency=3)
        for node in ("n1", "n2", "n3"):
            await limits.acquire(node, "g")
        # The loop's own time and threads, and a `ray` whose nodes() fails once then answers.
        monkeypatch.setattr(cluster_limits_module, "asyncio", SimpleNamespace(sleep=sleep, to_thread=to_thread))
        monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(nodes=nodes))
        with pytest.raises(Stop):
            await ClusterLimits._reap(limits)
        return dict(limits._leases)

    assert asyncio.run(run()) == {1: ("n1", "g")}
    assert slept == [REAP_EVERY] * 3
    assert answers == []


# -- RemoteLimits ----------------------------------------------------------------------------------------------


class Pending:
    """What a call of a Ray actor gives back, as far as :class:`RemoteLimits` uses it (an ``ObjectRef``): the call
    is under way at once, awaited or not; awaiting it can be cancelled without cancelling the call; and
    ``future()`` gives a new :class:`concurrent.futures.Future` of its outcome at each call, as Ray's does."""

    def __init__(self, call: Coroutine[Any, Any, Any]) -> None:
        self.task = asyncio.get_running_loop().create_task(call)

    def __await__(self) -> Generator[Any, None, Any]:
        return asyncio.shield(self.task).__await__()

    def future(self) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def done(task: asyncio.Task[Any]) -> None:
            if task.cancelled():
                future.cancel()
            elif task.exception() is not None:
                future.set_exception(task.exception())
            else:
                future.set_result(task.result())

        self.task.add_done_callback(done)
        return future


class FakeActor:
    """A handle to the batch's :class:`ClusterLimits` actor: ``acquire``, ``release`` and ``release_owner`` each
    have a ``remote(...)`` that runs the call on ``limits`` (in the test's loop) and is recorded in ``calls``."""

    def __init__(self, limits: ClusterLimits) -> None:
        self.limits = limits
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.pending: list[Pending] = []  # the loop keeps only weak references to tasks
        self.acquire = self._method("acquire")
        self.release = self._method("release")
        self.release_owner = self._method("release_owner")

    def _method(self, name: str) -> SimpleNamespace:
        def remote(*args: Any) -> Pending:
            self.calls.append((name, args))
            pending = Pending(getattr(self.limits, name)(*args))
            self.pending.append(pending)
            return pending

        return SimpleNamespace(remote=remote)


def test_a_slot_takes_one_lease_and_gives_it_back_with_the_tokens_the_call_used():
    async def run() -> tuple[list[tuple[str, tuple[Any, ...]]], dict[int, tuple[str, str]], dict[int, Any], int]:
        limits = cluster_limits(concurrency=1)
        actor = FakeActor(limits)
        async with RemoteLimits(actor, "n1").slot() as slot:
            held = dict(limits._leases)
            slot.tokens = 42
        return actor.calls, held, dict(limits._leases), in_flight(limits)

    calls, held, after, taken = asyncio.run(run())
    owner = calls[0][1][1]
    assert calls == [("acquire", ("n1", owner)), ("release", (1, 42))]
    assert held == {1: ("n1", owner)}
    assert after == {}
    assert taken == 0


def test_two_gateways_are_two_owners():
    async def run() -> list[tuple[str, tuple[Any, ...]]]:
        actor = FakeActor(cluster_limits(concurrency=2))
        async with RemoteLimits(actor, "n1").slot(), RemoteLimits(actor, "n1").slot():
            pass
        return actor.calls

    calls = asyncio.run(run())
    assert [name for name, _ in calls] == ["acquire", "acquire", "release", "release"]
    assert calls[0][1][1] != calls[1][1][1]


def test_close_gives_back_what_the_gateway_holds_under_its_own_name_only():
    async def run() -> tuple[list[tuple[str, tuple[Any, ...]]], dict[int, tuple[str, str]], dict[int, Any], int]:
        limits = cluster_limits(concurrency=2)
        actor = FakeActor(limits)
        closing, other = RemoteLimits(actor, "n1"), RemoteLimits(actor, "n2")
        async with other.slot(), closing.slot():
            closing.close()  # sent, not awaited (the gateway closes from synchronous code)
            await settle()
            during = dict(limits._leases)
        return actor.calls, during, dict(limits._leases), in_flight(limits)

    calls, during, after, taken = asyncio.run(run())
    other_owner, closing_owner = calls[0][1][1], calls[1][1][1]
    assert calls == [
        ("acquire", ("n2", other_owner)),
        ("acquire", ("n1", closing_owner)),
        ("release_owner", (closing_owner,)),
        ("release", (2, 0)),  # the closed gateway's slot ends: its lease is gone already, and ignored
        ("release", (1, 0)),
    ]
    assert during == {1: ("n2", other_owner)}
    assert after == {}
    assert taken == 0


def test_a_slot_cancelled_while_waiting_gives_back_the_lease_the_actor_hands_out_later():
    async def run() -> tuple[bool, list[tuple[str, tuple[Any, ...]]], dict[int, tuple[str, str]], int]:
        limits = cluster_limits(concurrency=1)
        actor = FakeActor(limits)
        held, _ = await limits.acquire("n1", "another gateway")  # the one slot, taken

        async def call() -> None:
            async with RemoteLimits(actor, "n2").slot():
                pass

        waiting = asyncio.create_task(call())
        await settle()
        waiting.cancel()
        await settle()
        assert waiting.cancelled()
        assert actor.calls == [("acquire", ("n2", actor.calls[0][1][1]))]  # the actor still waits for a slot
        await limits.release(held, 0)  # the slot goes to the call that nobody waits for any more
        await settle()
        return waiting.cancelled(), actor.calls, dict(limits._leases), in_flight(limits)

    cancelled, calls, leases, taken = asyncio.run(run())
    assert cancelled
    assert calls == [("acquire", ("n2", calls[0][1][1])), ("release", (2, 0))]
    assert leases == {}
    assert taken == 0
