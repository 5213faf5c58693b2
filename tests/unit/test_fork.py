"""``--fork K`` decided on the host: the options it refuses (one line, exit 2, no engine asked), the runtimes and
agents that cannot fork, and the gate itself, run by a real shell (the engine's part is
tests/integration/test_fork.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import threading
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
         "the engine's directories are not on this host (the controller must run beside the engine)"),
        ("0.0~20240729.0", {"ExperimentalBuild": True, "DockerRootDir": "/"}, None),
    ],
)  # fmt: skip
def test_which_gvisor_can_fork_on_which_engine(version, info, problem, monkeypatch, tmp_path):
    from pvisor_host.backend.docker import runtimes

    monkeypatch.setattr(runtimes, "RUNTIME_ROOT", str(tmp_path))  # the engine's shim state, here or not
    assert runtimes.fork_problem(version, info) == problem


def test_a_cluster_refuses_to_fork():
    from pvisor_host.backend.cluster.backend import ClusterBackend
    from pvisor_host.errors import UsageError

    with pytest.raises(UsageError) as refused:
        ClusterBackend.run_forks(object(), None)  # type: ignore[arg-type]
    assert str(refused.value) == (
        "--fork: forks run on one engine, not on a cluster (the checkpoint is one engine's; docs/fork.md)"
    )


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


# -- the orchestration, with the engine's parts faked: what each path decides, and what it leaves -------------------


class _Box:
    """A container as the fork code sees it."""

    id = "c0ffee"
    short_id = "c0ffee"
    attrs = {"State": {"StartedAt": ""}}

    def reload(self) -> None:
        pass


@pytest.fixture
def forking(tmp_path, monkeypatch):
    """``go(start_fails=..., checkpoint_fails=..., ends_early=..., strict=...)``: :func:`run_forks` of a prepared
    ``--fork 3`` replay on the fake backend, the engine's steps faked; its records, and the ways each run was
    asked for."""
    from pvisor_host.backend.docker import checkpoint as ck
    from pvisor_host.backend.docker.sandbox import fork
    from pvisor_host.backend.docker.sandbox.stage import Staging
    from pvisor_host.errors import InfrastructureError
    from pvisor_host.models.record import ForkInfo
    from pvisor_host.models.spec import ReplaySpec
    from pvisor_host.preflight.checks import check_inputs
    from pvisor_host.preflight.prepare import prepare

    from fakebackend import FakeBackend

    trajectory = write_jsonl(tmp_path / "t.jsonl", claude_files_session("/workspace"))
    monkeypatch.setenv("PVH_FORK_KEY", "k")
    spec = ReplaySpec(trajectory=trajectory, after_step=2, agent="claude-code", model_base_url="http://127.0.0.1:9/v1",
                      model="m", model_api_key_env="PVH_FORK_KEY")  # fmt: skip
    plain = prepare(check_inputs(spec, host_pvisor=False, run_id="r", out_dir=tmp_path / "out"), FakeBackend())
    backend = FakeBackend()

    def go(*, start_fails=(), checkpoint_fails=False, ends_early=False, strict=False, copy_fails=()):
        prepared = plain.model_copy(update={"spec": plain.spec.model_copy(update={"fork": 3, "fork_strict": strict})})
        asked: list = []
        copy = fork.copy_staging

        def copying(staging, root):
            if any(f"fork-{k}" in str(root) for k in copy_fails):
                raise InfrastructureError("cp -a workspace: Permission denied")
            return copy(staging, root)

        monkeypatch.setattr(fork, "copy_staging", copying)
        monkeypatch.setattr(ck, "give", lambda box, image, root: None)

        def checkpoint(runtime, box, image):
            if checkpoint_fails:
                raise ck.CheckpointFailed("gVisor could not checkpoint the sandbox: endpoint still has waiters")
            image.mkdir()
            return 0.1, 1000

        monkeypatch.setattr(ck, "checkpoint", checkpoint)

        def run(prepared, attempt, *, gateway, cancel, way):
            asked.append(way)
            way.attempt = attempt  # what the fork was run as (for the tests)
            record = backend.run_attempt(prepared, attempt)
            attempt.run_dir.mkdir(parents=True, exist_ok=True)
            info: ForkInfo | None = way.fork
            if way.boundary is not None and not ends_early:
                root = Path(tempfile.mkdtemp(dir=tmp_path))
                dirs = {name: root / name for name in ("input", "workspace", "run", "logs")}
                for path in dirs.values():
                    path.mkdir(parents=True)
                (dirs["input"] / "env.sh").write_text("OPENAI_API_KEY=secret\n")
                staging = Staging(root=root, input_dir=dirs["input"], workspace_dir=dirs["workspace"],
                                  run_dir=dirs["run"], logs_dir=dirs["logs"], trajectory_in_sandbox="/t",
                                  workspace_before=[])  # fmt: skip
                spec = type("Spec", (), {"command": ["pvisor", "replay"]})()
                try:
                    info = way.boundary(_Box(), staging, spec, "tok", 1.0)
                except ck.CheckpointFailed as exc:
                    info = info.model_copy(update={"reached": True, "checkpoint_error": exc.one_line()})
                    record = record.model_copy(update={"status": "infra_error"})
            elif way.before_start is not None and way.start is None:  # refused before it starts
                try:
                    way.before_start(_Box())
                except ck.CheckpointFailed as exc:
                    from pvisor_host.models.record import Failure

                    failure = Failure(category="infra_error", message=exc.one_line())
                    record = record.model_copy(update={"status": "infra_error", "failure": failure})
            elif way.start is not None:
                staged = way.staged(tmp_path)
                assert not (staged.input_dir / "env.sh").exists()  # its values are in the restored processes
                try:
                    way.before_start(_Box())
                    if info.index in start_fails:
                        raise ck.CheckpointFailed("failed to upload checkpoint to containerd")
                    seconds = way.start(_Box())
                    info = info.model_copy(update={"restore_seconds": seconds, "restored": True})
                    assert (staged.input_dir / "fork.go").exists()  # given its go-ahead once started
                except ck.CheckpointFailed as exc:
                    from pvisor_host.models.record import Failure

                    failure = Failure(category="infra_error", message=exc.one_line())
                    record = record.model_copy(update={"status": "infra_error", "failure": failure})
            return record.model_copy(update={"fork": info})

        monkeypatch.setattr(fork.sandbox, "start", lambda box, timeout, *, checkpoint: None)
        client = type("Client", (), {"info": lambda self: {"DockerRootDir": str(tmp_path)}})()
        records = fork.run_forks(client, backend.ownership, prepared, gateway=None, cancel=threading.Event(),
                                 kill=lambda run_id: None, run=run)  # fmt: skip
        assert not (prepared.out_dir / ".pvisor-host-fork").exists()  # the checkpoint and the copies, gone
        return records, asked

    go.out = plain.out_dir  # type: ignore[attr-defined]
    go.prepared = plain  # type: ignore[attr-defined]
    return go


def test_k_forks_start_from_the_checkpoint_each_under_its_own_run_id(forking):
    records, asked = forking()
    assert [(r.run_id, r.fork.role, r.fork.index, r.fork.restored) for r in records] == [
        ("r", "prefix", None, None), ("r-f1", "fork", 1, True), ("r-f2", "fork", 2, True), ("r-f3", "fork", 3, True),
    ]  # fmt: skip
    assert records[0].fork.reached and records[0].fork.checkpoint_bytes == 1000
    assert [w.token for w in asked[1:]] == ["tok"] * 3  # the prefix's, which each restored pvisor holds
    assert [w.attempt.pvisor_id for w in asked[1:]] == ["r"] * 3  # pvisor in each is still the prefix's run


def test_a_fork_that_cannot_start_runs_once_as_a_full_replay_unless_strict(forking):
    records, asked = forking(start_fails={2})
    second = records[2].fork
    assert (second.restored, second.fallback) == (False, "failed to upload checkpoint to containerd")
    plain = [w for w in asked if w.start is None and w.boundary is None]  # a plain replay's way
    assert records[2].status == "ok" and [(w.fork.index, w.fork.restored) for w in plain] == [(2, False)]
    assert len(asked) == 5  # the prefix, three restores, one full replay
    records, asked = forking(start_fails={2}, strict=True)
    assert (records[2].status, records[2].fork.restored, len(asked)) == ("infra_error", False, 4)
    assert [r.status for r in records if r.fork.index != 2] == ["ok", "ok", "ok"]


def test_a_failed_checkpoint_makes_every_fork_a_full_replay_unless_strict(forking):
    records, asked = forking(checkpoint_fails=True)
    assert records[0].fork.checkpoint_error.startswith("gVisor could not checkpoint the sandbox")
    assert [(r.fork.restored, r.status) for r in records[1:]] == [(False, "ok")] * 3
    assert all(w.start is None for w in asked[1:])
    records, _ = forking(checkpoint_fails=True, strict=True)
    assert [(r.fork.role, r.status, r.fork.alone) for r in records] == [("prefix", "infra_error", True)]


def test_a_prefix_that_ends_before_the_boundary_is_the_only_record(forking):
    from pvisor_host.models.record import fork_outcomes

    records, asked = forking(ends_early=True)
    assert [(r.fork.role, r.fork.reached, r.fork.alone) for r in records] == [("prefix", False, True)]
    assert json.loads((forking.out / "prefix" / "record.json").read_text())["fork"]["alone"] is True  # as saved
    assert fork_outcomes(records, 3) == [records[0]] * 3  # each fork's row is the prefix's


def test_a_fork_whose_copy_fails_runs_as_a_full_replay_or_fails_alone_with_strict(forking):
    records, asked = forking(copy_fails={3})
    assert (records[3].fork.restored, records[3].status) == (False, "ok")
    assert records[3].fork.fallback == "could not copy the sandbox at the boundary: cp -a workspace: Permission denied"
    records, asked = forking(copy_fails={3}, strict=True)
    assert [(r.fork.index, r.status, r.fork.restored) for r in records] == [
        (None, "ok", None), (1, "ok", True), (2, "ok", True), (3, "infra_error", False),
    ]  # fmt: skip
    assert records[3].failure.message == records[3].fork.fallback  # the copy's error, in its own record


def test_a_rerun_reads_a_forked_items_rows_from_its_records(forking, tmp_path, monkeypatch):
    """Resume: a prefix that stood alone is every fork's row; a forked prefix needs every fork's record."""
    from pvisor_host.fanout import resume
    from pvisor_host.fanout.manifest import BatchItem
    from pvisor_host.models.record import BatchInfo, save_record

    monkeypatch.setattr(resume, "content_key", lambda *_: "K")
    spec = forking.prepared.spec.model_copy(update={"fork": 3})
    item = BatchItem(id="a", line=1, spec=spec)
    out = tmp_path / "batch"

    def earlier(records):
        for record in records:
            keyed = record.model_copy(update={"batch": BatchInfo(item_id="a", line=1, content_key="K")})
            (out / "a" / record.fork.dir_name).mkdir(parents=True, exist_ok=True)
            save_record(keyed, out / "a" / record.fork.dir_name)
        return resume.finished_earlier(item, forking.prepared.trajectory, ("img", None), None, out=out,
                                       rerun_failed=False)[1]  # fmt: skip

    alone, _ = forking(ends_early=True)
    assert [(r.fork.role, r.run_id) for r in earlier(alone)] == [("prefix", "r")] * 3
    shutil.rmtree(out)
    forked, _ = forking()
    assert earlier(forked[:3]) is None  # fork 3 has no record: the item runs again
    assert [r.fork.index for r in earlier(forked[3:])] == [1, 2, 3]
