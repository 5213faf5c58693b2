"""`--inject`: replays in task images that contain neither pvisor nor node, with the runtime from a
read-only volume, and the same results as the baked images; clear refusals for unusable task images."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import build_test_image, run_cli
from trajgen import Call, Turn, claude_files_session, claude_session, codex_files_session, write_jsonl

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("runtime_volumes_removed_afterwards")]

TEST_LABELS = "LABEL pvisor-host.managed=true pvisor-host.role=test-image"


@pytest.fixture(scope="module")
def task_images(docker_client, base_image):
    """Two task images: python-only Debian, and one with a small git repository at /app (plus git)."""
    python = build_test_image(
        docker_client,
        "pvisor-host-test/task-python:1",
        f"FROM {base_image}\n{TEST_LABELS}\nRUN mkdir -p /srv/data && echo 'hello task' > /srv/data/input.txt\n",
    )
    git = build_test_image(
        docker_client,
        "pvisor-host-test/task-git:1",
        f"FROM {base_image}\n{TEST_LABELS}\n"
        "RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends git"
        " >/dev/null && rm -rf /var/lib/apt/lists/*"
        " && git config --system user.email task@example.invalid && git config --system user.name task"
        " && git config --system --add safe.directory '*'"
        " && mkdir /app && cd /app && git init -q -b main"
        " && printf 'def add(a, b):\\n    return a - b\\n' > calc.py && git add . && git commit -qm initial\n",
    )
    yield {"python": python, "git": git}
    for tag in (python, git):
        docker_client.images.remove(tag, force=True)


def _assert_has_neither_pvisor_nor_node(client, image: str) -> None:
    output = client.containers.run(
        image, ["/bin/sh", "-c", "command -v pvisor node codex claude || echo none"], remove=True, network_mode="none"
    )
    assert output.decode().strip() == "none"


def _record(out: Path) -> dict:
    return json.loads((out / "record.json").read_text())


def _comparable(record: dict) -> dict:
    """What must match between an injected and a baked replay of the same trajectory."""
    result = record["result"]
    return {
        "status": record["status"],
        "phase": result["phase"],
        "quality": result["quality"],
        "agent": (result["agent"]["type"], result["agent"]["version"]),
        "counts": (result["after_step"], result["replayed_tool_calls"], result["prefix_model_turns"]),
        "roles": sorted(a["role"] for a in result["artifacts"]),
        "outputs": sorted(a["path"] for a in record["artifacts"] if a["path"].startswith("output/")),
    }


# agent -> (trajectory, after-step, runtime entrypoint inside the volume)
INJECTED = {
    "codex": (lambda: codex_files_session("/workspace"), 4, "bin/codex"),
    "claude-code": (lambda: claude_files_session("/workspace"), 5, "bin/claude"),
}


@pytest.mark.parametrize("agent", sorted(INJECTED))
def test_injected_into_a_python_only_image_matches_the_baked_image(
    tmp_path, docker_client, task_images, agent_image, agent
):
    make, after, entrypoint = INJECTED[agent]
    _assert_has_neither_pvisor_nor_node(docker_client, task_images["python"])
    trajectory = write_jsonl(tmp_path / "t.jsonl", make())
    common = (
        "replay",
        "--agent",
        agent,
        "--trajectory",
        trajectory,
        "--after-step",
        str(after),
        "--mode",
        "replay-only",
    )
    injected, baked = tmp_path / "injected", tmp_path / "baked"
    result = run_cli(*common, "--image", task_images["python"], "--inject", "--out", injected)
    assert result.code == 0, result.stderr
    assert run_cli(*common, "--out", baked).code == 0
    record = _record(injected)
    assert _comparable(record) == _comparable(_record(baked))
    assert record["image"]["verified_by"] == "inject"
    assert record["image"]["ref"] == task_images["python"]
    assert record["image"]["agent_image"] == agent_image(agent)
    assert record["image"]["runtime_volume"].startswith(f"pvisor-host-runtime-{agent}-")
    assert record["result"]["agent"]["launch_source"] == "runtime_manifest"
    assert record["result"]["agent"]["entrypoint"] == f"/pvisor-host/runtime/agent/{entrypoint}"
    assert "--agent-runtime" in record["container"]["command"]
    assert (injected / "workspace" / "g.txt").read_text() == (baked / "workspace" / "g.txt").read_text()
    assert record["workspace_changes"] == _record(baked)["workspace_changes"]


def test_claude_injected_into_a_git_task_uses_the_image_repository_as_workspace(
    tmp_path, docker_client, task_images, claude_image
):
    _assert_has_neither_pvisor_nor_node(docker_client, task_images["git"])
    session = claude_session(
        "Fix add() in calc.py and commit.",
        [
            Turn([Call("Bash", {"command": "git log --oneline | wc -l > before.txt", "description": "count"}, "")]),
            Turn([Call("Edit", {"file_path": "/app/calc.py", "old_string": "a - b", "new_string": "a + b"}, "ok")]),
            Turn([Call("Bash", {"command": "git commit -qam 'fix add' && git log --format=%s -1 > last.txt"}, "")]),
        ],
        cwd="/app",
    )
    trajectory = write_jsonl(tmp_path / "claude.jsonl", session)
    out = tmp_path / "run"
    result = run_cli(
        "replay",
        "--image",
        task_images["git"],
        "--agent",
        "claude-code",
        "--inject",
        "--image-workspace",
        "--trajectory",
        trajectory,
        "--after-step",
        "3",
        "--mode",
        "replay-only",
        "--out",
        out,
    )
    assert result.code == 0, result.stderr
    record = _record(out)
    assert record["status"] == "ok" and record["result"]["replayed_tool_calls"] == 3
    assert record["inputs"]["workspace_from_image"] is True and record["inputs"]["workspace_path"] == "/app"
    assert (out / "workspace" / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    assert (out / "workspace" / "before.txt").read_text().strip() == "1"
    assert (out / "workspace" / "last.txt").read_text() == "fix add\n"
    changes = record["workspace_changes"]
    assert {"before.txt", "last.txt"} <= set(changes["added"]) and "calc.py" in changes["changed"]
    assert ".git/refs/heads/main" in changes["changed"] and changes["removed"] == []
    assert record["result"]["agent"]["launch_source"] == "runtime_manifest"
    # The task image itself is untouched: the next replay starts from the original commit again.
    again = tmp_path / "again"
    assert (
        run_cli(
            "replay",
            "--image",
            task_images["git"],
            "--agent",
            "claude-code",
            "--inject",
            "--image-workspace",
            "--trajectory",
            trajectory,
            "--after-step",
            "1",
            "--mode",
            "replay-only",
            "--out",
            again,
        ).code
        == 0
    )
    assert (again / "workspace" / "calc.py").read_text() == "def add(a, b):\n    return a - b\n"


def test_the_runtime_volume_is_filled_once_and_refilled_when_incomplete(
    tmp_path, docker_client, task_images, codex_image
):
    from pvisor_host.backend.docker.image.inject import Injector, runtime_volume_name
    from pvisor_host.models.ownership import Ownership
    from pvisor_host.models.profiles import get_profile

    profile = get_profile("codex")
    image_id = docker_client.images.get(codex_image).id
    name = runtime_volume_name(profile, profile.inject, image_id)
    injector = Injector(docker_client, Ownership.current())
    volume = injector.ensure_runtime_volume(profile, image_id)
    assert volume.name == name
    created_before = docker_client.volumes.get(name).attrs["CreatedAt"]
    assert injector.ensure_runtime_volume(profile, image_id).name == name
    assert docker_client.volumes.get(name).attrs["CreatedAt"] == created_before  # reused, not refilled
    labels = docker_client.volumes.get(name).attrs["Labels"]
    assert labels["pvisor-host.role"] == "runtime" and "pvisor-host.owner" not in labels
    # A volume left half-filled (no completion marker), e.g. by a killed controller, is refilled.
    docker_client.volumes.get(name).remove(force=True)
    docker_client.volumes.create(name=name, labels={"pvisor-host.managed": "true", "pvisor-host.role": "runtime"})
    Injector(docker_client, Ownership.current()).ensure_runtime_volume(profile, image_id)  # a new controller
    trajectory = write_jsonl(tmp_path / "codex.jsonl", codex_files_session("/workspace"))
    out = tmp_path / "run"
    result = run_cli(
        "replay",
        "--image",
        task_images["python"],
        "--agent",
        "codex",
        "--inject",
        "--trajectory",
        trajectory,
        "--after-step",
        "1",
        "--mode",
        "replay-only",
        "--out",
        out,
    )
    assert result.code == 0, result.stderr


@pytest.fixture(scope="module")
def unusable_images(docker_client, base_image):
    """A musl (busybox + musl loader) image, an arm64 image, and a glibc image without bash."""
    musl = build_test_image(
        docker_client,
        "pvisor-host-test/musl:1",
        f"FROM {base_image} AS parts\n"
        "RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends"
        " musl busybox-static >/dev/null\n"
        "FROM scratch\nCOPY --from=parts /bin/busybox /bin/busybox\n"
        "COPY --from=parts /lib/ld-musl-x86_64.so.1 /lib/ld-musl-x86_64.so.1\n"
        'RUN ["/bin/busybox", "--install", "-s", "/bin"]\n' + TEST_LABELS + "\n",
    )
    import tempfile

    with tempfile.TemporaryDirectory() as context:
        Path(context, "hello.txt").write_text("hi\n")
        Path(context, "Dockerfile").write_text(f"FROM scratch\nCOPY hello.txt /hello.txt\n{TEST_LABELS}\n")
        docker_client.images.build(path=context, tag="pvisor-host-test/arm64:1", platform="linux/arm64", rm=True)
    nobash = build_test_image(
        docker_client,
        "pvisor-host-test/no-bash:1",
        f"FROM {base_image}\n{TEST_LABELS}\nRUN rm -f /bin/bash /usr/bin/bash\n",
    )
    yield {"musl": musl, "arm64": "pvisor-host-test/arm64:1", "nobash": nobash}
    for tag in (musl, "pvisor-host-test/arm64:1", nobash):
        docker_client.images.remove(tag, force=True)


def _refusal(tmp_path: Path, image: str, agent: str = "claude-code") -> str:
    trajectory = write_jsonl(tmp_path / "t.jsonl", claude_session("x", [Turn([Call("Bash", {"command": "true"})])]))
    if agent == "codex":
        trajectory = write_jsonl(tmp_path / "t.jsonl", codex_files_session())
    result = run_cli(
        "replay",
        "--image",
        image,
        "--agent",
        agent,
        "--inject",
        "--trajectory",
        trajectory,
        "--after-step",
        "1",
        "--mode",
        "replay-only",
        "--out",
        tmp_path / "run",
    )
    assert result.code == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()
    return lines[0].removeprefix("pvisor-host: error: ")


def test_a_musl_image_is_refused(tmp_path, unusable_images, containers_created):
    started = time.time()
    line = _refusal(tmp_path, unusable_images["musl"], "codex")
    assert line.startswith(f"task image {unusable_images['musl']} is musl-based (/lib/ld-musl-x86_64.so.1); ")
    assert [c.get("pvisor-host.role") for c in containers_created(started)] == ["probe"]


def test_a_non_x86_64_image_is_refused_from_its_metadata(tmp_path, unusable_images, containers_created):
    started = time.time()
    line = _refusal(tmp_path, unusable_images["arm64"])
    assert line == (
        f"task image {unusable_images['arm64']} is linux/arm64; pvisor 0.3.1 ships only linux/amd64 (x86_64) "
        "binaries (use an x86_64 Linux task image)"
    )
    assert containers_created(started) == []


def test_what_the_runtime_needs_must_be_in_the_task_image(tmp_path, unusable_images):
    line = _refusal(tmp_path, unusable_images["nobash"])
    assert line == (
        f"task image {unusable_images['nobash']} lacks /bin/bash, which the injected claude-code runtime needs"
    )


def test_an_agent_without_an_inject_profile_is_refused(tmp_path, task_images):
    trajectory = tmp_path / "mini.json"
    from trajgen import mini_files_session, write_json

    write_json(trajectory, mini_files_session())
    result = run_cli(
        "replay",
        "--image",
        task_images["python"],
        "--agent",
        "mini-swe-agent",
        "--inject",
        "--trajectory",
        trajectory,
        "--after-step",
        "1",
        "--mode",
        "replay-only",
    )
    assert result.code == 2
    assert result.stderr.strip() == (
        "pvisor-host: error: mini-swe-agent cannot be injected into a task image: its runtime is a Python virtual "
        "environment bound to the image's own Python (drop --inject)"
    )
