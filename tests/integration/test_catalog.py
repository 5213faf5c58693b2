"""`images`, `images prune` and `doctor` against the real engine."""

from __future__ import annotations

import contextlib
import io
import json
from datetime import UTC, datetime, timedelta

import docker
import pytest

from conftest import run_cli

pytestmark = pytest.mark.docker


def test_images_lists_what_pvisor_host_built(claude_image, codex_image, docker_client, tmp_path):
    state = {"PVISOR_HOST_STATE_DIR": str(tmp_path / "state")}
    # An untagged image that inherited our labels, as the builder leaves them (whatever this engine's history).
    layer, _ = docker_client.images.build(
        fileobj=io.BytesIO(b"FROM scratch\nLABEL pvisor-host.managed=true pvisor-host.role=base\n"), rm=True
    )
    try:
        _lists_what_pvisor_host_built(claude_image, codex_image, state, layer.id)
    finally:
        with contextlib.suppress(docker.errors.ImageNotFound):
            docker_client.images.remove(layer.id, force=True)


def _lists_what_pvisor_host_built(claude_image: str, codex_image: str, state: dict[str, str], layer: str) -> None:
    result = run_cli("images", "--json", env=state)
    assert result.code == 0, result.stderr
    listed = json.loads(result.stdout)
    entries = {e["name"] if e["name"] != "<none>" else e["id"]: e for e in listed}
    claude = entries[claude_image]
    assert (claude["kind"], claude["role"], claude["agent"], claude["agent_version"], claude["pvisor_version"]) == (
        "image",
        "sandbox-image",
        "claude-code",
        "2.1.220",
        "0.3.1",
    )
    assert claude["size"] > 100 * 2**20 and claude["last_used"] is None
    assert entries[codex_image]["agent"] == "codex"
    assert all(e["name"].startswith(("pvisor-host", "<none>")) for e in listed)
    assert next(e for e in entries.values() if e["id"] == layer)["role"] == "build-cache"
    # Only what a user can act on: the builder's untagged intermediate layers are counted, not listed. On a new
    # engine the slow agent images build in the background meanwhile (their steps' layers come and go), so
    # the counts are compared within a window where the listing did not change.
    for _ in range(20):
        before = _build_layers(state)
        table = run_cli("images", env=state)
        everything = run_cli("images", "--all", env=state)
        if _build_layers(state) == before:
            break
    else:
        pytest.fail("the build layers changed during each of 20 listings: no window to compare the counts in")
    layers = len(before)
    assert table.code == 0 and claude_image in table.stdout and "sandbox-image" in table.stdout
    assert "<none>" not in table.stdout
    assert f"{layers} intermediate build layers not shown" in table.stdout, table.stdout
    assert everything.code == 0 and everything.stdout.count("<none> ") == layers
    assert "intermediate build layers not shown" not in everything.stdout


def _build_layers(state: dict[str, str]) -> set[str]:
    """The ids of the intermediate build layers ``images`` counts."""
    listed = run_cli("images", "--json", env=state)
    assert listed.code == 0, listed.stderr
    return {e["id"] for e in json.loads(listed.stdout) if e["role"] == "build-cache"}


@pytest.fixture
def throwaway_images(docker_client, tmp_path):
    tags = []
    for name in ("old", "busy", "recent"):
        tag = f"pvisor-host/prune-test-{name}:1"
        context = tmp_path / f"ctx-{name}"
        context.mkdir()
        (context / f"{name}.txt").write_text(name * 1000)
        (context / "Dockerfile").write_text(
            f"FROM scratch\nCOPY {name}.txt /{name}.txt\nLABEL pvisor-host.managed=true pvisor-host.role=test-image\n"
        )
        docker_client.images.build(path=str(context), tag=tag, rm=True)
        tags.append(tag)
    busy = docker_client.containers.create(tags[1], command=["/nonexistent"], labels={"pvisor-host.managed": "true"})
    yield {tag.split("-")[-1].split(":")[0]: docker_client.images.get(tag).id for tag in tags}
    busy.remove(force=True)
    for tag in tags:
        with contextlib.suppress(docker.errors.ImageNotFound):
            docker_client.images.remove(tag, force=True)


def _usage_file(tmp_path, docker_client, ages: dict[str, timedelta]) -> dict[str, str]:
    """A state dir where every pvisor-host image was used just now, except the given ids."""
    from pvisor_host.backend.docker.cleanup.catalog import list_catalog

    now = datetime.now(UTC)
    data = {e.id: now.isoformat() for e in list_catalog(docker_client)}
    data |= {image_id: (now - age).isoformat() for image_id, age in ages.items()}
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    (state / "last-used.json").write_text(json.dumps(data))
    return {"PVISOR_HOST_STATE_DIR": str(state)}


def test_prune_older_than_removes_only_unused_old_images(tmp_path, docker_client, throwaway_images, claude_image):
    ids = throwaway_images
    env = _usage_file(tmp_path, docker_client, {ids["old"]: timedelta(days=3), ids["busy"]: timedelta(days=3)})
    dry = run_cli("images", "prune", "--older-than", "2d", "--dry-run", "--json", env=env)
    assert dry.code == 0, dry.stderr
    planned = json.loads(dry.stdout)
    assert [e["name"] for e in planned["removed"]] == ["pvisor-host/prune-test-old:1"]
    assert docker_client.images.get("pvisor-host/prune-test-old:1")  # dry run removed nothing
    result = run_cli("images", "prune", "--older-than", "2d", "--json", env=env)
    assert result.code == 0, result.stderr
    done = json.loads(result.stdout)
    assert [e["name"] for e in done["removed"]] == ["pvisor-host/prune-test-old:1"]
    assert done["kept"] == {"pvisor-host/prune-test-busy:1": "in use by a container"}
    names = {t for i in docker_client.images.list() for t in i.tags}
    assert "pvisor-host/prune-test-old:1" not in names
    assert {"pvisor-host/prune-test-busy:1", "pvisor-host/prune-test-recent:1", claude_image} <= names


def test_prune_keep_bytes_removes_least_recently_used_first(tmp_path, docker_client, throwaway_images, claude_image):
    from pvisor_host.backend.docker.cleanup.catalog import list_catalog

    ids = throwaway_images
    env = _usage_file(tmp_path, docker_client, {ids["old"]: timedelta(days=9), ids["recent"]: timedelta(days=1)})
    entries = list_catalog(docker_client)
    old_size = next(e.size for e in entries if e.id == ids["old"])
    keep = sum(e.size for e in entries) - old_size
    result = run_cli("images", "prune", "--keep-bytes", str(keep), "--json", env=env)
    assert result.code == 0, result.stderr
    assert [e["name"] for e in json.loads(result.stdout)["removed"]] == ["pvisor-host/prune-test-old:1"]
    names = {t for i in docker_client.images.list() for t in i.tags}
    assert {"pvisor-host/prune-test-recent:1", claude_image} <= names


@pytest.mark.parametrize(
    "dockerfile",
    ["FROM scratch\nCOPY Dockerfile /x\n",
     # a user's task image built FROM one of ours: it inherits our labels, and is still not ours
     "FROM scratch\nCOPY Dockerfile /x\nLABEL pvisor-host.managed=true pvisor-host.role=base\n"],
    ids=["no-label", "inherited-label"],
)  # fmt: skip
def test_prune_never_touches_images_that_are_not_ours(tmp_path, docker_client, dockerfile):
    tag = "pvisor-host-test/not-ours:1"
    context = tmp_path / "ctx"
    context.mkdir()
    (context / "Dockerfile").write_text(dockerfile)
    docker_client.images.build(path=str(context), tag=tag, rm=True)
    try:
        env = _usage_file(tmp_path, docker_client, {})
        result = run_cli("images", "prune", "--keep-bytes", "1", "--dry-run", "--json", env=env)
        assert result.code == 0
        assert tag not in {e["name"] for e in json.loads(result.stdout)["removed"]}
        listed = run_cli("images", "--json", env=env)
        assert tag not in {e["name"] for e in json.loads(listed.stdout)}
    finally:
        docker_client.images.remove(tag, force=True)


def test_doctor_reports_a_ready_host(claude_image, codex_image):
    result = run_cli("doctor", "--json")
    assert result.code == 0, result.stderr
    report = json.loads(result.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] is True
    assert checks["engine"]["status"] == "ok" and checks["engine"]["detail"].startswith("Docker ")
    assert checks["pvisor on the host"]["status"] == "ok"
    assert checks["architecture"]["status"] == "ok"
    assert checks["runtimes"]["detail"].startswith("runc (default)")
    assert checks["disk"]["status"] in ("ok", "warn")
    assert checks["registry"]["status"] in ("ok", "warn")
    assert checks["image claude-code"] == {
        "name": "image claude-code",
        "status": "ok",
        "detail": claude_image,
        "fix": None,
        "required": False,
    }
    assert checks["image opencode"]["detail"] == "cannot be built here"
    text = run_cli("doctor")
    assert text.code == 0 and f"ok   image codex: {codex_image}" in text.stdout


def test_doctor_says_how_to_fix_a_missing_engine():
    result = run_cli("doctor", env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert result.code == 3
    first = result.stdout.splitlines()[0]
    assert first.startswith("FAIL engine: no Docker engine answers at unix:///nonexistent/docker.sock")
    assert "→ start dockerd (`make engine` installs and starts one on Debian) or set DOCKER_HOST" in first
