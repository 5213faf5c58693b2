"""``batch --cluster --registry``: the driver pushes the image once and every node pulls it by digest. Its
own cluster (nodes with fresh engines), so it lives in a module of its own: the other cluster tests share
one cluster for their module, and two clusters at once would compete for this machine."""

from __future__ import annotations

import json

import pytest

from cluster import Cluster, Registry, batch, records, remove_engines, slow_manifest, summary

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def node_engines(docker_client):
    yield
    remove_engines(docker_client)


def test_with_a_registry_the_nodes_pull_the_image_by_its_digest(docker_client, tmp_path, claude_image):
    image_id = docker_client.images.get(claude_image).id
    repository, _, tag = claude_image.rpartition(":")
    with (
        Registry(docker_client) as registry,
        Cluster(docker_client, nodes=2, slots=1, fresh=True, registry=registry.for_nodes) as cluster,
    ):
        manifest = slow_manifest(tmp_path / "data", 4, 0)
        result = batch(manifest, tmp_path / "out", "--cluster", cluster.address, "--registry", registry.name,
                       env=cluster.env)  # fmt: skip
        assert result.code == 0, result.stderr
        assert summary(tmp_path / "out")["counts"] == {"ok": 4}
        pushed = registry.digests(repository)
        assert len(pushed) == 1  # pushed once, under its content-hash tag
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
        again = batch(manifest, tmp_path / "out", "--cluster", cluster.address, "--registry", registry.name,
                      env=cluster.env)  # fmt: skip
        assert again.code == 0, again.stderr
        assert (summary(tmp_path / "out")["skipped"], summary(tmp_path / "out")["ran"]) == (4, 0)  # resumed
