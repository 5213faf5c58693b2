"""``--fork K`` decided on the host: the options it refuses (one line, exit 2, no engine asked), the runtimes and
agents that cannot fork, and the gate itself, run by a real shell (the engine's part is
tests/integration/test_fork.py)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from conftest import invoke_cli
from trajgen import claude_files_session, write_jsonl

NO_ENGINE = {"DOCKER_HOST": "unix:///nonexistent/pvisor-host-test.sock"}
MODEL = ("--model-base-url", "http://127.0.0.1:9/v1", "--model", "m", "--model-api-key-env", "PVH_FORK_KEY")


@pytest.fixture
def claude(tmp_path) -> Path:
    return write_jsonl(tmp_path / "claude.jsonl", claude_files_session())


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (("--mode", "replay-only", "--fork", "3"),
         "--fork with --mode replay-only: forks continue from the boundary; use --mode continue"),
        (("--fork", "3", *MODEL, "--model-network", "internal"),
         "--fork with --model-network internal: each fork reaches the model through a socket of its own; keep "
         "--model-network unix (the default)"),
        (("--fork", "2", *MODEL, "--model-cassette", "record", "tapes"),
         "--fork with --model-cassette record: K forks would record K tapes under one name; record with a plain "
         "replay, then fork with --model-cassette replay"),
        (("--fork-strict",), "--fork-strict without --fork"),
        (("--fork", "1"), "--fork: Input should be greater than or equal to 2"),
        (("--fork", "33"), "--fork: Input should be less than or equal to 32"),
    ],
)  # fmt: skip
def test_options_fork_refuses(tmp_path, claude, args, line):
    result = invoke_cli("replay", "--trajectory", claude, "--after-step", "1", "--out", tmp_path / "out", *args,
                        env={**NO_ENGINE, "PVH_FORK_KEY": "k"}, cwd=tmp_path)  # fmt: skip
    assert (result.code, result.error_lines) == (2, [f"pvisor-host: error: {line}"]), result.stderr
    assert not (tmp_path / "out").exists()


def test_fork_options_reach_the_spec(tmp_path, monkeypatch):
    import typer

    import pvisor_host.preflight.checks as checks
    from pvisor_host.cli.app import app

    seen = []
    monkeypatch.setattr(checks, "check_inputs", lambda spec, **_: (seen.append(spec), exit(0)))
    argv = ["replay", "--trajectory", "t", "--after-step", "1", "--agent", "codex", "--fork", "3", "--fork-strict"]
    with pytest.raises(SystemExit):
        typer.main.get_command(app).main(argv, standalone_mode=False)
    assert (seen[0].fork, seen[0].fork_strict) == (3, True)


def test_agents_whose_launch_the_gate_cannot_stand_in_front_of_are_refused():
    from pvisor_host.errors import UsageError
    from pvisor_host.models.profiles import get_profile
    from pvisor_host.models.replay import Runtime
    from pvisor_host.models.spec import ReplaySpec
    from pvisor_host.preflight.prepare import fork_checks

    able = Runtime(name="runsc-fork", path="/x/runsc", fork_problem=None)
    spec = ReplaySpec(trajectory=Path("t.json"), after_step=1, fork=2)
    forkable = {name for name in ("claude-code", "codex", "opencode", "mini-swe-agent", "openhands", "swe-agent",
                                  "pi-agent") if get_profile(name).fork_unsupported is None}  # fmt: skip
    assert forkable == {"claude-code", "codex", "opencode"}
    with pytest.raises(UsageError) as refused:
        fork_checks(spec, get_profile("mini-swe-agent"), able)
    assert str(refused.value) == (
        "--fork: mini-swe-agent cannot be forked at the boundary: pvisor finds its Python from its entrypoint's "
        "path, which the fork gate would stand in for"
    )
    fork_checks(spec, get_profile("codex"), able)  # refuses nothing
    fork_checks(spec.model_copy(update={"fork": None}), get_profile("openhands"), Runtime(name="runc"))
    with pytest.raises(UsageError) as refused:
        fork_checks(spec, get_profile("claude-code"), Runtime(name="runc"))
    assert str(refused.value) == (
        "--fork: runtime runc cannot fork a sandbox: only gVisor's runsc checkpoints a sandbox here (docs/fork.md)"
    )


@pytest.mark.parametrize(
    ("version", "info", "problem"),
    [
        (None, {}, "its runsc does not run on this host (the controller must run beside the engine)"),
        ("0.0~20221219.0", {"ExperimentalBuild": True},
         "gVisor 0.0~20221219.0 cannot save a sandbox at the boundary (its listening sockets): it needs gVisor "
         "20240729 or later (docs/fork.md)"),
        ("0.0~20240729.0", {"ExperimentalBuild": False},
         'the engine\'s experimental mode is off: Docker restores a checkpoint only with "experimental": true'),
        ("release-20250106.0", {"ExperimentalBuild": True, "DockerRootDir": "/nonexistent/docker"},
         "the engine's root directory is not on this host (the controller must run beside the engine)"),
        ("0.0~20240729.0", {"ExperimentalBuild": True, "DockerRootDir": "/"}, None),
    ],
)  # fmt: skip
def test_which_gvisor_can_fork_on_which_engine(version, info, problem):
    from pvisor_host.backend.docker.runtimes import fork_problem

    assert fork_problem(version, info) == problem


def test_a_cluster_refuses_to_fork():
    from pvisor_host.backend.cluster.backend import FORK_PROBLEM

    assert FORK_PROBLEM == "forks run on one engine, not on a cluster (the checkpoint is one engine's; docs/fork.md)"


def _gate(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The gate in front of a fake CLI that prints its arguments, its mount paths moved under ``tmp_path``."""
    from pvisor_host.backend.docker.sandbox.gate import gate_script

    real = tmp_path / "real cli"
    real.write_text('#!/bin/sh\necho "ran:$*"\n')
    real.chmod(0o755)
    run_dir, input_dir = tmp_path / "run", tmp_path / "input"
    run_dir.mkdir()
    input_dir.mkdir()
    script = (
        gate_script(str(real)).replace("/pvisor-host/run", str(run_dir)).replace("/pvisor-host/input", str(input_dir))
    )
    gate = tmp_path / "gate"
    gate.write_text(script)
    gate.chmod(0o755)
    return gate, run_dir, input_dir


def test_the_gate_lets_the_version_probe_through_and_holds_the_launch_until_the_go_ahead(tmp_path):
    gate, run_dir, input_dir = _gate(tmp_path)
    probe = subprocess.run([gate, "--version"], capture_output=True, text=True, timeout=10)
    assert (probe.returncode, probe.stdout, (run_dir / "fork.reached").exists()) == (0, "ran:--version\n", False)
    launch = subprocess.Popen([gate, "-p", "a b"], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(200):
            if (run_dir / "fork.reached").exists():
                break
            time.sleep(0.05)
        assert (run_dir / "fork.reached").exists() and launch.poll() is None  # at the boundary, waiting
        (input_dir / "fork.go").touch()
        out, _ = launch.communicate(timeout=10)
    finally:
        launch.kill()
    assert (launch.returncode, out) == (0, "ran:-p a b\n")  # the real CLI, with pvisor's arguments as they were
