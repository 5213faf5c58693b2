"""The model gateway's own logic, without a sandbox: the batch's limits, a journal added up into a record's
figures, prices, and how a cassette tells a request that drifted from its recording."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from pydantic import ValidationError

from pvisor_host.gateway.cassette import compare
from pvisor_host.gateway.journal import totals
from pvisor_host.gateway.limits import LocalLimits
from pvisor_host.models.gateway import ModelPrice
from pvisor_host.models.record import ModelTotals, add_totals
from pvisor_host.models.spec import ReplaySpec


def test_requests_per_minute_hold_a_call_until_the_window_moves_on():
    async def run() -> list[float]:
        limits = LocalLimits(requests_per_minute=2, window=0.4)
        waits = []
        for _ in range(3):
            waits.append(await limits.acquire())
            await limits.release(0)
        return waits

    first, second, third = asyncio.run(run())
    assert first < 0.05 and second < 0.05 and 0.3 < third < 0.6


def test_tokens_per_minute_hold_calls_while_the_last_window_used_them_up():
    async def run() -> tuple[float, float]:
        limits = LocalLimits(tokens_per_minute=100, window=0.4)
        await limits.acquire()
        await limits.release(60)
        quick = await limits.acquire()  # 60 < 100: goes
        await limits.release(60)
        return quick, await limits.acquire()  # 120 >= 100: waits for the first 60 to leave the window

    quick, held = asyncio.run(run())
    assert quick < 0.05 and 0.25 < held < 0.6


def test_concurrency_lets_the_next_call_in_as_one_ends():
    async def run() -> tuple[int, float]:
        limits = LocalLimits(concurrency=1)

        async def call() -> float:
            async with limits.slot() as slot:
                await asyncio.sleep(0.2)
                return slot.waited

        waits = await asyncio.gather(call(), call(), call())
        return limits.peak, max(waits)

    peak, longest = asyncio.run(run())
    assert peak == 1 and 0.35 < longest < 0.6


def _entry(status: int, usage: dict | None, latency: float, **extra) -> str:
    return json.dumps(
        {"path": "/v1/chat/completions", "status": status, "usage": usage, "latency_ms": latency, **extra}
    )


def test_a_journal_adds_up_to_the_records_model_figures_whatever_api_reported_the_usage(tmp_path):
    journal = tmp_path / "model-traffic.jsonl"
    journal.write_text("\n".join([
        _entry(200, {"prompt_tokens": 1000, "completion_tokens": 50, "total_tokens": 1050,
                     "prompt_tokens_details": {"cached_tokens": 800}}, 100.0, waited_ms=250.0),
        _entry(200, {"input_tokens": 2000, "output_tokens": 100, "input_tokens_details": {"cached_tokens": 0}},
               300.0, retries=[{"status": 429}, {"status": 429}]),
        _entry(429, None, 50.0, retries=[{"status": 429}]),
        json.dumps({"path": "/v1/models", "status": 200, "latency_ms": 1.0}),  # not a model call
    ]) + "\n")  # fmt: skip
    found = totals(journal, ModelPrice.model_validate("input=3,output=15,cached=0.3"))
    assert found.model_dump(exclude={"drift"}) == {
        "calls": 3, "input_tokens": 3000, "output_tokens": 150, "cached_tokens": 800, "retries": 3, "errors": 1,
        "waited_seconds": 0.25, "latency_p50_ms": 100.0, "latency_p90_ms": 300.0,
        "cost": round((2200 * 3 + 800 * 0.3 + 150 * 15) / 1e6, 6),
    }  # fmt: skip
    assert totals(journal).cost is None


def test_figures_of_several_runs_add_up():
    a = ModelTotals(calls=2, input_tokens=10, output_tokens=1, retries=1, latency_p50_ms=10, latency_p90_ms=20, cost=1)
    b = ModelTotals(calls=3, input_tokens=5, output_tokens=2, errors=2, latency_p50_ms=30, latency_p90_ms=90)
    both = add_totals([a, b])
    assert both is not None and (both.calls, both.input_tokens, both.output_tokens, both.retries, both.errors) == (
        5, 15, 3, 1, 2)  # fmt: skip
    assert (both.latency_p50_ms, both.latency_p90_ms, both.cost) == (10, 90, 1)
    assert add_totals([]) is None


@pytest.mark.parametrize("text", ["input=3", "input=3,output=x", "in=3,output=1", "input=-1,output=1"])
def test_a_price_that_cannot_be_read_is_refused(text):
    with pytest.raises(ValidationError):
        ModelPrice.model_validate(text)


BASE = {"trajectory": "/t.jsonl", "agent": "codex", "after_step": 1, "model": "m"}


def test_a_cassette_served_back_needs_no_upstream_and_no_key(tmp_path):
    spec = ReplaySpec.model_validate(BASE | {"model_cassette": ("replay", tmp_path)})
    assert spec.upstream is not None and spec.upstream.base_url is None and spec.upstream.api_key() is None
    with pytest.raises(ValidationError, match="missing --model-base-url, --model-api-key-env"):
        ReplaySpec.model_validate(BASE | {"model_cassette": ("record", tmp_path)})
    with pytest.raises(ValidationError, match="pass-through has none"):
        ReplaySpec.model_validate(BASE | {"model_cassette": ["replay", tmp_path], "model_network": "pass-through"})


def test_drift_is_the_first_differing_message_of_the_conversation():
    recorded = {"model": "m", "prompt_cache_key": "run-1", "input": [{"role": "user", "content": "a"},
                {"type": "function_call_output", "call_id": "c1", "output": "old"}]}  # fmt: skip
    same_but_ids = dict(recorded, prompt_cache_key="run-2")
    assert compare(recorded, same_but_ids) is None  # per-run settings are not the conversation
    changed = dict(recorded, input=[recorded["input"][0], dict(recorded["input"][1], output="new")])
    drift = compare(recorded, changed)
    assert drift is not None and (drift.field, drift.message) == ("input", 1)
    assert drift.diff == ('- {"call_id": "c1", "output": "old", "type": "function_call_output"}\n'
                          '+ {"call_id": "c1", "output": "new", "type": "function_call_output"}')  # fmt: skip
    longer = dict(recorded, input=[*recorded["input"], {"role": "user", "content": "more"}])
    assert compare(recorded, longer).message == 2  # type: ignore[union-attr]


def test_waiting_costs_no_cpu():
    async def run() -> float:
        limits = LocalLimits(concurrency=1)
        await limits.acquire()
        began = time.process_time()
        waiter = asyncio.ensure_future(limits.acquire())
        await asyncio.sleep(0.3)
        await limits.release(0)
        await waiter
        return time.process_time() - began

    assert asyncio.run(run()) < 0.05


def test_what_changes_from_run_to_run_by_itself_is_not_drift():
    recorded = {"messages": [{"role": "system", "content": "memory at /run/state/item-0-f91aa7/m; today is 2026-12-03",
                              "id": "msg_1"}]}  # fmt: skip
    sent = {"messages": [{"role": "system", "content": "memory at /run/state/item-0-0b7c2e/m; today is 2026-12-04",
                          "id": "msg_2"}]}  # fmt: skip
    assert compare(recorded, sent, recorded_run="item-0-f91aa7", run="item-0-0b7c2e") is None
    assert compare(recorded, sent) is not None  # without the two run ids, the paths differ


def test_a_long_message_shows_where_it_differs():
    base = "x" * 500
    drift = compare({"input": [{"text": base + "old" + base}]}, {"input": [{"text": base + "new" + base}]})
    assert drift is not None and drift.message == 0
    recorded, sent = drift.diff.splitlines()
    assert recorded.startswith("- …") and "old" in recorded and recorded.endswith("…") and len(recorded) < 260
    assert sent.startswith("+ …") and "new" in sent


def test_an_agents_own_fresh_text_is_masked_by_its_profile():
    import re

    from pvisor_host.models.profiles import get_profile

    volatile = [re.compile(p) for p in get_profile("codex").continuation.volatile]
    recorded = {
        "input": [{"type": "function_call_output", "output": "Chunk ID: c811bc\nWall time: 0.0000 seconds\nok"}]
    }
    sent = {"input": [{"type": "function_call_output", "output": "Chunk ID: 705a36\nWall time: 0.0021 seconds\nok"}]}
    assert compare(recorded, sent, volatile=volatile) is None
    assert compare(recorded, sent) is not None
    changed = {"input": [{"type": "function_call_output", "output": "Chunk ID: 705a36\nWall time: 0.1 seconds\nno"}]}
    assert compare(recorded, changed, volatile=volatile) is not None


def test_what_differs_between_hosts_and_runs_by_itself_is_masked_by_default():
    """Claude Code's prompt names the host's kernel; observations carry temp paths, timings and pids."""
    recorded = {"messages": [
        {"role": "system", "content": "Platform: linux\nOS Version: Linux 6.1.0-18-amd64\nToday: 2026-12-03"},
        {"role": "user", "content": "wrote /tmp/tmpk2j3x9_a/out.txt in 0.52s (pid 4121) at 10:02:11.3; real 0m0.003s"},
    ]}  # fmt: skip
    sent = {"messages": [
        {"role": "system", "content": "Platform: linux\nOS Version: Linux 6.8.0-1017-azure\nToday: 2026-12-04"},
        {"role": "user", "content": "wrote /tmp/tmp9q8w7e2b/out.txt in 1.7 s (pid 77) at 23:59:01.002; real 0m1.250s"},
    ]}  # fmt: skip
    assert compare(recorded, sent) is None
    changed = json.loads(json.dumps(sent).replace("out.txt", "other.txt"))
    drift = compare(recorded, changed)
    assert drift is not None and (drift.field, drift.message) == ("messages", 1)
    assert "other.txt" in drift.diff


@pytest.mark.parametrize(
    ("fresh", "again"),
    [
        ("at 2026-12-03T10:02:11.345Z", "at 2026-12-04T23:59:01.002Z"),
        (
            "Linux h 6.1.0-18-amd64 #1 SMP Debian 6.1.76-1 (2024-02-01)",
            "Linux h 6.8.0-1017-azure #1 SMP Debian 6.8.12-1 (2024-09-01)",
        ),
        ("Darwin Kernel Version 23.1.0: Mon", "Darwin Kernel Version 24.0.0: Mon"),
        ("/tmp/pytest-of-root/pytest-12/t0/a.txt", "/tmp/pytest-of-ci/pytest-3/t0/a.txt"),
        ("made /tmp/tmp.AbCdEfGhIj", "made /tmp/tmp.x9QzLmNoPq"),  # GNU mktemp's names
        ("-rw-r--r-- 1 root root 3 Nov  7 13:45 f.txt", "-rw-r--r-- 1 root root 3 Dec 12 09:01 f.txt"),  # ls -l
        ("Thu Dec  4 10:51:20 UTC 2026", "Fri Dec  5 08:00:01 UTC 2026"),  # date
        ("#26~22.04.1-Ubuntu SMP PREEMPT_DYNAMIC", "#31~22.04.1-Ubuntu SMP PREEMPT_DYNAMIC"),
        ("--- PASS: TestParse (0.00s)", "--- PASS: TestParse (0.31s)"),
        ("3 passed in 0.03s", "3 passed in 12s"),
        ("took 10234 us", "took 9987 us"),
        ("elapsed: 1.25µs", "elapsed: 3.5µs"),
    ],
)
def test_each_default_mask_hides_what_is_fresh_by_nature(fresh, again):
    assert compare({"input": fresh}, {"input": again}) is None


@pytest.mark.parametrize(
    ("was", "now"),
    [
        ("wrote /tmp/result.json", "wrote /tmp/results.json"),  # a file of the task's own, directly in /tmp
        ("timeout: 30s", "timeout: 300s"),  # a setting, not a measurement
        ("sleep 5s", "sleep 6s"),
        ("expected 5 s, got 6 s", "expected 5 s, got 7 s"),
        ("release 1.2.3", "release 1.2.4"),
        ("wrote /tmp/tmp_results.json", "wrote /tmp/tmp_results2.json"),
        ("wrote /tmp/output2024.csv", "wrote /tmp/output2025.csv"),
        ("wrote /tmp/cafe1234", "wrote /tmp/cafe1235"),
        ("sleep 1.5s", "sleep 2.5s"),
        ("timeout=0.5s", "timeout=1.5s"),
    ],
)
def test_a_default_mask_does_not_hide_a_real_change(was, now):
    assert compare({"input": was}, {"input": now}) is not None


@pytest.mark.parametrize("unit", ["1.", "/tmp/abcdef", "9", "in 1", "1:", "12-"])
def test_the_default_masks_take_linear_time_on_long_runs(unit):
    """A run 8 times as long takes about 8 times as long to mask, not 64 (a ratio in the same run, no clock limit)."""
    import time

    from pvisor_host.gateway.cassette import DEFAULT_MASKS

    def cost(text: str) -> float:
        started = time.process_time()
        for mask in DEFAULT_MASKS * 20:
            mask.sub("", text)
        return time.process_time() - started

    short, long = cost(unit * 2_000), cost(unit * 16_000)
    assert long < 24 * max(short, 1e-3)


def test_a_users_mask_is_a_regular_expression_checked_first(tmp_path):
    import re

    spec = ReplaySpec.model_validate(BASE | {"model_cassette": ("replay", tmp_path), "cassette_mask": ["seed=\\d+"]})
    assert spec.upstream is not None and spec.upstream.cassette_masks == ("seed=\\d+",)
    masks = [re.compile(p) for p in spec.upstream.cassette_masks]
    assert compare({"input": "seed=1 ok"}, {"input": "seed=2 ok"}, volatile=masks) is None
    with pytest.raises(ValidationError, match=r"'\(' is not a regular expression"):
        ReplaySpec.model_validate(BASE | {"model_cassette": ("replay", tmp_path), "cassette_mask": ["("]})
