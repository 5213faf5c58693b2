"""`pvisor-host replay` end to end: the real CLI, the real engine, the real images with the pinned
pvisor and agent CLIs, real trajectories. Each test checks the record and the files, not just exit 0."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pvisor_host.backend.docker.runtimes import runc_version

from conftest import run_cli, start_cli, wait_for_running
from trajgen import Call, Turn, claude_files_session, claude_session, codex_files_session, write_jsonl

pytestmark = pytest.mark.docker

REPLAY_ONLY = ("replay", "--agent", "claude-code", "--after-step", "1", "--mode", "replay-only")


def tree_digest(root: Path) -> dict[str, str]:
    """Path -> sha256 (or link target / 'dir') of everything under ``root``."""
    digest = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            digest[key] = "-> " + str(path.readlink())
        elif path.is_dir():
            digest[key] = "dir"
        else:
            digest[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record_of(out: Path) -> dict:
    return json.loads((out / "record.json").read_text())


def artifact_paths(record: dict) -> set[str]:
    return {a["path"] for a in record["artifacts"]}


@pytest.fixture
def seeded_workspace(tmp_path) -> Path:
    workspace = tmp_path / "host-workspace"
    (workspace / "src").mkdir(parents=True)
    (workspace / "README.md").write_text("seed\n")
    (workspace / "src" / "app.py").write_text("print('hi')\n")
    return workspace


def test_claude_replay_only(tmp_path, claude_image, seeded_workspace, docker_client):
    trajectory = write_jsonl(tmp_path / "claude.jsonl", claude_files_session("/srv/task"))
    before_traj, before_ws = sha(trajectory), tree_digest(seeded_workspace)
    out = tmp_path / "run"
    result = run_cli(
        "replay",
        "--agent",
        "claude-code",
        "--trajectory",
        trajectory,
        "--after-step",
        "5",
        "--mode",
        "replay-only",
        "--workspace-dir",
        seeded_workspace,
        "--out",
        out,
        "--run-id",
        "cc-replay-only",
        "--json",
    )
    assert result.code == 0, result.stderr
    record = json.loads(result.stdout)
    assert record == record_of(out)
    assert record["schema_version"] == "pvisor-host.record/v1"
    assert record["status"] == "ok" and record["failure"] is None
    res = record["result"]
    assert (res["phase"], res["quality"], res["agent_status"]) == ("replayed", "verified", "not_started")
    assert (res["after_step"], res["replayed_tool_calls"], res["prefix_model_turns"]) == (5, 6, 5)
    assert res["agent"]["version"] == "2.1.220" and res["agent"]["launch_source"] == "explicit_entrypoint"
    assert record["image"]["agent_version"] == "2.1.220" and record["image"]["pvisor_version"] == "0.3.1"
    assert record["image"]["ref"] == claude_image
    # The workspace is the recorded cwd, seeded with a copy of the host directory.
    assert record["inputs"]["workspace_path"] == "/srv/task"
    assert (out / "workspace" / "f.txt").read_text() == "hi\n"
    assert (out / "workspace" / "g.txt").read_text() == "bye from write\n"
    assert (out / "workspace" / "src" / "app.py").read_text() == "print('hi')\n"
    assert record["workspace_changes"] == {"added": ["f.txt", "g.txt"], "changed": [], "removed": [], "complete": True}
    # The host's own copies are untouched.
    assert tree_digest(seeded_workspace) == before_ws
    assert sha(trajectory) == before_traj == record["inputs"]["trajectory"]["sha256"]
    # pvisor's artifacts are collected, with sizes, hashes and roles.
    paths = artifact_paths(record)
    assert {
        "result.json",
        "logs/stdout.log",
        "logs/stderr.log",
        "output/manifest.json",
        "output/replay-events.jsonl",
        "output/native/reconstructed-prefix.jsonl",
        "output/observation-comparison.json",
        "state/replay-events.jsonl",
        "workspace/f.txt",
        "workspace/g.txt",
    } <= paths
    roles = {a["path"]: a["role"] for a in record["artifacts"]}
    assert roles["output/native/reconstructed-prefix.jsonl"] == "reconstructed_native_trajectory"
    for artifact in record["artifacts"]:
        assert sha(out / artifact["path"]) == artifact["sha256"]
        assert (out / artifact["path"]).stat().st_size == artifact["size"]
    assert (out / "result.json").read_bytes() == (out / "logs" / "stdout.log").read_bytes()
    assert json.loads((out / "result.json").read_text()) == res
    assert not (out / ".pvisor-host-staging").exists()
    assert set(p.name for p in out.iterdir()) == {"record.json", "result.json", "output", "state", "workspace", "logs"}
    assert docker_client.containers.list(all=True, filters={"label": "pvisor-host.run=cc-replay-only"}) == []


def test_claude_prepare_only_runs_no_tool(tmp_path, claude_image):
    trajectory = write_jsonl(tmp_path / "claude.jsonl", claude_files_session())
    out = tmp_path / "run"
    result = run_cli(
        "replay",
        "--image",
        claude_image,
        "--trajectory",
        trajectory,
        "--after-step",
        "3",
        "--mode",
        "prepare-only",
        "--out",
        out,
    )
    assert result.code == 0, result.stderr
    assert "status     ok" in result.stdout
    record = record_of(out)
    res = record["result"]
    assert record["inputs"]["agent"] == "claude-code"  # from the image's labels
    assert record["image"]["verified_by"] == "labels"
    assert (res["phase"], res["replayed_tool_calls"], res["prefix_model_turns"]) == ("prepared", 0, 3)
    assert res["agent"]["launch_source"] == "prepare_only" and res["agent"]["entrypoint"] is None
    assert "output/native/prepared-prefix.jsonl" in artifact_paths(record)
    assert record["workspace_changes"]["added"] == [] and list((out / "workspace").iterdir()) == []
    assert "--agent-entrypoint" not in record["container"]["command"]


def test_codex_replay_only_and_prepare_only(tmp_path, codex_image):
    trajectory = write_jsonl(tmp_path / "codex.jsonl", codex_files_session("/app"))
    before = sha(trajectory)
    replayed = tmp_path / "replayed"
    result = run_cli(
        "replay",
        "--agent",
        "codex",
        "--trajectory",
        trajectory,
        "--after-step",
        "4",
        "--mode",
        "replay-only",
        "--out",
        replayed,
    )
    assert result.code == 0, result.stderr
    record = record_of(replayed)
    res = record["result"]
    assert record["status"] == "ok" and record["inputs"]["workspace_path"] == "/app"
    assert (res["phase"], res["replayed_tool_calls"], res["prefix_model_turns"]) == ("replayed", 5, 4)
    assert res["agent"]["version"] == "0.149.0" and res["metadata"]["native_cli"] == "codex"
    assert (replayed / "workspace" / "f.txt").read_text() == "hi\n"
    assert (replayed / "workspace" / "g.txt").read_text() == "bye from codex\n"
    assert record["workspace_changes"]["added"] == ["f.txt", "g.txt"]
    assert {"output/native/reconstructed-trajectory.jsonl", "state/native-tool-1.log"} <= artifact_paths(record)

    prepared = tmp_path / "prepared"
    result = run_cli(
        "replay",
        "--agent",
        "codex",
        "--trajectory",
        trajectory,
        "--after-step",
        "2",
        "--mode",
        "prepare-only",
        "--out",
        prepared,
    )
    assert result.code == 0, result.stderr
    record = record_of(prepared)
    assert record["result"]["phase"] == "prepared" and record["result"]["replayed_tool_calls"] == 0
    assert record["workspace_changes"]["added"] == []
    assert sha(trajectory) == before


def replay_only(trajectory: Path, out: Path, *extra: str):
    """``pvisor-host replay --agent claude-code --after-step 1 --mode replay-only`` with ``extra`` options."""
    return run_cli(*REPLAY_ONLY, "--trajectory", trajectory, "--out", out, *extra)


def _probe_session(command: str, cwd: str = "/workspace") -> list[dict]:
    return claude_session(
        "Probe the sandbox.", [Turn([Call("Bash", {"command": command, "description": "probe"})])], cwd=cwd
    )


def test_trajectory_is_read_only_inside_the_sandbox(tmp_path, claude_image):
    name = "claude.jsonl"
    command = (
        f"if echo tampered >> /pvisor-host/input/{name}; then echo WROTE > verdict.txt; "
        "else echo REFUSED > verdict.txt; fi; grep -c . /pvisor-host/input/" + name + " > lines.txt"
    )
    trajectory = write_jsonl(tmp_path / name, _probe_session(command))
    before = sha(trajectory)
    out = tmp_path / "run"
    result = replay_only(trajectory, out)
    assert result.code == 0, result.stderr
    assert (out / "workspace" / "verdict.txt").read_text() == "REFUSED\n"
    assert int((out / "workspace" / "lines.txt").read_text()) == len(trajectory.read_text().splitlines())
    assert sha(trajectory) == before == record_of(out)["inputs"]["trajectory"]["sha256"]


HARDENING_PROBE = " ; ".join(
    [
        "id -u > uid.txt",
        "id -g > gid.txt",
        "grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status > proc-status.txt",
        'awk \'$2 == "/" {split($4, o, ","); print o[1]}\' /proc/mounts | tail -1 > rootfs.txt',
        "(touch /tmp/x && echo writable || echo read-only) > tmp.txt",
        'awk \'NR>2 {sub(":", "", $1); print $1}\' /proc/net/dev | sort > interfaces.txt',
        "cat /sys/fs/cgroup/pids/pids.max /sys/fs/cgroup/pids.max 2>/dev/null | head -1 > pids.txt",
        "cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/memory.max 2>/dev/null | head -1 > memory.txt",
        "cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu.max 2>/dev/null | head -1 > cpu.txt",
        "ps -o pid=,comm= -p 1 > pid1.txt 2>/dev/null || cat /proc/1/comm > pid1.txt",
        "env | cut -d= -f1 | sort > env-names.txt",
    ]
)


def _read(out: Path, name: str) -> str:
    return (out / "workspace" / name).read_text().strip()


def test_hardened_defaults_are_really_applied(tmp_path, claude_image, docker_client):
    trajectory = write_jsonl(tmp_path / "probe.jsonl", _probe_session(HARDENING_PROBE))
    out = tmp_path / "run"
    result = replay_only(trajectory, out, "--memory", "768m", "--pids", "300", "--cpus", "1.5")
    assert result.code == 0, result.stderr
    assert _read(out, "uid.txt") == "65532" and _read(out, "gid.txt") == "65532"
    status = dict(line.split(":\t") for line in _read(out, "proc-status.txt").splitlines())
    assert status == {"CapEff": "0000000000000000", "CapBnd": "0000000000000000", "NoNewPrivs": "1"}
    assert _read(out, "rootfs.txt") == "ro"
    assert _read(out, "tmp.txt") == "writable"
    assert _read(out, "interfaces.txt") == "lo"
    assert _read(out, "pids.txt") == "300"
    assert int(_read(out, "memory.txt")) == 768 * 2**20
    assert _read(out, "cpu.txt").split()[0] == "150000"
    assert _read(out, "pid1.txt").split()[-1] == "docker-init"  # --init: tini reaps the replay's processes
    limits = record_of(out)["limits"]
    assert limits | {"timeout": 0} == {
        "user": "65532:65532",
        "network": "none",
        "egress": None,
        "read_only_rootfs": True,
        "cap_drop": ["ALL"],
        "cap_add": [],
        "no_new_privileges": True,
        "memory": 768 * 2**20,
        "cpus": 1.5,
        "pids": 300,
        "tmp_size": 2**30,
        "timeout": 0,
        "collect_limit": 4 * 2**30,
        "init": True,
        "runtime": "runc",
        "runtime_version": runc_version(docker_client),
        "profile": "strict",
        "notes": [],
    }
    assert limits["runtime_version"]  # the engine says which runc it runs containers with


def test_each_relaxation_has_its_flag(tmp_path, claude_image):
    trajectory = write_jsonl(tmp_path / "probe.jsonl", _probe_session(HARDENING_PROBE))
    out = tmp_path / "run"
    result = replay_only(
        trajectory,
        out,
        "--network",
        "bridge",
        "--writable-rootfs",
        "--cap-add",
        "NET_RAW",
        "--allow-privilege-escalation",
        "--user",
        "4242:4343",
    )
    assert result.code == 0, result.stderr
    assert _read(out, "uid.txt") == "4242" and _read(out, "gid.txt") == "4343"
    status = dict(line.split(":\t") for line in _read(out, "proc-status.txt").splitlines())
    assert status["NoNewPrivs"] == "0"
    assert status["CapBnd"] == f"{1 << 13:016x}"  # CAP_NET_RAW is bit 13
    assert _read(out, "rootfs.txt") == "rw"
    assert _read(out, "interfaces.txt").splitlines() == ["eth0", "lo"]


def test_only_named_env_enters_and_never_the_container_config(tmp_path, claude_image, docker_client):
    secret = "s3cret-value-for-the-test"
    command = (
        'echo "$PVISOR_HOST_TEST_VALUE" > value.txt; env | cut -d= -f1 | sort > names.txt; '
        "python3 -c 'print(hash(\"abc\"))' > hash.txt; sleep 4"
    )
    trajectory = write_jsonl(tmp_path / "env.jsonl", _probe_session(command))
    out = tmp_path / "run"
    process = start_cli(
        *REPLAY_ONLY,
        "--trajectory",
        trajectory,
        "--out",
        out,
        "--run-id",
        "env-check",
        "--env",
        "PVISOR_HOST_TEST_VALUE",
        env={"PVISOR_HOST_TEST_VALUE": secret, "PVISOR_HOST_NOT_PASSED": "x"},
    )
    inspected = wait_for_running(docker_client, "env-check", process).attrs
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert secret not in json.dumps(inspected)
    assert not any(e.startswith("PVISOR_HOST_TEST_VALUE") for e in inspected["Config"]["Env"])
    assert (out / "workspace" / "value.txt").read_text() == secret + "\n"
    names = (out / "workspace" / "names.txt").read_text().split()
    assert "PVISOR_HOST_TEST_VALUE" in names
    assert "PVISOR_HOST_NOT_PASSED" not in names
    assert secret not in (out / "record.json").read_text()
    assert secret not in stdout + stderr
    assert record_of(out)["inputs"]["env_names"] == ["PVISOR_HOST_TEST_VALUE"]
    # The environment is pinned, so a Python tool's hash order is the same every run (the value PYTHONHASHSEED=0
    # gives the same Python here), and the record lists what the replay ran with, a secret by its name only.
    pinned = subprocess.run([sys.executable, "-c", "print(hash('abc'))"], env={"PYTHONHASHSEED": "0"},
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert (out / "workspace" / "hash.txt").read_text() == pinned
    environment = record_of(out)["inputs"]["environment"]
    assert {k: environment[k] for k in ("PYTHONHASHSEED", "TZ", "LANG")} == {
        "PYTHONHASHSEED": "0", "TZ": "UTC", "LANG": "C.UTF-8",
    }  # fmt: skip
    assert environment["PVISOR_HOST_TEST_VALUE"] is None


def test_timeout_kills_and_keeps_partial_artifacts(tmp_path, claude_image):
    session = claude_session(
        "Slow.",
        [
            Turn([Call("Bash", {"command": "echo early > before.txt"})]),
            Turn([Call("Bash", {"command": "sleep 60", "timeout": 120000})]),
        ],
    )
    trajectory = write_jsonl(tmp_path / "slow.jsonl", session)
    out = tmp_path / "run"
    started = time.monotonic()
    result = run_cli(
        "replay",
        "--agent",
        "claude-code",
        "--trajectory",
        trajectory,
        "--after-step",
        "2",
        "--mode",
        "replay-only",
        "--out",
        out,
        "--timeout",
        "4s",
    )
    assert time.monotonic() - started < 45
    assert result.code == 4, result.stderr
    record = record_of(out)
    assert record["status"] == "timeout"
    assert record["failure"] == {
        "category": "timeout",
        "message": "the sandbox ran past --timeout 4.0s and was killed",
        "retryable": False,
    }
    assert record["container"]["timed_out"] and record["container"]["exit_code"] == 137
    assert record["result"] is None
    assert (out / "workspace" / "before.txt").read_text() == "early\n"
    assert "output/manifest.json" in artifact_paths(record)  # pvisor writes its plan before the tools run


def test_oom_is_reported_as_oom(tmp_path, claude_image):
    hog = "python3 -c 'b = bytearray(1 << 30); print(len(b))'"
    trajectory = write_jsonl(tmp_path / "hog.jsonl", _probe_session(hog))
    out = tmp_path / "run"
    result = replay_only(trajectory, out, "--memory", "200m", "--tmp-size", "16m")
    assert result.code == 5, result.stderr
    record = record_of(out)
    assert record["status"] == "oom" and record["container"]["oom_killed"]
    assert record["failure"]["category"] == "oom"
    assert "--memory 200.0 MiB" in record["failure"]["message"]


def test_pvisor_failure_inside_the_sandbox_is_replay_failed(tmp_path, claude_image):
    # prepare-only (the host pre-flight) executes nothing, so a Write escaping the workspace only fails in the sandbox.
    session = claude_session("Escape.", [Turn([Call("Write", {"file_path": "/etc/escape.txt", "content": "x"})])])
    trajectory = write_jsonl(tmp_path / "escape.jsonl", session)
    out = tmp_path / "run"
    result = replay_only(trajectory, out)
    assert result.code == 1, result.stderr
    record = record_of(out)
    assert record["status"] == "replay_failed"
    assert record["failure"]["category"] == "ambiguous_execution"
    assert "tool path escapes workspace: /etc/escape.txt" in record["failure"]["message"]
    assert record["result"]["phase"] == "prepared" and record["result"]["quality"] == "degraded"
    assert record["container"]["exit_code"] == 31


def test_hostile_sandbox_output_stays_inside_the_run_directory(tmp_path, claude_image):
    command = " && ".join(
        [
            "ln -s /etc/passwd abs-link",
            "ln -s ../../../../../../etc rel-escape",
            "ln -s data/ok.txt good-link",
            "mkdir data && echo fine > data/ok.txt",
            "mkfifo pipe",
            "mknod null-device c 1 3",
            "head -c 3000000 /dev/zero > big.bin",
        ]
    )
    trajectory = write_jsonl(tmp_path / "hostile.jsonl", _probe_session(command))
    out = tmp_path / "run"
    result = replay_only(trajectory, out, "--user", "root", "--cap-add", "MKNOD", "--collect-limit", "1m")
    assert result.code == 0, result.stderr
    record = record_of(out)
    skipped = {s["path"]: s["reason"] for s in record["collection"]["skipped"]}
    assert skipped["abs-link"] == "symlink to an absolute path (/etc/passwd)"
    assert skipped["rel-escape"] == "symlink points outside the collected tree (../../../../../../etc)"
    assert skipped["pipe"] == "FIFO" and skipped["null-device"] == "device file"
    assert skipped["big.bin"].startswith("size cap reached")
    assert record["collection"]["truncated"] is True
    assert record["workspace_changes"]["complete"] is False
    workspace = out / "workspace"
    assert (workspace / "good-link").is_symlink() and (workspace / "good-link").read_text() == "fine\n"
    for name in ("abs-link", "rel-escape", "pipe", "null-device", "big.bin"):
        assert not (workspace / name).exists() and not (workspace / name).is_symlink()
    outside = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")} - {"hostile.jsonl"}
    assert all(p == "run" or p.startswith("run/") for p in outside)
    assert sum(a["size"] for a in record["artifacts"] if not a["path"].startswith("logs/")) <= 2**20 + 100_000


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupt_removes_the_container_and_records_interrupted(tmp_path, claude_image, docker_client, signal_number):
    trajectory = write_jsonl(tmp_path / "slow.jsonl", _probe_session("sleep 60"))
    out = tmp_path / "run"
    run_id = f"interrupt-{signal_number}"
    process = start_cli(*REPLAY_ONLY, "--trajectory", trajectory, "--out", out, "--run-id", run_id)
    wait_for_running(docker_client, run_id, process, command="sleep 60")  # pvisor runs the sleeping tool
    process.send_signal(signal_number)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith("pvisor-host: interrupted")
    assert docker_client.containers.list(all=True, filters={"label": f"pvisor-host.run={run_id}"}) == []
    assert record_of(out)["status"] == "interrupted"
    assert not (out / ".pvisor-host-staging").exists()
