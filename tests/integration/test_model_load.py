"""Live continuations by the batch: the real Claude Code 2.1.220 and Codex 0.149.0 CLIs, eight at a time, against a
fault-injecting OpenAI-compatible stub (chat completions for Claude's bridge, streamed Responses for Codex).

The gateway absorbs what the upstream means as passing (a burst of 429s with Retry-After) before the agents see
it, caps the calls in flight across the batch, counts every token, and records a cassette that a second batch
replays with no upstream and no key, naming the message where a changed tool output made the context drift.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from conftest import run_cli
from modelserver import StubServer
from trajgen import claude_files_session, codex_files_session, write_jsonl

pytestmark = pytest.mark.docker

KEY = "sk-test-REAL-load-key-93be17"
KEY_ENV = {"PVH_LOAD_KEY": KEY}
#: agent -> (trajectory, after-step)
AGENTS = {"claude-code": (claude_files_session, 4), "codex": (codex_files_session, 3)}


@pytest.fixture(scope="module", autouse=True)
def images(claude_image, codex_image) -> None:
    """Both agents' images, built (or found) before the first batch."""


#: A first command whose output differs every run by itself: a temp directory's made-up name, timings, a pid.
VOLATILE = "echo hi > f.txt; mktemp -d; s=$(date +%s%N); sleep 0.01; echo took $(( ($(date +%s%N) - s) / 1000 )) us"


def manifest(root: Path, items: int, *, workspace: Path | None = None, volatile: bool = False) -> Path:
    """``items`` continuations, Claude Code and Codex in turn, ids ``claude-code-0``, ``codex-1``, ...; with
    ``volatile``, their first command prints what differs from run to run (:data:`VOLATILE`)."""
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for n in range(items):
        agent = sorted(AGENTS)[n % 2]
        make, after = AGENTS[agent]
        events = make()
        if volatile:
            text = json.dumps(events)  # the command as it is, and inside Codex's JSON-encoded arguments
            assert "echo hi > f.txt" in text
            events = json.loads(text.replace("echo hi > f.txt", VOLATILE))
        trajectory = write_jsonl(root / f"{agent}.jsonl", events)
        line = {"id": f"{agent}-{n}", "agent": agent, "trajectory": str(trajectory), "after_step": after}
        if workspace is not None:
            line["workspace_dir"] = str(workspace)
        lines.append(line)
    path = root / "manifest.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def batch(manifest_path: Path, out: Path, *options: str, env: dict[str, str] | None = None, workers: int = 8):
    return run_cli(
        "batch", manifest_path, "--out", out, "--workers", str(workers), "--max-steps", "8", "--quiet", "--json",
        "--model", "stub-model", *options, env=env,
    )  # fmt: skip


def upstream(stub: StubServer) -> list[str]:
    return ["--model-base-url", stub.base_url, "--model-api-key-env", "PVH_LOAD_KEY"]


def records(out: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in out.glob("*/record.json")}


def journal(item_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (item_dir / "model-traffic.jsonl").read_text().splitlines()]


def test_a_burst_of_rate_limits_is_absorbed_within_the_concurrency_and_every_token_is_counted(tmp_path):
    out = tmp_path / "out"
    with StubServer() as stub:
        stub.model.fail_for(8, 429, retry_after=2)  # every call of the first 8 s: "come back in 2 s"
        stub.model.hold = 0.3  # calls overlap, so that the cap is what holds them back
        done = batch(manifest(tmp_path / "data", 8), out, *upstream(stub), "--model-concurrency", "3", env=KEY_ENV)
        refused = len(stub.model.model_requests()) - len(stub.model.served_usage)
        peak, served = stub.model.peak, list(stub.model.served_usage)
    assert done.code == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["counts"] == {"ok": 8}
    ran = records(out)
    assert all(r["attempts"] == [] and r["attempt"] == 1 for r in ran.values())  # no prefix ran twice
    assert peak <= 3, peak
    figures = summary["model"]
    assert refused > 0 and figures["retries"] == refused  # every 429 the stub gave was retried by the gateway
    assert figures["calls"] == len(served) and figures["errors"] == 0
    input_tokens = sum(u.get("prompt_tokens", u.get("input_tokens", 0)) for u in served)
    output_tokens = sum(u.get("completion_tokens", u.get("output_tokens", 0)) for u in served)
    assert (figures["input_tokens"], figures["output_tokens"]) == (input_tokens, output_tokens)
    assert sum(r["model"]["totals"]["calls"] for r in ran.values()) == len(served)
    waits = [e["retries"][0]["wait_ms"] for r in ran for e in journal(out / r) if e["retries"]]
    assert waits and set(waits) == {2000.0}  # as Retry-After said
    for path in out.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path
    assert KEY not in done.stdout + done.stderr


def test_failures_beyond_the_retry_budget_end_the_items_in_the_model_category_with_one_line_each(tmp_path):
    out = tmp_path / "out"
    with StubServer() as stub:
        stub.model.fail_for(3600, 500)
        done = batch(manifest(tmp_path / "data", 4), out, *upstream(stub), "--model-retry-budget", "2s",
                     "--attempts", "1", env=KEY_ENV, workers=4)  # fmt: skip
    assert done.code == 1, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["counts"] == {"replay_failed": 4}
    assert set(summary["categories"]) == {"model_internal_error"}, summary["categories"]
    for record in records(out).values():
        assert "\n" not in record["failure"]["message"] and record["failure"]["retryable"] is True
        assert record["model"]["totals"]["errors"] >= 1 and record["model"]["totals"]["retries"] >= 1
    assert summary["model"]["errors"] >= 4


def test_a_stream_cut_mid_way_ends_cleanly_and_the_run_is_classified(tmp_path):
    out = tmp_path / "out"
    with StubServer() as stub:
        stub.model.fail_next("cut")  # Codex's first streamed answer breaks off after its first event
        data = manifest(tmp_path / "data", 2)
        lines = [json.loads(line) for line in data.read_text().splitlines()]
        data.write_text(json.dumps(next(line for line in lines if line["agent"] == "codex")) + "\n")
        done = batch(data, out, *upstream(stub), "--timeout", "5m", env=KEY_ENV, workers=1)
    assert done.code in (0, 1), done.stderr[-3000:]
    (record,) = records(out).values()
    assert record["status"] in ("ok", "replay_failed"), record["failure"]  # classified, neither hung nor lost
    first = journal(out / "codex-1")[0]
    assert first["stream"] is True and first["error"].startswith("the upstream broke off the stream after ")
    assert record["model"]["totals"]["errors"] >= 1


def test_a_slow_first_byte_and_a_slow_stream_are_waited_for(tmp_path):
    out = tmp_path / "out"
    with StubServer() as stub:
        stub.model.first_byte_delay = 2.0
        stub.model.chunk_delay = 0.2
        done = batch(manifest(tmp_path / "data", 2), out, *upstream(stub), env=KEY_ENV, workers=2)
    assert done.code == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["counts"] == {"ok": 2}
    for item in records(out):
        entries = journal(out / item)
        assert entries and all(e["latency_ms"] >= 2000 and not e["retries"] for e in entries)


def test_a_cassette_replays_offline_and_a_changed_tool_output_is_drift_at_its_message(tmp_path):
    tapes = tmp_path / "tapes"
    data = manifest(tmp_path / "data", 4, volatile=True)  # temp paths, timings and pids differ in every run
    with StubServer() as stub:
        recorded = batch(data, tmp_path / "recorded", *upstream(stub), "--model-cassette", "record", str(tapes),
                         env=KEY_ENV, workers=4)  # fmt: skip
        calls = len(stub.model.model_requests())
    assert recorded.code == 0, recorded.stderr[-3000:]
    assert sorted(p.name for p in tapes.iterdir()) == sorted(f"{r}.jsonl" for r in records(tmp_path / "recorded"))
    for tape in tapes.iterdir():
        text = tape.read_text()
        assert KEY not in text and "pvhtok-" not in text and "Bearer " not in text

    # As if recorded on another host (a CI runner's kernel changes): Claude Code's prompt names the kernel, and
    # that is no drift (the default masks), nor are the temp directory, timings and pid the first command prints.
    for tape in tapes.iterdir():
        assert re.search(r"/tmp/tmp\.\w{10}\\ntook \d+ us", tape.read_text()), tape.name
    release = os.uname().release
    assert any(release in tape.read_text() for tape in tapes.glob("claude-code-*.jsonl"))  # the prompt names it
    other = "6.8.0-1017-azure" if release == "6.1.0-18-amd64" else "6.1.0-18-amd64"
    for tape in tapes.iterdir():
        tape.write_text(tape.read_text().replace(release, other))

    # No upstream at all (the stub is gone), and no key in the environment.
    replayed = batch(data, tmp_path / "replayed", "--model-cassette", "replay", str(tapes), workers=4)
    assert replayed.code == 0, replayed.stderr[-3000:]
    before, after = records(tmp_path / "recorded"), records(tmp_path / "replayed")
    for item, record in after.items():
        assert record["status"] == "ok" and record["model"]["upstream"] is None
        assert record["model"]["cassette"] == "replay" and record["model"]["totals"]["drift"] is None
        assert record["result"]["continued_steps"] == before[item]["result"]["continued_steps"]
        was, now = (json.loads((tmp_path / run / item / "output" / "next-action-comparison.json").read_text())
                    for run in ("recorded", "replayed"))  # fmt: skip
        assert now["replayed"] == was["replayed"]  # the same continued action
    assert sum(r["model"]["totals"]["calls"] for r in after.values()) == calls

    # The same batch over a workspace with one more file: the prefix's `ls` observes it, and the context sent
    # to the model differs from the recording at the message that carries that observation.
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "extra.txt").write_text("new\n")
    changed = manifest(tmp_path / "changed", 4, workspace=workspace, volatile=True)
    drifted = batch(changed, tmp_path / "drifted", "--model-cassette", "replay", str(tapes), workers=4)
    assert drifted.code == 1, drifted.stderr[-3000:]
    summary = json.loads(drifted.stdout)
    assert summary["categories"] == {"model_drift": 4}, summary
    for item, record in records(tmp_path / "drifted").items():
        drift = record["model"]["totals"]["drift"]
        first = json.loads((tapes / f"{item}.jsonl").read_text().splitlines()[drift["call"] - 1])["request"]
        conversation = first[drift["field"]]
        listing = LISTING[record["inputs"]["agent"]](record)
        expected = next(i for i, message in enumerate(conversation) if _answers(message, listing))
        assert drift["message"] == expected, (item, drift)
        assert "extra.txt" in drift["diff"]
        assert record["failure"]["category"] == "model_drift" and record["failure"]["retryable"] is False


def _call_id(record: dict, command: str) -> str:
    """The id of the recorded tool call that ran ``command`` (the listing), from the item's trajectory."""
    for line in Path(record["inputs"]["trajectory"]["path"]).read_text().splitlines():
        event = json.loads(line)
        payload = event.get("payload") or {}
        if payload.get("type") == "function_call" and json.loads(payload.get("arguments", "{}")).get("cmd") == command:
            return str(payload["call_id"])
        for part in (event.get("message") or {}).get("content") or []:
            if isinstance(part, dict) and part.get("type") == "tool_use" and part["input"].get("command") == command:
                return str(part["id"])
    raise AssertionError(f"no call ran {command!r}")


#: The listing each agent's trajectory runs, whose fresh observation changes with the workspace.
LISTING = {"claude-code": lambda record: _call_id(record, "ls -1"), "codex": lambda record: _call_id(record, "ls")}


def _answers(message: dict, call_id: str) -> bool:
    """Whether a conversation message is the observation of the call ``call_id``: a chat ``tool`` message, or a
    Responses ``function_call_output``."""
    return (message.get("role") == "tool" and message.get("tool_call_id") == call_id) or (
        message.get("type") == "function_call_output" and message.get("call_id") == call_id
    )
