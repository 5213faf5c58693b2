import pytest

from pvisor_host.errors import UsageError
from pvisor_host.models.spec import build_spec, check_workspace_path


def spec(**overrides):
    fields = {"trajectory": "t.jsonl", "agent": "claude-code", "after_step": 1} | overrides
    return build_spec(**fields)


def test_defaults_are_hardened():
    s = spec()
    assert (s.network, s.writable_rootfs, s.allow_privilege_escalation, s.cap_add) == ("none", False, False, [])
    assert s.mode == "continue" and s.memory == 4 * 2**30 and s.timeout == 7200.0


def test_strings_become_sizes_and_durations():
    s = spec(memory="512m", timeout="90s", tmp_size="64m", collect_limit="1g")
    assert (s.memory, s.timeout, s.tmp_size, s.collect_limit) == (512 * 2**20, 90.0, 64 * 2**20, 2**30)


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        ({"after_step": 0}, "--after-step: Input should be greater than or equal to 1"),
        ({"after_step": -3}, "--after-step: Input should be greater than or equal to 1"),
        ({"max_steps": 0}, "--max-steps: Input should be greater than or equal to 1"),
        ({"mode": "fast"}, "--mode: Input should be 'continue', 'replay-only' or 'prepare-only'"),
        ({"network": "host"}, "--network: Input should be 'none' or 'bridge'"),
        ({"run_id": "../evil"}, "--run-id: may contain only letters, digits, '-' and '_' (at most 100)"),
        (
            {"env": ["OPENAI_API_KEY=sk-123"]},
            "--env: OPENAI_API_KEY=...: pass only the name; the value is read from your environment",
        ),
        ({"env": ["1BAD"]}, "--env: '1BAD' is not a variable name"),
        ({"user": "bob"}, "--user: must be UID, UID:GID or root"),
        ({"workspace_path": "relative/x"}, "--workspace-path: 'relative/x' must be an absolute path"),
        (
            {"workspace_path": "/usr"},
            "--workspace-path: '/usr' would cover a system directory of the sandbox; choose e.g. /workspace",
        ),
        ({"workspace_path": "/app/../etc"}, "--workspace-path: '/app/../etc' must be a normalised path (try '/etc')"),
        ({"boundary_user_prompt": "   "}, "--boundary-user-prompt: must contain a non-whitespace character"),
        ({"memory": "lots"}, "--memory: 'lots' is not a size (use bytes or units like 512m, 2g, 1GiB)"),
        (
            {"timeout": "soon"},
            "--timeout: 'soon' is not a duration (use a number of seconds or units like 90s, 5m, 1h30m)",
        ),
        ({"inject": True}, "--inject needs --image (the task image to inject the agent's runtime into)"),
    ],
)
def test_bad_options_give_one_line_naming_the_flag(overrides, line):
    with pytest.raises(UsageError) as caught:
        spec(**overrides)
    assert caught.value.one_line() == line


def test_manifest_style_unknown_field_is_named():
    with pytest.raises(UsageError, match="--afterstep: is not a known option"):
        build_spec(trajectory="t", agent="codex", after_step=1, afterstep=2)


def test_workspace_paths():
    assert check_workspace_path("/app") == "/app"
    assert check_workspace_path("/srv/task/") == "/srv/task"
    assert check_workspace_path("/home/dev/project") == "/home/dev/project"
    for bad in ("/", "/proc/x", "/pvisor-host/run", "/tmp"):
        with pytest.raises(ValueError, match="system directory"):
            check_workspace_path(bad)


def test_pvisors_request_is_the_specs_and_its_flags_are_those_set():
    from pvisor_host.models.record import Inputs, PvisorRequest

    plain = PvisorRequest.of(spec(mode="replay-only"), "claude-code")
    assert (plain.agent, plain.after_step, plain.mode, plain.options()) == ("claude-code", 1, "replay-only", [])
    every = PvisorRequest.of(
        spec(agent=None, max_steps=9, session_id="s-1", boundary_user_prompt="go on", disable_thinking=True,
             allow_stale_observations=True),
        "codex",
    )  # fmt: skip
    assert every.agent == "codex"
    assert every.options() == [
        "--max-steps", "9", "--session-id", "s-1", "--boundary-user-prompt", "go on", "--disable-thinking",
        "--allow-stale-observations",
    ]  # fmt: skip
    assert set(PvisorRequest.model_fields) < set(Inputs.model_fields)  # the record lists the request as run


@pytest.mark.parametrize(
    ("mode", "inject", "agent_flags"),
    [
        ("continue", False, ["--agent-entrypoint", "/usr/bin/agent"]),
        ("replay-only", True, ["--agent-runtime", "/pvisor-host/runtime/agent"]),
        ("prepare-only", False, []),
    ],
)
def test_the_sandboxs_pvisor_command_is_the_requests_argv(tmp_path, monkeypatch, mode, inject, agent_flags):
    """The sandbox runs the request's :meth:`argv` behind its entry shim, with where its agent is (not in
    prepare-only, which starts none): the list the host's pre-flight runs too."""
    from pvisor_host.backend.docker.sandbox.launch import pvisor_command
    from pvisor_host.models.profiles import get_profile
    from pvisor_host.models.record import PvisorRequest
    from pvisor_host.models.replay import Attempt
    from pvisor_host.models.spec import ReplaySpec
    from pvisor_host.preflight.checks import check_inputs
    from pvisor_host.preflight.prepare import prepare

    from fakebackend import FakeBackend
    from trajgen import claude_files_session, write_jsonl

    trajectory = write_jsonl(tmp_path / "t.jsonl", claude_files_session("/workspace"))
    endpoint = [group[0] for group in get_profile("claude-code").continuation.env]
    for name in endpoint:  # a continuation without the gateway brings its own endpoint
        monkeypatch.setenv(name, "x")
    spec = ReplaySpec(trajectory=trajectory, after_step=2, agent="claude-code", mode=mode, max_steps=9,
                      network="bridge", env=endpoint)  # fmt: skip
    prepared = prepare(check_inputs(spec, host_pvisor=False, run_id="r", out_dir=tmp_path / "out"), FakeBackend())
    if inject:
        prepared = prepared.model_copy(update={"image": prepared.image.model_copy(update={"runtime_volume": "v"})})
    command = pvisor_command(prepared, Attempt(run_id="r-1", run_dir=tmp_path / "a"), "/pvisor-host/input/t.jsonl")
    argv = PvisorRequest.of(spec, "claude-code").argv(
        trajectory="/pvisor-host/input/t.jsonl", workspace="/workspace", state_dir="/pvisor-host/run/state",
        output_dir="/pvisor-host/run/output", run_id="r-1",
    )  # fmt: skip
    assert command[:3] == ["/bin/sh", "/pvisor-host/input/entry.sh", "/opt/pvisor/bin/pvisor"]
    at = argv.index("--max-steps")
    assert command[3:] == [*argv[:at], *agent_flags, *argv[at:]]
    assert ("--prepare-only" in command, "--replay-only" in command) == (mode == "prepare-only", mode == "replay-only")
    if mode == "continue":  # the whole line, as pvisor gets it
        assert command[3:] == [
            "replay", "--agent", "claude-code", "--trajectory", "/pvisor-host/input/t.jsonl", "--after-step", "2",
            "--workspace", "/workspace", "--state-dir", "/pvisor-host/run/state", "--output-dir",
            "/pvisor-host/run/output", "--run-id", "r-1", "--agent-entrypoint", "/usr/bin/agent", "--max-steps", "9",
        ]  # fmt: skip
