"""The cluster's set-up without a cluster: Ray as an optional extra, the head's address, the token (never on a
command line), the `ray start` a node becomes, a registry's name, and the ledger of where copies run."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import types

import pytest

from pvisor_host.backend import check_registry
from pvisor_host.backend.cluster import connect
from pvisor_host.backend.cluster.ledger import Ledger
from pvisor_host.backend.cluster.node.join import join_command
from pvisor_host.backend.cluster.ship import rechunk
from pvisor_host.backend.docker.image.images import Reference, push_target
from pvisor_host.errors import PrerequisiteError, UsageError


def test_without_ray_a_cluster_is_one_line_naming_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(PrerequisiteError) as caught:
        connect.require_ray()
    assert caught.value.one_line() == "a cluster needs Ray, which is not installed (pip install 'pvisor-host[ray]')"


@pytest.mark.parametrize("address", ["10.0.0.5:6379", "head.example:6380", "172.17.0.1:51161"])
def test_a_head_address_is_host_and_port(address):
    assert connect.check_address(address) == address


@pytest.mark.parametrize("address", ["nowhere", "10.0.0.5", ":6379", "ray://x:1", "a b:1"])
def test_anything_else_is_refused(address):
    with pytest.raises(UsageError, match=r"is not HOST:PORT"):
        connect.check_address(address)


def test_the_token_comes_from_the_environment_or_a_file(monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv(connect.TOKEN_FILE_ENV, raising=False)
    with pytest.raises(UsageError, match="the cluster's token is not set"):
        connect.auth_environment()
    token = tmp_path / "token"
    token.write_text("abc123\n")
    monkeypatch.setenv(connect.TOKEN_FILE_ENV, str(token))
    assert connect.auth_environment() == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "abc123",
                                          "RAY_USAGE_STATS_ENABLED": "0"}  # fmt: skip
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert connect.auth_environment()["RAY_AUTH_TOKEN"] == "from-env"
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.setenv(connect.TOKEN_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(UsageError, match=r"cannot read the cluster token \(No such file or directory\)"):
        connect.auth_environment()


def test_a_node_becomes_ray_start_with_its_slots_and_no_secret(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "s3cret-token")
    command = join_command("10.0.0.5:6379", 3, ray_binary="/opt/pvh/bin/ray")
    assert command == [
        "/opt/pvh/bin/ray", "start", "--address", "10.0.0.5:6379", "--resources", json.dumps({"docker_engine": 3}),
        "--num-cpus", "3", "--block", "--disable-usage-stats", "--include-log-monitor", "false",
    ]  # fmt: skip
    assert not any("s3cret" in part for part in command)


@pytest.mark.parametrize("registry", ["127.0.0.1:5000", "registry.internal:5000/team", "ghcr.io", "reg.example"])
def test_a_registry_is_host_port_and_path(registry):
    assert check_registry(registry + "/") == registry


@pytest.mark.parametrize("registry", ["http://reg:5000", "reg:5000:tag", "reg 1", "reg:port", ""])
def test_a_registry_with_a_scheme_or_a_tag_is_refused(registry):
    with pytest.raises(UsageError, match=r"is not HOST\[:PORT\]\[/PATH\]"):
        check_registry(registry)


IMAGE_ID = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("ref", "target"),
    [
        (
            "pvisor-host/codex:0.149.0-pvisor0.3.1-0123456789ab",
            ("reg:5000/pvisor-host/codex", "0.149.0-pvisor0.3.1-0123456789ab"),
        ),
        ("localhost:5001/task:v2", ("reg:5000/task", "v2")),  # from another registry: its path, not its host
        ("ghcr.io/org/task:v2", ("reg:5000/org/task", "v2")),
        ("ubuntu:22.04", ("reg:5000/ubuntu", "22.04")),
        (f"org/agent@sha256:{'cd' * 32}", ("reg:5000/org/agent", "ab" * 16)),  # a digest is not a tag
        (f"localhost:5001/task@sha256:{'cd' * 32}", ("reg:5000/task", "ab" * 16)),
        (IMAGE_ID, ("reg:5000/pvisor-host/image", "ab" * 16)),
    ],
)
def test_an_image_is_pushed_under_its_own_path_with_its_tag_or_its_id(ref, target):
    repository, tag = push_target("reg:5000", ref, IMAGE_ID)
    assert (repository, tag) == target
    pushed = Reference(f"{repository}:{tag}")  # a reference the engine accepts: registry, path, tag
    assert (pushed.registry, pushed.tag, pushed.digest) == ("reg:5000", tag, None)


def test_references_are_read_as_docker_reads_them():
    by_digest = Reference(f"localhost:5001/org/task@sha256:{'cd' * 32}")
    assert (by_digest.registry, by_digest.path, by_digest.tag, by_digest.digest) == (
        "localhost:5001",
        "org/task",
        None,
        f"sha256:{'cd' * 32}",
    )
    hub = Reference("ubuntu")
    assert (hub.registry, hub.path, hub.tag, hub.digest, hub.is_id) == (None, "ubuntu", None, None, False)
    assert Reference(IMAGE_ID).is_id


def test_the_ledger_says_where_copies_started_and_which_should_stop():
    ledger = Ledger()
    ledger.started("run-1/a", "n1", "node1", "2026-12-02T10:00:00+00:00", "t1")
    ledger.started("run-1/a", "n2", "node2", "2026-12-02T10:00:05+00:00", "t2")  # Ray ran it again
    ledger.started("run-2/b", "n2", "node2", "2026-12-02T10:00:01+00:00", "t3")
    assert [start["node"] for start in ledger.snapshot()["run-1/a"]] == ["node1", "node2"]
    assert ledger.should_stop("run-1/a") is None
    ledger.stop("run-1/a")
    assert (ledger.should_stop("run-1/a"), ledger.should_stop("run-2/b")) == ("superseded", None)
    ledger.forget("run-1/a")
    assert list(ledger.snapshot()) == ["run-2/b"] and ledger.should_stop("run-1/a") == "superseded"
    ledger.started("run-1/a", "n3", "node3", "2026-12-02T10:01:00+00:00", "t4")  # Ray ran the stopped copy again
    assert list(ledger.snapshot()) == ["run-2/b"]
    ledger.stop_all()
    assert ledger.should_stop("run-2/b") == ledger.should_stop("run-9/z") == "cancelled"


def test_a_driver_off_the_cluster_is_one_line_before_ray_is_touched(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "abc")
    monkeypatch.setattr(connect, "local_raylet", lambda: False)
    with pytest.raises(PrerequisiteError) as caught:
        connect.connect("10.0.0.5:6379")
    assert caught.value.one_line() == (
        "this machine is not a node of the cluster at 10.0.0.5:6379, and Ray runs a driver only on one "
        "(run the batch on the head, or on a Docker host that ran `pvisor-host node join`)"
    )


def test_an_image_goes_into_the_object_store_in_whole_chunks():
    pieces = [b"a" * 3, b"b" * 5, b"", b"c" * 9, b"d"]
    assert list(rechunk(pieces, 4)) == [b"aaab", b"bbbb", b"cccc", b"cccc", b"cd"]
    assert list(rechunk([], 4)) == []


class FakeRayModule(types.ModuleType):
    """Just enough of the ``ray`` module for a driver to connect and leave."""

    def __init__(self) -> None:
        super().__init__("ray")
        self.__spec__ = importlib.machinery.ModuleSpec("ray", None)
        self.initialised = False
        self.seen_token: str | None = None

    def is_initialized(self) -> bool:
        return self.initialised

    def init(self, **_: object) -> None:
        import os

        self.seen_token = os.environ.get("RAY_AUTH_TOKEN")
        self.initialised = True

    def shutdown(self) -> None:
        self.initialised = False


@pytest.fixture
def fake_ray(monkeypatch):
    import sys

    fake = FakeRayModule()
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(connect, "local_raylet", lambda: True)
    monkeypatch.setattr(connect, "_current", None)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "tok")
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    return fake


def test_a_connection_owns_its_ray_state_and_puts_the_environment_back(fake_ray):
    import os

    first = connect.connect("10.0.0.5:6379")
    assert fake_ray.seen_token == "tok" and os.environ["RAY_AUTH_MODE"] == "token"
    first.close()
    assert not fake_ray.initialised and "RAY_AUTH_MODE" not in os.environ  # as it was before
    assert os.environ["RAY_AUTH_TOKEN"] == "tok"
    first.close()  # idempotent
    connect.connect("10.0.0.5:6379").close()  # and the next one may connect


def test_a_second_cluster_connection_in_one_process_is_refused_in_one_line(fake_ray):
    first = connect.connect("10.0.0.5:6379")
    try:
        with pytest.raises(UsageError) as refused:
            connect.connect("10.0.0.6:6379")
        assert refused.value.one_line() == (
            "this process is already running a cluster batch on 10.0.0.5:6379, and Ray allows one cluster "
            "connection per process: run the next batch after it, or in another process"
        )
        assert fake_ray.initialised  # the first one is untouched
    finally:
        first.close()


def test_ray_initialised_by_the_application_is_left_alone(fake_ray):
    fake_ray.initialised = True  # the application called ray.init() itself
    with pytest.raises(UsageError, match="Ray is already initialised in this process by something else"):
        connect.connect("10.0.0.5:6379")
    assert fake_ray.initialised  # not shut down by us
