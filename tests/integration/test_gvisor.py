"""Replays under gVisor (``--runtime runsc``), the engine's runtime that ``make test`` registers: the hardening
probe, Claude Code and Codex replay-only, a live continuation through the gateway's unix socket, a timeout,
an OOM kill, a 10-item batch, and what differs from runc (``--pids``, ``statx``), each against the real engine.

Without a registered runsc these tests skip locally and fail when ``CI=true``: CI must run them.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import IN_CI, run_cli
from modelserver import StubServer
from trajgen import Call, Turn, claude_files_session, claude_session, codex_files_session, write_jsonl

pytestmark = pytest.mark.docker

RUNSC = ("--runtime", "runsc")
GVISOR_PIDS = (
    "pids: under gVisor the limit counts the sandbox's host threads (several per process inside it), "
    "and reaching it stops the whole sandbox instead of failing a fork"
)
KEY = {"PVH_TEST_MODEL_KEY": "sk-test-REAL-upstream-key-gvisor"}


@pytest.fixture(scope="module", autouse=True)
def runsc(docker_client) -> None:
    runtimes = docker_client.info().get("Runtimes") or {}
    if "runsc" not in runtimes:
        message = "gVisor (runsc) is not registered with this engine; `make test` registers it"
        if IN_CI:
            pytest.fail(f"CI=true and {message}")
        pytest.skip(message)


def record_of(out: Path) -> dict:
    return json.loads((out / "record.json").read_text())


def probe(command: str) -> list[dict]:
    return claude_session("Probe the sandbox.", [Turn([Call("Bash", {"command": command, "description": "probe"})])])


def replay_only(trajectory: Path, out: Path, *extra: str | Path, agent: str = "claude-code"):
    return run_cli(
        "replay", "--agent", agent, "--after-step", "1", "--mode", "replay-only",
        "--trajectory", trajectory, "--out", out, *RUNSC, *extra,
    )  # fmt: skip


#: The suite's hardening probe, reading no-new-privileges with prctl(2): gVisor's /proc/self/status leaves it out.
PROBE = " ; ".join(
    [
        "id -u > uid.txt",
        "id -g > gid.txt",
        "grep -E '^(CapEff|CapBnd)' /proc/self/status > caps.txt",
        "python3 -c 'import ctypes; print(ctypes.CDLL(None).prctl(39, 0, 0, 0, 0))' > no-new-privs.txt",
        'awk \'$2 == "/" {split($4, o, ","); print o[1]}\' /proc/mounts | tail -1 > rootfs.txt',
        "(touch /tmp/x && echo writable || echo read-only) > tmp.txt",
        'awk \'NR>2 {sub(":", "", $1); print $1}\' /proc/net/dev | sort > interfaces.txt',
        "cat /proc/1/comm > pid1.txt",
        "dmesg 2>/dev/null | head -1 > kernel.txt",
        "(echo x >> /pvisor-host/input/probe.jsonl && echo WROTE || echo REFUSED) > trajectory.txt",
    ]
)


def test_every_hardening_default_holds_under_gvisor(tmp_path, claude_image):
    trajectory = write_jsonl(tmp_path / "probe.jsonl", probe(PROBE))
    out = tmp_path / "run"
    result = replay_only(trajectory, out, "--memory", "768m", "--pids", "300", "--cpus", "1.5")
    assert result.code == 0, result.stderr

    def read(name: str) -> str:
        return (out / "workspace" / name).read_text().strip()

    assert "gVisor" in read("kernel.txt")  # the user-space kernel really is in between
    assert (read("uid.txt"), read("gid.txt")) == ("65532", "65532")
    assert read("caps.txt").splitlines() == ["CapEff:\t0000000000000000", "CapBnd:\t0000000000000000"]
    assert read("no-new-privs.txt") == "1"
    assert (read("rootfs.txt"), read("tmp.txt")) == ("ro", "writable")
    assert read("interfaces.txt") == "lo"
    assert read("pid1.txt") == "docker-init"
    assert read("trajectory.txt") == "REFUSED"
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
        "runtime": "runsc",
        "runtime_version": subprocess.run(["runsc", "--version"], capture_output=True, text=True).stdout.split()[2],
        "profile": "strict",
        "notes": [GVISOR_PIDS],
    }


@pytest.mark.parametrize("agent", ["claude-code", "codex"])
def test_replay_only_under_gvisor(tmp_path, agent_image, agent):
    agent_image(agent)
    session = claude_files_session() if agent == "claude-code" else codex_files_session()
    trajectory = write_jsonl(tmp_path / f"{agent}.jsonl", session)
    out = tmp_path / "run"
    result = replay_only(trajectory, out, "--after-step", "3", agent=agent)
    assert result.code == 0, result.stderr
    record = record_of(out)
    assert record["status"] == "ok" and record["limits"]["runtime"] == "runsc"
    assert (record["result"]["phase"], record["result"]["after_step"]) == ("replayed", 3)
    assert record["result"]["replayed_tool_calls"] >= 3
    assert record["workspace_changes"]["added"]  # the replayed tools wrote, and the files came back


def test_a_live_continuation_reaches_the_gateway_through_its_socket(tmp_path, claude_image):
    trajectory = write_jsonl(tmp_path / "claude.jsonl", claude_files_session("/workspace"))
    out = tmp_path / "run"
    with StubServer(command="echo continued > continued.txt") as stub:
        result = run_cli(
            "replay", "--agent", "claude-code", "--trajectory", trajectory, "--after-step", "4", "--max-steps", "8",
            "--model-base-url", stub.base_url, "--model", "stub-model", "--model-api-key-env", "PVH_TEST_MODEL_KEY",
            "--timeout", "300s", "--out", out, *RUNSC, env=KEY,
        )  # fmt: skip
        requests = stub.model.model_requests()
    assert result.code == 0, (result.stderr, _tail(out / "logs" / "stderr.log"))
    record = record_of(out)
    assert record["status"] == "ok" and record["result"]["phase"] == "continued"
    assert record["limits"]["runtime"] == "runsc" and record["model"]["network"] == "unix"
    assert (out / "workspace" / "continued.txt").read_text() == "continued\n"
    assert requests and {r["headers"]["authorization"] for r in requests} == {f"Bearer {KEY['PVH_TEST_MODEL_KEY']}"}
    assert not any(KEY["PVH_TEST_MODEL_KEY"] in p.read_text(errors="replace") for p in out.rglob("*") if p.is_file())


def test_stat_based_tools_fail_under_this_gvisor_release(tmp_path, claude_image):
    """What differs from runc, pinned down: runsc 0.0~20221219 answers coreutils' statx(2) with EINVAL, so a
    replayed `ls` or `stat` prints an error where it printed a listing under runc (docs/security.md says so).
    Reading files and Python's os.listdir work."""
    command = (
        "ls / > ls.txt 2>&1; echo $? >> ls.txt; stat -c %n / > stat.txt 2>&1; echo $? >> stat.txt; "
        'python3 -c \'import os; print("etc" in os.listdir("/"))\' > listdir.txt'
    )
    trajectory = write_jsonl(tmp_path / "stat.jsonl", probe(command))
    out = tmp_path / "run"
    result = replay_only(trajectory, out)
    assert result.code == 0, result.stderr
    workspace = out / "workspace"
    assert (workspace / "ls.txt").read_text() == "ls: cannot access '/': Invalid argument\n2\n"
    assert (workspace / "stat.txt").read_text() == "stat: cannot statx '/': Invalid argument\n1\n"
    assert (workspace / "listdir.txt").read_text() == "True\n"


def test_a_timeout_under_gvisor(tmp_path, claude_image, docker_client):
    trajectory = write_jsonl(tmp_path / "slow.jsonl", probe("sleep 60"))
    out = tmp_path / "run"
    result = replay_only(trajectory, out, "--timeout", "4s")
    assert result.code == 4, result.stderr
    record = record_of(out)
    assert record["status"] == "timeout" and record["container"]["timed_out"]
    assert docker_client.containers.list(all=True, filters={"name": record["container"]["name"]}) == []


def test_an_oom_under_gvisor(tmp_path, claude_image):
    hog = "python3 -c 'b = bytearray(1 << 30); print(len(b))'"
    trajectory = write_jsonl(tmp_path / "hog.jsonl", probe(hog))
    out = tmp_path / "run"
    result = replay_only(trajectory, out, "--memory", "200m", "--tmp-size", "16m")
    assert result.code == 5, result.stderr
    record = record_of(out)
    assert record["status"] == "oom" and record["container"]["oom_killed"]


def forking(processes: int) -> list[dict]:
    return probe(
        f'python3 -c \'import subprocess; ps = [subprocess.Popen(["sleep", "20"]) for _ in range({processes})]; '
        "print(len(ps)); [p.kill() for p in ps]' > started.txt 2>&1 || true"
    )


def test_pids_counts_host_threads_under_gvisor_and_reaching_it_stops_the_sandbox(tmp_path, claude_image):
    """What differs from runc, pinned down. Under runc a fork past --pids fails (EAGAIN) and the replay goes on;
    under gVisor (ptrace platform) each process inside costs several host threads, and reaching the limit stops
    the whole sandbox. The record and the failure say so."""
    trajectory = write_jsonl(tmp_path / "forks.jsonl", forking(60))
    roomy = replay_only(trajectory, tmp_path / "roomy", "--pids", "4096")
    assert roomy.code == 0, roomy.stderr
    assert (tmp_path / "roomy" / "workspace" / "started.txt").read_text().strip() == "60"
    tight = replay_only(trajectory, tmp_path / "tight", "--pids", "300")
    assert tight.code == 6, tight.stderr
    record = record_of(tmp_path / "tight")
    assert record["status"] == "infra_error" and record["container"]["exit_code"] == 2
    assert record["failure"]["message"] == (
        "pvisor printed no result on stdout (exit code 2); "
        "a gVisor sandbox stops like this when it reaches --pids (several host threads per process)"
    )
    assert record["limits"]["notes"] == [GVISOR_PIDS]


def test_a_ten_item_batch_under_gvisor(tmp_path, claude_image):
    root = tmp_path / "data"
    root.mkdir()
    lines = []
    for n in range(10):
        write_jsonl(root / f"t{n}.jsonl", claude_files_session())
        lines.append(json.dumps({"id": f"t{n}", "trajectory": f"t{n}.jsonl", "after_step": 1 + n % 5}))
    (root / "m.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    result = run_cli(
        "batch", root / "m.jsonl", "--agent", "claude-code", "--mode", "replay-only", "--workers", "3",
        "--out", out, *RUNSC,
    )  # fmt: skip
    assert result.code == 0, result.stderr
    assert json.loads((out / "summary.json").read_text())["counts"] == {"ok": 10}
    assert {record_of(out / f"t{n}")["limits"]["runtime"] for n in range(10)} == {"runsc"}


def test_a_runtime_the_engine_does_not_have_is_one_line_and_starts_nothing(tmp_path, claude_image, containers_created):
    import time

    trajectory = write_jsonl(tmp_path / "t.jsonl", claude_files_session())
    since = time.time()
    result = run_cli(
        "replay", "--agent", "claude-code", "--trajectory", trajectory, "--after-step", "1", "--mode", "replay-only",
        "--runtime", "kata", "--out", tmp_path / "run",
    )  # fmt: skip
    assert result.code == 2
    assert result.error_lines == [
        "pvisor-host: error: --runtime kata: the engine has no runtime 'kata'; it has runc, runsc, runsc-fork "
        "(register it in /etc/docker/daemon.json (docs/security.md#gvisor))"
    ]
    assert not (tmp_path / "run").exists() and containers_created(since) == []
    bridged = replay_only(trajectory, tmp_path / "run2", "--network", "bridge")
    assert bridged.code == 2
    assert bridged.error_lines == [
        "pvisor-host: error: --network bridge: runtime runsc is registered with --network=none, so its sandboxes "
        "have no network (drop --network, or register a runtime without --network=none)"
    ]


def test_gvisor_can_be_the_default_through_the_environment(tmp_path, claude_image):
    trajectory = write_jsonl(tmp_path / "t.jsonl", claude_files_session())
    out = tmp_path / "run"
    result = run_cli(
        "replay", "--agent", "claude-code", "--trajectory", trajectory, "--after-step", "1", "--mode", "replay-only",
        "--out", out, env={"PVISOR_HOST_RUNTIME": "runsc"},
    )  # fmt: skip
    assert result.code == 0, result.stderr
    assert record_of(out)["limits"]["runtime"] == "runsc"


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.is_file() else f"(no {path.name})"
