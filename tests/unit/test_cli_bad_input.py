"""Bad input to `pvisor-host replay`: one clear line on stderr, a documented exit code, no traceback,
nothing created — all decided on the host before the engine is even asked (the CLI's own ``main`` in this
process, and in a real process where the process itself matters: no engine, ``--debug``, a usage error; the
real host pvisor does the trajectory and boundary checks)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import invoke_cli, run_cli
from trajgen import claude_files_session, codex_files_session, write_jsonl

# An address where no engine answers: proves these errors come before any engine call.
NO_ENGINE = {"DOCKER_HOST": "unix:///nonexistent/pvisor-host-test.sock"}


#: The options' own checks come first; tests of the later ones pass a mode that needs no model.
REPLAY_ONLY = ("--mode", "replay-only")


@pytest.fixture
def claude(tmp_path) -> Path:
    return write_jsonl(tmp_path / "claude.jsonl", claude_files_session())


def replay(tmp_path: Path, *args: str | Path, env: dict[str, str] | None = None, process: bool = False):
    """``replay --out <tmp>/out ARGS`` in this process (``process``: in a child of its own)."""
    out = tmp_path / "out"
    run = run_cli if process else invoke_cli
    result = run("replay", "--out", out, *args, env={**NO_ENGINE, **(env or {})}, cwd=tmp_path)
    return result, out


def assert_one_line(result, code: int, line: str) -> None:
    assert result.code == code, result.stderr
    assert "Traceback" not in result.stderr
    assert result.error_lines == [f"pvisor-host: error: {line}"], result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.write_bytes(b""), "is empty"),
        (lambda p: p.mkdir(), "is a directory (pass the native trajectory file itself)"),
        (
            lambda p: p.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(64)),
            "is binary (NUL byte at offset 7) (pass a native trajectory (JSON or JSONL text))",
        ),
        (lambda p: p.open("wb").truncate(257 * 2**20), "is 257 MiB; pvisor accepts at most 256 MiB"),
    ],
)
def test_unusable_trajectory_files(tmp_path, make, problem):
    path = tmp_path / "t.jsonl"
    make(path)
    result, out = replay(tmp_path, "--agent", "claude-code", "--trajectory", path, "--after-step", "1")
    assert_one_line(result, 2, f"trajectory {path}: {problem}")
    assert not out.exists()


def test_malformed_trajectory_is_reported_by_pvisor_with_its_line(tmp_path, claude):
    lines = claude.read_text().splitlines()
    lines[2] = lines[2][:40]
    claude.write_text("\n".join(lines) + "\n")
    result, out = replay(tmp_path, "--agent", "claude-code", "--trajectory", claude, "--after-step", "1", *REPLAY_ONLY)
    assert result.code == 2 and len(result.error_lines) == 1
    assert result.error_lines[0].startswith(
        "pvisor-host: error: pvisor rejected the replay (trajectory_error): invalid Claude native JSONL at line 3:"
    )
    assert not out.exists()


def test_wrong_agent_for_the_trajectory(tmp_path):
    codex = write_jsonl(tmp_path / "codex.jsonl", codex_files_session())
    result, _ = replay(tmp_path, "--agent", "claude-code", "--trajectory", codex, "--after-step", "1", *REPLAY_ONLY)
    assert_one_line(
        result,
        2,
        f"trajectory {codex}: looks like a codex trajectory, not claude-code (Claude Code session JSONL "
        "(~/.claude/projects/<project>/<session>.jsonl)) (pass --agent codex)",
    )


@pytest.mark.parametrize(
    ("after", "line"),
    [
        ("0", "--after-step: Input should be greater than or equal to 1"),
        ("-2", "--after-step: Input should be greater than or equal to 1"),
        (
            "6",
            "pvisor rejected the replay (trajectory_error): requested after-step 6, trajectory has 5 complete batches",
        ),
    ],
)
def test_after_step_out_of_range(tmp_path, claude, after, line):
    result, out = replay(
        tmp_path, "--agent", "claude-code", "--trajectory", claude, "--after-step", after, *REPLAY_ONLY
    )
    assert_one_line(result, 2, line)
    assert not out.exists()


@pytest.mark.parametrize(
    ("mode", "steps", "line"),
    [
        ("replay-only", "4", "--max-steps 4 is smaller than the selected replay prefix of 5 steps"),
        (
            "continue",
            "5",
            "--max-steps 5 leaves no live step after the selected replay prefix of 5 steps (use at least 6)",
        ),
    ],
)
def test_max_steps_below_the_prefix(tmp_path, claude, mode, steps, line):
    env = {"OPENAI_BASE_URL": "http://model", "OPENAI_API_KEY": "k", "MODEL_NAME": "m"}
    extra = ["--network", "bridge", "--env", "OPENAI_BASE_URL", "--env", "OPENAI_API_KEY", "--env", "MODEL_NAME"]
    result, _ = replay(
        tmp_path,
        "--agent",
        "claude-code",
        "--trajectory",
        claude,
        "--after-step",
        "5",
        "--mode",
        mode,
        "--max-steps",
        steps,
        *extra,
        env=env,
    )
    assert_one_line(result, 2, line)


def test_unknown_agent(tmp_path, claude):
    result, _ = replay(tmp_path, "--agent", "gemini", "--trajectory", claude, "--after-step", "1")
    assert_one_line(
        result,
        2,
        "unknown agent 'gemini' (known agents: claude-code, codex, mini-swe-agent, opencode, openhands, pi-agent, "
        "swe-agent)",
    )


def test_out_not_empty(tmp_path, claude):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    result, out = replay(tmp_path, "--agent", "claude-code", "--trajectory", claude, "--after-step", "1", *REPLAY_ONLY)
    assert_one_line(result, 2, f"--out {out} is not empty (pass a new directory; pvisor-host never overwrites a run)")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_a_refused_replay_makes_no_cassette_directory(tmp_path, claude):
    """``--model-cassette record DIR`` is checked (it could be made) but made only when a tape is written."""
    tapes = tmp_path / "tapes" / "new"
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    model = ("--model-base-url", "http://127.0.0.1:9/v1", "--model", "m", "--model-api-key-env", "PVH_TEST_KEY")
    result, out = replay(
        tmp_path, "--agent", "claude-code", "--trajectory", claude, "--after-step", "1", *model,
        "--model-cassette", "record", tapes, env={"PVH_TEST_KEY": "sk-test"},
    )  # fmt: skip
    assert_one_line(result, 2, f"--out {out} is not empty (pass a new directory; pvisor-host never overwrites a run)")
    assert not (tmp_path / "tapes").exists()


def test_out_is_a_file(tmp_path, claude):
    (tmp_path / "out").write_text("x")
    result, out = replay(tmp_path, "--agent", "claude-code", "--trajectory", claude, "--after-step", "1", *REPLAY_ONLY)
    assert_one_line(result, 2, f"--out {out} exists and is not a directory")


def test_out_not_writable(tmp_path, claude):
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() == 0 and shutil.which("chattr"):
        subprocess.run(["chattr", "+i", str(locked)], check=True)  # even root cannot create entries
    else:
        locked.chmod(0o555)
    try:
        out = locked / "run"
        result = run_cli(
            "replay",
            "--agent",
            "claude-code",
            "--trajectory",
            claude,
            "--after-step",
            "1",
            "--mode",
            "replay-only",
            "--out",
            out,
            env=NO_ENGINE,
        )
        assert result.code == 2 and len(result.error_lines) == 1, result.stderr
        assert result.error_lines[0].startswith(f"pvisor-host: error: --out {out} is not writable ({locked}: ")
        assert not out.exists()
    finally:
        if os.geteuid() == 0 and shutil.which("chattr"):
            subprocess.run(["chattr", "-i", str(locked)], check=True)


@pytest.mark.parametrize(
    ("flag", "value", "line"),
    [
        (
            "--timeout",
            "soon",
            "--timeout: 'soon' is not a duration (use a number of seconds or units like 90s, 5m, 1h30m)",
        ),
        (
            "--timeout",
            "-5m",
            "--timeout: '-5m' is not a duration (use a number of seconds or units like 90s, 5m, 1h30m)",
        ),
        ("--memory", "lots", "--memory: 'lots' is not a size (use bytes or units like 512m, 2g, 1GiB)"),
        ("--tmp-size", "0", "--tmp-size: '0' must be greater than zero"),
        ("--collect-limit", "1x", "--collect-limit: '1x' is not a size (use bytes or units like 512m, 2g, 1GiB)"),
    ],
)
def test_bad_duration_and_size_strings(tmp_path, claude, flag, value, line):
    result, _ = replay(tmp_path, "--agent", "claude-code", "--trajectory", claude, "--after-step", "1", flag, value)
    assert_one_line(result, 2, line)


def test_env_must_be_set_and_named_only(tmp_path, claude):
    result, _ = replay(
        tmp_path,
        "--agent",
        "claude-code",
        "--trajectory",
        claude,
        "--after-step",
        "1",
        "--mode",
        "replay-only",
        "--env",
        "PVISOR_HOST_TEST_UNSET",
    )
    assert_one_line(result, 2, "--env PVISOR_HOST_TEST_UNSET: PVISOR_HOST_TEST_UNSET is not set in this environment")
    result, _ = replay(
        tmp_path,
        "--agent",
        "claude-code",
        "--trajectory",
        claude,
        "--after-step",
        "1",
        "--env",
        "OPENAI_API_KEY=sk-secret",
    )
    assert_one_line(result, 2, "--env: OPENAI_API_KEY=...: pass only the name; the value is read from your environment")
    assert "sk-secret" not in result.stderr


GATEWAY_HINT = "(pass --model-base-url URL --model NAME --model-api-key-env VAR: a host-side gateway keeps the key)"


def test_continue_mode_needs_a_model(tmp_path, claude):
    base = ("--agent", "claude-code", "--trajectory", claude, "--after-step", "1")
    result, _ = replay(tmp_path, *base)
    assert_one_line(
        result, 2, f"--mode continue lets the agent call its model, which --network none cannot reach {GATEWAY_HINT}"
    )
    result, _ = replay(tmp_path, *base, "--network", "bridge")
    assert_one_line(
        result,
        2,
        "--mode continue: claude-code needs one of OPENAI_BASE_URL, OPENAI_API_BASE, LLM_BASE_URL passed with --env "
        + GATEWAY_HINT,
    )


MODEL = ("--model-base-url", "http://127.0.0.1:9/v1", "--model", "m", "--model-api-key-env", "PVH_TEST_KEY")


@pytest.mark.parametrize(
    ("extra", "env", "line"),
    [
        (MODEL[:4], {}, "a model gateway needs --model-base-url, --model and --model-api-key-env; missing "
                        "--model-api-key-env"),
        (("--model-base-url", "ftp://x", *MODEL[2:]), {}, "--model-base-url: 'ftp://x' is not an http(s) URL"),
        (("--model-api-key-env", "sk-123abc", *MODEL[:4]), {},
         "--model-api-key-env: not a variable name (pass the name of the variable that holds the key, not the key)"),
        (MODEL, {}, "--model-api-key-env PVH_TEST_KEY: PVH_TEST_KEY is not set or empty"),
        ((*MODEL, "--network", "bridge"), {"PVH_TEST_KEY": "k"},
         "--network bridge: with --model-network unix the sandbox reaches only the gateway (drop --network)"),
        ((*MODEL, "--env", "OPENAI_API_KEY"), {"PVH_TEST_KEY": "k", "OPENAI_API_KEY": "x"},
         "--env OPENAI_API_KEY: the model gateway sets OPENAI_API_KEY for claude-code; drop it"),
        ((*MODEL, "--model-network", "wifi"), {"PVH_TEST_KEY": "k"},
         "--model-network: Input should be 'unix', 'internal' or 'pass-through'"),
        ((*MODEL, "--attempts", "0"), {"PVH_TEST_KEY": "k"}, "--attempts: Input should be greater than or equal to 1"),
    ],
)  # fmt: skip
def test_bad_model_gateway_options(tmp_path, claude, extra, env, line):
    result, out = replay(
        tmp_path, "--agent", "claude-code", "--trajectory", claude, "--after-step", "1", *extra, env=env
    )
    assert_one_line(result, 2, line)
    assert not out.exists()
    assert "sk-123abc" not in result.stderr  # a key passed where its variable's name belongs is never echoed


def test_engine_unreachable_is_a_missing_prerequisite(tmp_path, claude):
    result, out = replay(
        tmp_path, "--agent", "claude-code", "--trajectory", claude, "--after-step", "1", "--mode", "replay-only",
        process=True,
    )  # fmt: skip
    assert result.code == 3
    assert len(result.error_lines) == 1 and "Traceback" not in result.stderr
    assert result.error_lines[0].startswith(
        "pvisor-host: error: no Docker engine answers at unix:///nonexistent/pvisor-host-test.sock:"
    )
    assert result.error_lines[0].endswith(
        "(start dockerd (`make engine` installs and starts one on Debian) or set DOCKER_HOST)"
    )
    assert not out.exists()


def test_debug_shows_the_traceback(tmp_path):
    result = run_cli(
        "--debug",
        "replay",
        "--agent",
        "claude-code",
        "--trajectory",
        tmp_path / "missing.jsonl",
        "--after-step",
        "1",
        env=NO_ENGINE,
    )
    assert result.code == 2
    assert "Traceback" in result.stderr and "UsageError" in result.stderr


def test_missing_required_option_is_a_usage_error(tmp_path):
    result = run_cli("replay", "--agent", "claude-code", env=NO_ENGINE)
    assert result.code == 2
    assert "missing option" in result.stderr and "--trajectory" in result.stderr


@pytest.mark.parametrize(
    ("value", "line"),
    [
        ("allow:", "--egress: '': the host is empty"),
        ("allow:pypi.org:99999", "--egress: 'pypi.org:99999': the port must be a number from 1 to 65535"),
        ("allow:https://pypi.org/simple",
         "--egress: 'https://pypi.org/simple' is a URL; give its host (and port): allow:HOST[:PORT]"),
    ],
)  # fmt: skip
def test_bad_egress_values_are_one_line_each_before_any_engine(tmp_path, claude, value, line):
    result, out = replay(tmp_path, "--agent", "claude-code", "--trajectory", claude, "--after-step", "1",
                         "--egress", value)  # fmt: skip
    assert_one_line(result, 2, line)
    assert not out.exists()


def test_egress_with_the_bridge_is_refused(tmp_path, claude):
    result, out = replay(tmp_path, "--agent", "claude-code", "--trajectory", claude, "--after-step", "1",
                         "--egress", "pypi", "--network", "bridge")  # fmt: skip
    assert result.code == 2 and len(result.error_lines) == 1, result.stderr
    assert "--egress with --network bridge: the bridge reaches every host" in result.error_lines[0]
    assert not out.exists()
