"""The image cache's arithmetic and its room-making, on a fake engine and a fake clock (no sleeps)."""

from __future__ import annotations

import threading

import pytest
from fakecache import MB, Clock, FakeEngine, swe

from pvisor_host.backend.docker.image.cache import ImageCache, Ledger
from pvisor_host.backend.docker.image.cache.layers import chain_ids, engine_layers
from pvisor_host.errors import Interrupted, RegistryError, UsageError
from pvisor_host.models.ownership import Ownership


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def clock() -> Clock:
    return Clock()


def cache_for(tmp_path, engine, clock, owner: str | None = None, session: str = "s1") -> ImageCache:
    ownership = Ownership.current(session=session)
    if owner is not None:
        ownership = ownership.model_copy(update={"owner": owner})
    return ImageCache(engine, Ledger(tmp_path / "cache.json", ownership), ownership, clock=clock, sleep=clock.sleep)


@pytest.fixture
def cache(tmp_path, engine, clock) -> ImageCache:
    return cache_for(tmp_path, engine, clock)


def take(cache: ImageCache, ref: str, budget: int | None, **kwargs: object):
    reservation = cache.reserve(ref, budget=budget, **kwargs)  # type: ignore[arg-type]
    cache.fill(reservation)
    return reservation


# -- layers ----------------------------------------------------------------------------------------------------


def test_chain_ids_follow_the_oci_rule():
    import hashlib

    first, second = chain_ids(["sha256:a", "sha256:b"])
    assert first == "sha256:a"
    assert second == "sha256:" + hashlib.sha256(b"sha256:a sha256:b").hexdigest()


def test_engine_history_is_weighed_per_layer_metadata_steps_making_none():
    history = [  # newest first, as the engine answers
        {"Size": 0, "CreatedBy": 'CMD ["bash"]'},
        {"Size": 30, "CreatedBy": "RUN make"},
        {"Size": 0, "CreatedBy": "RUN true"},  # a layer of no bytes
        {"Size": 0, "CreatedBy": "ENV A=1"},
        {"Size": 100, "CreatedBy": "ADD rootfs.tar /"},
    ]
    layers = engine_layers(["sha256:a", "sha256:b", "sha256:c"], history)
    assert [x.size for x in layers] == [100, 0, 30]
    assert [x.chain for x in layers] == chain_ids(["sha256:a", "sha256:b", "sha256:c"])


# -- accounting ------------------------------------------------------------------------------------------------


def test_shared_layers_count_once_and_a_pull_is_priced_without_the_layers_present(cache, engine):
    refs = swe(engine, 3)
    first = cache.reserve(refs[0], budget=None)
    assert first.added == (50 + 250 + 20) * MB // 2 * 3  # compressed × the first ratio (3.0)
    cache.fill(first)
    second = cache.reserve(refs[1], budget=None)
    assert second.compressed == 10 * MB  # only its own layer downloads
    assert second.added == 20 * MB  # the unpacking ratio learned from the first pull: 2.0
    cache.fill(second)
    assert cache.usage().bytes == (50 + 250 + 20 + 20) * MB
    assert cache.usage().peak == (50 + 250 + 20 + 20) * MB


def test_the_budget_evicts_unheld_images_least_recently_used_first_those_sharing_layers_with_the_pull_last(
    cache, engine, clock
):
    refs = swe(engine, 5, envs=2)  # task0, task2, task4 on env0; task1, task3 on env1
    budget = (50 + 250 + 250 + 20 + 20 + 20) * MB
    held = take(cache, refs[0], budget)
    for ref in refs[1:3]:
        cache.release(take(cache, ref, budget))
        clock.now += 1
    fourth = take(cache, refs[3], budget)  # task2 goes: task1 is older, but removing it would remove env1
    assert engine.removals == ["task2"]
    assert fourth.evicted == ["task2"]
    assert cache.usage().bytes == budget
    cache.release(fourth)
    clock.now += 1
    take(cache, refs[4], budget)  # task1 goes now (least recently used): env0 stays, held by task0
    assert engine.removals == ["task2", "task1"]
    assert cache.usage().bytes == (50 + 250 + 250 + 20 + 20 + 20) * MB
    assert "task0" in engine.present_refs  # held: never removed
    cache.release(held)


def test_a_pull_waits_while_only_held_images_could_make_room_and_goes_when_they_are_let_go(cache, engine, clock):
    refs = swe(engine, 2, envs=2)
    budget = (50 + 250 + 20) * MB + 5 * MB
    held = take(cache, refs[0], budget)
    clock.on_wait = lambda: cache.release(held) if clock.waits == 3 else None
    take(cache, refs[1], budget)
    assert clock.waits == 3
    assert engine.removals == ["task0"]


def test_past_the_wait_the_pull_goes_over_budget_and_says_so(cache, engine, clock, caplog_lines):
    refs = swe(engine, 2, envs=2)
    budget = (50 + 250 + 20) * MB + 5 * MB
    take(cache, refs[0], budget)  # held for good
    second = take(cache, refs[1], budget)
    assert second.over_budget
    assert clock.now - 1_000.0 >= 600
    assert any("over the --image-budget" in line for line in caplog_lines())


def test_the_registry_is_asked_once_per_reserve_however_long_it_waits(cache, engine, clock):
    refs = swe(engine, 2, envs=2)
    budget = (50 + 250 + 20) * MB + 5 * MB
    held = take(cache, refs[0], budget)
    clock.on_wait = lambda: cache.release(held) if clock.waits == 20 else None
    take(cache, refs[1], budget)
    assert clock.waits == 20 and engine.prices == ["task0", "task1"]


def test_a_present_image_whose_pull_is_still_being_noted_is_held_once_it_is(cache, engine, clock):
    refs = swe(engine, 1)
    first = cache.reserve(refs[0], budget=None)
    engine.present_refs[refs[0]] = engine.registry[refs[0]].id  # the engine has it; its puller has not noted it
    clock.on_wait = lambda: cache.fill(first) if clock.waits == 1 else None
    second = cache.reserve(refs[0], budget=None)
    assert clock.waits == 1 and second.key == engine.registry[refs[0]].id  # held, not merely found
    (entry,) = cache.entries()
    assert set(entry.holds) == {first.token, second.token}


def test_a_removal_the_engine_fails_is_settled_and_the_image_stays_counted(cache, engine):
    refs = swe(engine, 1)
    cache.release(take(cache, refs[0], None))
    engine.fail_remove = RuntimeError("the engine went away")
    with pytest.raises(RuntimeError):
        cache.finish()
    (entry,) = cache.entries()
    assert (entry.state, entry.worker, entry.stuck) == ("present", None, True)  # nobody waits on it for ever


def test_an_image_too_large_once_unpacked_is_not_removed_from_under_another_holder(tmp_path, engine, clock):
    engine.add("grows", [("g", 100 * MB)], [])
    engine.registry["grows"].compressed = [10 * MB]
    mine = cache_for(tmp_path, engine, clock)
    other = cache_for(tmp_path, engine, clock, owner="otherhost/5/5", session="s2")
    reservation = mine.reserve("grows", budget=60 * MB)
    taken = []
    let_go = mine.release

    def another_batch_holds_it_meanwhile(hold):  # between this holder letting go and the image's removal
        let_go(hold)
        taken.append(other.reserve("grows", budget=None))

    mine.release = another_batch_holds_it_meanwhile  # type: ignore[method-assign]
    with pytest.raises(UsageError, match="grows takes 95.4 MiB, more than the whole --image-budget 57.2 MiB"):
        mine.fill(reservation)
    assert engine.removals == [] and "grows" in engine.present_refs
    assert taken[0].key == engine.registry["grows"].id


def test_an_image_the_engine_will_not_remove_is_marked_stuck_and_the_pull_goes_over_at_once(cache, engine, clock):
    refs = swe(engine, 2, envs=2)
    budget = (50 + 250 + 20) * MB + 5 * MB
    cache.release(take(cache, refs[0], budget))
    engine.in_use.add(engine.registry["task0"].id)  # a container of someone else's uses it
    second = take(cache, refs[1], budget)
    assert second.over_budget and clock.waits == 0  # nothing anyone holds would free room: no waiting
    assert engine.removals == []


def test_an_image_larger_than_the_whole_budget_is_refused_before_and_after_its_pull(cache, engine):
    engine.add("huge", [("big", 400 * MB)], [])
    refused = r"huge downloads 190.7 MiB \(more unpacked\), more than the whole --image-budget 143.1 MiB"
    with pytest.raises(UsageError, match=refused):
        cache.reserve("huge", budget=150 * MB)
    engine.add("grows", [("g", 100 * MB)], [])
    engine.registry["grows"].compressed = [10 * MB]
    reservation = cache.reserve("grows", budget=60 * MB)
    with pytest.raises(UsageError, match="grows takes 95.4 MiB, more than the whole --image-budget 57.2 MiB"):
        cache.fill(reservation)
    assert engine.removals == ["grows"]
    assert cache.entries() == []


def test_an_unpriced_image_is_estimated_as_the_largest_and_pulled_alone(cache, engine, clock, tmp_path):
    refs = swe(engine, 2, envs=2)
    engine.unpriced.add(refs[1])
    first = cache.reserve(refs[0], budget=None)  # still pulling
    clock.on_wait = lambda: cache.fill(first) if clock.waits == 2 else None
    second = cache.reserve(refs[1], budget=None)
    assert clock.waits == 2  # waited for the other pull to end
    assert second.added == (50 + 250 + 20) * MB  # as large as the largest image here


# -- failures and ends -------------------------------------------------------------------------------------------


def test_a_failed_pull_is_forgotten_and_one_that_arrived_as_it_was_cancelled_stays_ours(cache, engine):
    refs = swe(engine, 2, envs=2)
    engine.fail_pull[refs[0]] = RegistryError("pulling task0 kept failing for 600s")
    with pytest.raises(RegistryError):
        cache.fill(cache.reserve(refs[0], budget=None))
    assert cache.entries() == []
    engine.fail_pull[refs[1]] = Interrupted("interrupted while pulling task1")
    engine.arrive_anyway.add(refs[1])
    with pytest.raises(Interrupted):
        cache.fill(cache.reserve(refs[1], budget=None))
    (entry,) = cache.entries()
    assert (entry.key, entry.state, entry.holds) == (engine.registry["task1"].id, "present", {})
    assert cache.finish() == ["task1"]  # removed at the batch's end, as any it pulled


def test_finish_removes_what_nobody_holds_hands_over_what_another_holds_and_keep_gives_up(tmp_path, engine, clock):
    refs = swe(engine, 3, envs=3)
    mine = cache_for(tmp_path, engine, clock)
    other = cache_for(tmp_path, engine, clock, owner="otherhost/1/1", session="s2")
    mine.release(take(mine, refs[0], None))
    shared = take(mine, refs[1], None)
    mine.release(shared)
    held_by_other = other.reserve(refs[1], budget=None)
    kept = take(mine, refs[2], None)
    mine.release(kept)
    entries = {e.ref: e for e in mine.entries()}
    assert entries["task1"].owner == Ownership.current().owner
    assert sorted(mine.finish()) == ["task0", "task2"]  # nobody holds them
    assert "task1" in engine.present_refs
    assert {e.ref: e.owner for e in mine.entries()}["task1"] == "otherhost/1/1"
    other.release(held_by_other)
    assert other.finish() == ["task1"]


def test_keep_gives_the_images_up(cache, engine):
    refs = swe(engine, 1)
    cache.release(take(cache, refs[0], None))
    assert cache.finish(keep=True) == []
    (entry,) = cache.entries()
    assert entry.kept and entry.owner is None
    assert cache.usage().bytes == 0  # no longer counted


def test_a_dead_process_holds_nothing_and_its_pull_becomes_what_the_engine_has(tmp_path, engine, clock):
    refs = swe(engine, 2, envs=2)
    dead = cache_for(tmp_path, engine, clock, owner=f"{Ownership.current().host}/999999/1", session="dead")
    dead.reserve(refs[0], budget=None)  # killed mid-pull: its note stays
    engine.present_refs[refs[0]] = engine.registry[refs[0]].id  # the engine finished the pull all the same
    dead.reserve(refs[1], budget=None)  # killed mid-pull: nothing arrived
    live = cache_for(tmp_path, engine, clock)
    budget = 500 * MB  # task1 alone, estimated at 3 × its compressed bytes: 480 MB
    take(live, refs[1], budget)  # the dead pull of task1 is gone; task0 (unheld now) makes room
    assert engine.removals == ["task0"]
    assert [e.ref for e in live.entries()] == ["task1"]


def test_two_batches_share_one_budget_and_never_remove_what_the_other_holds(tmp_path, engine, clock):
    refs = swe(engine, 4, envs=4)
    budget = 2 * (50 + 250 + 20) * MB
    first = cache_for(tmp_path, engine, clock, session="a")
    second = cache_for(tmp_path, engine, clock, owner="otherhost/2/2", session="b")
    a = take(first, refs[0], budget)
    b = take(second, refs[1], budget)
    clock.on_wait = lambda: first.release(a) if clock.waits == 1 else None
    take(second, refs[2], budget)  # waits for the first batch's image, then removes it
    assert engine.removals == ["task0"]
    assert first.usage().bytes <= budget
    second.release(b)


def test_a_batch_keeps_to_a_smaller_budget_another_batch_gave_after_it_started_and_says_so_once(
    tmp_path, engine, clock, caplog_lines
):
    refs = swe(engine, 4, envs=4)
    one = (50 + 250 + 20) * MB
    first = cache_for(tmp_path, engine, clock, session="a")
    second = cache_for(tmp_path, engine, clock, owner="otherhost/2/2", session="b")
    first.share_budget(4 * one)  # the first batch started alone, with room for four images
    for ref in refs[:2]:
        first.release(take(first, ref, 4 * one))
        clock.now += 1
    second.share_budget(2 * one)  # a second batch beside it keeps to two
    first.release(take(first, refs[2], 4 * one))
    first.release(take(first, refs[3], 4 * one))
    assert engine.removals == ["task0", "task1"]  # within the smaller budget, least recently used first
    assert first.usage().bytes <= 2 * one
    said = [line.strip() for line in caplog_lines() if "another batch on this engine" in line]
    assert said == ["another batch on this engine keeps the image cache within 610.4 MiB; this one keeps to it too"]
    second.finish()  # the second batch ends: its budget no longer binds
    first.release(take(first, refs[0], 4 * one))
    assert engine.removals == ["task0", "task1"]


def test_a_batch_that_says_which_images_are_done_keeps_the_others_of_its_own(tmp_path, cache, engine, clock):
    refs = swe(engine, 4, envs=4)
    budget = 2 * (50 + 250 + 20) * MB
    earlier = cache_for(tmp_path, engine, clock, owner="otherhost/3/3", session="earlier")
    earlier.release(take(earlier, refs[0], budget))  # an earlier batch's image: it may go when nobody holds it
    clock.now += 1
    cache.release(take(cache, refs[1], budget))
    clock.now += 1
    take(cache, refs[2], budget, done=lambda: set())  # this batch's task1 is not done: task0 goes
    assert engine.removals == ["task0"]
    take(cache, refs[3], budget, done=lambda: {engine.registry["task1"].id})
    assert engine.removals == ["task0", "task1"]


def test_the_batchs_own_image_nobody_holds_goes_after_a_short_wait_whatever_the_driver_says(cache, engine, clock):
    """On a cluster the items still to run of an image may be on another node: one image fits each node's
    budget, each node keeps its image for those items, and each waits for the other's. Nobody holds the image
    here, so after :data:`SPARE_WAIT` it goes, and the pull keeps to the budget (not ten minutes, then over)."""
    from pvisor_host.backend.docker.image.cache.cache import SPARE_WAIT

    refs = swe(engine, 2, envs=2)
    budget = (50 + 250 + 20) * MB
    cache.release(take(cache, refs[0], budget))
    started = clock.now
    held = take(cache, refs[1], budget, done=lambda: set())  # the driver never says task0 is done
    assert engine.removals == ["task0"] and not held.over_budget
    assert SPARE_WAIT <= clock.now - started < SPARE_WAIT + 1


def test_the_batchs_own_image_is_spared_from_its_last_use_not_from_when_the_pull_began_to_wait(cache, engine, clock):
    """A pull that has waited past :data:`SPARE_WAIT` for a holder still spares that image once it is let go: its
    items still to run may come next (removing it at once would pull it again); one unused that long goes at
    once."""
    from pvisor_host.backend.docker.image.cache.cache import SPARE_WAIT

    refs = swe(engine, 3, envs=3)
    budget = (50 + 250 + 20) * MB
    held = take(cache, refs[0], budget)
    started = clock.now
    released: list[float] = []

    def let_go() -> None:
        if not released and clock.now - started > SPARE_WAIT + 10:
            cache.release(held)
            released.append(clock.now)

    def never() -> set[str]:  # the driver never says task0 is done
        asked.append(clock.now)
        return set()

    asked: list[float] = []
    clock.on_wait = let_go
    second = take(cache, refs[1], budget, done=never)
    assert engine.removals == ["task0"] and not second.over_budget
    assert SPARE_WAIT <= clock.now - released[0] < SPARE_WAIT + 1
    # asked only while its answer could spare something: not while task0 was held, nor once it could go anyway
    assert asked and all(released[0] <= t < released[0] + SPARE_WAIT for t in asked)
    cache.release(second)
    clock.on_wait = None
    clock.now += SPARE_WAIT + 1  # task1 unused since
    waits, asked = clock.waits, []
    take(cache, refs[2], budget, done=never)
    assert engine.removals == ["task0", "task1"] and clock.waits == waits and asked == []  # no wait, no question


def test_a_cancel_ends_the_wait(cache, engine, clock):
    refs = swe(engine, 2, envs=2)
    budget = (50 + 250 + 20) * MB
    take(cache, refs[0], budget)
    cancel = threading.Event()
    clock.on_wait = cancel.set
    with pytest.raises(Interrupted):
        cache.reserve(refs[1], budget=budget, cancel=cancel)
    assert [e.ref for e in cache.entries()] == ["task0"]  # no note of the pull that never started


def test_a_second_holder_of_an_image_being_pulled_waits_and_then_holds_it(cache, engine, clock):
    refs = swe(engine, 1)
    first = cache.reserve(refs[0], budget=None)
    clock.on_wait = lambda: cache.fill(first) if clock.waits == 1 else None
    second = cache.reserve(refs[0], budget=None)
    assert second.present is not None and engine.pulls == ["task0"]
    (entry,) = cache.entries()
    assert set(entry.holds) == {first.token, second.token}


def test_two_holders_that_ask_at_once_make_one_pull(tmp_path, engine, clock):
    refs = swe(engine, 1)
    first = cache_for(tmp_path, engine, clock)
    second = cache_for(tmp_path, engine, clock, owner="otherhost/4/4", session="s2")
    racing = {}

    def the_other_prices_meanwhile() -> None:  # both saw no pull under way; the second notes its pull first
        if not racing:
            racing["started"] = True
            racing["hold"] = second.reserve(refs[0], budget=None)

    engine.on_price = the_other_prices_meanwhile
    clock.on_wait = lambda: second.fill(racing["hold"]) if clock.waits == 1 else None
    hold = first.reserve(refs[0], budget=None)
    assert hold.present is not None and engine.pulls == ["task0"]


def test_a_batch_that_finds_its_image_here_trims_what_earlier_batches_left_to_its_budget(tmp_path, engine, clock):
    refs = swe(engine, 3, envs=3)
    earlier = cache_for(tmp_path, engine, clock, owner="otherhost/5/5", session="earlier")
    for ref in refs:  # an earlier batch without a budget left three images
        earlier.release(take(earlier, ref, None))
        clock.now += 1
    later = cache_for(tmp_path, engine, clock, session="later")
    hold = later.reserve(refs[1], budget=(50 + 250 + 20) * MB)  # here already: no pull, and the others go
    assert hold.present is not None and engine.pulls == refs
    assert engine.removals == ["task0", "task2"]
    assert later.usage().bytes == later.usage().peak == (50 + 250 + 20) * MB


def test_an_image_on_its_way_out_is_not_in_the_peak_of_a_copy_that_holds_another_meanwhile(
    tmp_path, engine, clock, monkeypatch
):
    """Two copies of one batch on a node find their image here; while the first removes what an earlier batch
    left, the second holds the image too: the peak is what stays, not what is being removed."""
    refs = swe(engine, 3, envs=3)
    earlier = cache_for(tmp_path, engine, clock, owner="otherhost/5/5", session="earlier")
    for ref in refs:
        earlier.release(take(earlier, ref, None))
        clock.now += 1
    budget = (50 + 250 + 20) * MB
    first = cache_for(tmp_path, engine, clock, owner="node/1/1", session="later")
    second = cache_for(tmp_path, engine, clock, owner="node/2/2", session="later")
    remove = engine.remove
    meanwhile = []

    def second_holds_meanwhile(ref, image_id):
        if not meanwhile:
            meanwhile.append(second.reserve(refs[1], budget=budget))
        return remove(ref, image_id)

    monkeypatch.setattr(engine, "remove", second_holds_meanwhile)
    held = first.reserve(refs[1], budget=budget)
    assert held.present is not None and meanwhile[0].present is not None
    assert engine.removals == ["task0", "task2"]
    assert first.peak("later") == first.usage().bytes == budget


def test_layers_the_engine_had_before_do_not_count_as_the_caches(cache, engine):
    refs = swe(engine, 2)
    engine.add("env-image", [("os", 50 * MB), ("env0", 250 * MB)], [])
    engine.present_refs["env-image"] = engine.registry["env-image"].id  # the user's: its layers were here
    hold = cache.reserve(refs[0], budget=None)
    assert (hold.added, hold.compressed) == (30 * MB, 10 * MB)  # its own layer only (3 × compressed, estimated)
    cache.fill(hold)
    assert cache.usage().bytes == 20 * MB  # what the pull brought to the disk
    cache.fill(cache.reserve(refs[1], budget=None))
    assert cache.usage().bytes == 40 * MB


def test_a_hold_let_go_before_its_pull_ran_leaves_no_note_and_the_image_is_asked_for_again(cache, engine, clock):
    refs = swe(engine, 1)
    abandoned = cache.reserve(refs[0], budget=None)  # the batch was cancelled before this pull started
    cache.release(abandoned)
    assert cache.entries() == [] and abandoned.key is None
    with pytest.raises(Interrupted, match="let go before its pull started"):
        cache.fill(abandoned)
    again = take(cache, refs[0], budget=None)  # asked again: pulled, not waited for until the end of time
    assert clock.waits == 0 and engine.pulls == ["task0"] and again.key == engine.registry["task0"].id


def test_a_pull_that_fails_after_the_download_leaves_no_pulling_note(cache, engine, clock, monkeypatch):
    refs = swe(engine, 1)

    def weighing_fails(image_id: str):
        raise RuntimeError("the engine failed to inspect it")

    monkeypatch.setattr(engine, "layers", weighing_fails)
    with pytest.raises(RuntimeError):
        cache.fill(cache.reserve(refs[0], budget=None))
    (entry,) = cache.entries()  # it arrived: this process's to remove, held by nobody
    assert (entry.state, entry.holds) == ("present", {})
    monkeypatch.undo()
    held = cache.reserve(refs[0], budget=None)
    assert clock.waits == 0 and held.present is not None and engine.pulls == ["task0"]


def test_a_registry_that_could_not_price_during_the_wait_is_asked_again_now_and_then(cache, engine, clock):
    refs = swe(engine, 2, envs=2)
    first = cache.reserve(refs[0], budget=None)  # still pulling: the unpriced second waits for it
    engine.unpriced.add(refs[1])  # a brief registry error

    def meanwhile() -> None:
        if clock.waits == 3:
            engine.unpriced.discard(refs[1])
        if clock.waits == 40:
            cache.fill(first)

    clock.on_wait = meanwhile
    second = cache.reserve(refs[1], budget=None)
    assert engine.prices.count("task1") == 2  # every TIDY_EVERY (10 waits of POLL) until it answers, then no more
    assert clock.waits == 10 and second.compressed > 0  # priced once it answered: pulled alongside, not alone
    assert not [x for e in cache.entries() for x in e.layers if x.chain.startswith("unpriced:")]


def test_a_hold_let_go_while_its_pull_runs_keeps_the_pull_noted_until_it_is_weighed(cache, engine, monkeypatch):
    refs = swe(engine, 1)
    first = cache.reserve(refs[0], budget=None)
    pull = engine.pull

    def let_go_meanwhile(ref, **kwargs):
        cache.release(first)  # its item was cancelled while the pull ran
        (noted,) = cache.entries()
        assert (noted.state, noted.holds) == ("pulling", {})  # still noted as pulling: a second asker waits for it
        assert cache._pulled_elsewhere(ref)
        return pull(ref, **kwargs)

    monkeypatch.setattr(engine, "pull", let_go_meanwhile)
    cache.fill(first)
    (entry,) = cache.entries()
    assert (entry.state, entry.holds) == ("present", {})
    second = cache.reserve(refs[0], budget=None)
    assert second.key == entry.key and engine.pulls == ["task0"] and set(cache.entries()[0].holds) == {second.token}


# -- the decision, as a pure function of the ledger's state ------------------------------------------------------


def _image(key: str, size: int, *, used: float = 0.0, session: str = "other", **fields: object):
    from pvisor_host.backend.docker.image.cache.layers import Layer
    from pvisor_host.backend.docker.image.cache.ledger import CachedImage

    fields = {"state": "present", **fields}
    return CachedImage(
        key=key, ref=f"task/{key}", layers=[Layer(chain=f"c-{key}", size=size)], used=used, session=session,
        **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def _deciding(*images, new_size: int = 40 * MB, budget: int = 100 * MB, finished=None, ask=False, late=False):
    from pvisor_host.backend.docker.image.cache import cache as policy
    from pvisor_host.backend.docker.image.cache.ledger import CacheState, Hold

    new = _image("new", new_size, used=100.0, session="mine", state="pulling", holds={"t": Hold(process="p")})
    state = CacheState(images={i.key: i for i in (*images, new)})
    return policy.make_room(state, new, set(), budget, finished, ask=ask, late=late)


def test_the_decision_pulls_within_the_budget_and_removes_the_least_recently_used_first():
    from pvisor_host.backend.docker.image.cache.cache import Room, Verdict

    assert _deciding(_image("a", 50 * MB)) == Verdict(Room.PULL)
    old, recent = _image("old", 50 * MB, used=1.0), _image("recent", 50 * MB, used=2.0)
    assert _deciding(recent, old) == Verdict(Room.REMOVE, victims=["old"])


def test_the_decision_waits_for_a_holder_and_goes_over_the_budget_when_nobody_will_let_go_or_it_is_late():
    from pvisor_host.backend.docker.image.cache.cache import Room, Verdict
    from pvisor_host.backend.docker.image.cache.ledger import Hold

    held = _image("held", 90 * MB, holds={"x": Hold(process="q")})
    assert _deciding(held) == Verdict(Room.WAIT)
    assert _deciding(held, late=True) == Verdict(Room.PULL, over_budget=True)
    stuck = _image("stuck", 90 * MB, stuck=True)  # the engine would not remove it, and nobody holds anything
    assert _deciding(stuck) == Verdict(Room.PULL, over_budget=True)


def test_the_decision_asks_the_batch_only_while_one_of_its_images_is_spared():
    from pvisor_host.backend.docker.image.cache.cache import Room, Verdict
    from pvisor_host.backend.docker.image.cache.ledger import Hold

    own = _image("own", 90 * MB, used=95.0, session="mine")  # its batch's, used 5 s ago
    assert _deciding(own, ask=True) == Verdict(Room.ASK)
    assert _deciding(own, finished=set()) == Verdict(Room.WAIT)  # not done: spared, and its items still to run
    assert _deciding(own, finished={"own"}) == Verdict(Room.REMOVE, victims=["own"])
    held = _image("own", 90 * MB, used=95.0, session="mine", holds={"x": Hold(process="q")})
    assert _deciding(held, ask=True) == Verdict(Room.WAIT)  # held: its batch's answer would change nothing
    stale = _image("own", 90 * MB, used=50.0, session="mine")  # unused for longer than SPARE_WAIT: not spared
    assert _deciding(stale, ask=True) == Verdict(Room.REMOVE, victims=["own"])
