"""One pre-flight per trajectory, for all its boundaries, against the real host pvisor (no engine): the count
agrees with pvisor's own, a valid file costs one pvisor run (OpenHands two), a refused batch is located and
every boundary from it up is refused with pvisor's own reason, and a mini-swe-agent config without its agent
templates is filled from the agent's defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from pvisor_host.backend.docker.sandbox.native import fill_config
from pvisor_host.preflight.hostpvisor import probe
from pvisor_host.preflight.inspect import inspect_trajectory
from pvisor_host.preflight.survey import PAST_THE_END, Survey, _survey, prefix_model_turns
from pvisor_host.preflight.trajectory import read_trajectory

from trajgen import (
    Call,
    Turn,
    claude_session,
    codex_rollout,
    mini_trajectory,
    openhands_events,
    pi_session,
    write_json,
    write_jsonl,
)

FIXTURES = Path(__file__).parent.parent / "data" / "trajectories"


def bash(n: int) -> Turn:
    return Turn([Call("Bash", {"command": f"echo {n}"}, f"{n}\n")])


def run(n: int) -> Turn:
    return Turn([Call("run", {"command": f"echo {n}"}, f"{n}\n")])


def fresh(agent: str, path: Path) -> Survey:
    """A survey made now (not the process's cached one), with its pvisor runs counted."""
    return _survey(agent, read_trajectory(path))


def pvisor_count(agent: str, path: Path) -> int | None:
    return probe(agent, path, PAST_THE_END).complete


@pytest.mark.parametrize(
    ("agent", "make", "runs"),
    [
        ("claude-code", lambda p: write_jsonl(p, claude_session("t", [bash(1), bash(2), bash(3)])), 1),
        ("claude-code", lambda p: (FIXTURES / "claude-split-parallel-stop-reason-set.jsonl").read_bytes(), 1),
        ("claude-code", lambda p: (FIXTURES / "claude-5batch-relative-paths.jsonl").read_bytes(), 1),
        ("codex", lambda p: write_jsonl(p, codex_rollout("t", [bash(1), bash(2)])), 1),
        ("codex", lambda p: (FIXTURES / "codex-parallel-calls.jsonl").read_bytes(), 1),
        ("pi-agent", lambda p: write_jsonl(p, pi_session("t", [Turn([Call("bash", {"command": "ls"}, "x")])])), 1),
        ("mini-swe-agent", lambda p: write_json(p, mini_trajectory("t", [bash(1), bash(2)])), 1),
        ("openhands", lambda p: write_json(p, openhands_events("t", [run(1), run(2)])), 2),
        ("opencode", lambda p: (FIXTURES / "opencode-contract-shape.jsonl").read_bytes(), 1),
    ],
)
def test_a_valid_file_is_counted_as_pvisor_counts_it_in_one_run(tmp_path, agent, make, runs):
    path = tmp_path / "t.json"
    made = make(path)
    if isinstance(made, bytes):
        path.write_bytes(made)
    found = fresh(agent, path)
    assert found.complete == pvisor_count(agent, path)
    assert found.accepted == (1, found.complete)
    assert found.pvisor_runs == runs
    bound = read_trajectory(path).bounds.get(agent)
    assert bound is not None and bound >= found.complete  # the first run's boundary can only be too high


def test_a_refused_batch_refuses_every_boundary_from_it_with_pvisors_reason(tmp_path):
    """Claude Code: an unsupported tool in batch 3 of 5. Boundaries 1-2 are accepted, 3-5 refused with the reason
    pvisor gives at each of them, 6 is past the end."""
    web = Turn([Call("WebFetch", {"url": "https://example.com", "prompt": "read"}, "page")])
    path = write_jsonl(tmp_path / "t.jsonl", claude_session("t", [bash(1), bash(2), web, bash(4), bash(5)]))
    found = fresh("claude-code", path)
    assert (found.complete, found.refused_from, found.accepted) == (5, 3, (1, 2))
    for step in range(1, 7):
        expected = probe("claude-code", path, step).failure
        assert found.verdict(step) == expected, step
    assert found.verdict(3) is not None and "WebFetch(toolu_03a)" in found.verdict(3).message  # type: ignore[union-attr]
    assert found.pvisor_runs <= 1 + 1 + 3 + 1  # the bound, boundary 1, a bisection of 5, the count


def test_a_mini_submission_inside_the_prefix_is_located(tmp_path):
    submit = Turn([Call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}, "")])
    path = write_json(tmp_path / "m.json", mini_trajectory("t", [bash(1), bash(2), submit, bash(4)]))
    found = fresh("mini-swe-agent", path)
    assert found.refused_from == 3 and found.accepted == (1, 2)
    for step in (1, 2, 3, 4):
        assert found.verdict(step) == probe("mini-swe-agent", path, step).failure, step
    assert found.count == 3  # `all`: the accepted boundaries and the first refused one


def test_openhands_refuses_the_boundaries_before_its_user_message(tmp_path):
    events = openhands_events("t", [run(1), run(2), run(3)])
    user, first_action, first_observation = events[:3]
    first_action["id"], first_observation["id"], first_observation["cause"], user["id"] = 0, 1, 0, 2
    events = [first_action, first_observation, user, *events[3:]]  # the user's message after batch 1
    path = write_json(tmp_path / "o.json", events)  # type: ignore[arg-type]
    found = fresh("openhands", path)
    for step in (1, 2, 3, 4):
        assert found.verdict(step) == probe("openhands", path, step).failure, step
    assert found.accepted == (2, 3)


def test_a_file_pvisor_refuses_outright_is_refused_at_every_boundary(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", claude_session("t", [bash(1), bash(2)], version="2.1.219"))
    found = fresh("claude-code", path)
    assert (found.refused_from, found.accepted, found.count) == (1, None, None)
    assert found.failure is not None and "2.1.220" in found.failure.message


def test_codex_budgets_count_text_only_turns_as_pvisor_does(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", codex_rollout("t", [bash(1), Turn(text="thinking"), bash(2), bash(3)]))
    for step in (1, 2, 3):
        assert prefix_model_turns("codex", read_trajectory(path), step) == probe("codex", path, step).prefix_model_turns


def test_inspect_lists_each_batchs_tools_and_the_recorded_cwd(tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        claude_session("t", [bash(1), Turn([Call("Read", {"file_path": "/testbed/a"}, "a"), Call("Grep", {})])],
                       cwd="/testbed"),
    )  # fmt: skip
    report = inspect_trajectory(path)
    assert report.model_dump(include={"agent", "recorded_version", "boundaries", "batches", "cwd", "accepted"}) == {
        "agent": "claude-code",
        "recorded_version": "2.1.220",
        "boundaries": 2,
        "batches": [["Bash"], ["Read", "Grep"]],
        "cwd": "/testbed",
        "accepted": (1, 2),
    }
    assert report.ok
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{}\n")
    assert inspect_trajectory(broken).problem is not None


def test_a_mini_config_without_its_agent_templates_is_filled_with_the_agents_defaults():
    document: dict[str, object] = {"info": {"config": {"model": {}, "agent": {"step_limit": 5}}}, "messages": []}
    defaults = {
        "mini.yaml": {"agent": {"system_template": "sys", "instance_template": "inst", "mode": "confirm"}},
        "mini_textbased.yaml": {"agent": {"system_template": "sys-text", "instance_template": "inst-text"}},
    }
    assert fill_config(document, defaults) == [
        "info.config.environment",
        "info.config.agent.system_template",
        "info.config.agent.instance_template",
    ]
    assert document["info"]["config"]["agent"] == {
        "step_limit": 5,
        "system_template": "sys",
        "instance_template": "inst",
    }
    textbased = {"info": {"config": {"model_type": "x.LitellmTextbasedModel", "agent": {"system_template": "mine"}}}}
    assert fill_config(textbased, defaults) == [
        "info.config.model",
        "info.config.environment",
        "info.config.agent.instance_template",
    ]
    assert textbased["info"]["config"]["agent"] == {"system_template": "mine", "instance_template": "inst-text"}
    assert fill_config(textbased, defaults) == []  # nothing left to fill: the copy stays the file


def test_a_pvisor_killed_or_failing_on_the_host_is_no_verdict_on_the_file(tmp_path, monkeypatch):
    import subprocess

    import pvisor_host.preflight.hostpvisor as hostpvisor
    from pvisor_host.errors import InfrastructureError

    path = write_jsonl(tmp_path / "t.jsonl", claude_session("t", [bash(1)]))
    killed = subprocess.CompletedProcess(args=[], returncode=-9, stdout=b"", stderr=b"")
    monkeypatch.setattr(hostpvisor, "_prepare_only", lambda *args: killed)
    with pytest.raises(InfrastructureError, match="killed by signal 9"):
        probe("claude-code", path, 1)
    spaceless = subprocess.CompletedProcess(args=[], returncode=1, stdout=b"", stderr=b"No space left on device\n")
    monkeypatch.setattr(hostpvisor, "_prepare_only", lambda *args: spaceless)
    with pytest.raises(InfrastructureError, match="No space left on device"):
        _survey("claude-code", read_trajectory(path))


def test_the_single_boundary_pre_flight_asks_pvisor_with_the_sandboxs_own_flags(tmp_path, monkeypatch):
    """``prepare_only`` runs the host's pvisor with the sandbox's own command line (one
    :meth:`PvisorRequest.argv`), but for its paths, ``--prepare-only`` and the agent's runtime; the real pvisor
    takes every flag at that boundary."""
    from pvisor_host.models.record import PvisorRequest
    from pvisor_host.preflight import hostpvisor

    trajectory = write_jsonl(tmp_path / "s.jsonl", claude_session("Go.", [bash(n) for n in range(3)]))
    request = PvisorRequest(agent="claude-code", after_step=2, mode="continue", max_steps=9, session_id="s-1",
                            boundary_user_prompt="hello", disable_thinking=True,
                            allow_stale_observations=True)  # fmt: skip
    asked: list[list[str]] = []
    real = hostpvisor._run

    def seen(command: list[str], **kwargs: object) -> object:
        asked.append(command)
        return real(command, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(hostpvisor, "_run", seen)
    result, plan = hostpvisor.prepare_only(request, trajectory, "run-1")
    (command,) = asked
    scratch = command[command.index("--workspace") + 1].removesuffix("/workspace")
    assert command[1:] == [
        "replay", "--agent", "claude-code", "--trajectory", str(trajectory), "--after-step", "2", "--prepare-only",
        "--workspace", f"{scratch}/workspace", "--state-dir", f"{scratch}/state", "--output-dir", f"{scratch}/output",
        "--run-id", "run-1", "--max-steps", "9", "--session-id", "s-1", "--boundary-user-prompt", "hello",
        "--disable-thinking", "--allow-stale-observations",
    ]  # fmt: skip
    sandbox = request.argv(trajectory=str(trajectory), workspace=f"{scratch}/workspace", state_dir=f"{scratch}/state",
                           output_dir=f"{scratch}/output", run_id="run-1",
                           agent_flags=["--agent-entrypoint", "claude"])  # fmt: skip
    assert [a for a in sandbox if a not in ("--agent-entrypoint", "claude")] == [
        a for a in command[1:] if a != "--prepare-only"
    ]  # the sandbox's command is the same list, in continue mode with its agent
    assert (plan.after_step, plan.prefix_model_turns, plan.tool_calls) == (2, 2, 2)
    assert result.metadata is not None and result.metadata["boundary_user_prompt"]["requested"] is True
