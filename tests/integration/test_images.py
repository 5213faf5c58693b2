"""Sandbox images: content-addressed builds verified inside the image, and every way an image given
to `replay` can be wrong (decided from labels without a container where the host can tell)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pvisor_host.backend.docker import labels as L
from pvisor_host.backend.docker.image.base import find_image
from pvisor_host.errors import ImageBuildError
from pvisor_host.models.image import BuildOptions, BuildPlan
from pvisor_host.models.profiles import get_profile

from conftest import ROOT, run_cli
from trajgen import claude_files_session, write_jsonl

pytestmark = pytest.mark.docker


def test_images_carry_the_pinned_versions(docker_client, claude_image, codex_image):
    for tag, agent, version in ((claude_image, "claude-code", "2.1.220"), (codex_image, "codex", "0.149.0")):
        assert tag.startswith(f"pvisor-host/{agent}:{version}-pvisor0.3.1-")
        labels = docker_client.images.get(tag).labels
        assert labels[L.AGENT] == agent and labels[L.AGENT_VERSION] == version
        assert labels[L.PVISOR_VERSION] == "0.3.1"
        assert tag.endswith("-" + labels[L.RECIPE_HASH][:12])


def test_second_build_finds_the_image_and_builds_nothing(docker_client, claude_image, containers_created):
    started = time.time()
    result = run_cli("build", "--agent", "claude-code", "--json")
    assert result.code == 0, result.stderr
    built = json.loads(result.stdout)
    assert built["cached"] is True and built["tag"] == claude_image
    assert built["base"]["source"] in ("local", "bootstrapped-earlier")
    # The classic builder would have created containers for its RUN steps.
    assert containers_created(started) == []


def test_build_says_how_the_base_was_obtained(claude_image):
    result = run_cli("build", "--agent", "codex")
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("pvisor-host/codex:0.149.0-pvisor0.3.1-")
    assert lines[1].strip().startswith("agent codex 0.149.0, pvisor 0.3.1,")
    assert lines[2].strip().startswith("base ") and lines[2].strip().endswith(
        ("(local)", "(bootstrapped-earlier)", "(bootstrapped)", "(pulled)")
    )


def test_an_image_without_the_pinned_version_is_refused_and_removed(docker_client, backend, claude_image):
    # Same recipe, but the profile says the agent lives elsewhere: node answers "v22...", not "2.1.220".
    wrong = get_profile("claude-code").model_copy(update={"entrypoint": "/usr/local/bin/node"})
    with pytest.raises(ImageBuildError) as caught:
        backend.ensure_image(BuildPlan(profile=wrong), BuildOptions())
    message = caught.value.one_line()
    assert message == (
        "the image just built for claude-code has /usr/local/bin/node --version printing 'v22.23.5'; "
        "claude-code must be exactly 2.1.220"
    )
    assert docker_client.images.list(filters={"label": f"{L.AGENT_ENTRYPOINT}=/usr/local/bin/node"}) == []
    assert docker_client.images.get(claude_image)  # the good image is untouched


def _derived_image(docker_client, base: str, tag: str, dockerfile_tail: str) -> str:
    dockerfile = f"FROM {base}\n{dockerfile_tail}\n"
    docker_client.images.build(
        fileobj=io.BytesIO(dockerfile.encode()),
        tag=tag,
        rm=True,
        forcerm=True,
        labels={L.MANAGED: "true", L.ROLE: "test-image"},
    )
    return tag


@pytest.fixture(scope="module")
def fake_claude_image(docker_client, claude_image):
    """pvisor present, but the agent prints 2.1.219, and no pvisor-host labels vouch for it."""
    tag = "pvisor-host-test/fake-claude:2.1.219"
    tail = (
        'LABEL pvisor-host.agent="" pvisor-host.agent-version="" pvisor-host.recipe-hash=""\n'
        "RUN printf '#!/bin/sh\\necho \"2.1.219 (Claude Code)\"\\n' "
        "> /usr/local/lib/node_modules/@anthropic-ai/claude-code/bin/claude.exe"
    )
    yield _derived_image(docker_client, claude_image, tag, tail)
    docker_client.images.remove(tag, force=True)


@pytest.fixture(scope="module")
def mislabelled_image(docker_client, claude_image):
    tag = "pvisor-host-test/mislabelled:1"
    yield _derived_image(docker_client, claude_image, tag, "LABEL pvisor-host.agent-version=2.1.219")
    docker_client.images.remove(tag, force=True)


def _replay(tmp_path: Path, *args: str):
    trajectory = write_jsonl(tmp_path / "claude.jsonl", claude_files_session())
    out = tmp_path / "run"
    result = run_cli(
        "replay", "--trajectory", trajectory, "--after-step", "1", "--mode", "replay-only", "--out", out, *args
    )
    return result, out


def _one_line(result, code: int) -> str:
    assert result.code == code, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pvisor-host: error: ")
    return lines[0].removeprefix("pvisor-host: error: ")


def test_unknown_image(tmp_path, docker_client, containers_created):
    started = time.time()
    result, out = _replay(tmp_path, "--image", "pvisor-host-test/does-not-exist:1", "--agent", "claude-code")
    line = _one_line(result, 2)
    assert line.startswith("image pvisor-host-test/does-not-exist:1 does not exist here and cannot be pulled (")
    assert line.endswith("(build one with `pvisor-host build --agent AGENT` or pass --agent without --image)")
    assert containers_created(started) == [] and not out.exists()


def test_image_of_another_agent_is_refused_from_its_labels(tmp_path, codex_image, containers_created):
    started = time.time()
    result, out = _replay(tmp_path, "--image", codex_image, "--agent", "claude-code")
    line = _one_line(result, 2)
    assert line == (
        f"image {codex_image} holds codex 0.149.0, not claude-code "
        "(drop --image to use the claude-code image, or drop --agent)"
    )
    assert containers_created(started) == [] and not out.exists()


def test_image_labelled_with_another_version_is_refused_without_a_container(
    tmp_path, mislabelled_image, containers_created
):
    started = time.time()
    result, out = _replay(tmp_path, "--image", mislabelled_image)
    line = _one_line(result, 2)
    assert line == (
        f"image {mislabelled_image} has claude-code 2.1.219; pvisor 0.3.1 replays only 2.1.220 "
        "(pvisor-host build --agent claude-code)"
    )
    assert containers_created(started) == [] and not out.exists()


def test_image_without_pvisor_is_refused_after_a_probe(tmp_path, base_image, containers_created):
    started = time.time()
    result, out = _replay(tmp_path, "--image", base_image, "--agent", "claude-code")
    line = _one_line(result, 2)
    assert line == (
        f"image {base_image} has no pvisor; pvisor-host needs pvisor 0.3.1 in the image "
        "(pvisor-host build --agent claude-code)"
    )
    roles = [c.get("pvisor-host.role") for c in containers_created(started)]
    assert roles == ["probe"]  # the host cannot tell without looking; no replay container ran
    assert not out.exists()


def test_image_with_the_wrong_agent_version_is_refused_after_a_probe(tmp_path, fake_claude_image, containers_created):
    started = time.time()
    result, out = _replay(tmp_path, "--image", fake_claude_image, "--agent", "claude-code")
    line = _one_line(result, 2)
    assert line == (
        f"image {fake_claude_image} has /usr/local/lib/node_modules/@anthropic-ai/claude-code/bin/claude.exe "
        "--version printing '2.1.219 (Claude Code)'; claude-code must be exactly 2.1.220 "
        "(pvisor-host build --agent claude-code)"
    )
    assert [c.get("pvisor-host.role") for c in containers_created(started)] == ["probe"]
    assert not out.exists()


def test_an_unlabelled_image_is_probed_for_the_agent_its_trajectory_names(tmp_path, base_image):
    result, _ = _replay(tmp_path, "--image", base_image)  # no --agent: the trajectory is Claude Code's
    line = _one_line(result, 2)
    assert line == (
        f"image {base_image} has no pvisor; pvisor-host needs pvisor 0.3.1 in the image "
        "(pvisor-host build --agent claude-code)"
    )


@pytest.mark.slow
def test_pip_install_into_a_fresh_venv_outside_the_repo(tmp_path, claude_image):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check", str(ROOT)],
        check=True,
        cwd=tmp_path,
        timeout=900,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run(
        [str(venv / "bin" / "pvisor-host"), "build", "--agent", "claude-code", "--json"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    built = json.loads(done.stdout)
    assert built["tag"] == claude_image and built["cached"] is True
    installed = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import pvisor_host, sys; print(pvisor_host.__file__)"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        check=True,
    )
    assert str(ROOT) not in installed.stdout  # the wheel's copy, not the checkout
    assert find_image(__import__("docker").from_env(), claude_image) is not None
