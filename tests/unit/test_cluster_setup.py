"""The cluster's set-up without a cluster: Ray as an optional extra, the head's address, the token (never on a
command line), and the `ray start` a node becomes."""

from __future__ import annotations

import importlib.util
import json

import pytest

from pvisor_host.cluster import connect
from pvisor_host.cluster.join import join_command
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
        "--num-cpus", "3", "--block", "--disable-usage-stats",
    ]  # fmt: skip
    assert not any("s3cret" in part for part in command)
