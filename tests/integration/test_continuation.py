"""Live continuation through the host-side model gateway: the real Claude Code 2.1.220 and Codex 0.149.0
in real sandboxes, a deterministic OpenAI-compatible stub as the upstream (a test aid, not a model)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from pvisor_host.backend.docker.gateway import network_gateway
from pvisor_host.models.profiles import get_profile

from conftest import run_cli, start_cli, wait_for_running
from modelserver import StubServer
from trajgen import claude_files_session, codex_files_session, write_jsonl

pytestmark = pytest.mark.docker

REAL_KEY = "sk-test-REAL-upstream-key-4f7c2a"
KEY_ENV = {"PVH_TEST_MODEL_KEY": REAL_KEY}
# agent -> (trajectory, after-step, max-steps)
AGENTS = {
    "claude-code": (lambda: claude_files_session("/workspace"), 4, 8),
    "codex": (lambda: codex_files_session("/workspace"), 3, 8),
}


def _record(out: Path) -> dict:
    return json.loads((out / "record.json").read_text())


def _continue(base_url: str, agent: str, tmp_path: Path, *extra: str) -> list[str]:
    make, after, max_steps = AGENTS[agent]
    trajectory = write_jsonl(tmp_path / f"{agent}.jsonl", make())
    return [
        "replay",
        "--agent",
        agent,
        "--trajectory",
        str(trajectory),
        "--after-step",
        str(after),
        "--max-steps",
        str(max_steps),
        "--model-base-url",
        base_url,
        "--model",
        "stub-model",
        "--model-api-key-env",
        "PVH_TEST_MODEL_KEY",
        *extra,
    ]


def _every_file(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_continuation_through_the_gateway_keeps_the_key_on_the_host(tmp_path, docker_client, agent_image, agent):
    agent_image(agent)
    run_id = f"cont-{agent}"
    out = tmp_path / "run"
    with StubServer(command="echo continued > continued.txt && sleep 2") as stub:
        process = start_cli(
            *_continue(stub.base_url, agent, tmp_path, "--out", str(out), "--run-id", run_id), env=KEY_ENV
        )
        inspected = wait_for_running(docker_client, run_id, process).attrs
        stdout, stderr = process.communicate(timeout=300)
        requests = stub.model.model_requests()
    assert process.returncode == 0, stderr
    record = _record(out)
    result = record["result"]
    assert record["status"] == "ok"
    assert (result["phase"], result["agent_status"]) == ("continued", "completed")
    assert result["continued_steps"] >= 1
    # The file the continued tool call wrote is collected, with pvisor's continuation artifacts.
    assert (out / "workspace" / "continued.txt").read_text() == "continued\n"
    assert "continued.txt" in record["workspace_changes"]["added"]
    paths = {a["path"] for a in record["artifacts"]}
    assert "output/next-action-comparison.json" in paths
    assert f"output/{get_profile(agent).artifacts.continued}" in paths
    assert "model-traffic.jsonl" in paths
    # The upstream saw the real key; the sandbox never had it.
    assert requests and {r["headers"]["authorization"] for r in requests} == {f"Bearer {REAL_KEY}"}
    assert {r["headers"].get("x-litellm-session-id") for r in requests} == {run_id}
    config = json.dumps(inspected)
    assert REAL_KEY not in config
    assert "pvhtok-" not in config  # nor the per-run token
    assert inspected["HostConfig"]["NetworkMode"] == "none"
    for path in _every_file(out):
        assert REAL_KEY.encode() not in path.read_bytes(), path
    assert REAL_KEY not in stdout + stderr
    journal = [json.loads(line) for line in (out / "model-traffic.jsonl").read_text().splitlines()]
    assert len(journal) == len(requests) == record["model"]["requests"]
    assert all(e["status"] == 200 and e["session_id"] == run_id and e["usage"] for e in journal)
    assert all(not any("authorization" in key.lower() for key in e) for e in journal)
    assert "pvhtok-" not in (out / "model-traffic.jsonl").read_text()
    figures = record["model"].pop("totals")
    assert record["model"] == {
        "upstream": stub.base_url,
        "model": "stub-model",
        "network": "unix",
        "api_key_env": "PVH_TEST_MODEL_KEY",
        "journal": "model-traffic.jsonl",
        "requests": len(requests),
        "cassette": None,
    }
    served = stub.model.served_usage
    tokens_in = sum(u.get("prompt_tokens", u.get("input_tokens", 0)) for u in served)
    assert (figures["calls"], figures["input_tokens"], figures["output_tokens"]) == (
        len(requests), tokens_in, 10 * len(served))  # fmt: skip
    assert (figures["retries"], figures["errors"], figures["cost"]) == (0, 0, None)


PROBE = (
    'python3 -c "import socket\n'
    "def attempt(label, f):\n"
    "    try:\n        f(); return label + ' open'\n"
    "    except Exception as e:\n        return label + ' ' + type(e).__name__\n"
    "print(attempt('host', lambda: socket.create_connection(('HOST_IP', HOST_PORT), 3)))\n"
    "print(attempt('loopback', lambda: socket.create_connection(('127.0.0.1', HOST_PORT), 3)))\n"
    "print(attempt('outside', lambda: socket.create_connection(('1.1.1.1', 443), 3)))\n"
    "print(attempt('dns', lambda: socket.getaddrinfo('example.com', 443)))\" > probe.txt"
    " && echo continued > continued.txt"
)


def test_a_continuing_sandbox_reaches_nothing_but_the_gateway(tmp_path, docker_client, claude_image):
    bridge = network_gateway(docker_client.networks.get("bridge").attrs)
    # A service the sandbox must not reach: the stub itself, listening on the host's bridge address too.
    with StubServer(host="0.0.0.0") as decoy:
        port = decoy.httpd.server_address[1]
        with StubServer(command=PROBE.replace("HOST_IP", bridge).replace("HOST_PORT", str(port))) as stub:
            out = tmp_path / "run"
            result = run_cli(*_continue(stub.base_url, "claude-code", tmp_path, "--out", str(out)), env=KEY_ENV)
        assert decoy.model.requests == []
    assert result.code == 0, result.stderr
    probe = (out / "workspace" / "probe.txt").read_text().split("\n")
    verdicts = dict(line.split(" ", 1) for line in probe if line)
    assert set(verdicts) == {"host", "loopback", "outside", "dns"}
    assert not any(v == "open" for v in verdicts.values()), verdicts
    assert verdicts["dns"] == "gaierror"
    assert (out / "workspace" / "continued.txt").exists()  # ... while the gateway worked


@pytest.mark.parametrize(("status", "category"), [(429, "model_rate_limit"), (500, "model_internal_error")])
def test_retryable_upstream_failures_are_retried_in_a_fresh_sandbox(tmp_path, claude_image, status, category):
    out = tmp_path / "run"
    with StubServer() as stub:
        stub.model.fail_sessions(lambda session: not session.endswith("-a2"), status)
        result = run_cli(
            *_continue(
                stub.base_url,
                "claude-code",
                tmp_path,
                "--out",
                str(out),
                "--run-id",
                f"retry-{status}",
                "--attempts",
                "3",
                "--retry-backoff",
                "1s",
                "--model-retry-budget",
                "0",  # the gateway passes the failure on at once: the retry here is a fresh sandbox's
            ),
            env=KEY_ENV,
        )
    assert result.code == 0, result.stderr
    record = _record(out)
    assert record["status"] == "ok" and record["attempt"] == 2 and record["run_id"] == f"retry-{status}-a2"
    first, second = record["attempts"]
    assert (first["attempt"], first["status"], first["path"]) == (1, "replay_failed", "attempts/1")
    assert first["failure"]["category"] == category and first["failure"]["retryable"] is True
    assert (second["attempt"], second["status"], second["path"]) == (2, "ok", ".")
    assert first["container_id"] != second["container_id"]
    earlier = _record(out / "attempts" / "1")
    assert earlier["status"] == "replay_failed" and earlier["result"]["retryable"] is True
    journal = [json.loads(line) for line in (out / "attempts" / "1" / "model-traffic.jsonl").read_text().splitlines()]
    assert journal and all(e["status"] == status for e in journal)
    assert (out / "workspace" / "continued.txt").exists()


def test_a_refused_upstream_is_retried_until_it_comes_back(tmp_path, claude_image):
    with StubServer() as probe:  # learn a free port, then free it
        port = probe.httpd.server_address[1]
    base_url = f"http://127.0.0.1:{port}/v1"
    out = tmp_path / "run"
    started: list[StubServer] = []

    def bring_the_upstream_back() -> None:
        deadline = time.monotonic() + 240
        while not (out / "attempts" / "1" / "record.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        server = StubServer(port=port)
        server.__enter__()
        started.append(server)

    helper = threading.Thread(target=bring_the_upstream_back, daemon=True)
    helper.start()
    try:
        result = run_cli(
            *_continue(
                base_url,
                "claude-code",
                tmp_path,
                "--out",
                str(out),
                "--attempts",
                "3",
                "--retry-backoff",
                "2s",
                "--model-retry-budget",
                "0",
            ),
            env=KEY_ENV,
        )
    finally:
        helper.join(timeout=10)
        for server in started:
            server.__exit__()
    assert result.code == 0, result.stderr
    record = _record(out)
    first = record["attempts"][0]
    assert first["status"] == "replay_failed" and first["failure"]["retryable"] is True
    assert first["failure"]["category"] in ("model_connection_error", "model_internal_error")
    assert record["status"] == "ok" and (out / "workspace" / "continued.txt").exists()
    journal = [json.loads(line) for line in (out / "attempts" / "1" / "model-traffic.jsonl").read_text().splitlines()]
    assert journal and {e["status"] for e in journal} == {502}
    assert "connection refused" in journal[0]["response_body"]


def test_internal_network_mode(tmp_path, docker_client, claude_image):
    out = tmp_path / "run"
    with StubServer() as stub:
        result = run_cli(
            *_continue(stub.base_url, "claude-code", tmp_path, "--out", str(out), "--model-network", "internal"),
            env=KEY_ENV,
        )
    assert result.code == 0, result.stderr
    record = _record(out)
    assert record["status"] == "ok" and record["result"]["phase"] == "continued"
    assert record["model"]["network"] == "internal"
    assert record["limits"]["network"].startswith("pvisor-host-gw-")
    assert docker_client.networks.list(names=[record["limits"]["network"]]) == []  # removed after the run
    assert (out / "workspace" / "continued.txt").exists()


def test_pass_through_mode_warns_and_hands_over_the_key(tmp_path, docker_client, claude_image):
    bridge = network_gateway(docker_client.networks.get("bridge").attrs)
    out = tmp_path / "run"
    with StubServer(host=bridge) as stub:
        result = run_cli(
            *_continue(stub.base_url, "claude-code", tmp_path, "--out", str(out), "--model-network", "pass-through"),
            env=KEY_ENV,
        )
        requests = stub.model.model_requests()
    assert result.code == 0, result.stderr
    assert "--model-network pass-through: the real key from PVH_TEST_MODEL_KEY enters the sandbox" in result.stderr
    record = _record(out)
    assert record["status"] == "ok" and record["model"]["journal"] is None
    assert record["limits"]["network"] == "bridge"
    assert {r["headers"]["authorization"] for r in requests} == {f"Bearer {REAL_KEY}"}


def test_journal_without_bodies(tmp_path, claude_image):
    out = tmp_path / "run"
    with StubServer() as stub:
        result = run_cli(
            *_continue(stub.base_url, "claude-code", tmp_path, "--out", str(out), "--no-model-bodies"), env=KEY_ENV
        )
    assert result.code == 0, result.stderr
    journal = [json.loads(line) for line in (out / "model-traffic.jsonl").read_text().splitlines()]
    assert journal and all("request_body" not in e and "response_body" not in e for e in journal)
    assert all(e["request_bytes"] > 1000 and e["response_bytes"] > 0 for e in journal)
