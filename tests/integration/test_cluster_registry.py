"""``batch --cluster --registry``: the driver pushes the image once and every node pulls it by digest. On the
session's cluster and registry (``conftest.py``), whose nodes are first made to lack the image."""

from __future__ import annotations

import json

import pytest

from cluster import batch, records, slow_manifest, summary

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def test_with_a_registry_the_nodes_pull_the_image_by_its_digest(
    docker_client, tmp_path, claude_image, ray_cluster, cluster_registry
):
    cluster, registry = ray_cluster, cluster_registry
    image_id = docker_client.images.get(claude_image).id
    repository, _, tag = claude_image.rpartition(":")
    for name in cluster.nodes:  # the cluster's other tests shipped it (docker load): no node has it now
        node = docker_client.containers.get(name)
        node.exec_run(["docker", "image", "rm", "--force", image_id])
        assert node.exec_run(["docker", "image", "inspect", image_id]).exit_code == 1
    manifest = slow_manifest(tmp_path / "data", 4, 3)  # four at once on four slots: both nodes take items
    args = ("--cluster", cluster.address, "--registry", registry.name)
    result = batch(manifest, tmp_path / "out", *args, env=cluster.env)
    assert result.code == 0, result.stderr
    assert summary(tmp_path / "out")["counts"] == {"ok": 4}
    pushed = registry.digests(repository)
    assert len(pushed) == 1  # under its content-hash tag, whichever batch of the session pushed it first
    assert claude_image in docker_client.images.get(image_id).tags  # the driver's engine keeps its own name
    for name in cluster.nodes:  # each node pulled exactly that digest (a load sets none) and has the tag
        done = docker_client.containers.get(name).exec_run(
            ["docker", "image", "inspect", "--format", "{{.Id}} {{json .RepoDigests}} {{json .RepoTags}}", image_id]
        )
        assert done.exit_code == 0, done.output
        found_id, digests, tags = done.output.decode().split()
        assert found_id == image_id
        assert json.loads(digests) == [f"{registry.name}/{repository}@{pushed[0]}"]
        assert json.loads(tags) == [claude_image]
        assert cluster.node_containers(name) == []
    assert {r["host"]["node"] for r in records(tmp_path / "out").values()} == set(cluster.nodes)
    again = batch(manifest, tmp_path / "out", *args, env=cluster.env)
    assert again.code == 0, again.stderr
    assert (summary(tmp_path / "out")["skipped"], summary(tmp_path / "out")["ran"]) == (4, 0)  # resumed
