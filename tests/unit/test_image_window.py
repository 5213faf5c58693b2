"""Task images just in time, within a budget, with a scripted backend instead of an engine and a registry:
the first result after one pull, pulls overlapping sandboxes, every image pulled once, the budget held (by
the fake engine's own count), removals least recently used first and only of what the batch pulled, and the
images that cannot be had refused for their items only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pvisor_host.errors import UsageError
from pvisor_host.fanout.manifest import BatchInput, BatchItem
from pvisor_host.fanout.options import BatchOptions, checked_model
from pvisor_host.fanout.scheduler import BatchOutcome, BatchRun

from fakebackend import FakeBackend, FakeRegistry, trajectories

MB = 1024**2
DEFAULTS = {"agent": "claude-code", "mode": "replay-only", "inject": True}


def dataset(root: Path, images: list[str], per_image: int) -> tuple[list[BatchItem], dict[str, int]]:
    """``per_image`` items for each image, written interleaved (the manifest brings each image's together)."""
    lines = []
    for n in range(per_image):
        for i, image in enumerate(images):
            [path] = trajectories(root / "data", [f"t{i}-{n}"])
            lines.append({"id": f"t{i}-{n}", "trajectory": str(path), "after_step": 1, "image": image})
    manifest = root / "data" / "m.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    source = BatchInput.parse(manifest=manifest, defaults=DEFAULTS)
    return list(source.items()), source.check().image_counts


def run(backend: FakeBackend, root: Path, images: list[str], per_image: int, **options: object) -> BatchOutcome:
    items, counts = dataset(root, images, per_image)
    workers = int(options.pop("workers", 2))  # type: ignore[call-overload]
    batch = BatchRun(
        items, backend, checked_model(BatchOptions, {"out": root / "out", "workers": workers, **options}),
        total=len(items),
        task_images=counts,
    )  # fmt: skip
    for _ in batch:
        pass
    assert batch.outcome is not None
    return batch.outcome


def registry(count: int, size: int = 100 * MB, seconds: float = 0.2) -> tuple[FakeRegistry, list[str]]:
    refs = [f"reg:5000/task/t{n}:v1" for n in range(count)]
    return FakeRegistry(dict.fromkeys(refs, (size, seconds))), refs


def test_images_arrive_just_in_time_each_pulled_once_the_first_result_after_one_pull(tmp_path):
    images, refs = registry(4, seconds=0.4)
    backend = FakeBackend(seconds=0.1, registry=images)
    items, counts = dataset(tmp_path, refs, 3)
    batch = BatchRun(items, backend, BatchOptions(out=tmp_path / "out", workers=2, pull_workers=1), total=12,
                     task_images=counts)  # fmt: skip
    results = iter(batch)
    first = next(results)
    assert first.status == "ok" and backend.pulls == refs[:1]  # the first result came after one pull
    for _ in results:
        pass
    assert batch.outcome is not None and batch.outcome.summary.counts == {"ok": 12}
    assert sorted(backend.pulls) == refs  # each once
    runs = [ref for kind, ref in backend.events if kind == "run"]
    assert runs == sorted(runs, key=refs.index)  # the items of one image ran together, images in order
    stats = batch.outcome.summary.images
    assert stats is not None and (stats.pulled, stats.removed, stats.failed) == (4, 4, 0)
    assert backend.present == {}  # what the batch pulled, it removed at its end


def test_pulls_overlap_the_sandboxes(tmp_path):
    images, refs = registry(4, seconds=0.5)
    backend = FakeBackend(seconds=0.5, registry=images)
    outcome = run(backend, tmp_path, refs, 2, workers=2, pull_workers=2)
    assert outcome.summary.counts == {"ok": 8}
    # a pull ran while a sandbox of another image did: started after that sandbox, ended before it
    events = backend.events
    assert any(
        events.index(("run", refs[n])) < events.index(("pulling", refs[m])) < events.index(("ran", refs[n]))
        for n in range(4) for m in range(n + 1, 4)
    )  # fmt: skip
    pulls = [event for event in backend.events if event[0] in ("pulling", "pull")]
    assert pulls[:2] == [("pulling", refs[0]), ("pull", refs[0])]  # the first pull went alone
    # and so did the first item once its image was here: the next pull, and the next item, started after it ended
    first_ended = backend.events.index(("ran", refs[0]))
    assert backend.events.index(("pulling", refs[1])) > first_ended
    assert [n for n, event in enumerate(backend.events) if event[0] == "run"][1] > first_ended


def test_a_budget_forces_removals_least_recently_used_first_and_is_never_exceeded(tmp_path):
    images, refs = registry(6, size=100 * MB, seconds=0.05)
    backend = FakeBackend(seconds=0.05, registry=images, present={"reg:5000/task/mine:1": 500 * MB})
    outcome = run(backend, tmp_path, [*refs, "reg:5000/task/mine:1"], 2, workers=3, image_budget=250 * MB)
    assert outcome.summary.counts == {"ok": 14}
    assert backend.peak <= 250 * MB  # the fake engine's own count of the pulled images
    stats = outcome.summary.images
    assert stats is not None and stats.peak <= 250 * MB and stats.budget == 250 * MB
    assert stats.pulled == 6 and stats.removed == 6
    assert "reg:5000/task/mine:1" not in backend.removals  # present before the batch: never the batch's to remove
    assert backend.present == {"reg:5000/task/mine:1": (500 * MB, False)}
    for n, ref in enumerate(refs[2:], start=2):  # room was made before each pull: older images were gone
        assert backend.events.index(("remove", refs[n - 2])) < backend.events.index(("pull", ref))


def test_with_room_for_one_image_only_one_is_ever_there(tmp_path):
    images, refs = registry(3, size=100 * MB, seconds=0.05)
    backend = FakeBackend(seconds=0.05, registry=images)
    outcome = run(backend, tmp_path, refs, 3, workers=3, image_budget=150 * MB)
    assert outcome.summary.counts == {"ok": 9}
    assert backend.peak == 100 * MB
    pulls_and_removals = [event for event in backend.events if event[0] in ("pull", "remove")]
    assert pulls_and_removals == [("pull", refs[0]), ("remove", refs[0]), ("pull", refs[1]), ("remove", refs[1]),
                                  ("pull", refs[2]), ("remove", refs[2])]  # fmt: skip
    # the backend heard of each image once every item that asked for it had ended (a cluster's nodes use it)
    assert [event for event in backend.events if event[0] == "done"] == [("done", ref) for ref in refs]


def test_an_image_larger_than_the_budget_is_refused_for_its_items_in_one_line(tmp_path):
    images, refs = registry(2, size=100 * MB, seconds=0.05)
    images.images["reg:5000/task/huge:1"] = (900 * MB, 0.05)
    backend = FakeBackend(seconds=0.01, registry=images)
    outcome = run(backend, tmp_path, [refs[0], "reg:5000/task/huge:1", refs[1]], 2, image_budget=400 * MB)
    assert outcome.summary.counts == {"ok": 4, "rejected": 2}
    refused = [r for r in outcome.results if r.status == "rejected"]
    assert {r.id for r in refused} == {"t1-0", "t1-1"}
    assert refused[0].message == (
        "image reg:5000/task/huge:1 downloads 450.0 MiB (more unpacked), more than the whole --image-budget "
        "400.0 MiB (raise --image-budget, or run its items on a host with more room)"
    )
    assert "reg:5000/task/huge:1" not in backend.pulls


@pytest.mark.parametrize("kind", ["image_not_found", "registry_unauthorized"])
def test_an_image_that_cannot_be_had_fails_its_items_in_a_category_of_their_own(tmp_path, kind):
    images, refs = registry(2, seconds=0.05)
    images.images["reg:5000/task/gone:1"] = kind
    backend = FakeBackend(seconds=0.01, registry=images)
    outcome = run(backend, tmp_path, [refs[0], "reg:5000/task/gone:1", refs[1]], 2)
    assert outcome.summary.counts == {"ok": 4, "rejected": 2}
    assert outcome.summary.categories == {kind: 2}
    assert outcome.summary.images is not None and outcome.summary.images.failed == 1


def test_without_pull_workers_every_image_comes_first(tmp_path):
    images, refs = registry(3, seconds=0.05)
    backend = FakeBackend(seconds=0.01, registry=images)
    outcome = run(backend, tmp_path, refs, 2, pull_workers=0)
    assert outcome.summary.counts == {"ok": 6}
    kinds = [kind for kind, _ in backend.events if kind != "pulling"]
    assert kinds[:3] == ["pull"] * 3 and "pull" not in kinds[3:]


def test_without_pull_workers_no_budget_can_apply_and_the_two_are_refused_together(tmp_path):
    images, refs = registry(3, size=100 * MB, seconds=0.05)
    backend = FakeBackend(seconds=0.01, registry=images)
    with pytest.raises(UsageError, match="--image-budget cannot apply with --pull-workers 0"):
        run(backend, tmp_path, refs, 2, pull_workers=0, image_budget=150 * MB)
    assert backend.events == [] and not (tmp_path / "out").exists()  # nothing pulled, nothing written


def test_kept_images_stay(tmp_path):
    images, refs = registry(2, seconds=0.01)
    backend = FakeBackend(seconds=0.01, registry=images)
    outcome = run(backend, tmp_path, refs, 1, keep_images=True)
    assert outcome.summary.counts == {"ok": 2} and backend.removals == []
    assert set(backend.present) == set(refs)


def test_a_rerun_skips_finished_items_without_pulling_their_images(tmp_path):
    images, refs = registry(3, seconds=0.05)
    backend = FakeBackend(seconds=0.01, registry=images)
    first = run(backend, tmp_path, refs, 2)
    assert first.summary.counts == {"ok": 6} and len(backend.pulls) == 3 and backend.present == {}
    again = run(backend, tmp_path, refs, 2)
    assert again.summary.counts == {"ok": 6} and again.summary.skipped == 6
    assert len(backend.pulls) == 3  # nothing pulled to tell that nothing needs to run
    assert again.summary.images is not None and again.summary.images.pulled == 0


class NodesPull(FakeBackend):
    """A backend whose nodes pull (a cluster): as many images open at once as it has slots."""

    def running_sandboxes(self) -> int:
        return 0

    def capacity(self) -> int | None:
        return 8

    def node_pulls(self) -> int | None:
        return len(self.pulls)


def test_on_a_cluster_as_many_images_are_open_as_it_has_slots(tmp_path):
    images, refs = registry(8, seconds=0.01)
    backend = NodesPull(seconds=0.5, registry=images)
    outcome = run(backend, tmp_path, refs, 1, workers=8, pull_workers=1)
    assert outcome.summary.counts == {"ok": 8}
    assert backend.most_running == 8  # not the 2 x pull workers one engine's disk would allow
    stats = outcome.summary.images
    assert stats is not None and (stats.node_pulls, stats.removed, stats.peak) == (8, 0, 0)


def test_an_image_whose_last_item_never_asked_for_it_is_done_all_the_same():
    from pvisor_host.fanout.images import ImageWindow

    images, refs = registry(1, seconds=0.01)
    backend = FakeBackend(registry=images)
    window = ImageWindow(backend, {refs[0]: 2}, budget=None)
    window.start()
    try:
        with window.holding(refs[0]):
            pass
        assert ("done", refs[0]) not in backend.events  # one item is still to end
        window.skip(refs[0])  # it ends without asking (a deadline, a full disk)
        assert backend.events.count(("done", refs[0])) == 1
    finally:
        window.close()
