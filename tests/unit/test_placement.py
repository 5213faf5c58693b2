"""Where a cluster batch sends each task image's items (:class:`Placement`), without Ray: a new image goes to the
node that already has the most of its layers among the least loaded (within one item), ties going to the node
that comes first by name; an image stays on its node while that node is alive, and moves when it is lost."""

from __future__ import annotations

from pvisor_host.backend.cluster.task_images import Placement

ENV = "sha256:" + "e0" * 32
OTHER_ENV = "sha256:" + "e1" * 32
NODES = ["a", "b", "c"]


def own(name: str) -> str:
    """A layer only one task image has."""
    return "sha256:" + name.encode().hex().ljust(64, "0")


def test_images_on_one_environment_share_a_node_while_the_loads_allow():
    placement = Placement()
    assert placement.place("task1", NODES, {ENV: 900, own("t1"): 10}) == "a"
    assert placement.place("task2", NODES, {ENV: 900, own("t2"): 10}) == "a"  # a is one item ahead: near enough


def test_a_new_image_goes_to_the_node_with_the_most_bytes_of_its_layers():
    placement = Placement()
    assert placement.place("small", ["a", "b"], {ENV: 100}) == "a"
    assert placement.place("large", ["a", "b"], {OTHER_ENV: 500}) == "b"  # shares nothing: the less loaded node
    assert placement.place("both", ["a", "b"], {ENV: 100, OTHER_ENV: 500, own("both"): 10}) == "b"


def test_a_node_more_than_one_item_ahead_is_passed_over_for_all_it_shares():
    placement = Placement()
    assert placement.place("task1", NODES, {ENV: 900, own("t1"): 10}) == "a"
    assert placement.place("task1", NODES) == "a"  # a holds two items now, b and c none
    assert placement.place("task2", NODES, {ENV: 900, own("t2"): 10}) == "b"


def test_among_nodes_sharing_nothing_the_least_loaded_wins_then_the_first_by_name():
    placement = Placement()
    assert placement.place("task1", ["c", "b", "a"]) == "a"
    assert placement.place("task2", ["c", "b", "a"]) == "b"
    assert placement.place("task3", ["c", "b", "a"]) == "c"
    assert placement.place("task4", ["c", "b", "a"]) == "a"


def test_an_image_stays_on_its_node_however_loaded_that_node_is():
    placement = Placement()
    assert [placement.place("task1", NODES) for _ in range(5)] == ["a"] * 5
    assert placement.place("task2", NODES) == "b"
    assert placement.place("task1", NODES) == "a"


def test_an_image_whose_node_is_lost_is_placed_again_and_stays_on_its_new_node():
    placement = Placement()
    assert placement.place("task1", NODES, {ENV: 900}) == "a"
    assert placement.place("task1", ["b", "c"], {ENV: 900}) == "b"
    assert placement.place("task1", NODES, {ENV: 900}) == "b"  # a is back: the image does not move again


def test_an_item_that_ends_lowers_its_nodes_load():
    placement = Placement()
    assert placement.place("task1", ["a", "b"]) == "a"
    assert placement.place("task1", ["a", "b"]) == "a"
    assert placement.place("task2", ["a", "b"]) == "b"
    placement.ended("a")
    placement.ended("a")
    assert placement.place("task3", ["a", "b"]) == "a"  # a: 0 items, b: 1 (without the ends: a 2, b 1, so b)


def test_without_nodes_there_is_no_placement_and_the_image_is_placed_once_there_are():
    placement = Placement()
    assert placement.place("task1", [], {ENV: 900}) is None
    assert placement.place("task2", ["b"], {ENV: 900}) == "b"
    assert placement.place("task1", ["a", "b"], {ENV: 900}) == "b"  # shares the environment with task2
    assert placement.place("task1", [], {ENV: 900}) is None  # its node is gone, and no other is there


def test_copies_without_a_task_image_spread_over_the_least_loaded_alive_nodes():
    """After a node died, each copy is placed (see ClusterBackend.place): least loaded first, task image items
    counted too, ties to the first by name; none without a node."""
    placement = Placement()
    assert placement.place("task1", ["a", "b"]) == "a"
    assert [placement.spread(["a", "b"]) for _ in range(3)] == ["b", "a", "b"]
    placement.ended("b")
    assert placement.spread(["a", "b", "c"]) == "c"  # a 2, b 1, c 0
    assert placement.spread(["b"]) == "b"  # a and c are gone
    assert placement.spread([]) is None


def test_the_backend_places_copies_without_a_task_image_only_after_a_death_and_lets_them_spill():
    """``ClusterBackend.place`` and ``submit_copy`` without Ray: which node a copy prefers, and Ray's strategy
    for it (a task image's items wait at their node; copies spread after a death take a free slot elsewhere)."""
    from types import SimpleNamespace

    from pvisor_host.backend.cluster.backend import ClusterBackend

    A, B = "0a" * 28, "0b" * 28  # Ray's node ids  # noqa: N806
    backend = object.__new__(ClusterBackend)
    backend.watch = SimpleNamespace(engines=lambda: [A, B], seen_death=False)
    backend.placement = Placement()
    backend.task_images = SimpleNamespace(layers=lambda ref: {})
    plain = SimpleNamespace(image=SimpleNamespace(runtime_volume=None, id="i1", ref="r1"))
    task = SimpleNamespace(image=SimpleNamespace(runtime_volume="volume", id="i2", ref="r2"))
    assert (backend.place(plain), backend.place(task)) == (None, A)
    backend.watch.seen_death = True
    assert backend.place(plain) == B  # A holds the task image's item
    strategies = []

    class RunCopy:
        def options(self, scheduling_strategy):
            strategies.append(scheduling_strategy)
            return self

        def remote(self, *args):
            return "ref"

    backend._run_copy, backend.ledger = RunCopy(), "ledger"
    backend.submit_copy("c1", {"task": None}, b"", None, None, None)
    backend.submit_copy("c2", {"task": {"id": "i2"}}, b"", None, None, A)
    backend.submit_copy("c3", {"task": None}, b"", None, None, B)
    assert [(s.node_id, s.soft, s._spill_on_unavailable) for s in strategies] == [(A, True, False), (B, True, True)]
