"""One attempt on the cluster, from the driver's side: the copies of it that run as Ray tasks, and the
watchdog that decides when a copy is lost.

:class:`AttemptRun` submits a copy (:func:`.node.tasks.run_copy`) and follows it until the first copy finishes
with a record. Ray runs a copy again on another node when its node dies (``max_retries``); when a node hangs
or is cut off, Ray marks it dead but leaves its tasks blocked, so :class:`Watch` (one thread per batch)
reads node liveness and the ledger of where each copy started, and after ``grace`` seconds the attempt
gives that copy up and submits another. Two copies may then run at once, each in its own disposable
sandbox; the first to finish is the record, and the record lists every other start in ``superseded``.

It needs from its backend only what :class:`Cluster` names, so it is tested without a cluster against a
fake of Ray's task API (``tests/fakeray.py``).
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..._log import logger
from ...errors import (
    ImageBuildError,
    ImageUnavailable,
    InfrastructureError,
    Interrupted,
    PrerequisiteError,
    PvisorHostError,
    UsageError,
)
from ...files.archive import Budget, extract_tar, tar_stream
from ...models.record import ReplayRecord, SupersededAttempt, load_record, save_record
from .connect import ENGINE_RESOURCE

if TYPE_CHECKING:
    from ...models.replay import Attempt, PreparedReplay

#: Node losses one attempt survives (Ray's retries and the watchdog's together) before it fails.
MAX_NODE_LOSSES = 3
#: How often the watchdog reads the nodes' liveness (and, once a node died, the ledger) (seconds).
WATCH_PERIOD = 0.5
_ERRORS: dict[str, type[PvisorHostError]] = {
    "UsageError": UsageError,
    "PreflightRejected": UsageError,
    "PrerequisiteError": PrerequisiteError,
    "ImageBuildError": ImageBuildError,
    "Interrupted": Interrupted,
}


class Cluster(Protocol):
    """What an attempt needs from the cluster backend that follows it."""

    ray: Any
    """Ray (the module, or a fake of its task API): ``wait``, ``get``, ``cancel``, ``nodes``, ``exceptions``."""
    ledger: Any
    """The batch's :class:`~.ledger.Ledger` actor."""
    watch: Watch
    grace: float
    address: str

    @property
    def session(self) -> str: ...

    def submit_copy(
        self,
        copy_id: str,
        request: dict[str, Any],
        trajectory: bytes,
        workspace: Any,
        key: str | None,
        node: str | None = None,
    ) -> Any:
        """Start :func:`.node.tasks.run_copy` as a Ray task, preferably on ``node``; its object ref."""

    def fetch_from(self, node_id: str, token: str) -> Any:
        """Start :func:`.node.tasks.fetch_run` pinned to ``node_id``; its streaming generator."""

    def image_manifest(self, prepared: PreparedReplay, *, chunks: bool) -> dict[str, Any]:
        """What a node gets to make the attempt's image present (see :class:`~.ship.Shipper`)."""

    def task_manifest(self, prepared: PreparedReplay) -> dict[str, Any] | None:
        """What a node needs to pull the attempt's task image itself (None: it has none)."""

    def place(self, prepared: PreparedReplay) -> str | None:
        """The node Ray is asked to prefer for the attempt's next copy (None: anywhere)."""

    def ended(self, node: str | None, pulled: str | None) -> None:
        """A copy placed on ``node`` ended, having pulled the task image ``pulled`` (or none)."""

    def workspace_ref(self, path: Path) -> Any:
        """The workspace directory in the object store (once per directory)."""

    def cancelled(self, cancel: threading.Event | None) -> bool:
        """Whether the batch, or this attempt, was asked to stop."""

    def cancel(self) -> None:
        """Stop every copy of the batch on every node."""


class Watch:
    """The driver's view of the cluster, refreshed every :data:`WATCH_PERIOD` by one thread: since when each
    node has been dead, and where every copy started (the ledger). The ledger is read only once a node died
    during the batch (the watchdog needs it then) and when :meth:`settle` asks: while no node died a view of the
    starts decides nothing, and reading it twice a second cost every item Ray calls."""

    def __init__(self, ray: Any, ledger: Any) -> None:
        self._ray, self._ledger = ray, ledger
        self._lock = threading.Lock()
        self._starts: dict[str, list[dict[str, str]]] = {}
        self._dead_since: dict[str, float] = {}
        self.seen_death = False
        """A node died during the batch (from then on every refresh reads the ledger too)."""
        self._reads = self._read = 0  # ledger reads asked, and the latest one applied (a later one wins)
        self._closed = threading.Event()
        nodes = ray.nodes()
        for entry in nodes:  # dead before this batch: no copy of it can be waiting there
            if not entry.get("Alive"):
                self._dead_since[entry["NodeID"]] = float("-inf")
        self._engines = _engines(nodes)
        self._thread = threading.Thread(target=self._run, name="pvisor-host-cluster-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.wait(WATCH_PERIOD):
            with contextlib.suppress(Exception):  # a slow head: keep the last view, try again
                self.refresh()

    def refresh(self) -> None:
        """Read the nodes now, and the ledger too once a node died during the batch."""
        nodes = self._ray.nodes()
        now = time.monotonic()
        with self._lock:  # a node newly dead: its copies' starts are read before the watchdog sees it dead
            dying = self.seen_death or any(not n.get("Alive") and n["NodeID"] not in self._dead_since for n in nodes)
        if dying:
            self.settle()
        with self._lock:
            self._engines = _engines(nodes)
            for entry in nodes:
                node_id = entry["NodeID"]
                if entry.get("Alive"):
                    self._dead_since.pop(node_id, None)
                elif self._dead_since.setdefault(node_id, now) == now:
                    self.seen_death = True

    def settle(self) -> None:
        """Read where every copy started now (before a decision that needs it: a node died, the batch was
        cancelled, or a copy won while others run or after Ray started it again). Raises what Ray raised."""
        with self._lock:
            self._reads += 1
            mine = self._reads
        starts = self._ray.get(self._ledger.snapshot.remote(), timeout=30)
        with self._lock:
            if mine > self._read:  # reads overlap (several attempts settle at once): an older one does not win
                self._starts, self._read = starts, mine

    def engines(self) -> list[str]:
        """The alive nodes with a Docker engine, as of the latest refresh (sorted ids): no Ray call per item."""
        with self._lock:
            return list(self._engines)

    def starts(self, copy_id: str) -> list[dict[str, str]]:
        """Where copy ``copy_id`` started so far (Ray starts it again when its node dies)."""
        with self._lock:
            return list(self._starts.get(copy_id, []))

    def dead_for(self, node_id: str) -> float:
        """Seconds the node has been dead (0: alive, or not seen dead yet; infinite: dead before the batch)."""
        with self._lock:
            since = self._dead_since.get(node_id)
        return 0.0 if since is None else time.monotonic() - since

    def lost(self, grace: float) -> list[str]:
        """The nodes dead for ``grace`` seconds or more (ids)."""
        now = time.monotonic()
        with self._lock:
            return sorted(node_id for node_id, since in self._dead_since.items() if now - since >= grace)

    def deaths_since(self, moment: float) -> list[float]:
        """When the nodes that died after ``moment`` (monotonic) were first seen dead."""
        with self._lock:
            return [since for since in self._dead_since.values() if since >= moment]

    def close(self) -> None:
        self._closed.set()


class Copy:
    """One copy of an attempt: a Ray task, and what the driver decided about it."""

    def __init__(self, ref: Any, copy_id: str, node: str | None = None) -> None:
        self.ref, self.id = ref, copy_id
        self.placed = node
        """The node the driver asked Ray to prefer for it (its task image's, or after a node died, the least
        loaded)."""
        self.submitted = time.monotonic()
        self.given_up = False
        """The driver runs another copy instead (this one may still finish first; if Ray starts it only now, it
        runs nothing)."""
        self.starts = 1
        """How many times Ray started it, as its reply said."""
        self.ended = False
        """The backend heard that it ended (its node's count of placed copies went down)."""

    @property
    def hopeful(self) -> bool:
        """Running, or waiting to, and not given up on."""
        return self.ref is not None and not self.given_up


class AttemptRun:
    """One attempt on the cluster: its copies, followed until the first finishes (see the module docstring)."""

    def __init__(self, backend: Cluster, prepared: PreparedReplay, attempt: Attempt, gateway: Any = None) -> None:
        self.backend, self.prepared, self.attempt = backend, prepared, attempt
        self.key: str | None = gateway.key if gateway is not None else None
        self.model_limits = gateway.limits if gateway is not None else None
        """The batch's model limits (a Ray actor), or None."""
        self.ray = backend.ray
        self.copies: list[Copy] = []
        self.reasons: dict[str, str] = {}
        """Why each copy that did not make the record was left (by copy id)."""
        self.unshipped: set[str] = set()
        """Copies that found no image on their node and ran nothing (not superseded: nothing ran)."""
        self.losses = 0
        self.chunks = False
        self.trajectory = prepared.trajectory.path.read_bytes()
        workspace = prepared.spec.workspace_dir
        self.workspace = backend.workspace_ref(workspace.absolute()) if workspace is not None else None
        upstream = prepared.spec.continuation
        cassette = upstream.cassette if upstream is not None else None
        self.tape = cassette.tape(prepared.name).read_bytes() if cassette is not None and cassette.replaying else None
        """With a cassette served back: the run's tape, for the node's gateway."""

    def submit(self) -> Copy:
        request = {
            "session": self.backend.session,
            "prepared": self.prepared.model_dump_json(),
            "attempt": self.attempt.number,
            "run_id": self.attempt.run_id,
            "image": self.backend.image_manifest(self.prepared, chunks=self.chunks),
            "model_limits": self.model_limits,
            "tape": self.tape,
            "task": self.backend.task_manifest(self.prepared),
        }
        copy_id = f"{self.attempt.run_id}/{uuid.uuid4().hex[:8]}"
        node = self.backend.place(self.prepared)
        try:
            ref = self.backend.submit_copy(copy_id, request, self.trajectory, self.workspace, self.key, node)
        except BaseException:
            self.backend.ended(node, None)  # placed, never submitted: the node's load goes back down
            raise
        copy = Copy(ref, copy_id, node)
        self.copies.append(copy)
        return copy

    def live(self) -> list[Copy]:
        return [c for c in self.copies if c.ref is not None]

    def follow(self, cancel: threading.Event | None) -> ReplayRecord:
        """Wait for the first copy to finish with a record, keeping a copy running while nodes fail."""
        backend, ray = self.backend, self.ray
        self.submit()
        stopped_at: float | None = None
        try:
            while True:
                if stopped_at is None and backend.cancelled(cancel):
                    stopped_at = time.monotonic()
                    backend.cancel()
                    if self.live() and self._settle():  # else each one that starts now runs nothing
                        for copy in self.live():
                            if not self.backend.watch.starts(copy.id):
                                ray.cancel(copy.ref)  # not started: it never will
                if not any(copy.hopeful for copy in self.copies):
                    if stopped_at is not None:
                        raise Interrupted("cancelled; no copy of it is running on a node that answers")
                    self._lost_all()
                live = self.live()
                ready, _ = ray.wait([c.ref for c in live], num_returns=1, timeout=WATCH_PERIOD)
                for ref in ready:
                    copy = next(c for c in live if c.ref is ref)
                    record = self._finished(copy, interrupted_wanted=stopped_at is not None)
                    if record is not None:
                        return self._won(copy, record)
                if stopped_at is None:
                    self._watchdog()
                elif time.monotonic() - stopped_at > 60 + backend.grace:
                    raise Interrupted("cancelled; a node did not answer, so its copy may still run there")
        finally:
            for copy in self.copies:
                self._ended(copy, None)  # one that lost, was given up or cancelled ends here for the driver
                with contextlib.suppress(Exception):
                    if copy.ref is not None:  # the attempt ended without it: it stops, or runs nothing if it starts
                        backend.ledger.stop.remote(copy.id)
                    backend.ledger.forget.remote(copy.id)

    def _ended(self, copy: Copy, pulled: str | None) -> None:
        if not copy.ended:
            copy.ended = True
            self.backend.ended(copy.placed, pulled)

    def _finished(self, copy: Copy, *, interrupted_wanted: bool) -> ReplayRecord | None:
        """A copy's task ended: its record (fetched), or None when it gave none (and what to do next is done)."""
        ray = self.ray
        ref, copy.ref = copy.ref, None
        reply: dict[str, Any] = {}
        try:
            reply = ray.get(ref)
        except ray.exceptions.TaskCancelledError:
            return None
        except _lost_errors(ray) as exc:
            self._lose(copy, f"its node was lost and Ray's retries ran out ({type(exc).__name__})")
            return None
        except ray.exceptions.RayTaskError as exc:  # a bug on the node: its last line says what
            raise InfrastructureError(f"a node failed running {self.attempt.run_id}: {_last_line(exc)}") from None
        finally:
            self._ended(copy, reply.get("pulled"))
        copy.starts = reply.get("starts", 1)
        if reply.get("superseded"):
            return None
        if copy.given_up and reply.get("interrupted") and not interrupted_wanted:
            return None  # Ray's cancel reached it as it started: the copy that replaced it runs
        if reply.get("need_image"):
            self.unshipped.add(copy.id)
            self.chunks = True
            if not copy.given_up:  # (one given up was replaced already; a replacement without it asks too)
                self.submit()  # not a loss: the node learns how to get the image
            return None
        error = reply.get("error")
        if error is not None:
            if any(c.hopeful for c in self.copies) and error["type"] not in (*_ERRORS, "ImageUnavailable"):
                self.reasons[copy.id] = f"it failed there: {error['message']}"
                return None  # another copy is still running: it may do better
            if error["type"] == "ImageUnavailable":  # the node's registry said no: the item's, in its category
                raise ImageUnavailable(error.get("category") or "image_unreachable", error["message"])
            raise _ERRORS.get(error["type"], InfrastructureError)(error["message"])
        try:
            if "tar" in reply:
                self._extract(iter([reply["tar"]]))
            else:
                self._fetch(reply["node_id"], reply["token"])
        except _NodeLost as exc:
            self._lose(copy, str(exc))
            return None
        path = self.attempt.run_dir / "record.json"
        if not path.exists():
            if reply["interrupted"] or interrupted_wanted:
                raise Interrupted("interrupted on a node before its sandbox started")
            raise InfrastructureError(f"the copy on {reply['node']} sent back no record")
        return self._as_local(load_record(path), reply["node"])

    def _won(self, winner: Copy, record: ReplayRecord) -> ReplayRecord:
        """``winner`` finished first: stop the others, list every other start, and write the record."""
        # Where copies started decides something only if others ran, or Ray started this one more than once.
        if len(self.copies) > 1 or winner.starts > 1 or self.backend.watch.seen_death:
            self._settle()
        losers = self.live()
        for copy in losers:
            self.reasons.setdefault(copy.id, f"a copy on {record.host.get('node')} finished first")
        stops = [self.backend.ledger.stop.remote(copy.id) for copy in losers]  # asked at once, answered together
        try:
            started = self.ray.get(stops, timeout=30) if stops else []
        except Exception:  # noqa: BLE001 - a slow head: each hears "superseded" when it asks
            started = [True] * len(losers)
        for copy, began in zip(losers, started, strict=True):
            if not began and not copy.given_up:  # (one given up was cancelled then)
                self.ray.cancel(copy.ref)  # out of Ray's queue (if Ray starts it first, it runs nothing)
        record = record.model_copy(update={"superseded": self._superseded(winner)})
        save_record(record, self.attempt.run_dir)
        if record.status == "interrupted":
            raise Interrupted("interrupted while the sandbox ran on a node; its record says so")
        return record

    def _superseded(self, winner: Copy) -> list[SupersededAttempt]:
        found = []
        for copy in self.copies:
            if copy.id in self.unshipped:
                continue
            starts = self.backend.watch.starts(copy.id)
            if copy is winner:
                starts = starts[:-1]
            for n, start in enumerate(starts):
                if copy is winner or n < len(starts) - 1:
                    reason = f"its copy on node {start['node']} was lost; Ray ran it again"
                else:
                    reason = self.reasons.get(copy.id, "stopped by the driver")
                found.append(
                    SupersededAttempt(node=start["node"], reason=reason, started_at=datetime.fromisoformat(start["at"]))
                )
        return sorted(found, key=lambda s: s.started_at)

    def _settle(self) -> bool:
        """Read where every copy started, now; False when the ledger did not answer (the last view stays)."""
        try:
            self.backend.watch.settle()
        except Exception:  # noqa: BLE001 - a slow head: decide nothing that needs the starts
            return False
        return True

    def _lose(self, copy: Copy, reason: str) -> None:
        self.reasons[copy.id] = reason
        self.losses += 1
        logger.warning("{}: {}; running it on another node", self.attempt.run_id, reason)

    def _lost_all(self) -> None:
        """No copy is left: run another, unless nodes were lost too often."""
        if self.losses > MAX_NODE_LOSSES:
            raise InfrastructureError(f"{self.losses} nodes were lost running {self.attempt.run_id}")
        self.submit()

    def _watchdog(self) -> None:
        """Give up on copies whose node Ray has marked dead for ``grace`` seconds, and on copies that may be
        queued at such a node (the loop then runs another copy; see the module docstring)."""
        watch, grace = self.backend.watch, self.backend.grace
        for copy in self.copies:
            if not copy.hopeful:
                continue
            starts = watch.starts(copy.id)
            if starts:  # it started: is its node dead for the grace?
                last = starts[-1]
                dead = watch.dead_for(last["node_id"])
                if dead >= grace and self._give_up(copy, [last["node_id"]]):
                    self._lose(copy, f"node {last['node']} stopped answering (Ray marked it dead {dead:.0f}s ago)")
            else:  # its lease may wait at a node that died meanwhile
                waited = any(time.monotonic() - since >= grace for since in watch.deaths_since(copy.submitted))
                if waited and self._give_up(copy, watch.lost(grace)):
                    self.reasons[copy.id] = "queued while a node died; replaced"

    def _give_up(self, copy: Copy, lost: list[str]) -> bool:
        """Give ``copy`` up, unless the ledger says it runs on a node not ``lost`` (the watch's view of the
        starts lags the ledger by up to :data:`WATCH_PERIOD`: a copy queued until a moment ago runs now, and a
        cancel would interrupt it). If Ray starts a copy given up later, it runs nothing; the cancel drops it
        from Ray's queue (a crashed node's copy may wait there to be run again by Ray: ours replaces it; a hung
        node's copy cannot be cancelled, and Ray drops its result when the node returns)."""
        try:
            given_up = bool(self.ray.get(self.backend.ledger.give_up.remote(copy.id, lost), timeout=30))
        except Exception as exc:  # noqa: BLE001 - a slow head: decide at the next look
            logger.debug("{}: the ledger did not answer giving a copy up ({!r})", self.attempt.run_id, exc)
            return False
        if not given_up:
            self._settle()  # it started on a node that answers: see where before the next look
            return False
        copy.given_up = True
        self.ray.cancel(copy.ref)
        return True

    def _fetch(self, node_id: str, token: str) -> None:
        """Stream the copy's run directory from its node into ``attempt.run_dir`` (under the run's cap)."""
        ray, watch = self.ray, self.backend.watch
        generator = self.backend.fetch_from(node_id, token)

        def chunks() -> Any:
            while True:
                ready, _ = ray.wait([generator], timeout=WATCH_PERIOD)
                if not ready:
                    if watch.dead_for(node_id) >= self.backend.grace:
                        raise _NodeLost("its node stopped answering while its results came back")
                    continue
                try:
                    ref = next(generator)
                    yield ray.get(ref)
                except StopIteration:
                    return
                except _lost_errors(ray) as exc:
                    raise _NodeLost(f"its node was lost while its results came back ({type(exc).__name__})") from None

        self._extract(chunks())

    def _extract(self, chunks: Iterator[bytes]) -> None:
        """Unpack a copy's run directory into ``attempt.run_dir``, through the safe extractor, under the cap."""
        dest = self.attempt.run_dir
        if dest.exists():
            shutil.rmtree(dest)  # what an earlier copy's interrupted fetch left
        # The run directory holds what pvisor-host collected under the cap; a little room for its own files.
        extract_tar(tar_stream(chunks), dest, Budget(self.prepared.spec.collect_limit + 64 * 2**20))

    def _as_local(self, record: ReplayRecord, node: str) -> ReplayRecord:
        spec = self.prepared.spec
        inputs = record.inputs.model_copy(
            update={
                "trajectory": record.inputs.trajectory.model_copy(update={"path": str(self.prepared.trajectory.path)}),
                "workspace_dir": str(spec.workspace_dir.absolute()) if spec.workspace_dir else None,
            }
        )
        host = {**record.host, "node": node, "cluster": self.backend.address}
        return record.model_copy(update={"inputs": inputs, "host": host})


def _last_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


class _NodeLost(Exception):
    """A node was lost while a copy's results came back."""


def _lost_errors(ray: Any) -> tuple[type[BaseException], ...]:
    names = ("WorkerCrashedError", "NodeDiedError", "ObjectLostError", "OwnerDiedError", "RaySystemError",
             "ActorDiedError", "ObjectReconstructionFailedError", "ObjectFetchTimedOutError")  # fmt: skip
    return tuple(kind for name in names if (kind := getattr(ray.exceptions, name, None)) is not None)


def _engines(nodes: list[dict[str, Any]]) -> list[str]:
    """The alive nodes of ``nodes`` (``ray.nodes()``) that advertise a Docker engine, their ids sorted."""
    return sorted(str(n["NodeID"]) for n in nodes if n.get("Alive") and n.get("Resources", {}).get(ENGINE_RESOURCE))
