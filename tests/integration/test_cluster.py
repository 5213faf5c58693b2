"""``batch --cluster`` on a real Ray cluster: a head on this host and two nodes, each a container running its
own Docker engine and ``pvisor-host node join`` (``tests/cluster.py``). Real images, shipped to the nodes
with ``docker save`` and ``docker load``; real pvisor; a stub model for continuations, reached through
each node's own gateway."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import docker.errors
import pytest

from cluster import KEY, Cluster, batch, explain, one, records, slow_manifest, summary
from conftest import default_signals, run_cli
from modelserver import StubServer
from trajgen import Call, Turn, claude_files_session, claude_session, write_jsonl

#: A tool call that prints what a URL answers (as the egress tests' own).
FETCH = ("python3 -c \"import sys, urllib.request as u\ntry: print(u.urlopen(sys.argv[1], timeout=30).read().decode())"
         "\nexcept Exception as e: print('failed:', e)\" ")  # fmt: skip

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def mixed_manifest(root: Path, model_url: str) -> Path:
    """30 items: replay-only (ok, a diverging observation, a stale Claude tool, a timeout), prepare-only,
    and live continuations through the gateway."""
    root.mkdir(parents=True, exist_ok=True)
    lines = []

    def add(item_id: str, events: list[dict], **fields: object) -> None:
        write_jsonl(root / f"{item_id}.jsonl", events)
        lines.append({"id": item_id, "trajectory": f"{item_id}.jsonl", "after_step": 1, **fields})

    for n in range(12):
        add(f"ok{n:02d}", one(f"echo {n}", f"{n}\n", n))
    for n in range(4):
        add(f"drift{n}", one(f"echo {n}", "something else\n", n))
    for n in range(4):
        add(f"prep{n}", one(f"echo {n}", f"{n}\n", n), mode="prepare-only")
    for n in range(2):
        # a stale Claude tool: pvisor's prepare-only on the host lets it by, the replay in the sandbox refuses it
        add(f"stale{n}", claude_session(f"Plan {n}.", [Turn([Call("TodoWrite", {"todos": []}, "ok")])]))
        add(f"slow{n}", one("sleep 60", n=n), timeout="4s")
    for n in range(6):
        add(f"live{n}", claude_files_session(), after_step=4, mode="continue", max_steps=8,
            model_base_url=model_url, model="stub-model", model_api_key_env="PVH_TEST_MODEL_KEY")  # fmt: skip
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return manifest


@pytest.fixture
def cluster(ray_cluster: Cluster) -> Iterator[Cluster]:
    """The session's cluster (``conftest.py``), with both nodes up (``cluster_whole``); after the test, no sandbox
    of ours is left on a node."""
    yield ray_cluster
    for name in ray_cluster.nodes:
        assert ray_cluster.node_containers(name) == [], f"{name} kept containers of ours"


def test_a_mixed_batch_across_two_nodes_ends_as_it_does_locally(cluster, tmp_path, claude_image):
    with StubServer(host=cluster.host) as stub:
        manifest = mixed_manifest(tmp_path / "data", stub.base_url)
        on_cluster = batch(manifest, tmp_path / "cluster", "--cluster", cluster.address, env=cluster.env)
        local = batch(manifest, tmp_path / "local", "--workers", "4")
    assert on_cluster.code == local.code == 1, on_cluster.stderr
    remote, here = summary(tmp_path / "cluster"), summary(tmp_path / "local")
    assert remote["counts"] == here["counts"] == {"ok": 26, "replay_failed": 2, "timeout": 2}
    assert remote["categories"] == here["categories"]
    assert remote["ran"] == 30 and remote["failed"] == here["failed"]

    ran = records(tmp_path / "cluster")
    assert len(ran) == 30
    nodes = {record["host"]["node"] for record in ran.values()}
    assert nodes == set(cluster.nodes)  # both nodes ran items, and only they did
    for item_id, record in ran.items():
        assert record["host"]["cluster"] == cluster.address
        assert record["superseded"] == []
        assert record["inputs"]["trajectory"]["path"] == str(tmp_path / "data" / f"{item_id}.jsonl")
    for n in range(6):
        live = ran[f"live{n}"]
        assert (live["status"], live["result"]["phase"], live["model"]["requests"] > 0) == ("ok", "continued", True)
        assert (tmp_path / "cluster" / f"live{n}" / "workspace" / "continued.txt").read_text() == "continued\n"
    assert (tmp_path / "cluster" / "report.html").is_file()
    for path in (tmp_path / "cluster").rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path  # the key stayed with the nodes' gateways
    assert KEY not in on_cluster.stderr and cluster.token not in on_cluster.stderr
    assert subprocess.run(["grep", "-rlF", KEY, str(cluster.temp_dir)], capture_output=True).stdout == b""
    for name in cluster.nodes:  # nor in Ray's logs and spilled objects (the head's temp dir, on every node)
        node = cluster.client.containers.get(name)
        assert node.exec_run(["test", "-d", str(cluster.temp_dir)]).exit_code == 0
        found = node.exec_run(["grep", "-rlF", KEY, str(cluster.temp_dir), "/var/log"])
        assert (found.exit_code, found.output) == (1, b""), found.output

    status = run_cli("cluster", "status", "--address", cluster.address, "--json", env=cluster.env)
    assert status.code == 0, status.stderr
    nodes = {n["node"]: n for n in json.loads(status.stdout)}
    for name in cluster.nodes:  # the image was shipped once to each, nothing runs any more
        node = nodes[name]
        assert (node["alive"], node["slots"], node["running"], node["free"]) == (True, 2, 0, 2)
        assert claude_image in nodes[name]["images"]
    heads = [n for n in nodes.values() if n["slots"] == 0]
    assert len(heads) == 1 and heads[0]["engine"] is None  # the head has no engine: nothing ran there


def test_the_model_concurrency_holds_across_the_nodes(cluster, tmp_path):
    """Six continuations on two nodes of two slots, each node's sandboxes behind their own gateways, one call in
    flight at a time: the batch's limit, held by one actor, not a node's or a sandbox's."""
    root = tmp_path / "data"
    root.mkdir()
    write_jsonl(root / "live.jsonl", claude_files_session())
    lines = [{"id": f"live{n}", "trajectory": "live.jsonl", "after_step": 4, "mode": "continue", "max_steps": 8}
             for n in range(6)]  # fmt: skip
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    with StubServer(host=cluster.host) as stub:
        stub.model.hold = 1.0  # each call stays in flight a while: without the limit, calls would overlap
        done = batch(manifest, out, "--cluster", cluster.address, "--model-base-url", stub.base_url, "--model",
                     "stub-model", "--model-api-key-env", "PVH_TEST_MODEL_KEY", "--model-concurrency", "1",
                     env=cluster.env)  # fmt: skip
        peak, calls = stub.model.peak, len(stub.model.model_requests())
    assert done.code == 0, done.stderr[-3000:]
    ran = records(out)
    assert {r["status"] for r in ran.values()} == {"ok"}
    assert {r["host"]["node"] for r in ran.values()} == set(cluster.nodes)
    assert peak == 1
    assert sum(r["model"]["totals"]["calls"] for r in ran.values()) == calls
    assert sum(r["model"]["totals"]["waited_seconds"] for r in ran.values()) > 1  # calls did queue for the slot


@contextlib.contextmanager
def running_batch(manifest: Path, out: Path, cluster: Cluster, grace: int = 3) -> Iterator[subprocess.Popen[str]]:
    """A cluster batch in the background; one still running when the test ends is interrupted like a user would."""
    env = {**os.environ, **cluster.env, "PVISOR_HOST_CLUSTER_GRACE": str(grace), "PVH_TEST_MODEL_KEY": KEY}
    with subprocess.Popen(
        [str(Path(sys.executable).parent / "pvisor-host"), "batch", str(manifest), "--agent", "claude-code",
         "--mode", "replay-only", "--out", str(out), "--quiet", "--cluster", cluster.address],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals,
    ) as process:  # fmt: skip
        try:
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.communicate()


def freeze(node) -> None:
    """``docker pause``, again if the freezer caught the node's processes mid-fork ("unable to freeze")."""
    for _ in range(10):
        try:
            node.pause()
            return
        except docker.errors.APIError as exc:
            if "unable to freeze" not in str(exc):
                raise
            time.sleep(0.5)
    node.pause()


def wait_until_running(cluster: Cluster, name: str, process: subprocess.Popen[str], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cluster.node_containers(name, all_states=False):
            return
        if process.poll() is not None:
            raise AssertionError(f"the batch ended first ({process.returncode}): {process.stderr.read()[-3000:]}")
        time.sleep(0.3)
    process.kill()
    raise AssertionError(f"no sandbox started on {name}: {process.communicate()[1][-3000:]}")


@pytest.mark.faults  # `make test-faults` (CI runs it after `make test`)
@pytest.mark.parametrize("failure", ["kill", "pause", "disconnect"])
def test_losing_a_node_mid_batch_every_item_ends_once(cluster, tmp_path, docker_client, failure):
    manifest = slow_manifest(tmp_path / "data", 8, 6)
    out = tmp_path / "out"
    # A crash is Ray's to retry (a long grace keeps the watchdog out of it); a hang is the watchdog's.
    victim, survivor = cluster.nodes
    node = docker_client.containers.get(victim)
    with running_batch(manifest, out, cluster, grace=60 if failure == "kill" else 3) as process:
        wait_until_running(cluster, victim, process)
        try:
            if failure == "kill":
                node.kill()
            elif failure == "pause":
                freeze(node)
            else:
                docker_client.networks.get("bridge").disconnect(node)
            stdout, stderr = process.communicate(timeout=600)
        finally:
            node.reload()
            if node.status == "paused":
                node.unpause()
    assert process.returncode == 0, explain(out, stderr)
    assert summary(out)["counts"] == {"ok": 8}
    ran = records(out)
    assert sorted(ran) == [f"s{n}" for n in range(8)]  # every item, each once
    lost = [r for r in ran.values() if r["superseded"]]
    assert lost, "no attempt was run again"
    reason = "was lost; Ray ran it again" if failure == "kill" else "stopped answering (Ray marked it dead"
    for record in lost:
        assert record["host"]["node"] == survivor
        assert [s["node"] for s in record["superseded"]] == [victim]
        assert reason in record["superseded"][0]["reason"]
    assert cluster.node_containers(survivor) == []
    # The lost node comes back (unpaused above): it is swept when it joins again.
    if failure == "disconnect":
        docker_client.networks.get("bridge").connect(node)
    node.reload()
    deadline = time.monotonic() + 120
    while node.status == "running" and failure != "kill" and time.monotonic() < deadline:
        time.sleep(1)  # its raylet finds it was marked dead and exits, and the node container with it
        node.reload()
    if node.status != "running":
        node.start()
    cluster.wait_for_nodes(2)
    assert cluster.node_containers(victim) == []  # `node join` swept what the lost attempts left


def test_ctrl_c_on_a_cluster_batch_leaves_no_container_on_any_node(cluster, tmp_path):
    manifest = slow_manifest(tmp_path / "data", 6, 60)
    out = tmp_path / "out"
    with running_batch(manifest, out, cluster) as process:
        for name in cluster.nodes:
            wait_until_running(cluster, name, process)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert summary(out)["interrupted"] is True
    for name in cluster.nodes:
        assert cluster.node_containers(name) == [], name


def test_without_a_token_or_a_node_the_batch_says_so_in_one_line(cluster, tmp_path):
    manifest = slow_manifest(tmp_path / "data", 1, 0)
    no_token = run_cli(
        "batch", manifest, "--agent", "claude-code", "--mode", "replay-only", "--out", tmp_path / "a", "--cluster",
        cluster.address, env={"RAY_AUTH_TOKEN": ""},
    )  # fmt: skip
    assert (no_token.code, len(no_token.error_lines)) == (2, 1)
    assert no_token.error_lines[0].startswith(
        "pvisor-host: error: the cluster's token is not set: export RAY_AUTH_TOKEN"
    )
    bad = run_cli("batch", manifest, "--agent", "claude-code", "--out", tmp_path / "b", "--cluster", "nowhere")
    assert bad.code == 2
    assert bad.error_lines == [
        "pvisor-host: error: --cluster 'nowhere' is not HOST:PORT (the Ray head's address, e.g. 10.0.0.5:6379)"
    ]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


API_BATCH = """
import json, sys
from pathlib import Path

import pvisor_host

data, out, address = map(str, sys.argv[1:])
items = [dict(json.loads(line), trajectory=f"{data}/{json.loads(line)['trajectory']}")
         for line in Path(data, "manifest.jsonl").read_text().splitlines()]
with pvisor_host.batch(items, out=out, defaults={"agent": "claude-code", "mode": "replay-only"},
                       cluster=address) as batch:
    results = sorted((r.id, r.status) for r in batch)
print(json.dumps({"results": results, "counts": batch.summary.counts}))
"""


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = b"hello from the host"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        return


def test_an_egress_replay_on_a_node_reaches_the_listed_host_through_the_nodes_proxy(cluster, tmp_path):
    """The sandbox on a node keeps no network: its call reaches a server on this host (the nodes' bridge
    address, listed) through the egress proxy of the node's own worker, and the journal comes back in the record."""
    server = http.server.ThreadingHTTPServer((cluster.host, 0), _Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        target = f"{cluster.host}:{server.server_address[1]}"
        root = tmp_path / "data"
        root.mkdir()
        write_jsonl(root / "e.jsonl", one(FETCH + f"http://{target}/hello", "hello from the host\n"))
        manifest = root / "m.jsonl"
        manifest.write_text(json.dumps({"id": "egress", "trajectory": "e.jsonl", "after_step": 1,
                                        "egress": f"allow:{target}"}) + "\n")  # fmt: skip
        out = tmp_path / "out"
        result = batch(manifest, out, "--cluster", cluster.address, env=cluster.env)
    finally:
        server.shutdown()
        server.server_close()
    assert result.code == 0, explain(out, result.stderr)
    record = records(out)["egress"]
    assert record["host"]["node"] in cluster.nodes
    assert (record["egress"]["connections"], record["egress"]["hosts"]) == (1, [target])
    assert [call["match"] for call in record["observations"]["calls"]] == ["exact"]  # the host's answer, as recorded


def test_the_python_api_runs_a_batch_on_the_cluster(cluster, tmp_path):
    """``pvisor_host.batch(..., cluster=)``: the same items, records and summary as ``batch --cluster``, and the
    library prints nothing."""
    slow_manifest(tmp_path / "data", 4, 0)
    script = tmp_path / "api_batch.py"
    script.write_text(API_BATCH)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "data"), str(out), cluster.address],
        capture_output=True, text=True, timeout=600, check=False, env={**os.environ, **cluster.env},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout) == {
        "results": [["s0", "ok"], ["s1", "ok"], ["s2", "ok"], ["s3", "ok"]],
        "counts": {"ok": 4},
    }
    ran = records(out)
    assert sorted(ran) == ["s0", "s1", "s2", "s3"]
    assert {r["host"]["node"] for r in ran.values()} <= set(cluster.nodes)
    assert {r["host"]["cluster"] for r in ran.values()} == {cluster.address}
    assert (out / "junit.xml").is_file() and (out / "report.html").is_file()
