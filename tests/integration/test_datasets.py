"""Datasets of task images, for real: a real registry (Debian's ``docker-registry``) holding task images made
here, reached through a proxy that misbehaves on purpose (``tests/registryproxy.py``); real pulls by the
real engine, real sandboxes with the agent injected, real records."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import time
from pathlib import Path

import docker.errors
import pytest

from pvisor_host.backend.docker.image.pull import PATIENCE_ENV

from cluster import Registry
from conftest import DATA, run_cli, start_cli
from registryproxy import RegistryProxy
from trajgen import Call, Turn, claude_session, mini_trajectory, write_jsonl

pytestmark = pytest.mark.usefixtures("runtime_volumes_removed_afterwards")

TASKS = 10
#: The trajectory every task item replays: it reads the task's README from the image's own /app.
SESSION = claude_session(
    "Read the task.", [Turn([Call("Bash", {"command": "cat README && echo done > done.txt"}, "task\ndone\n")])],
    cwd="/app",
)  # fmt: skip


def task_dockerfile(base: str, n: int, megabytes: int) -> str:
    return (
        f"FROM {base}\n"
        f"RUN mkdir -p /app && echo 'task {n}' > /app/README "
        f"&& head -c {megabytes * 1024 * 1024} /dev/urandom > /opt/task-{n}.bin\n"
        "LABEL pvisor-host.test=task-image\n"
    )


@pytest.fixture(scope="module")
def registry(docker_client, node_image):
    with Registry(docker_client) as running:
        yield running


@pytest.fixture(scope="module")
def task_images(docker_client, registry, base_image) -> list[str]:
    """``task/t0:v1`` ... in the registry (2 MB of their own each; ``task/big:v1`` has 40 MB), none on the
    engine. Their names here are the registry's own address; tests pull them through a proxy."""
    names = [f"task/t{n}:v1" for n in range(TASKS)] + ["task/big:v1"]
    for n, name in enumerate(names):
        size = 40 if name == "task/big:v1" else 2
        image, _ = docker_client.images.build(
            fileobj=io.BytesIO(task_dockerfile(base_image, n, size).encode()), rm=True, forcerm=True
        )
        repository, tag = f"{registry.name}/{name}".rsplit(":", 1)
        image.tag(repository, tag)
        for line in docker_client.images.push(repository, tag, stream=True, decode=True):
            assert "error" not in line, line
        docker_client.images.remove(f"{repository}:{tag}")
    return names


@pytest.fixture
def proxy(registry, task_images):
    with RegistryProxy(registry.name) as running:
        yield running


def via(proxy: RegistryProxy, name: str) -> str:
    return f"{proxy.name}/{name}"


def absent(docker_client, *refs: str) -> None:
    """The engine holds none of ``refs`` (a test that left one must not make the next one pass)."""
    for ref in refs:
        with contextlib.suppress(docker.errors.ImageNotFound):
            docker_client.images.remove(ref)


def present(docker_client, ref: str) -> bool:
    try:
        docker_client.images.get(ref)
    except docker.errors.ImageNotFound:
        return False
    return True


def manifest(root: Path, images: list[str], per_image: int, **fields: object) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    trajectory = write_jsonl(root / "task.jsonl", SESSION)
    lines = [
        {"id": f"{image.rsplit('/', 1)[-1].replace(':', '-')}-{n}", "trajectory": str(trajectory), "after_step": 1,
         "image": image, **fields}
        for n in range(per_image) for image in images
    ]  # fmt: skip
    path = root / "m.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def batch(path: Path, out: Path, *args: str, env: dict[str, str] | None = None):
    return run_cli("batch", path, "--agent", "claude-code", "--inject", "--image-workspace", "--workspace-path",
                   "/app", "--mode", "replay-only", "--out", out, "--json", *args, env=env)  # fmt: skip


def test_a_dataset_within_a_disk_budget(docker_client, proxy, task_images, tmp_path, claude_image):
    refs = [via(proxy, name) for name in task_images[:TASKS]]
    absent(docker_client, *refs)
    mine = refs[-1]
    docker_client.images.pull(mine)  # on the engine before the batch: never the batch's to remove
    size = docker_client.images.get(mine).attrs["Size"]
    budget = int(size * 2.5)  # room for two task images at once
    result = batch(manifest(tmp_path / "data", refs, 2), tmp_path / "out", "--workers", "2",
                   "--image-budget", str(budget))  # fmt: skip
    assert result.code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["counts"] == {"ok": 2 * TASKS}
    images = summary["images"]
    assert (images["pulled"], images["removed"], images["failed"]) == (TASKS - 1, TASKS - 1, 0)
    assert images["budget"] == budget and 0 < images["peak"] <= budget
    assert present(docker_client, mine)  # left alone
    assert [ref for ref in refs[:-1] if present(docker_client, ref)] == []  # the batch's own: gone again
    for path in (tmp_path / "out").glob("*/record.json"):
        record = json.loads(path.read_text())
        assert record["image"]["digest"].startswith(f"{record['image']['ref'].rsplit(':', 1)[0]}@sha256:")
        assert (path.parent / "workspace" / "done.txt").read_text() == "done\n"  # the image's /app, copied
    absent(docker_client, mine)


def test_registry_faults_are_retried_and_a_rate_limit_is_waited_out(docker_client, proxy, task_images, tmp_path,
                                                                     claude_image):  # fmt: skip
    refs = [via(proxy, name) for name in task_images[:3]]
    absent(docker_client, *refs)
    proxy.fail_manifests(429, 4, retry_after=True)  # a rate limit for 4 s, then 5xx for 2 s
    proxy.fail_manifests(500, 6)
    proxy.drop_blobs(1)
    result = batch(manifest(tmp_path / "data", refs, 1), tmp_path / "out", "--workers", "2", "--pull-workers", "1")
    assert result.code == 0, result.stderr
    assert json.loads(result.stdout)["counts"] == {"ok": 3}
    asked = [seen for seen in proxy.answered(429) if "pvisor-host" in seen.agent and seen.method == "HEAD"]
    assert asked and asked[0].retry_after is not None  # the engine failed, we asked the registry how long to wait
    wait = float(asked[0].retry_after)
    later = [seen for seen in proxy.requests if seen.at > asked[0].at and "pvisor-host" not in seen.agent]
    assert later and later[0].at >= asked[0].at + wait - 0.2  # no pull, of any image, before it said
    assert proxy.answered(500) and len(proxy.answered(429)) <= 8  # waited out, not hammered


def test_an_image_that_does_not_exist_fails_its_items_and_the_others_run(docker_client, proxy, task_images,
                                                                       tmp_path, claude_image):  # fmt: skip
    good, gone = via(proxy, task_images[0]), via(proxy, "task/nope:v1")
    absent(docker_client, good)
    result = batch(manifest(tmp_path / "data", [good, gone], 2), tmp_path / "out", "--workers", "2")
    assert result.code == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if "task/nope" in line]
    assert len(lines) == 1 and "was not found in its registry" in lines[0]  # one line for the image
    summary = json.loads(result.stdout)
    assert summary["counts"] == {"ok": 2, "rejected": 2} and summary["categories"] == {"image_not_found": 2}
    results = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    refused = [r for r in results if r["status"] == "rejected"]
    assert len(refused) == 2
    for item in refused:
        assert item["message"].startswith(f"image {gone} was not found in its registry (")
        assert "\n" not in item["message"]


def test_kill_9_mid_pull_then_the_same_batch_resumes_and_gc_cleans_up(docker_client, proxy, task_images, tmp_path,
                                                                      claude_image):  # fmt: skip
    small, big = via(proxy, task_images[0]), via(proxy, "task/big:v1")
    absent(docker_client, small, big)
    data = manifest(tmp_path / "data", [small, big], 1)
    proxy.slow_blobs = 2 * 1024 * 1024  # the big image's 40 MB take 20 s
    process = start_cli("batch", data, "--agent", "claude-code", "--inject", "--image-workspace",
                        "--workspace-path", "/app", "--mode", "replay-only", "--out", tmp_path / "out",
                        "--workers", "1", "--pull-workers", "2")  # fmt: skip
    big_blobs = f"/v2/{big.split('/', 1)[1].split(':')[0]}/blobs/"

    def big_layer_on_its_way() -> bool:  # the engine has its config and asks for its layer (the base's are here)
        return sum(s.method == "GET" and s.status == 200 and s.path.startswith(big_blobs)
                   and "pvisor-host" not in s.agent for s in proxy.requests) >= 2  # fmt: skip

    deadline = time.monotonic() + 120
    while not (present(docker_client, small) and big_layer_on_its_way()):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1]
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=30)
    proxy.slow_blobs = None
    listed = run_cli("images", "--json")
    assert listed.code == 0, listed.stderr
    ours = [e for e in json.loads(listed.stdout) if e["role"] == "pulled" and e["name"].startswith(proxy.name)]
    assert [e["name"] for e in ours] == [small]
    swept = run_cli("gc", "--json")
    assert swept.code == 0, swept.stderr
    assert {(r["kind"], r["name"]) for r in json.loads(swept.stdout)["orphans"]} >= {("image", small)}
    assert not present(docker_client, small)
    again = batch(data, tmp_path / "out", "--workers", "1")
    assert again.code == 0, again.stderr
    assert json.loads(again.stdout)["counts"] == {"ok": 2}
    for path in (tmp_path / "out").glob("*/record.json"):  # whole images, exactly the registry's
        record = json.loads(path.read_text())
        name = record["image"]["ref"].removeprefix(f"{proxy.name}/")
        assert record["status"] == "ok" and record["image"]["id"] == config_digest(proxy.registry, name)
    assert run_cli("gc", "--json").code == 0


def config_digest(registry: str, name: str) -> str:
    """The id an image pulled from ``registry`` gets: its manifest's config digest, asked of the registry."""
    import urllib.request

    repository, tag = name.rsplit(":", 1)
    request = urllib.request.Request(
        f"http://{registry}/v2/{repository}/manifests/{tag}",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return str(json.load(answer)["config"]["digest"])


def test_build_push_then_replay_by_digest_on_an_engine_without_the_image(docker_client, registry, codex_image,
                                                                          tmp_path):  # fmt: skip
    built = run_cli("build", "--agent", "codex", "--push", registry.name, "--json")
    assert built.code == 0, built.stderr
    pushed = json.loads(built.stdout)["pushed"]
    repository, tag = codex_image.rsplit(":", 1)
    assert pushed.startswith(f"{registry.name}/{repository}@sha256:")
    image_id = docker_client.images.get(codex_image).id
    try:
        docker_client.images.remove(codex_image)  # the tag, and with it the image (the push left no name behind)
        with pytest.raises(docker.errors.ImageNotFound):
            docker_client.images.get(image_id)
        trajectory = DATA / "trajectories" / "codex-contract-shape.jsonl"
        done = run_cli("replay", "--image", pushed, "--trajectory", trajectory, "--after-step", "1",
                       "--mode", "replay-only", "--out", tmp_path / "run", "--json")  # fmt: skip
        assert done.code == 0, done.stderr
        record = json.loads(done.stdout)
        assert (record["image"]["ref"], record["image"]["id"], record["image"]["digest"]) == (pushed, image_id, pushed)
        assert (record["image"]["agent"], record["image"]["verified_by"]) == ("codex", "labels")
    finally:  # the session's other tests find the image under its tag again
        if not any(t == codex_image for i in docker_client.images.list() for t in i.tags):
            docker_client.images.pull(pushed)
            docker_client.images.get(image_id).tag(repository, tag)
            docker_client.images.remove(pushed)  # as it was: the tag, no registry name


def test_prepare_only_needs_no_agent_runtime(tmp_path, docker_client, base_image):
    lines = [
        {"id": "opencode", "trajectory": str(DATA / "trajectories" / "opencode-contract-shape.jsonl"),
         "after_step": 1, "agent": "opencode"},
        {"id": "swe-agent", "trajectory": str(DATA / "trajectories" / "swe-agent-b-replay-0.json"),
         "after_step": 1, "agent": "swe-agent"},
    ]  # fmt: skip
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = run_cli("batch", path, "--mode", "prepare-only", "--out", tmp_path / "out", "--json")
    assert result.code == 0, result.stderr
    assert json.loads(result.stdout)["counts"] == {"ok": 2}
    for item in ("opencode", "swe-agent"):
        record = json.loads((tmp_path / "out" / item / "record.json").read_text())
        assert record["result"]["phase"] == "prepared" and record["result"]["replayed_tool_calls"] == 0
        assert record["image"]["ref"].startswith("pvisor-host/pvisor:0.3.1-")
        assert docker_client.images.get(record["image"]["id"]).labels.get("pvisor-host.agent") is None


def test_mini_swe_agent_replay_only_needs_no_model_name(tmp_path, agent_image):
    agent_image("mini-swe-agent")
    trajectory = tmp_path / "mini.json"
    turns = [Turn([Call("bash", {"command": "echo hi > f.txt"}, "")])]
    trajectory.write_text(json.dumps(mini_trajectory("Write f.txt.", turns, model_name=None)))
    done = run_cli("replay", "--agent", "mini-swe-agent", "--trajectory", trajectory, "--after-step", "1",
                   "--mode", "replay-only", "--out", tmp_path / "run", "--json")  # fmt: skip
    assert done.code == 0, done.stderr
    record = json.loads(done.stdout)
    assert (record["status"], record["result"]["phase"]) == ("ok", "replayed")
    assert (tmp_path / "run" / "workspace" / "f.txt").read_text() == "hi\n"


# -- one image cache per engine (issue 28) --------------------------------------------------------------------


def test_two_batches_on_one_engine_keep_one_budget_and_never_remove_what_the_other_uses(docker_client, proxy,
                                                                                        task_images, tmp_path,
                                                                                        claude_image):  # fmt: skip
    first, second = [via(proxy, n) for n in task_images[:3]], [via(proxy, n) for n in task_images[3:6]]
    absent(docker_client, *first, *second)
    docker_client.images.pull(first[0])
    one = docker_client.images.get(first[0]).attrs["Size"]
    absent(docker_client, first[0])
    budget = one + 6 * 2**20  # the shared base once, and room for three of the images' own 2 MB
    args = ("--agent", "claude-code", "--inject", "--image-workspace", "--workspace-path", "/app", "--mode",
            "replay-only", "--json", "--workers", "2")  # fmt: skip
    running = [  # the second asks for twice the room: it keeps to the first's all the same
        start_cli("batch", manifest(tmp_path / name, refs, 2), "--out", tmp_path / f"{name}-out", *args,
                  "--image-budget", str(budget * times))
        for name, refs, times in (("a", first, 1), ("b", second, 2))
    ]  # fmt: skip
    outcomes = [process.communicate(timeout=300) for process in running]
    for process, (stdout, stderr) in zip(running, outcomes, strict=True):
        assert process.returncode == 0, stderr[-3000:]
        summary = json.loads(stdout)
        assert summary["counts"] == {"ok": 6}  # an image removed under a sandbox would fail its item
        assert 0 < summary["images"]["peak"] <= budget  # both batches' images, each layer once, within the smaller
    shared = "another batch on this engine keeps the image cache within"
    assert [shared in stderr for _, stderr in outcomes] == [False, True], outcomes[1][1][-3000:]
    assert [ref for ref in first + second if present(docker_client, ref)] == []


def test_ctrl_c_mid_pull_on_a_throttled_blob_ends_within_10_seconds_and_a_rerun_completes(docker_client, proxy,
                                                                                          task_images, tmp_path,
                                                                                          claude_image):  # fmt: skip
    big = via(proxy, "task/big:v1")
    absent(docker_client, big)
    data = manifest(tmp_path / "data", [big], 1)
    proxy.slow_blobs = 256 * 1024  # its 40 MB would take minutes
    process = start_cli("batch", data, "--agent", "claude-code", "--inject", "--mode", "replay-only", "--out",
                        tmp_path / "out", "--quiet")  # fmt: skip
    deadline = time.monotonic() + 120
    while not any("/blobs/" in seen.path and seen.status == 200 for seen in proxy.requests):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1]
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=10)  # the requirement itself: within 10 s
    assert process.returncode == 130, stderr
    assert not present(docker_client, big)  # nothing half-pulled is left to be used
    proxy.slow_blobs = None
    again = batch(data, tmp_path / "out")
    assert again.code == 0, again.stderr
    assert json.loads(again.stdout)["counts"] == {"ok": 1}
    record = json.loads((tmp_path / "out" / "big-v1-0" / "record.json").read_text())
    assert record["image"]["id"] == config_digest(proxy.registry, "task/big:v1")


def test_a_registry_outage_is_an_infrastructure_error_after_the_pulls_patience(docker_client, proxy, task_images,
                                                                              tmp_path, claude_image):  # fmt: skip
    ref = via(proxy, task_images[0])
    absent(docker_client, ref)
    proxy.fail_manifests(503, 60)
    result = batch(manifest(tmp_path / "data", [ref], 1), tmp_path / "out", env={PATIENCE_ENV: "3"})
    assert result.code == 6, result.stderr  # as on a cluster (test_cluster_datasets.py): the same outcome
    summary = json.loads(result.stdout)
    assert summary["counts"] == {"infra_error": 1} and summary["categories"] == {"registry_error": 1}
    (item,) = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert item["message"].startswith(f"pulling {ref} kept failing for ")


def test_a_dataset_named_under_docker_hub_is_pulled_through_the_mirror(docker_client, registry, task_images,
                                                                      tmp_path, claude_image):  # fmt: skip
    names = task_images[:2]  # task/t0:v1 ...: Docker Hub names; nothing may go to Docker Hub
    absent(docker_client, *names)
    with Registry(docker_client, mirror_of=registry.for_nodes) as mirror, RegistryProxy(mirror.name) as watched:
        result = batch(manifest(tmp_path / "data", names, 1), tmp_path / "out", "--registry-mirror", watched.name)
        pulled = {seen.path for seen in watched.requests if "/manifests/" in seen.path and seen.status == 200}
    assert result.code == 0, result.stderr
    assert json.loads(result.stdout)["counts"] == {"ok": 2}
    assert {path.split("/manifests/")[0] for path in pulled} == {"/v2/task/t0", "/v2/task/t1"}
    for path in (tmp_path / "out").glob("*/record.json"):
        record = json.loads(path.read_text())
        assert record["image"]["ref"] in names  # the dataset's own name
        assert record["image"]["id"] == config_digest(registry.name, record["image"]["ref"])
    assert [name for name in names if present(docker_client, name)] == []
