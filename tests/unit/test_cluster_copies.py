"""The cluster driver's copy/watchdog state machine without a cluster: against a fake of Ray's task API
(``tests/fakeray.py``), a copy finishes, dies and is run again by Ray, is lost for good, hangs on a node Ray
marked dead, waits at a dead node, asks for its image, fails, or is cancelled; each ends with exactly one
record, naming every other start. The real cluster runs in ``tests/integration/test_cluster.py``."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from pvisor_host.backend.cluster import copies
from pvisor_host.backend.cluster.copies import MAX_NODE_LOSSES, AttemptRun
from pvisor_host.backend.cluster.ledger import Ledger
from pvisor_host.errors import InfrastructureError, Interrupted, UsageError
from pvisor_host.models.record import ReplayRecord, save_record
from pvisor_host.models.replay import Attempt, PreparedReplay
from pvisor_host.models.spec import ReplaySpec
from pvisor_host.preflight.checks import check_inputs
from pvisor_host.preflight.prepare import prepare

from fakebackend import FakeBackend, trajectories
from fakeray import FakeCluster, FakeRay, Step

GRACE = 0.6


@pytest.fixture(autouse=True)
def quick_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copies, "WATCH_PERIOD", 0.05)


@pytest.fixture
def prepared(tmp_path: Path) -> PreparedReplay:
    [trajectory] = trajectories(tmp_path / "data", ["t1"])
    spec = ReplaySpec(trajectory=trajectory, after_step=1, agent="claude-code", mode="replay-only")
    checked = check_inputs(spec, host_pvisor=False, run_id="run-1", out_dir=tmp_path / "out")
    return prepare(checked, FakeBackend())


@pytest.fixture
def template(prepared: PreparedReplay, tmp_path: Path) -> ReplayRecord:
    """The record a node's pipeline writes (made by the scripted backend)."""
    return FakeBackend().run_attempt(prepared, Attempt(run_id="run-1", run_dir=tmp_path / "template"))


@pytest.fixture
def run(prepared: PreparedReplay, template: ReplayRecord, tmp_path: Path) -> Iterator[object]:
    """``run(script, nodes)``: follow one attempt on a fake cluster; returns (record or error, cluster, ray)."""
    clusters: list[FakeCluster] = []

    def make_run(directory: Path, status: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_record(template.model_copy(update={"status": status}), directory)

    def follow(
        script: list[Step], nodes: tuple[str, ...] = ("n1", "n2", "n3", "n4", "n5"), cancel_after: float | None = None
    ) -> tuple[ReplayRecord | BaseException, FakeCluster, FakeRay]:
        ray = FakeRay(list(nodes))
        cluster = FakeCluster(ray, script, make_run, grace=GRACE).use_scratch(tmp_path / "nodes")
        clusters.append(cluster)
        cancel = threading.Event()
        if cancel_after is not None:
            threading.Timer(cancel_after, cancel.set).start()
        attempt = Attempt(run_id="run-1", run_dir=tmp_path / "out" / "run-1")
        try:
            outcome: ReplayRecord | BaseException = AttemptRun(cluster, prepared, attempt, None).follow(cancel)
        except (InfrastructureError, Interrupted, UsageError) as exc:
            outcome = exc
        return outcome, cluster, ray

    yield follow
    for cluster in clusters:
        cluster.close()
        # every copy placed (once a node died) ended once for the placement: no node's load is left counted
        assert set(cluster.placement._load.values()) <= {0}, cluster.placement._load


def reasons(record: ReplayRecord) -> list[tuple[str, str]]:
    return [(s.node, s.reason) for s in record.superseded]


def test_a_copy_that_finishes_is_the_record_and_nothing_else_ran(run, tmp_path):
    record, cluster, ray = run([("n1", "ok")])
    assert isinstance(record, ReplayRecord) and record.status == "ok"
    assert (record.host["node"], record.host["cluster"]) == ("n1", "head:6379")
    assert record.superseded == [] and len(cluster.submitted) == 1 and ray.cancelled == []
    assert (tmp_path / "out" / "run-1" / "record.json").is_file()
    assert cluster.ledger.calls["snapshot"] == 0  # no node died: where copies started decided nothing


def test_a_node_that_dies_has_its_copy_run_again_by_ray_and_the_first_start_is_named(run):
    record, cluster, _ = run([("n1", "retried:n2")])
    assert cluster.ledger.calls["snapshot"] > 0


def test_a_copy_ray_ran_again_with_no_node_dead_still_names_its_first_start(run):
    """Only its worker died (or the driver has not seen its node die yet): the copy's reply says it started
    twice, so the driver reads where."""
    record, cluster, ray = run([("n1", "worker-retried:n2")])
    assert record.host["node"] == "n2" and len(cluster.submitted) == 1 and ray.cancelled == []
    assert reasons(record) == [("n1", "its copy on node n1 was lost; Ray ran it again")]
    assert cluster.ledger.calls["snapshot"] == 1


def test_when_rays_retries_run_out_the_driver_runs_another_copy(run):
    record, cluster, _ = run([("n1", "lost"), ("n2", "ok")])
    assert record.host["node"] == "n2" and [s["node"] for s in cluster.submitted] == ["n1", "n2"]
    assert reasons(record) == [("n1", "its node was lost and Ray's retries ran out (NodeDiedError)")]


def test_a_copy_on_a_hung_node_is_given_up_after_the_grace_and_replaced(run):
    started = time.monotonic()
    record, cluster, ray = run([("n1", "hang"), ("n2", "ok")])
    assert record.host["node"] == "n2" and len(cluster.submitted) == 2
    assert time.monotonic() - started >= GRACE  # not before Ray's verdict has stood for the grace
    [(node, reason)] = reasons(record)
    assert node == "n1" and reason.startswith("node n1 stopped answering (Ray marked it dead ")
    assert len(ray.cancelled) == 1  # the hung copy is cancelled (Ray drops its result if the node returns)
    assert len(cluster.ends) == 2  # each copy ended once for the placement, the given-up one included


def test_a_copy_queued_while_a_node_died_is_replaced_and_not_counted_as_run(run):
    record, cluster, ray = run([("n1", "queued-hang"), ("n2", "ok")])
    assert record.host["node"] == "n2" and len(cluster.submitted) == 2
    assert record.superseded == []  # it never started anywhere
    assert [ref.name for ref in ray.cancelled] == ["copy0"]


def test_a_copy_given_up_while_queued_runs_nothing_when_ray_starts_it_after_all(run):
    """Ray's cancel does not reach a lease stuck at a dead node: when the lease comes back, the copy starts,
    and the ledger tells it that it was stopped before anything ran."""
    record, cluster, ray = run([("n1", "queued-late:n3"), ("n2", "ok")])
    assert record.host["node"] == "n2" and record.superseded == []  # the late start ran nothing
    first, second = (s["copy_id"] for s in cluster.submitted)
    deadline = time.monotonic() + 5
    while first not in cluster.heard and time.monotonic() < deadline:
        time.sleep(0.01)  # the late start may come after the replacement finished
    assert (cluster.heard.get(first), cluster.heard[second]) == ([0], [1])
    assert [ref.name for ref in ray.cancelled] == ["copy0"]
    assert Counter(cluster.ends) == Counter([(None, None), ("id-n2", None)])  # the replacement was placed


def test_a_copy_that_started_as_the_watchdog_looked_is_neither_given_up_nor_cancelled(run, monkeypatch):
    """The watch's view of the starts lags the ledger: a copy queued while another node died may be running
    by the time the watchdog gives up on queued copies. The ledger, asked in the same call, says so, and the
    copy runs on (a cancel would interrupt it: Ray raises KeyboardInterrupt in a running task)."""
    monkeypatch.setattr(copies.Watch, "settle", lambda self: None)  # the view never catches up
    record, cluster, ray = run([("n1", "ok-while:n2")])
    assert record.status == "ok" and record.host["node"] == "n1"
    assert len(cluster.submitted) == 1 and ray.cancelled == []
    assert cluster.ledger.calls["give_up"] > 0  # the watchdog did look


def test_a_copy_given_up_that_the_cancel_interrupts_does_not_end_the_attempt(run):
    record, cluster, ray = run([("n1", "hang-cancelled"), ("n2", "ok")])
    assert isinstance(record, ReplayRecord) and record.status == "ok" and record.host["node"] == "n2"
    [(node, reason)] = reasons(record)
    assert node == "n1" and reason.startswith("node n1 stopped answering")


def test_a_copy_placed_whose_submission_fails_leaves_no_load_on_its_node(run):
    """After a death the replacement is placed, then submitting it raises: the error is the attempt's, and the
    node's load goes back down (the fixture checks every node's load is 0)."""
    error, cluster, _ = run([("n1", "hang"), ("n2", "submit-fails")])
    assert isinstance(error, InfrastructureError)
    assert error.one_line() == "the driver lost its connection to the cluster"
    assert len(cluster.submitted) == 1


def test_a_node_without_the_image_is_sent_it_and_that_is_no_loss(run):
    record, cluster, _ = run([("n1", "need_image"), ("n1", "ok")])
    assert record.status == "ok" and cluster.manifests == [False, True]  # the second copy carries the chunks
    assert record.superseded == []


def test_a_refusal_on_a_node_is_the_same_error_here(run):
    error, _, _ = run([("n1", "error:UsageError:n1: the workspace is too big")])
    assert isinstance(error, UsageError) and error.one_line() == "n1: the workspace is too big"


def test_a_failure_on_a_node_is_one_line_when_no_other_copy_runs(run):
    error, _, _ = run([("n1", "error:InfrastructureError:n1: Docker engine failed to create the container: x")])
    assert type(error) is InfrastructureError
    assert error.one_line() == "n1: Docker engine failed to create the container: x"


def test_nodes_lost_too_often_fail_the_attempt(run):
    error, cluster, _ = run([(f"n{n}", "lost") for n in range(1, 6)])
    assert isinstance(error, InfrastructureError)
    assert error.one_line() == f"{MAX_NODE_LOSSES + 1} nodes were lost running run-1"
    assert len(cluster.submitted) == MAX_NODE_LOSSES + 1


def test_cancel_stops_the_running_copy_and_its_interrupted_record_is_kept(run, tmp_path):
    error, cluster, _ = run([("n1", "wait")], cancel_after=0.3)
    assert isinstance(error, Interrupted)
    assert error.one_line() == "interrupted while the sandbox ran on a node; its record says so"
    assert '"status": "interrupted"' in (tmp_path / "out" / "run-1" / "record.json").read_text()
    assert cluster.ledger._instance.should_stop(cluster.submitted[0]["copy_id"]) == "cancelled"


def test_a_copy_given_up_that_still_runs_is_told_it_was_superseded(run):
    record, cluster, ray = run([("n1", "cut-off"), ("n2", "ok")])
    assert record.host["node"] == "n2" and len(cluster.submitted) == 2
    first = cluster.submitted[0]["copy_id"]
    deadline = time.monotonic() + 5
    while first not in cluster.stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cluster.stopped == {first: "superseded"}  # it removes its sandbox; nobody fetches its run
    [(node, reason)] = reasons(record)
    assert node == "n1" and reason.startswith("node n1 stopped answering")
    assert len(ray.cancelled) == 1  # cancelled once by the watchdog, not again by the winner (it had started)
    assert len(cluster.ends) == 2


def test_the_ledger_gives_a_copy_up_only_where_it_has_not_started_or_its_node_was_lost():
    ledger = Ledger()
    at = "2026-12-04T00:00:00+00:00"
    assert ledger.give_up("queued", ["node-1"]) is True
    assert ledger.started("queued", "node-2", "n2", at, "t") == 0  # Ray started it after all: it runs nothing
    assert ledger.started("lost", "node-1", "n1", at, "t") == 1
    assert ledger.give_up("lost", ["node-1"]) is True
    assert ledger.started("lost", "node-2", "n2", at, "t") == 0  # Ray's retry of a copy given up: nothing
    assert ledger.started("moved", "node-1", "n1", at, "t") == 1
    assert ledger.started("moved", "node-2", "n2", at, "t") == 2  # Ray ran it again on a node that answers
    assert ledger.give_up("moved", ["node-1"]) is False
    assert ledger.should_stop("lost") is None  # a copy given up is not told to stop: it may finish first
    assert (ledger.stop("moved"), ledger.stop("never")) == (True, False)  # whether each had started
    ledger.stop_all()
    assert ledger.started("late", "node-2", "n2", at, "t") == 0  # after Ctrl-C on the driver: nothing runs
    assert sorted(ledger.snapshot()) == ["lost", "moved"] and len(ledger.snapshot()["moved"]) == 2


def test_the_ledger_answers_a_waiting_copy_when_it_is_told_to_stop_and_not_before():
    async def scenario() -> list[str | None]:
        ledger = Ledger()
        for copy_id in ("a", "b", "c", "d"):
            ledger.started(copy_id, "node-1", "n1", "2026-12-04T00:00:00+00:00", copy_id)
        waits = [asyncio.create_task(ledger.wait_stop(copy_id, 30)) for copy_id in ("a", "b", "c")]
        await asyncio.sleep(0)
        assert not any(w.done() for w in waits)
        ledger.stop("a")  # another copy of a's attempt finished first
        ledger.forget("b")  # the driver is done with b: its watcher stops waiting, with no reason
        answered = [await waits[0], await waits[1]]
        assert not waits[2].done()
        ledger.stop_all()  # Ctrl-C on the driver
        answered += [await waits[2], await ledger.wait_stop("d", 30)]  # d asks after: at once
        assert await Ledger().wait_stop("e", 0.01) is None  # nothing happened within the wait
        return answered

    assert asyncio.run(scenario()) == ["superseded", None, "cancelled", "cancelled"]
