"""The model gateway over a real unix socket, in front of the stub model server (no engine needed)."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pvisor_host.backend.docker.gateway import Gateway, network_gateway
from pvisor_host.gateway.upstream import Tries
from pvisor_host.models.spec import ModelUpstream

from modelserver import StubServer

REAL_KEY = "sk-real-upstream-key-0123456789"


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("gateway", timeout=10)
        self.path_ = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path_)


def post(gateway: Gateway, path: str, body: dict, token: str | None) -> tuple[int, bytes]:
    connection = UnixConnection(gateway.address)
    headers = {"Content-Type": "application/json", "X-LiteLLM-Session-ID": "run-1"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    connection.request("POST", path, json.dumps(body), headers)
    response = connection.getresponse()
    return response.status, response.read()


@pytest.fixture
def stub():
    with StubServer() as server:
        yield server


def gateway_for(stub: StubServer, **overrides) -> Gateway:
    config = ModelUpstream(base_url=stub.base_url, model="stub-model", api_key_env="X", network="unix", **overrides)
    return Gateway(config, REAL_KEY)


def post_to(socket_path: str, body: dict, token: str) -> int:
    connection = UnixConnection(socket_path)
    connection.request("POST", "/v1/chat/completions", json.dumps(body),
                       {"Content-Type": "application/json", "Authorization": f"Bearer {token}"})  # fmt: skip
    response = connection.getresponse()
    response.read()
    return response.status


def test_forks_holding_one_token_are_told_apart_by_their_own_sockets(stub, tmp_path):
    """``--fork``: every fork holds its prefix's token; each is granted it on a socket of its own, its calls are
    journaled as its own, and releasing one fork closes its socket and leaves the others'."""
    body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "tools": []}
    with gateway_for(stub) as gateway:
        prefix = gateway.access("r", tmp_path / "prefix.jsonl")
        gateway.release(prefix)  # the prefix is checkpointed: its token lives on in the forks' memory only
        forks = [gateway.access("r", tmp_path / f"f{k}.jsonl", token=prefix.token) for k in (1, 2)]
        assert [f.api_key for f in forks] == [prefix.token] * 2 and forks[0].socket_dir != forks[1].socket_dir
        sockets = [str(f.socket_dir / "gw.sock") for f in forks]
        assert [post_to(sockets[0], body, prefix.token), post_to(sockets[1], body, prefix.token),
                post_to(sockets[1], body, prefix.token)] == [200, 200, 200]  # fmt: skip
        assert post(gateway, "/v1/chat/completions", body, prefix.token)[0] == 401  # not on the gateway's own socket
        gateway.release(forks[0])
        assert not forks[0].socket_dir.exists() and post_to(sockets[1], body, prefix.token) == 200
    assert not forks[1].socket_dir.exists()
    lines = {k: len((tmp_path / f"f{k}.jsonl").read_text().splitlines()) for k in (1, 2)}
    assert lines == {1: 1, 2: 3} and not (tmp_path / "prefix.jsonl").exists()


def test_only_the_run_token_passes_and_the_upstream_gets_the_real_key(stub, tmp_path):
    journal = tmp_path / "model-traffic.jsonl"
    with gateway_for(stub) as gateway:
        access = gateway.access("run-1", journal)
        body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "tools": []}
        assert post(gateway, "/v1/chat/completions", body, "wrong-token")[0] == 401
        assert post(gateway, "/v1/chat/completions", body, None)[0] == 401
        assert stub.model.requests == []  # refused requests never reach the upstream
        status, answer = post(gateway, "/v1/chat/completions", body, access.api_key)
        assert status == 200
        assert json.loads(answer)["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "bash"
        gateway.release(access)
        assert post(gateway, "/v1/chat/completions", body, access.api_key)[0] == 401
    (seen,) = stub.model.requests
    assert seen["headers"]["authorization"] == f"Bearer {REAL_KEY}"
    assert seen["headers"]["x-litellm-session-id"] == "run-1"
    assert access.api_key.startswith("pvhtok-") and REAL_KEY not in access.model_dump_json()
    (entry,) = [json.loads(line) for line in journal.read_text().splitlines()]
    assert entry["status"] == 200 and entry["path"] == "/v1/chat/completions" and entry["session_id"] == "run-1"
    assert entry["usage"] == {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}
    assert entry["request_bytes"] == len(json.dumps(body)) and entry["stream"] is False
    assert REAL_KEY not in journal.read_text() and access.api_key not in journal.read_text()
    assert not Path(gateway.address or "/nonexistent").exists()  # the socket directory is gone


def test_streams_pass_through_and_usage_is_read_from_the_last_event(stub, tmp_path):
    journal = tmp_path / "j.jsonl"
    with gateway_for(stub, body_limit=200) as gateway:
        access = gateway.access("run-2", journal)
        body = {
            "model": "stub-model",
            "stream": True,
            "input": [{"type": "message", "role": "user", "content": "x"}],
            "tools": [{"type": "function", "name": "exec_command", "parameters": {"properties": {"cmd": {}}}}],
        }
        status, answer = post(gateway, "/v1/responses", body, access.api_key)
    assert status == 200
    events = [json.loads(line[5:]) for line in answer.decode().splitlines() if line.startswith("data:")]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["name"] == "exec_command"
    entry = json.loads(journal.read_text())
    assert entry["stream"] is True and entry["usage"] == {"input_tokens": 100, "output_tokens": 10, "total_tokens": 110}
    assert len(entry["response_body"]) == 200 and entry["response_body_truncated"] is True
    assert entry["response_bytes"] == len(answer)


def test_upstream_failures_become_gateway_answers(tmp_path):
    config = ModelUpstream(base_url="http://127.0.0.1:9/v1", model="m", api_key_env="X", network="unix", retry_budget=0)
    journal = tmp_path / "j.jsonl"
    with Gateway(config, REAL_KEY) as gateway:
        access = gateway.access("run-3", journal)
        status, answer = post(gateway, "/v1/chat/completions", {"messages": []}, access.api_key)
        assert status == 502
        assert (
            json.loads(answer)["error"]["message"]
            == "pvisor-host gateway: upstream connection error: connection refused"
        )
        assert post(gateway, "/v1/files", {}, access.api_key)[0] == 404
    statuses = [json.loads(line)["status"] for line in journal.read_text().splitlines()]
    assert statuses == [502, 404]


def read_chunked(connection: UnixConnection) -> tuple[int, bytes]:
    """An answer read strictly: a chunked body must end with its last chunk (else IncompleteRead)."""
    response = connection.getresponse()
    return response.status, response.read()


def test_a_stream_the_upstream_breaks_off_ends_cleanly_and_is_journaled(stub, tmp_path):
    """Once the answer's headers went out, a failing upstream must not make the gateway write a second status
    line into the stream: the agent gets the bytes that came, then a proper end."""
    stub.model.fail_next("cut")
    journal = tmp_path / "j.jsonl"
    with gateway_for(stub) as gateway:
        access = gateway.access("run-5", journal)
        connection = UnixConnection(gateway.address)
        body = json.dumps({"model": "stub-model", "stream": True, "messages": []})
        headers = {"Authorization": f"Bearer {access.api_key}", "Content-Type": "application/json"}
        connection.request("POST", "/v1/chat/completions", body, headers)
        status, answer = read_chunked(connection)
        assert status == 200
        assert answer == b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}}]}\n\n'
        connection.request("POST", "/v1/chat/completions", body, headers)  # the connection is still good
        again, _ = read_chunked(connection)
        assert again == 200
    first, second = [json.loads(line) for line in journal.read_text().splitlines()]
    assert first["status"] == 200 and first["stream"] is True and first["response_bytes"] == len(answer)
    assert first["error"].startswith(f"the upstream broke off the stream after {len(answer)} bytes: ")
    assert "error" not in second


def test_a_chunked_request_body_is_forwarded_whole_and_the_connection_stays_in_step(stub, tmp_path):
    """A request sent with Transfer-Encoding: chunked: the upstream gets its body, and none of its bytes are
    read as a next request on the kept-alive connection."""
    with gateway_for(stub) as gateway:
        access = gateway.access("run-6", tmp_path / "j.jsonl")
        connection = UnixConnection(gateway.address)
        body = {"model": "stub-model", "messages": [{"role": "user", "content": "chunked " * 200}], "tools": []}
        data = json.dumps(body).encode()
        pieces = iter([data[:100], data[100:1000], data[1000:]])
        headers = {"Authorization": f"Bearer {access.api_key}", "Content-Type": "application/json"}
        connection.request("POST", "/v1/chat/completions", pieces, headers, encode_chunked=True)
        status, _ = read_chunked(connection)
        connection.request("GET", "/v1/models", headers=headers)
        listed, models = read_chunked(connection)
    assert (status, listed) == (200, 200) and json.loads(models)["data"][0]["id"] == "stub-model"
    chat, listing = stub.model.requests
    assert chat["body"] == body and listing["method"] == "GET"


def test_upstream_errors_pass_through_with_their_status_once_the_budget_is_spent(stub, tmp_path):
    stub.model.fail_next(429)
    with gateway_for(stub, body_limit=0, retry_budget=0) as gateway:
        access = gateway.access("run-4", tmp_path / "j.jsonl")
        status, answer = post(gateway, "/v1/chat/completions", {"messages": []}, access.api_key)
    assert status == 429
    assert json.loads(answer)["error"]["message"] == (
        "pvisor-host gateway: upstream returned status 429 (rate limit: too many requests): stub failure 429"
    )
    entry = json.loads((tmp_path / "j.jsonl").read_text())
    assert "request_body" not in entry and "response_body" not in entry  # bodies omitted


@pytest.mark.parametrize(
    ("ipam", "address"),
    [
        # An engine that has been up a while (and every network the gateway creates on 20.10): the gateway is given.
        ({"Driver": "default", "Config": [{"Subnet": "172.18.0.0/16", "Gateway": "172.18.0.1"}]}, "172.18.0.1"),
        # A freshly started docker.io 20.10.24: the default bridge has only its subnet; docker0 is its first host.
        ({"Driver": "default", "Options": None, "Config": [{"Subnet": "172.17.0.0/16"}]}, "172.17.0.1"),
        # An IPv6 entry first, and a gateway written with its prefix length.
        ({"Config": [{"Subnet": "fd00::/64", "Gateway": "fd00::1"}, {"Subnet": "10.9.0.0/24"}]}, "10.9.0.1"),
        ({"Config": [{"Subnet": "10.9.0.0/24", "Gateway": "10.9.0.254/24"}]}, "10.9.0.254"),
    ],
)
def test_the_gateway_address_does_not_depend_on_the_engine_filling_it_in(ipam, address):
    assert network_gateway({"Name": "n", "IPAM": ipam}) == address


@pytest.mark.parametrize("ipam", [None, {}, {"Config": None}, {"Config": [{"Subnet": "fd00::/64"}]}])
def test_a_network_without_an_ipv4_subnet_is_refused_in_words(ipam):
    with pytest.raises(ValueError, match="network n has no IPv4 subnet"):
        network_gateway({"Name": "n", "IPAM": ipam})


def journal_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_rate_limit_is_waited_out_as_retry_after_says_before_the_agent_sees_anything(stub, tmp_path):
    stub.model.fail_for(1.5, 429, retry_after=1)
    with gateway_for(stub) as gateway:
        access = gateway.access("run-7", tmp_path / "j.jsonl")
        started = time.monotonic()
        status, _ = post(gateway, "/v1/chat/completions", {"messages": []}, access.api_key)
        took = time.monotonic() - started
    assert status == 200 and 1.5 <= took < 5
    (entry,) = journal_of(tmp_path / "j.jsonl")
    assert entry["status"] == 200
    assert [(r["status"], r["retry_after"]) for r in entry["retries"]] == [(429, 1.0)] * 2
    first, second = (r["wait_ms"] for r in entry["retries"])
    assert 1000.0 <= first <= 1500.0 and 1000.0 <= second <= 2000.0  # Retry-After, or the backoff if longer
    assert len(stub.model.model_requests()) == 3


def test_failures_beyond_the_budget_reach_the_agent_with_their_status_and_every_retry_is_journaled(stub, tmp_path):
    stub.model.fail_for(60, 500)
    with gateway_for(stub, retry_budget=3) as gateway:
        access = gateway.access("run-8", tmp_path / "j.jsonl")
        started = time.monotonic()
        status, answer = post(gateway, "/v1/chat/completions", {"messages": []}, access.api_key)
        took = time.monotonic() - started
    assert status == 500 and took < 3.5  # no sleep is begun that would end past the budget
    assert "upstream returned status 500 (internal server error)" in json.loads(answer)["error"]["message"]
    (entry,) = journal_of(tmp_path / "j.jsonl")
    assert len(entry["retries"]) == len(stub.model.model_requests()) - 1 >= 1
    assert all(r["status"] == 500 and "retry_after" not in r for r in entry["retries"])


def test_a_refused_connection_is_retried_until_the_upstream_comes_back(tmp_path, monkeypatch):
    with StubServer() as probe:  # a free port, free again
        port = probe.httpd.server_address[1]
    config = ModelUpstream(base_url=f"http://127.0.0.1:{port}/v1", model="m", api_key_env="X", network="unix")
    refused = threading.Event()
    note = Tries.note

    def noted(tries: Tries, state: Any) -> None:  # tenacity's before_sleep: a try was refused
        note(tries, state)
        refused.set()

    monkeypatch.setattr(Tries, "note", noted)
    started: list[StubServer] = []

    def come_back() -> None:  # once the gateway has been refused
        if refused.wait(60):
            started.append(StubServer(port=port).__enter__())

    later = threading.Thread(target=come_back)
    with Gateway(config, REAL_KEY) as gateway:
        access = gateway.access("run-9", tmp_path / "j.jsonl")
        later.start()
        try:
            status, _ = post(gateway, "/v1/chat/completions", {"messages": []}, access.api_key)
        finally:
            later.join()
            for server in started:
                server.__exit__()
    assert status == 200
    (entry,) = journal_of(tmp_path / "j.jsonl")
    assert entry["retries"] and {r["error"] for r in entry["retries"]} == {"connection refused"}


def test_calls_in_flight_never_exceed_the_concurrency_and_the_wait_is_journaled(stub, tmp_path):
    stub.model.hold = 0.3
    with gateway_for(stub, concurrency=2) as gateway:
        accesses = [gateway.access(f"run-c{n}", tmp_path / f"j{n}.jsonl") for n in range(6)]
        answers: list[int] = []
        threads = [
            threading.Thread(target=lambda a=a: answers.append(post(gateway, "/v1/chat/completions", {}, a.api_key)[0]))
            for a in accesses
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert answers == [200] * 6 and stub.model.peak == 2
    waits = sorted(journal_of(tmp_path / f"j{n}.jsonl")[0]["waited_ms"] for n in range(6))
    assert waits[:2] == [0.0, 0.0] or waits[0] < 50  # the first two went at once
    assert waits[-1] >= 500  # the last two waited for two rounds of 0.3 s


def test_a_cassette_records_then_serves_with_no_upstream_and_names_the_first_drifting_message(stub, tmp_path):
    from pvisor_host.gateway.cassette import Tape
    from pvisor_host.models.gateway import Cassette

    tape = tmp_path / "t.jsonl"
    chat = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "tools": []}
    with gateway_for(stub, cassette=Cassette(mode="record", dir=tmp_path)) as gateway:
        access = gateway.access("rec", tmp_path / "rec.jsonl", Tape(tape, replaying=False))
        first = post(gateway, "/v1/chat/completions", chat, access.api_key)
        streamed = post(gateway, "/v1/responses", {"stream": True, "input": [{"role": "user", "content": "x"}]},
                        access.api_key)  # fmt: skip
    assert [json.loads(line)["call"] for line in tape.read_text().splitlines()] == [1, 2]
    assert REAL_KEY not in tape.read_text() and access.api_key not in tape.read_text()
    offline = ModelUpstream(model="stub-model", network="unix", cassette=Cassette(mode="replay", dir=tmp_path))
    with Gateway(offline, None) as gateway:
        access = gateway.access("rep", tmp_path / "rep.jsonl", Tape(tape, replaying=True))
        assert post(gateway, "/v1/chat/completions", chat, access.api_key) == first
        assert post(gateway, "/v1/responses", {"stream": True, "input": [{"role": "user", "content": "x"}]},
                    access.api_key) == streamed  # fmt: skip
        drifted = Tape(tape, replaying=True)
        access = gateway.access("drift", tmp_path / "drift.jsonl", drifted)
        changed = dict(chat, messages=[{"role": "user", "content": "hello"}])
        status, answer = post(gateway, "/v1/chat/completions", changed, access.api_key)
    assert status == 400
    assert json.loads(answer)["error"]["message"].endswith("cassette drift at call 1: messages message 0 differs "
                                                           "from the recording")  # fmt: skip
    assert drifted.drift is not None and (drifted.drift.call, drifted.drift.field, drifted.drift.message) == (
        1, "messages", 0)  # fmt: skip
    assert drifted.drift.diff == '- {"content": "hi", "role": "user"}\n+ {"content": "hello", "role": "user"}'
    assert len(stub.model.model_requests()) == 2  # nothing reached the upstream while serving
    (entry,) = journal_of(tmp_path / "drift.jsonl")
    assert entry["drift"]["message"] == 0 and entry["status"] == 400


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def test_a_sandbox_cannot_make_the_gateway_hold_what_it_likes(stub, tmp_path):
    """An oversized body is refused (413) before it is read, a run's requests in flight are capped (429), and the
    gateway's memory stays flat while sandboxes send 16 bodies of 100 MiB at once (curl streams them from a file,
    so only the gateway's memory is this process's)."""
    from pvisor_host.gateway.proxy import MAX_REQUEST_BODY, MAX_REQUESTS_PER_RUN

    journal = tmp_path / "model-traffic.jsonl"
    big = tmp_path / "big.json"
    with big.open("wb") as handle:
        handle.truncate(100 * 1024**2)
    stub.model.hold = 2.0
    with gateway_for(stub) as gateway:
        access = gateway.access("run-1", journal)
        baseline, peak, sampling = _rss(), [0], threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                peak[0] = max(peak[0], _rss())
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        sends = [
            subprocess.Popen(
                [
                    "curl",
                    "-s",
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code}",
                    "--unix-socket",
                    gateway.address,
                    "-H",
                    f"Authorization: Bearer {access.api_key}",
                    "-H",
                    "Content-Type: application/json",
                    "--data-binary",
                    f"@{big}",
                    "http://gateway/v1/chat/completions",
                ],
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for _ in range(16)
        ]
        codes = [send.communicate(timeout=60)[0] for send in sends]
        sampling.set()
        sampler.join()
        assert set(codes) <= {"413", "429"} and "413" in codes  # past the cap of 8 at once: 429 before anything
        assert peak[0] - baseline < 64 * 1024**2  # no body was buffered (each was 100 MiB)
        assert stub.model.requests == []

        answers: list[int] = []
        lock = threading.Lock()

        def call() -> None:
            status = post(gateway, "/v1/chat/completions", {"messages": []}, access.api_key)[0]
            with lock:
                answers.append(status)

        calls = [threading.Thread(target=call) for _ in range(MAX_REQUESTS_PER_RUN + 3)]
        for thread in calls:
            thread.start()
        for thread in calls:
            thread.join()
        assert sorted(answers) == [200] * MAX_REQUESTS_PER_RUN + [429] * 3
    entries = journal_of(journal)
    refused = [e for e in entries if e["status"] == 413]
    assert refused and all(e["request_bytes"] == 0 for e in refused) and MAX_REQUEST_BODY > 0


def test_an_upstream_error_that_echoes_the_key_reaches_neither_the_sandbox_nor_the_journal_nor_the_tape(stub, tmp_path):
    from pvisor_host.gateway.cassette import Tape

    journal, tape = tmp_path / "model-traffic.jsonl", tmp_path / "tape.jsonl"
    stub.model.fail_next("echo-key")
    with gateway_for(stub, body_limit=1 << 20) as gateway:
        access = gateway.access("run-1", journal, Tape(tape, replaying=False))
        status, answer = post(gateway, "/v1/chat/completions", {"messages": []}, access.api_key)
    assert status == 401
    assert "Incorrect API key provided: <the key>. You sent: <the key>" in answer.decode()
    written = journal.read_text() + (tape.read_text() if tape.exists() else "")
    assert "Incorrect API key provided" in journal.read_text()  # the error is journaled, scrubbed
    assert REAL_KEY not in written and "****" not in written
