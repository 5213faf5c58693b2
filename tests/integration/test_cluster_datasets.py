"""A dataset of task images across a cluster: ``batch --cluster --inject`` on a real Ray cluster of two
engine-in-container nodes and a real registry. The driver resolves each task image to its digest and pulls
nothing; each node pulls the task images of the items Ray runs there, fills its own runtime volume, and keeps
its pulls within its own budget; the items of one image go to one node where Ray can. On the session's cluster
and registry (``conftest.py``)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import docker.errors
import pytest

from pvisor_host.backend.docker.image.pull import PATIENCE_ENV

from cluster import Cluster, Registry, records, summary
from conftest import default_signals, run_cli
from registryproxy import RegistryProxy
from trajgen import Call, Turn, claude_session, write_jsonl

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.usefixtures("runtime_volumes_removed_afterwards")]

IMAGES = 3
PER_IMAGE = 4
SESSION = claude_session("Read the task.", [Turn([Call("Bash", {"command": "cat README"}, "task\n")])], cwd="/app")


@pytest.fixture(scope="module")
def setup(docker_client, base_image, ray_cluster, cluster_registry):
    """The session's cluster and its registry, with the task images (``task/c0:v1`` ...: the base image and 20 MB
    of their own each; none on the host's engine or a node's). The sizes are each image's own layers': the nodes
    hold the base image already, so a pull brings (and a node's budget counts) only those."""
    base = int(docker_client.images.get(base_image).attrs["Size"])
    refs = push_task_images(docker_client, cluster_registry, base_image, "v1", [20] * IMAGES)
    sizes = [int(docker_client.images.get(ref).attrs["Size"]) - base for ref in refs]
    for ref in refs:
        docker_client.images.remove(ref)
    return ray_cluster, cluster_registry, refs, sizes


@pytest.fixture(scope="module")
def big_task_image(setup, docker_client, base_image) -> str:
    """A task image of 300 MB of its own in the cluster's registry (none on an engine): a pull long enough to kill
    a node during (only the fault test's: the others' setup does without its build and push)."""
    (ref,) = push_task_images(docker_client, setup[1], base_image, "v1", [300], first=IMAGES)
    docker_client.images.remove(ref)
    return ref


def push_task_images(
    docker_client, registry: Registry, base_image: str, tag: str, megabytes: list[int], first: int = 0
) -> list[str]:
    """``task/c<n>:<tag>`` from ``n = first``: the base image and ``megabytes[n - first]`` MB of random bytes of its
    own, pushed (and left on the host's engine for the caller to measure, then remove)."""
    refs = []
    for n, size in enumerate(megabytes, start=first):
        dockerfile = (f"FROM {base_image}\nRUN mkdir -p /app && echo 'task {n}' > /app/README "
                      f"&& head -c {size * 2**20} /dev/urandom > /opt/task.bin\n")  # fmt: skip
        image, _ = docker_client.images.build(fileobj=io.BytesIO(dockerfile.encode()), rm=True, forcerm=True)
        repository = f"{registry.name}/task/c{n}"
        image.tag(repository, tag)
        for line in docker_client.images.push(repository, tag, stream=True, decode=True):
            assert "error" not in line, line
        refs.append(f"{repository}:{tag}")
    return refs


def manifest(root: Path, refs: list[str], per_image: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    trajectory = write_jsonl(root / "task.jsonl", SESSION)
    lines = [{"id": f"{ref.rsplit('/', 1)[-1].replace(':', '-')}-{n}", "trajectory": str(trajectory),
              "after_step": 1, "image": ref} for ref in refs for n in range(per_image)]  # fmt: skip
    path = root / "m.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def batch(path: Path, out: Path, *args: str, env: dict[str, str] | None = None):
    return run_cli("batch", path, "--agent", "claude-code", "--inject", "--image-workspace", "--workspace-path",
                   "/app", "--mode", "replay-only", "--out", out, "--quiet", "--json", *args, env=env)  # fmt: skip


def holders(cluster: Cluster, docker_client, image_id: str) -> list[str]:
    """The nodes whose engine holds the image."""
    found = []
    for name in cluster.nodes:
        done = docker_client.containers.get(name).exec_run(["docker", "image", "inspect", "--format", "{{.Id}}",
                                                            image_id])  # fmt: skip
        if done.exit_code == 0:
            found.append(name)
    return found


def test_task_images_are_pulled_by_the_nodes_near_their_items(setup, docker_client, tmp_path):
    cluster, registry, refs, _ = setup
    path = manifest(tmp_path / "data", refs[:IMAGES], PER_IMAGE)
    out = tmp_path / "cluster"
    done = batch(path, out, "--cluster", cluster.address, "--registry", registry.name, env=cluster.env)
    assert done.code == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["counts"] == {"ok": IMAGES * PER_IMAGE}
    ran = records(out)
    assert {r["host"]["node"] for r in ran.values()} == set(cluster.nodes)  # both nodes ran items
    ids = {r["image"]["ref"]: r["image"]["id"] for r in ran.values()}
    assert set(ids) == set(refs[:IMAGES])
    for image_id in ids.values():
        with pytest.raises(docker.errors.ImageNotFound):
            docker_client.images.get(image_id)  # the driver pulled none of them
    assert all(r["image"]["digest"].startswith(f"{registry.name}/task/c") for r in ran.values())
    pulls = sum(len(holders(cluster, docker_client, image_id)) for image_id in ids.values())
    assert IMAGES <= pulls <= 1.5 * IMAGES, pulls  # locality: an image is pulled about once, not once per node
    assert result["images"]["node_pulls"] == pulls
    # The same batch on one engine: the same workspaces (the image's /app, copied once per image and node), and
    # compare sees no change at all.
    local = tmp_path / "local"
    here = batch(path, local, "--workers", "4")
    assert here.code == 0, here.stderr[-3000:]
    for item, record in records(local).items():
        assert record["workspace_changes"] == ran[item]["workspace_changes"]
    compared = run_cli("compare", local, out, "--json")
    assert compared.code == 0, compared.stderr
    assert json.loads(compared.stdout)["changes"] == []
    status = run_cli("cluster", "status", "--address", cluster.address, "--json", env=cluster.env)
    nodes = {n["node"]: n for n in json.loads(status.stdout)}
    assert sum(nodes[name]["task_images"] for name in cluster.nodes) == pulls


def test_a_node_budget_forces_removals_and_each_node_stays_within_it(setup, docker_client, tmp_path):
    cluster, registry, refs, sizes = setup
    budget = int(max(sizes[:IMAGES]) + 10 * 2**20)  # one task image's own 20 MB, and less than two
    path = manifest(tmp_path / "data", refs[:IMAGES], 2)
    out = tmp_path / "out"
    done = batch(path, out, "--cluster", cluster.address, "--registry", registry.name, "--image-budget", str(budget),
                 env=cluster.env)  # fmt: skip
    assert done.code == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["counts"] == {"ok": IMAGES * 2}
    status = run_cli("cluster", "status", "--address", cluster.address, "--json", env=cluster.env)
    for node in json.loads(status.stdout):
        if node["node"] in cluster.nodes:
            assert node["task_image_budget"] == budget
            assert node["task_image_peak"] <= budget, node
            assert node["task_images"] <= 1, node  # the others were removed to stay within it


@pytest.mark.faults  # `make test-faults` (CI runs it after `make test`)
def test_a_node_killed_while_it_pulls_loses_no_item(setup, big_task_image, docker_client, tmp_path):
    cluster, registry, _, _ = setup
    path = manifest(tmp_path / "data", [big_task_image], 4)
    out = tmp_path / "out"
    environment = {**os.environ, **cluster.env, "PVISOR_HOST_CLUSTER_GRACE": "60"}
    command = [str(Path(sys.executable).parent / "pvisor-host"), "batch", str(path), "--agent", "claude-code",
               "--inject", "--mode", "replay-only", "--out", str(out), "--quiet", "--cluster", cluster.address,
               "--registry", registry.name]  # fmt: skip
    with subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=default_signals) as process:  # fmt: skip
        victim = _pulling_node(cluster, docker_client, process)
        node = docker_client.containers.get(victim)
        node.kill()
        try:
            stdout, stderr = process.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGINT)
            stdout, stderr = process.communicate(timeout=120)
        finally:
            node.start()  # the session's cluster gets its node back (it joins again, and sweeps)
    assert process.returncode == 0, stderr[-3000:]
    assert summary(out)["counts"] == {"ok": 4}
    ran = records(out)
    assert sorted(ran) == [f"c{IMAGES}-v1-{n}" for n in range(4)]  # every item, each once
    assert all(r["host"]["node"] != victim for r in ran.values())
    lost = [r for r in ran.values() if r["superseded"]]
    assert lost and all(s["node"] == victim for r in lost for s in r["superseded"])


def _pulling_node(cluster: Cluster, docker_client, process: subprocess.Popen[str], timeout: float = 300) -> str:
    """The first node seen pulling a task image (its image cache's ledger notes a pull), once the batch is under
    way."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in cluster.nodes:
            done = docker_client.containers.get(name).exec_run(
                ["sh", "-c", "cat ${PVISOR_HOST_STATE_DIR:-$HOME/.local/state/pvisor-host}/image-cache-*.json"]
            )
            if re.search(rb'"state":"pulling"', done.output):  # noted before the pull starts
                return name
        if process.poll() is not None:
            raise AssertionError(f"the batch ended first: {process.stderr.read()[-3000:] if process.stderr else ''}")
        time.sleep(0.2)
    raise AssertionError("no node started pulling")


def test_a_registry_outage_ends_as_it_does_on_one_engine(setup, docker_client, tmp_path):
    cluster, registry, refs, _ = setup
    with RegistryProxy(registry.name) as proxy:
        proxy.fail_manifests(503, 60)
        ref = f"{proxy.name}/{refs[0].split('/', 1)[1]}"
        done = batch(manifest(tmp_path / "data", [ref], 1), tmp_path / "out", "--cluster", cluster.address,
                     "--registry", registry.name, env={**cluster.env, PATIENCE_ENV: "3"})  # fmt: skip
    assert done.code == 6, done.stderr[-3000:]  # as test_datasets.py's outage on one engine
    result = json.loads(done.stdout)
    assert result["counts"] == {"infra_error": 1} and result["categories"] == {"registry_error": 1}


@pytest.mark.faults
def test_node_join_restarted_mid_dataset_orphans_no_task_image(setup, docker_client, base_image, tmp_path):
    cluster, registry, _, _ = setup
    refs = push_task_images(docker_client, registry, base_image, "v2", [20] * IMAGES)  # no node holds them yet
    for ref in refs:
        docker_client.images.remove(ref)
    path = manifest(tmp_path / "data", refs[:IMAGES], PER_IMAGE)
    command = [str(Path(sys.executable).parent / "pvisor-host"), "batch", str(path), "--agent", "claude-code",
               "--inject", "--mode", "replay-only", "--out", str(tmp_path / "out"), "--quiet", "--cluster",
               cluster.address, "--registry", registry.name]  # fmt: skip
    environment = {**os.environ, **cluster.env, "PVISOR_HOST_CLUSTER_GRACE": "60"}
    with subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=default_signals) as process:  # fmt: skip
        victim = _pulling_node(cluster, docker_client, process)
        docker_client.containers.get(victim).restart(timeout=0)  # `node join` again: its scratch folder goes
        _, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-3000:]
    cluster.wait_for_nodes(2)
    for name in cluster.nodes:  # every task image a node's engine holds is in its image cache, which gc reads
        node = docker_client.containers.get(name)
        deadline = time.monotonic() + 120
        while node.exec_run(["docker", "version"]).exit_code != 0:  # the restarted node's engine comes up
            assert time.monotonic() < deadline, cluster.node_logs(name)[-2000:]
            time.sleep(0.5)
        listed = node.exec_run(["python3", "-m", "pvisor_host", "images", "--json"])
        assert listed.exit_code == 0, listed.output.decode(errors="replace")[-2000:]
        known = {e["id"] for e in json.loads(listed.output) if e["role"] == "pulled"}
        ids = node.exec_run(["sh", "-c", f"docker images -q --no-trunc '{registry.name}/task/*'"])
        assert set(ids.output.decode().split()) <= known, (name, ids.output, known)
