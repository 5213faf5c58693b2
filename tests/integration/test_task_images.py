"""A SWE-style dataset, for real: task images built here the way SWE-bench's are (root, a Python project at
/testbed in an environment of its own, HOME=/root), trajectories recorded as root in them, and the dataset
brought as it is (a glob, an image template, every boundary, no agent named). The replay must reproduce every
effect the recording had; ``--strict`` keeps today's hardening."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import build_test_image, run_cli
from trajgen import Call, Turn, claude_session, codex_rollout, write_json, write_jsonl

pytestmark = pytest.mark.usefixtures("runtime_volumes_removed_afterwards")

SWE_TASK = "pvisor-host-test/swe-task:1"
#: The seven effects of a SWE-style recording, each with what the recording saw (as root, HOME=/root, in the
#: project's environment): an editable install into the environment, an import of it from anywhere, a write
#: under $HOME and one under /usr/local, the uid and HOME, and the install's metadata in the workspace.
EFFECTS = [
    ("pip install -q --no-build-isolation --no-deps --no-index -e . >/dev/null 2>&1 && echo installed", "installed\n"),
    ("cd / && python -c 'import taskpkg; print(taskpkg.VALUE, taskpkg.__file__)'", "42 /testbed/taskpkg/__init__.py\n"),
    ('ls "$(python -c \'import sysconfig; print(sysconfig.get_paths()["purelib"])\')" | grep -ci taskpkg', "1\n"),
    ('echo state > "$HOME/.task-state" && ls /root/.task-state', "/root/.task-state\n"),
    ("echo tool > /usr/local/share/task-tool && cat /usr/local/share/task-tool", "tool\n"),
    ("id -u", "0\n"),
    ('echo "$HOME"', "/root\n"),
]


@pytest.fixture(scope="module")
def swe_task(docker_client, base_image) -> str:
    """A task image shaped like SWE-bench's: root, /testbed with a setuptools project, its own Python
    environment first on PATH, HOME=/root, WORKDIR /testbed."""
    tag = build_test_image(
        docker_client,
        SWE_TASK,
        f"FROM {base_image}\n"
        "RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends"
        " python3-venv >/dev/null && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/envs/testbed\n"
        "ENV PATH=/opt/envs/testbed/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root\n"
        "RUN mkdir -p /testbed/taskpkg && echo 'VALUE = 42' > /testbed/taskpkg/__init__.py"
        ' && printf \'from setuptools import setup\\nsetup(name="taskpkg", version="0.1", packages=["taskpkg"])\\n\''
        " > /testbed/setup.py\n"
        "WORKDIR /testbed\n"
        "LABEL pvisor-host.test=swe-task\n",
    )
    yield tag
    docker_client.images.remove(tag, force=True)


def effects_session() -> list[dict]:
    calls = [Turn([Call("Bash", {"command": command, "description": "effect"}, seen)]) for command, seen in EFFECTS]
    return claude_session("Install the project and check the environment.", calls, cwd="/testbed")


def replay(trajectory: Path, out: Path, image: str, *extra: str):
    return run_cli(
        "replay", "--image", image, "--inject", "--image-workspace", "--trajectory", trajectory,
        "--after-step", str(len(EFFECTS)), "--mode", "replay-only", "--out", out, *extra,
    )  # fmt: skip


def comparison(out: Path) -> list[bool]:
    return [call["exact"] for call in json.loads((out / "output" / "observation-comparison.json").read_text())]


def test_a_task_image_runs_as_the_image_says_and_every_effect_matches_the_recording(tmp_path, swe_task):
    trajectory = write_jsonl(tmp_path / "swe.jsonl", effects_session())
    out = tmp_path / "run"
    result = replay(trajectory, out, swe_task)  # no --agent: the file says it is Claude Code's
    assert result.code == 0, result.stderr
    assert comparison(out) == [True] * len(EFFECTS)
    record = json.loads((out / "record.json").read_text())
    assert record["inputs"]["agent"] == "claude-code"
    limits = record["limits"]
    assert (limits["profile"], limits["user"], limits["read_only_rootfs"]) == ("task-image", "0:0", False)
    assert (limits["network"], limits["cap_drop"], limits["no_new_privileges"]) == ("none", ["ALL"], True)
    assert "taskpkg.egg-info/PKG-INFO" in record["workspace_changes"]["added"]
    # Debian 12's runc predates the 2025 escape fixes: a root sandbox says so, once, and names the remedy.
    if limits["runtime_version"] and limits["runtime_version"].startswith("1.1."):
        warnings = [line for line in result.stderr.splitlines() if "CVE-2025-31133" in line]
        assert len(warnings) == 1 and "--runtime runsc" in warnings[0]


def test_strict_keeps_todays_hardening_in_a_task_image(tmp_path, swe_task):
    probe = " ; ".join(
        [
            "id -u > uid.txt",
            'echo "$HOME" > home.txt',
            "grep -E '^(CapEff|NoNewPrivs)' /proc/self/status > status.txt",
            'awk \'$2 == "/" {split($4, o, ","); print o[1]}\' /proc/mounts | tail -1 > rootfs.txt',
            "(echo x > /usr/local/share/x && echo WROTE || echo REFUSED) > usr-local.txt",
        ]
    )
    trajectory = write_jsonl(
        tmp_path / "probe.jsonl", claude_session("Probe.", [Turn([Call("Bash", {"command": probe})])], cwd="/testbed")
    )
    out = tmp_path / "run"
    result = run_cli(
        "replay", "--image", swe_task, "--inject", "--image-workspace", "--trajectory", trajectory,
        "--after-step", "1", "--mode", "replay-only", "--out", out, "--strict",
    )  # fmt: skip
    assert result.code == 0, result.stderr

    def read(name: str) -> str:
        return (out / "workspace" / name).read_text().strip()

    assert (read("uid.txt"), read("home.txt"), read("rootfs.txt"), read("usr-local.txt")) == (
        "65532",
        "/tmp",
        "ro",
        "REFUSED",
    )
    assert dict(line.split(":\t") for line in read("status.txt").splitlines()) == {
        "CapEff": "0000000000000000",
        "NoNewPrivs": "1",
    }
    limits = json.loads((out / "record.json").read_text())["limits"]
    assert (limits["profile"], limits["user"], limits["read_only_rootfs"]) == ("strict", "65532:65532", True)


def test_a_swebench_shaped_glob_runs_every_boundary_in_each_files_image(tmp_path, docker_client, swe_task, codex_image):
    """trajs/<instance_id>.jsonl, Claude Code and Codex mixed, each task's image named by a template over the
    file's stem, after_step all, no --agent. A third file has a tool pvisor refuses in batch 3: its boundaries
    1-2 run, 3-4 are refused with pvisor's reason, on the host, without a sandbox."""
    instances = {"django__django-1": "claude", "astropy__astropy-2": "codex", "sympy__sympy-3": "claude"}
    tags = []
    for instance in instances:
        tag = f"pvisor-host-test/sweb.eval.{instance.replace('__', '_1776_').lower()}:v1"
        tags.append(build_test_image(docker_client, tag, f"FROM {swe_task}\nRUN echo {instance} > /testbed/ID\n"))
    trajs = tmp_path / "trajs"
    trajs.mkdir()
    two = [Turn([Call("Bash", {"command": "cat ID"}, "x\n")]), Turn([Call("Bash", {"command": "echo 2 > two"})])]
    write_jsonl(trajs / "django__django-1.jsonl", claude_session("Fix it.", two, cwd="/testbed"))
    write_jsonl(trajs / "astropy__astropy-2.jsonl", codex_rollout("Fix it.", two, cwd="/testbed"))
    web = Turn([Call("WebFetch", {"url": "https://example.invalid", "prompt": "read"}, "page")])
    write_jsonl(trajs / "sympy__sympy-3.jsonl", claude_session("Fix it.", [*two, web, two[0]], cwd="/testbed"))
    try:
        inspected = run_cli("inspect", "--json", *sorted(trajs.iterdir()))
        assert inspected.code == 2, inspected.stderr  # one file has boundaries pvisor refuses
        counts = {Path(r["path"]).stem: r["boundaries"] for r in json.loads(inspected.stdout)}
        assert counts == {"astropy__astropy-2": 2, "django__django-1": 2, "sympy__sympy-3": 4}

        out = tmp_path / "batch"
        result = run_cli(
            "batch", "--trajectories", trajs / "*.jsonl", "--after-step", "all",
            "--image", "pvisor-host-test/sweb.eval.{stem|swebench}:v1", "--inject", "--image-workspace",
            "--mode", "replay-only", "--workers", "2", "--out", out, "--json",
        )  # fmt: skip
        assert result.code == 1, result.stderr  # two items refused
        rows = {row["id"]: row for row in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
        assert sorted(rows) == sorted(f"{stem}-after{n}" for stem, count in counts.items() for n in range(1, count + 1))
        statuses = {item: row["status"] for item, row in rows.items()}
        assert statuses == {item: "rejected" if item.endswith(("sympy__sympy-3-after3", "-after4")) else "ok"
                            for item in rows}  # fmt: skip
        refused = rows["sympy__sympy-3-after3"]
        assert refused["message"] == (
            "pvisor rejected the replay (unsupported_version): "
            "unsupported Claude replay tool call WebFetch(toolu_03a) inside the selected prefix"
        )
        assert not (out / "sympy__sympy-3-after4" / "record.json").exists()  # refused on the host: no sandbox
        assert {row["agent"] for row in rows.values()} == {"claude-code", "codex"}
        for item, row in rows.items():
            if row["status"] == "ok":
                record = json.loads((out / item / "record.json").read_text())
                assert (
                    record["image"]["ref"]
                    == f"pvisor-host-test/sweb.eval.{item.rsplit('-after', 1)[0].replace('__', '_1776_').lower()}:v1"
                )
                assert record["limits"]["profile"] == "task-image"
    finally:
        for tag in tags:
            docker_client.images.remove(tag, force=True)


def test_a_mini_trajectory_without_its_agent_templates_replays_with_the_agents_defaults(tmp_path, agent_image):
    """pvisor's own synthetic mini-swe-agent trajectory: its saved config is empty."""
    agent_image("mini-swe-agent")
    source = Path(__file__).parent.parent / "data" / "trajectories" / "mini-pvisor-b-replay.json"
    trajectory = write_json(tmp_path / "mini.json", json.loads(source.read_text()))
    out = tmp_path / "run"
    result = run_cli("replay", "--trajectory", trajectory, "--after-step", "2", "--mode", "replay-only", "--out", out)
    assert result.code == 0, result.stderr
    assert (out / "workspace" / "marker-0.txt").read_text() == "fixture-0"
    record = json.loads((out / "record.json").read_text())
    staged = record["inputs"]["trajectory"]
    assert staged["filled"] == ["info.config.agent.system_template", "info.config.agent.instance_template"]
    assert staged["staged_sha256"] not in (None, staged["sha256"])
    rebuilt = json.loads((out / "output" / "native" / "reconstructed-trajectory.json").read_text())
    assert rebuilt["info"]["config"]["agent"]["system_template"]  # the agent's own default, as it saved it
