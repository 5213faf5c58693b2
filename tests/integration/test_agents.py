"""Every agent pvisor 0.3.1 replays: installable ones get a verified pinned image and replay for real;
the others are listed with a precise reason and refused by `build` without a build."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import run_cli
from trajgen import mini_files_session, openhands_files_session, pi_files_session, write_json, write_jsonl

pytestmark = pytest.mark.docker


def _record(out: Path) -> dict:
    return json.loads((out / "record.json").read_text())


# agent -> (pinned version, trajectory writer, tool calls in its 3-batch prefix, g.txt after the replay)
SDK_AGENTS = {
    "pi-agent": ("0.83.0", lambda p: write_jsonl(p / "pi.jsonl", pi_files_session()), 4, "bye from pi\n"),
    "mini-swe-agent": ("2.4.6", lambda p: write_json(p / "mini.json", mini_files_session()), 3, "bye from mini\n"),
    "openhands": ("0.53.0", lambda p: write_json(p / "oh.json", openhands_files_session()), 3, "bye from openhands\n"),
}


@pytest.mark.slow
@pytest.mark.parametrize("agent", sorted(SDK_AGENTS))
def test_sdk_agents_replay_for_real(tmp_path, agent_image, agent):
    version, make, calls, g_txt = SDK_AGENTS[agent]
    after, turns, files = 3, 3, {"f.txt": "hi\n", "g.txt": g_txt}
    image = agent_image(agent)
    trajectory = make(tmp_path)
    replayed = tmp_path / "replayed"
    result = run_cli(
        "replay",
        "--agent",
        agent,
        "--trajectory",
        trajectory,
        "--after-step",
        str(after),
        "--mode",
        "replay-only",
        "--out",
        replayed,
    )
    assert result.code == 0, result.stderr
    record = _record(replayed)
    res = record["result"]
    assert record["status"] == "ok"
    assert record["image"]["ref"] == image and record["image"]["agent_version"] == version
    assert res["agent"]["version"] == version and res["agent"]["launch_source"] == "explicit_entrypoint"
    assert (res["phase"], res["replayed_tool_calls"], res["prefix_model_turns"]) == ("replayed", calls, turns)
    for name, content in files.items():
        assert (replayed / "workspace" / name).read_text() == content
    assert record["workspace_changes"]["added"] == sorted(files)

    prepared = tmp_path / "prepared"
    result = run_cli(
        "replay",
        "--agent",
        agent,
        "--trajectory",
        trajectory,
        "--after-step",
        "1",
        "--mode",
        "prepare-only",
        "--out",
        prepared,
    )
    assert result.code == 0, result.stderr
    record = _record(prepared)
    assert (record["result"]["phase"], record["result"]["replayed_tool_calls"]) == ("prepared", 0)
    assert record["workspace_changes"]["added"] == []


@pytest.mark.parametrize(
    ("agent", "reason"),
    [
        ("opencode", "OpenCode 1.17.7 is not on the npm registry"),
        ("swe-agent", "SWE-agent 1.1.0 is not on PyPI"),
    ],
)
def test_unavailable_agents_are_refused_with_the_reason(agent, reason, containers_created):
    started = time.time()
    result = run_cli("build", "--agent", agent)
    assert result.code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1
    assert lines[0].startswith(f"pvisor-host: error: cannot build {agent} ")
    assert reason in lines[0]
    assert containers_created(started) == []


def test_agents_lists_every_agent(claude_image, codex_image):
    result = run_cli("agents", "--json")
    assert result.code == 0, result.stderr
    agents = {a["agent"]: a for a in json.loads(result.stdout)}
    assert {name: a["version"] for name, a in agents.items()} == {
        "claude-code": "2.1.220",
        "codex": "0.149.0",
        "mini-swe-agent": "2.4.6",
        "openhands": "0.53.0",
        "opencode": "1.17.7",
        "pi-agent": "0.83.0",
        "swe-agent": "1.1.0",
    }
    assert agents["claude-code"]["image"] == claude_image
    assert agents["codex"]["image"] == codex_image
    assert agents["claude-code"]["continuation_api"] == "chat-completions"
    assert agents["codex"]["continuation_api"] == "responses"
    assert (
        not agents["opencode"]["installable"] and "github.com/sst/opencode" in agents["opencode"]["unavailable_reason"]
    )
    assert agents["codex"]["injectable"] and not agents["mini-swe-agent"]["injectable"]
    table = run_cli("agents")
    assert table.code == 0
    assert "opencode: OpenCode 1.17.7 is not on the npm registry" in table.stdout
