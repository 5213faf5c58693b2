"""The batch scheduler above the seam, with a scripted backend instead of an engine: bounded in-flight work,
cancellation with sandboxes running, the deadline, per-item retries, resume keys, summaries and exit codes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from pvisor_host.errors import ExitCode
from pvisor_host.fanout.manifest import BatchInput, BatchItem
from pvisor_host.fanout.options import BatchOptions, default_workers, fit_workers
from pvisor_host.fanout.scheduler import BatchOutcome, run_batch
from pvisor_host.fanout.summary import exit_code

from fakebackend import FakeBackend, trajectories

DEFAULTS = {"agent": "claude-code", "mode": "replay-only", "retry_backoff": "10ms"}


def items(root: Path, names: list[str], **fields: object) -> list[BatchItem]:
    paths = trajectories(root / "data", names)
    manifest = root / "data" / "m.jsonl"
    manifest.write_text(
        "".join(json.dumps({"id": p.stem, "trajectory": str(p), "after_step": 1}) + "\n" for p in paths)
    )
    source = BatchInput.parse(manifest=manifest, defaults={**DEFAULTS, **fields})
    return list(source.items())


def run(
    backend: FakeBackend,
    batch: list[BatchItem] | Iterator[BatchItem],
    out: Path,
    *,
    workers: int = 2,
    **options: object,
) -> BatchOutcome:
    total = len(batch) if isinstance(batch, list) else int(options.pop("total"))  # type: ignore[call-overload]
    return run_batch(batch, backend, BatchOptions(out=out, workers=workers, **options), total=total)


def record(out: Path, item: str) -> dict:
    return json.loads((out / item / "record.json").read_text())


def test_no_more_sandboxes_run_at_once_than_workers_and_the_manifest_is_read_as_it_goes(tmp_path):
    batch = items(tmp_path, [f"t{n:02d}" for n in range(24)])
    backend = FakeBackend(seconds=0.05)
    ahead: list[int] = []

    def stream() -> Iterator[BatchItem]:
        for item in batch:
            ahead.append(item.line - backend.finished)  # items pulled but not yet finished
            yield item

    outcome = run(backend, stream(), tmp_path / "out", workers=3, total=len(batch))
    assert backend.most_running == 3
    assert max(ahead) <= 2 * 3 + 1  # at most 2 × workers in flight, so a long manifest is never all in memory
    assert outcome.summary.counts == {"ok": 24} and outcome.summary.ran == 24
    assert exit_code(outcome.summary, 0) == ExitCode.OK
    assert all(record(tmp_path / "out", f"t{n:02d}")["batch"]["item_id"] == f"t{n:02d}" for n in range(24))


def test_ctrl_c_with_sandboxes_running_stops_them_all_and_keeps_every_record(tmp_path, ctrl_c_raises):
    batch = items(tmp_path, [f"t{n}" for n in range(10)])
    backend = FakeBackend(seconds=30)

    def interrupt_when_four_run() -> None:
        while backend.running < 4:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does to the main thread

    threading.Thread(target=interrupt_when_four_run, daemon=True).start()
    started = time.monotonic()
    outcome = run(backend, batch, tmp_path / "out", workers=4)
    assert time.monotonic() - started < 10  # stopped, not waited out
    assert backend.cancels == 1 and backend.running == 0
    summary = outcome.summary
    # 4 ran, 4 more were queued (2 × workers in flight), 2 were never reached: a row each, the counts add up.
    assert summary.interrupted and summary.items == 10 and summary.counts == {"interrupted": 8, "not_run": 2}
    assert sorted(r.id for r in outcome.results) == sorted(f"t{n}" for n in range(10))
    assert exit_code(summary, 0) == ExitCode.INTERRUPTED
    ran = sorted(p.parent.name for p in (tmp_path / "out").glob("*/record.json"))
    assert len(ran) == 4 and {record(tmp_path / "out", name)["status"] for name in ran} == {"interrupted"}
    not_started = [r for r in outcome.results if r.message == "not started"]
    assert len(not_started) == 4
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["interrupted"] is True


def test_the_deadline_cuts_running_items_and_starts_no_more(tmp_path):
    batch = items(tmp_path, [f"t{n}" for n in range(6)])
    backend = FakeBackend(seconds=5)
    outcome = run(backend, batch, tmp_path / "out", workers=2, deadline=1.0)
    assert outcome.summary.counts == {"not_run": 4, "timeout": 2}
    assert outcome.summary.deadline_reached
    assert exit_code(outcome.summary, 0) == ExitCode.TIMEOUT
    assert sum(len(v) for v in backend.attempts.values()) == 2
    assert record(tmp_path / "out", "t0")["limits"]["timeout"] <= 1.0  # the item's timeout was cut to what was left
    assert sorted(p.parent.name for p in (tmp_path / "out").glob("*/record.json")) == ["t0", "t1"]
    skipped = ET.parse(tmp_path / "out" / "junit.xml").getroot().findall("testsuite/testcase/skipped")
    assert len(skipped) == 4


def test_one_batch_at_a_time_per_directory_and_the_api_says_so(tmp_path):
    """Through the Python API, on a lent backend: a second batch into the same directory starts nothing."""
    import fcntl

    import pvisor_host
    from pvisor_host.errors import UsageError

    [path] = trajectories(tmp_path / "data", ["t0"])
    out = tmp_path / "out"
    out.mkdir()
    backend = FakeBackend()
    run = pvisor_host.batch([{"trajectory": path, "after_step": 1, **DEFAULTS}], out=out, backend=backend)
    with (out / ".pvisor-host-batch.lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(UsageError) as refused:
            list(run)
    assert refused.value.one_line() == f"--out {out}: another batch is running in this directory"
    assert backend.attempts == {} and not (out / "t0-after1").exists()


def test_each_item_retries_what_is_worth_retrying_and_nothing_else(tmp_path):
    script = {
        "flaky": ["infra_error", "ok"],
        "limited": ["rate_limited", "rate_limited", "ok"],
        "broken": ["replay_failed"],
        "hungry": ["oom"],
        "fine": ["ok"],
    }
    batch = items(tmp_path, list(script))
    backend = FakeBackend(script)
    outcome = run(backend, batch, tmp_path / "out")
    assert backend.attempts == {
        "flaky": ["infra_error", "ok"],
        "limited": ["rate_limited", "rate_limited", "ok"],
        "broken": ["replay_failed"],
        "hungry": ["oom"],  # an OOM is retried only with --retry-oom
        "fine": ["ok"],
    }
    flaky = record(tmp_path / "out", "flaky")
    assert [(a["attempt"], a["status"]) for a in flaky["attempts"]] == [(1, "infra_error"), (2, "ok")]
    assert (tmp_path / "out" / "flaky" / "attempts" / "1" / "record.json").is_file()
    assert outcome.summary.counts == {"ok": 3, "oom": 1, "replay_failed": 1}
    assert outcome.summary.categories == {"oom": 1, "trajectory_error": 1}
    assert exit_code(outcome.summary, 0) == ExitCode.REPLAY_FAILED
    assert exit_code(outcome.summary, 2) == ExitCode.OK

    again = FakeBackend({"hungry": ["oom", "ok"]})
    run(again, items(tmp_path / "b", ["hungry"]), tmp_path / "out2", retry_oom=True)
    assert again.attempts == {"hungry": ["oom", "ok"]}


def test_a_rerun_skips_what_finished_and_reruns_what_changed(tmp_path):
    names = ["a", "b", "c", "d"]
    batch = items(tmp_path, names)
    out = tmp_path / "out"
    first = run(FakeBackend({"d": ["replay_failed"]}), batch, out)
    assert first.summary.counts == {"ok": 3, "replay_failed": 1}
    keys = {name: record(out, name)["batch"]["content_key"] for name in names}

    unchanged = FakeBackend()
    second = run(unchanged, batch, out)
    assert unchanged.attempts == {} and second.summary.skipped == 4 and second.summary.ran == 0
    assert second.summary.counts == {"ok": 3, "replay_failed": 1}  # the skipped items keep their outcomes

    (tmp_path / "data" / "b.jsonl").write_text((tmp_path / "data" / "b.jsonl").read_text().replace("hello", "HELLO"))
    edited = FakeBackend()
    run(edited, batch, out)
    assert edited.attempts == {"b": ["ok"]}
    assert record(out, "b")["batch"]["content_key"] != keys["b"]
    assert [p.parent.parent.name for p in (out / ".previous").glob("*/*/record.json")] == ["b"]  # kept, not lost

    failed = FakeBackend()
    run(failed, batch, out, rerun_failed=True)
    assert failed.attempts == {"d": ["ok"]}

    # An option that changes the outcome reruns everything; one that does not (attempts) reruns nothing.
    assert run(FakeBackend(), items(tmp_path, names, attempts=5), out).summary.skipped == 4
    assert run(FakeBackend(), items(tmp_path, names, memory="1g"), out).summary.skipped == 0


def test_an_image_that_cannot_be_had_fails_its_items_only(tmp_path):
    good = items(tmp_path / "g", ["g1", "g2"])
    bad = items(tmp_path / "b", ["b1", "b2"], image="nowhere:1")
    backend = FakeBackend(unbuildable={"nowhere:1"})
    batch = [item.model_copy(update={"line": n + 1}) for n, item in enumerate([*good, *bad])]
    outcome = run(backend, batch, tmp_path / "out")
    assert outcome.summary.counts == {"ok": 2, "rejected": 2}
    rejected = [r for r in outcome.results if r.status == "rejected"]
    assert {r.id for r in rejected} == {"b1", "b2"}
    assert all(r.message == "image nowhere:1 does not exist here and cannot be pulled (fake)" for r in rejected)
    assert exit_code(outcome.summary, 0) == ExitCode.REPLAY_FAILED


def test_only_infrastructure_failures_exit_6(tmp_path):
    backend = FakeBackend({"a": ["infra_error"], "b": ["infra_error"]})
    outcome = run(backend, items(tmp_path, ["a", "b", "c"], attempts=2), tmp_path / "out")
    assert backend.attempts == {"a": ["infra_error", "infra_error"], "b": ["infra_error", "infra_error"], "c": ["ok"]}
    assert outcome.summary.counts == {"infra_error": 2, "ok": 1}
    assert exit_code(outcome.summary, 0) == ExitCode.INFRASTRUCTURE
    assert exit_code(outcome.summary, 2) == ExitCode.OK


def test_continuations_share_one_gateway_per_model_and_it_is_closed(tmp_path, monkeypatch):
    monkeypatch.setenv("PVH_FAKE_KEY", "k")
    model = {"model_base_url": "http://model/v1", "model": "m", "model_api_key_env": "PVH_FAKE_KEY"}
    batch = items(tmp_path, ["a", "b", "c"], mode="continue", **model)
    backend = FakeBackend()
    outcome = run(backend, batch, tmp_path / "out", workers=3)
    assert outcome.summary.counts == {"ok": 3}
    assert len(backend.gateways) == 1 and backend.gateways[0].closed


@pytest.mark.parametrize("workers", [1, 4])
def test_the_image_is_made_ready_once_for_every_item_that_shares_it(tmp_path, workers):
    backend = FakeBackend()
    run(backend, items(tmp_path, [f"t{n}" for n in range(8)]), tmp_path / "out", workers=workers)
    assert backend.images_made == 1


def test_a_full_disk_stops_starting_items_and_a_rerun_redoes_what_it_cost(tmp_path):
    batch = items(tmp_path, [f"t{n}" for n in range(8)])
    backend = FakeBackend({"t2": ["disk_full"]})
    outcome = run(backend, batch, tmp_path / "out", workers=1)
    summary = outcome.summary
    assert backend.attempts["t2"] == ["disk_full"]  # never retried: another attempt would find it as full
    assert summary.counts == {"infra_error": 1, "not_run": 5, "ok": 2}
    assert summary.categories == {"disk_full": 1}
    assert summary.stopped is not None and " is full (" in summary.stopped
    assert exit_code(summary, 0) == ExitCode.INFRASTRUCTURE
    rerun = FakeBackend()
    again = run(rerun, batch, tmp_path / "out", workers=1)
    assert sorted(rerun.attempts) == [f"t{n}" for n in range(2, 8)]  # the full disk's item runs again
    assert again.summary.counts == {"ok": 8}


def test_a_second_batch_beside_a_first_runs_in_what_is_left_and_says_so(tmp_path, caplog_lines, monkeypatch):
    from pvisor_host.fanout import options as batch_options

    monkeypatch.setattr(batch_options, "default_workers", lambda memory: 8)
    backend = FakeBackend()
    asked = BatchOptions(out=tmp_path)
    assert fit_workers(asked, backend, 2**30).workers == 8  # alone on the engine
    backend.others = 5
    assert fit_workers(asked, backend, 2**30).workers == 3
    given = BatchOptions(out=tmp_path, workers=8)
    assert fit_workers(given, backend, 2**30).workers == 8  # --workers is the user's word
    backend.others = 20
    assert fit_workers(asked, backend, 2**30).workers == 1
    said = [line.strip() for line in caplog_lines() if "sandboxes of another batch run on this engine" in line]
    assert said == [
        "5 sandboxes of another batch run on this engine: this one runs at most 3 at a time (--workers sets it)",
        "20 sandboxes of another batch run on this engine: this one runs at most 1 at a time (--workers sets it)",
    ]
    assert default_workers(2**30) >= 1
