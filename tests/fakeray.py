"""A fake of the part of Ray's task API the cluster driver uses, so the copy/watchdog state machine
(``backend/cluster/copies.py``) is tested without a cluster, in seconds. A test aid for our own logic only.

:class:`FakeRay` has ``get``, ``wait``, ``cancel``, ``nodes`` and ``exceptions`` as Ray has them; object refs
are resolved by whoever plays the nodes. :class:`FakeCluster` is the backend side an :class:`AttemptRun`
follows: each copy it is asked to start runs in a thread, on the node the test's script says, doing what the
script says (finish, die, hang, ask for the image, fail), and writes to a real :class:`Ledger` as a copy on a
node would.
"""

from __future__ import annotations

import io
import itertools
import tarfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pvisor_host.backend.cluster.connect import ENGINE_RESOURCE
from pvisor_host.backend.cluster.copies import Watch
from pvisor_host.backend.cluster.ledger import Ledger
from pvisor_host.backend.cluster.task_images import Placement
from pvisor_host.errors import InfrastructureError


class RayError(Exception):
    pass


class TaskCancelledError(RayError):
    pass


class RayTaskError(RayError):
    pass


class GetTimeoutError(RayError, TimeoutError):
    pass


class NodeDiedError(RayError):
    pass


class WorkerCrashedError(RayError):
    pass


EXCEPTIONS = SimpleNamespace(
    RayError=RayError,
    TaskCancelledError=TaskCancelledError,
    RayTaskError=RayTaskError,
    GetTimeoutError=GetTimeoutError,
    NodeDiedError=NodeDiedError,
    WorkerCrashedError=WorkerCrashedError,
)


class ObjectRef:
    """A future value: set once, by a node (or by a cancel)."""

    _names = itertools.count()

    def __init__(self, task: str = "") -> None:
        self.name = task or f"ref-{next(self._names)}"
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def resolve(self, value: Any = None, *, error: BaseException | None = None) -> None:
        if not self._done.is_set():
            self._value, self._error = value, error
            self._done.set()

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def __repr__(self) -> str:
        return f"ObjectRef({self.name})"


def resolved(value: Any) -> ObjectRef:
    ref = ObjectRef("value")
    ref.resolve(value)
    return ref


class FakeRay:
    """``ray`` as the driver sees it: nodes that live and die, refs to wait on, tasks to cancel."""

    exceptions = EXCEPTIONS

    def __init__(self, nodes: list[str]) -> None:
        self._lock = threading.Lock()
        self._nodes = {
            name: {"NodeID": f"id-{name}", "NodeManagerAddress": name, "Alive": True, "Resources": {ENGINE_RESOURCE: 2}}
            for name in nodes
        }
        self.cancelled: list[ObjectRef] = []
        """Every ref the driver cancelled, in order."""
        self.cancellable: set[str] = set()
        """Refs (by name) whose task a cancel really ends (a task still queued; not one on a hung node)."""

    def node_id(self, name: str) -> str:
        return str(self._nodes[name]["NodeID"])

    def kill(self, name: str) -> None:
        """Ray marks the node dead (it crashed, hung, or was cut off)."""
        with self._lock:
            self._nodes[name]["Alive"] = False

    def nodes(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(entry) for entry in self._nodes.values()]

    def get(self, refs: Any, *, timeout: float | None = None) -> Any:
        many = isinstance(refs, list)
        deadline = None if timeout is None else time.monotonic() + timeout
        for ref in refs if many else [refs]:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not ref._done.wait(left):
                raise GetTimeoutError(f"{ref} not ready within {timeout}s")
        return [ref.result() for ref in refs] if many else refs.result()

    def wait(
        self, refs: list[ObjectRef], *, num_returns: int = 1, timeout: float | None = None
    ) -> tuple[list[ObjectRef], list[ObjectRef]]:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while True:
            ready = [ref for ref in refs if ref.ready]
            if len(ready) >= num_returns or time.monotonic() >= deadline:
                return ready[:num_returns], [ref for ref in refs if ref not in ready[:num_returns]]
            time.sleep(0.01)

    def cancel(self, ref: ObjectRef) -> None:
        self.cancelled.append(ref)
        if ref.name in self.cancellable:
            ref.resolve(error=TaskCancelledError(ref.name))


class FakeActor:
    """An actor handle: ``handle.method.remote(*args)`` runs the method at once and returns a resolved ref."""

    def __init__(self, instance: Any) -> None:
        self._instance = instance
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        """How often each method was called."""

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._instance, name)

        def remote(*args: Any) -> ObjectRef:
            with self._lock:
                self.calls[name] += 1
                return resolved(method(*args))

        return SimpleNamespace(remote=remote)


#: What a copy does on its node: ``(node, behaviour)``; see :meth:`FakeCluster.submit_copy`.
Step = tuple[str, str]


class FakeCluster:
    """The driver's cluster backend around a :class:`FakeRay` (see the module docstring).

    ``script`` lists, per copy submitted in order, what it does (the last one repeats). A behaviour is one of:

    * ``"ok"``: it starts on the node and finishes with a record (``status`` from ``make_run``);
    * ``"retried:NODE2"``: it starts, its node dies, Ray runs it again on NODE2, where it finishes;
    * ``"worker-retried:NODE2"``: as ``"retried"``, but only its worker died: no node is seen dead;
    * ``"lost"``: it starts, its node dies and Ray's retries run out (the ref raises ``NodeDiedError``);
    * ``"hang"``: it starts, then its node stops answering (Ray marks it dead; the ref never resolves);
    * ``"cut-off"``: as ``"hang"``, but the copy still runs there and still hears the ledger (its node was cut
      off from the head, not from everything), so it ends as ``"wait"`` does;
    * ``"queued-hang"``: it never starts, and its node is marked dead (a lease stuck at a dead node);
    * ``"queued-late:NODE2"``: as ``"queued-hang"``, and a cancel does not reach it; once the driver gave it up,
      Ray starts it on NODE2 after all (the lease came back), and it does what ``run_copy`` does with the
      ledger's answer (nothing when it was given up, else it runs and finishes);
    * ``"ok-while:NODE2"``: it starts, NODE2 (another node) dies, and it finishes with a record after a while;
    * ``"hang-cancelled"``: as ``"hang"``, but the driver's cancel reaches it: it ends ``interrupted``;
    * ``"submit-fails"``: submitting it raises (the driver cannot reach Ray);
    * ``"need_image"``: the node has not got the image (the copy ran nothing);
    * ``"error:TYPE:MESSAGE"``: the copy failed there;
    * ``"wait"``: it starts and runs until the ledger tells it to stop, then ends as its node would
      (an ``interrupted`` record when cancelled, ``superseded`` when another copy finished first).
    """

    def __init__(
        self,
        ray: FakeRay,
        script: list[Step],
        make_run: Callable[[Path, str], None],
        *,
        grace: float = 0.6,
        delay: float = 0.05,
    ) -> None:
        self.ray = ray
        self.script = script
        self.make_run = make_run
        self.grace = grace
        self.delay = delay
        self.address = "head:6379"
        self.ledger = FakeActor(Ledger())
        self.watch = Watch(ray, self.ledger)
        self.placement = Placement()
        self.submitted: list[dict[str, Any]] = []
        self.manifests: list[bool] = []
        self.ends: list[tuple[str | None, str | None]] = []
        """What the driver heard of each copy that ended: the node it was placed on, the image it pulled."""
        self.stopped: dict[str, str] = {}
        """Why each copy that was told to stop stopped (``cancelled``, ``superseded``), by copy id."""
        self.heard: dict[str, list[int]] = {}
        """What the ledger answered each start of each copy (how many starts it knows; 0: stopped before)."""
        self._cancelled = threading.Event()
        self._scratch = Path()
        self._threads: list[threading.Thread] = []

    @property
    def session(self) -> str:
        return "fake-session"

    def use_scratch(self, path: Path) -> FakeCluster:
        self._scratch = path
        return self

    # -- the backend side AttemptRun uses ---------------------------------------------------------------------

    def image_manifest(self, prepared: Any, *, chunks: bool) -> dict[str, Any]:
        self.manifests.append(chunks)
        return {"id": prepared.image.id, "ref": prepared.image.ref, **({"chunks": ["c0"]} if chunks else {})}

    def task_manifest(self, prepared: Any) -> dict[str, Any] | None:
        return None

    def place(self, prepared: Any) -> str | None:
        """As the cluster backend places a copy with no task image: nowhere until a node died, then spread."""
        return self.placement.spread(self.watch.engines()) if self.watch.seen_death else None

    def ended(self, node: str | None, pulled: str | None) -> None:
        self.ends.append((node, pulled))
        if node is not None:
            self.placement.ended(node)

    def workspace_ref(self, path: Path) -> Any:
        return resolved(b"")

    def cancelled(self, cancel: threading.Event | None) -> bool:
        return self._cancelled.is_set() or (cancel is not None and cancel.is_set())

    def cancel(self) -> None:
        self._cancelled.set()
        self.ledger.stop_all.remote()

    def submit_copy(
        self,
        copy_id: str,
        request: dict[str, Any],
        trajectory: bytes,
        workspace: Any,
        key: str | None,
        node: str | None = None,
    ) -> ObjectRef:
        n = len(self.submitted)
        node, behaviour = self.script[min(n, len(self.script) - 1)]
        if behaviour == "submit-fails":
            raise InfrastructureError("the driver lost its connection to the cluster")
        self.submitted.append({"copy_id": copy_id, "node": node, "behaviour": behaviour, "request": request})
        ref = ObjectRef(f"copy{n}")
        if behaviour == "queued-hang":
            self.ray.cancellable.add(ref.name)
        thread = threading.Thread(target=self._play, args=(ref, copy_id, node, behaviour), daemon=True)
        self._threads.append(thread)
        thread.start()
        return ref

    def fetch_from(self, node_id: str, token: str) -> Any:
        raise AssertionError("every fake run directory comes back in the copy's reply")

    # -- what the nodes do ----------------------------------------------------------------------------------

    def _start(self, copy_id: str, node: str) -> str:
        token = f"tok-{node}-{copy_id.rsplit('/', 1)[-1]}"
        at = datetime.now(UTC).isoformat()
        starts = self.ray.get(self.ledger.started.remote(copy_id, self.ray.node_id(node), node, at, token))
        self.heard.setdefault(copy_id, []).append(starts)
        return token

    def _reply(
        self, node: str, token: str, status: str, starts: int = 1, *, interrupted: bool = False
    ) -> dict[str, Any]:
        run = self._scratch / token / "run"
        self.make_run(run, status)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            archive.add(run, arcname="run")
        return {"node": node, "node_id": self.ray.node_id(node), "token": token, "interrupted": interrupted,
                "starts": starts, "tar": buffer.getvalue()}  # fmt: skip

    def _play(self, ref: ObjectRef, copy_id: str, node: str, behaviour: str) -> None:
        time.sleep(self.delay)
        kind, _, rest = behaviour.partition(":")
        if kind == "queued-hang":
            self.ray.kill(node)
            return
        if kind == "queued-late":
            self.ray.kill(node)
            deadline = time.monotonic() + 10  # a driver that never gives it up fails the test, not hangs it
            while copy_id not in self.ledger._instance._given_up and time.monotonic() < deadline:
                time.sleep(0.01)
            token = self._start(copy_id, rest)
            ref.resolve(self._reply(rest, token, "ok") if self.heard[copy_id][-1] else {"superseded": True})
            return
        if kind == "need_image":
            ref.resolve({"need_image": True})
            return
        token = self._start(copy_id, node)
        if kind == "ok":
            ref.resolve(self._reply(node, token, "ok"))
        elif kind == "ok-while":
            self.ray.kill(rest)
            time.sleep(self.grace * 3)
            ref.resolve(self._reply(node, token, "ok"))
        elif kind in ("retried", "worker-retried"):
            if kind == "retried":
                self.ray.kill(node)
            time.sleep(self.delay)
            ref.resolve(self._reply(rest, self._start(copy_id, rest), "ok", starts=2))
        elif kind == "lost":
            self.ray.kill(node)
            ref.resolve(error=NodeDiedError(f"{node} died"))
        elif kind == "hang":
            self.ray.kill(node)
        elif kind == "hang-cancelled":
            self.ray.kill(node)
            deadline = time.monotonic() + 10  # a driver that never cancels it fails the test, not hangs it
            while ref not in self.ray.cancelled and time.monotonic() < deadline:
                time.sleep(0.01)
            ref.resolve(self._reply(node, token, "interrupted", interrupted=True))
        elif kind == "cut-off":
            self.ray.kill(node)
            self._until_stopped(ref, copy_id, node, token)
        elif kind == "error":
            error_type, _, message = rest.partition(":")
            ref.resolve({"error": {"type": error_type, "message": message, "exit_code": None}})
        elif kind == "wait":
            self._until_stopped(ref, copy_id, node, token)
        else:
            raise AssertionError(f"unknown behaviour {behaviour}")

    def _until_stopped(self, ref: ObjectRef, copy_id: str, node: str, token: str) -> None:
        while (reason := self.ledger._instance.should_stop(copy_id)) is None:
            time.sleep(0.01)
        self.stopped[copy_id] = reason
        if reason == "superseded":
            ref.resolve({"superseded": True})
        else:
            ref.resolve(self._reply(node, token, "interrupted"))

    def close(self) -> None:
        self.watch.close()
