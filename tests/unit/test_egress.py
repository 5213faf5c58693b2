"""The egress list, its caps and its journal, and the proxy itself on loopback: real sockets and real HTTP
upstreams on 127.0.0.1, names resolved by a table (the proxy's resolver seam), no engine."""

from __future__ import annotations

import contextlib
import http.server
import ipaddress
import json
import re
import socket
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from pvisor_host.backend.docker.egress import proxy_env
from pvisor_host.backend.docker.sandbox.outcome import tool_calls
from pvisor_host.gateway.egress import EgressProxy, public
from pvisor_host.models.egress import PRESETS, Egress, EgressInfo, EgressLimit, EgressStats, EgressTotals
from pvisor_host.models.spec import ReplaySpec

# -- the list ---------------------------------------------------------------------------------------------------


def test_entries_presets_wildcards_and_ports():
    egress = Egress.model_validate("pypi,allow:*.Example.org,allow:api.test:8443,10.0.0.5:8080,[::1]:9,npm")
    assert egress.presets == ("pypi", "npm")
    assert egress.allows("pypi.org", 443) and egress.allows("files.pythonhosted.org", 80)
    assert egress.allows("registry.npmjs.org", 443)
    assert egress.allows("a.b.example.org", 443) and not egress.allows("example.org", 443)  # subdomains only
    assert not egress.allows("badexample.org", 443)
    assert egress.allows("api.test", 8443) and not egress.allows("api.test", 443)
    assert egress.allows("10.0.0.5", 8080) and not egress.allows("10.0.0.5", 80)
    assert egress.allows("::1", 9)
    assert not egress.allows("evil.test", 443)
    assert str(egress) == "pypi,npm,allow:*.example.org,allow:api.test:8443,allow:10.0.0.5:8080,allow:[::1]:9"
    again = Egress.model_validate(str(egress))  # the compact form reads back
    assert (set(again.rules), again.presets) == (set(egress.rules), egress.presets)
    assert Egress.model_validate(["pypi", "allow:x.test"]).allows("x.test", 80)  # a manifest's list
    assert Egress.model_validate("none").rules == () and str(Egress.model_validate("none")) == "none"


def test_presets_are_documented_as_they_are():
    page = (Path(__file__).parents[2] / "docs" / "egress.md").read_text()
    for name, hosts in PRESETS.items():
        assert f"| `{name}` | " + ", ".join(f"`{h}`" for h in hosts) + " |" in page


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("allow:", "the host is empty"),
        ("allow::443", "the host is empty"),
        ("allow:pypi.org:0", "the port must be a number from 1 to 65535"),
        ("allow:pypi.org:http", "the port must be a number from 1 to 65535"),
        ("allow:pypi.org:70000", "the port must be a number from 1 to 65535"),
        ("allow:https://pypi.org/simple", "is a URL; give its host (and port)"),
        ("pypi.org/simple", "is a URL"),
        ("allow:a..b", "is not a host name"),
        ("allow:*.*.x.org", "a wildcard is only *.NAME"),
        ("allow:x*.org", "a wildcard is only *.NAME"),
        ("pypi,,npm", "an empty entry"),
        ("allow:[::1", "an IPv6 address in brackets"),
        ("allow:[nope]:1", "is not an IPv6 address"),
        ("allow:0.0.0.0:80", "0.0.0.0 is no host"),
        ("allow:[::]:80", "[::] is no host"),
    ],
)
def test_bad_entries_are_refused_in_one_line(value, message):
    with pytest.raises(ValidationError) as caught:
        Egress.model_validate(value)
    assert message in str(caught.value)
    assert len(caught.value.errors()) == 1


def test_egress_needs_the_network_off_and_limits_read_back():
    with pytest.raises(ValidationError, match="--egress with --network bridge"):
        ReplaySpec(trajectory=Path("t.jsonl"), after_step=1, egress="pypi", network="bridge")  # type: ignore[arg-type]
    for network in ("internal", "pass-through"):
        with pytest.raises(ValidationError, match=f"--egress with --model-network {network}: that puts the sandbox"):
            ReplaySpec.model_validate({
                "trajectory": "t.jsonl", "after_step": 1, "egress": "pypi", "model_base_url": "http://m.test/v1",
                "model": "m", "model_api_key_env": "KEY", "model_network": network,
            })  # fmt: skip
    assert ReplaySpec(trajectory=Path("t.jsonl"), after_step=1, egress_limit="bytes=1m").egress is None  # type: ignore[arg-type]
    limit = EgressLimit.model_validate("connections=5,bytes=2m")
    assert (limit.connections, limit.bytes, limit.at_once) == (5, 2 * 1024**2, 64)
    assert EgressLimit.model_validate(str(limit)) == limit
    with pytest.raises(ValidationError, match="expected connections=N,bytes=SIZE"):
        EgressLimit.model_validate("conns=5")


@pytest.mark.parametrize(
    ("address", "reaches"),
    [
        ("8.8.8.8", True), ("2001:4860:4860::8888", True), ("10.0.0.1", False), ("127.0.0.1", False),
        ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("::1", False), ("fd00::1", False),
        ("fe80::1", False), ("::ffff:10.0.0.1", False), ("::ffff:8.8.8.8", True), ("64:ff9b::a00:1", False),
        ("64:ff9b::a9fe:a9fe", False), ("64:ff9b::808:808", True), ("64:ff9b:1::a00:1", False),
        ("2002:7f00:1::", False), ("2002:a00:1::", False), ("::7f00:1", False), ("::ffff:0:7f00:1", False),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", False), ("ff02::1", False), ("224.0.0.1", False),
    ],
)  # fmt: skip
def test_only_public_addresses_pass_in_any_ipv6_form_that_carries_ipv4(address, reaches):
    assert public(ipaddress.ip_address(address)) is reaches


def test_the_proxy_variables_in_every_form_the_tools_read():
    env = proxy_env(["172.30.0.1"])
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        assert env[name] == "http://127.0.0.1:18081"
    assert env["no_proxy"] == env["NO_PROXY"] == "127.0.0.1,localhost,::1,172.30.0.1"


# -- the proxy --------------------------------------------------------------------------------------------------


class _Upstream(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        size = int(self.path.split("/big/")[1]) if "/big/" in self.path else 0
        body = b"x" * size if size else f"got {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(201)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[::-1])

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def upstream():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


NAMES = {"inside.test": ["10.1.2.3"], "meta.test": ["169.254.169.254"], "mixed.test": ["192.168.0.9", "127.0.0.1"]}


async def _table(host: str, port: int) -> list[str]:
    if host not in NAMES:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    return NAMES[host]


@pytest.fixture
def proxy():
    proxy = EgressProxy(resolver=_table)
    yield proxy
    proxy.close()


def _open(proxy: EgressProxy, tmp_path: Path, egress: str, limit: EgressLimit | None = None, name: str = "e"):
    return proxy.open("r1", Egress.model_validate(egress), limit or EgressLimit(), tmp_path / f"{name}.sock")


def _ask(path: Path, raw: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        if raw:
            sock.sendall(raw)
        else:  # nothing to say: a proxy that refuses before reading a byte may have answered and closed already
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def _get(path: Path, url: str) -> tuple[int, bytes]:
    answer = _ask(path, f"GET {url} HTTP/1.1\r\nHost: x\r\nProxy-Connection: keep-alive\r\n\r\n".encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_listed_hosts_are_reached_the_rest_refused_with_one_line_each(proxy, upstream, tmp_path):
    run = _open(proxy, tmp_path, f"allow:127.0.0.1:{upstream},inside.test,meta.test,mixed.test:{upstream}")
    sock = run.socket_path
    assert _get(sock, f"http://127.0.0.1:{upstream}/ok?q=1") == (200, b"got /ok?q=1")
    posted = _ask(
        sock, f"POST http://127.0.0.1:{upstream}/p HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc".encode()
    )
    assert posted.startswith(b"HTTP/1.1 201 ") and posted.endswith(b"\r\n\r\ncba")
    refusals = {
        f"http://127.0.0.1:{upstream + 1}/": f"refused 127.0.0.1:{upstream + 1}: not in --egress",
        "http://inside.test/": "refused inside.test:80: inside.test resolves to 10.1.2.3, a private address",
        "http://meta.test/latest": "refused meta.test:80: meta.test resolves to 169.254.169.254, a link-local "
        "address (cloud metadata)",
        "http://unknown.test/": "not in --egress",
        "https://127.0.0.1:8443/": "a proxy request names an http:// URL (HTTPS goes by CONNECT)",
    }
    # a name with a private address and a listed one: the listed one, which it checked, is the one it connects to
    assert _get(sock, f"http://mixed.test:{upstream}/mixed") == (200, b"got /mixed")
    for url, reason in refusals.items():
        status, body = _get(sock, url)
        assert status == 403 and reason in body.decode() and body.count(b"\n") == 1, (url, body)
    info = proxy.close_run(run)
    assert (info.connections, info.refused) == (3, len(refusals))
    assert info.hosts == [f"127.0.0.1:{upstream}", f"mixed.test:{upstream}"]
    assert [e.verdict for e in info.events] == ["allowed"] * 3 + ["refused"] * len(refusals)
    assert info.events[2].address == "127.0.0.1"
    first = info.events[0]
    assert (first.method, first.path, first.status, first.received, first.address) == (
        "GET", "/ok", 200, len(b"got /ok?q=1"), "127.0.0.1"
    )  # fmt: skip
    assert (info.events[1].sent, info.events[1].received) == (3, 3)
    assert not run.socket_path.exists()


def test_an_allowed_name_with_an_unlisted_address_is_refused_unless_the_address_is_listed(
    proxy, upstream, tmp_path, monkeypatch
):
    monkeypatch.setitem(NAMES, "local.test", ["127.0.0.1"])
    run = _open(proxy, tmp_path, f"allow:local.test:{upstream}")
    status, body = _get(run.socket_path, f"http://local.test:{upstream}/")
    assert status == 403 and b"resolves to 127.0.0.1, a loopback address" in body
    proxy.close_run(run)
    listed = _open(proxy, tmp_path, f"allow:local.test:{upstream},allow:127.0.0.1:{upstream}", name="f")
    assert _get(listed.socket_path, f"http://local.test:{upstream}/named") == (200, b"got /named")
    proxy.close_run(listed)


def test_a_connect_tunnel_carries_bytes_both_ways_and_counts_them(proxy, upstream, tmp_path):
    run = _open(proxy, tmp_path, f"allow:127.0.0.1:{upstream}")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(run.socket_path))
        request = b"GET /tunnelled HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        # the tunnelled request sent at once, behind the CONNECT (those bytes are carried and counted too)
        sock.sendall(f"CONNECT 127.0.0.1:{upstream} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode() + request)
        assert sock.recv(39) == b"HTTP/1.1 200 Connection established\r\n\r\n"
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.endswith(b"got /tunnelled")
    deadline = time.monotonic() + 5
    while run.tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    info = proxy.close_run(run)
    [event] = info.events
    assert (event.method, event.verdict, event.sent, event.received) == (
        "CONNECT",
        "allowed",
        len(request),
        len(answer),
    )


def test_the_caps_refuse_connections_and_cut_bytes_and_say_which(proxy, upstream, tmp_path):
    run = _open(proxy, tmp_path, f"allow:127.0.0.1:{upstream}", EgressLimit(connections=2))
    assert _get(run.socket_path, f"http://127.0.0.1:{upstream}/1")[0] == 200
    assert _get(run.socket_path, f"http://127.0.0.1:{upstream}/2")[0] == 200
    status, body = _get(run.socket_path, f"http://127.0.0.1:{upstream}/3")
    assert status == 403 and b"--egress-limit: the sandbox's 2 connections are used up" in body
    info = proxy.close_run(run)
    assert (info.connections, info.refused, info.limited) == (2, 1, "connections")

    run = _open(proxy, tmp_path, f"allow:127.0.0.1:{upstream}", EgressLimit(bytes=100_000), name="g")
    answer = _ask(run.socket_path, f"GET http://127.0.0.1:{upstream}/big/1000000 HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 200 ") and len(answer) < 1_000_000  # cut short
    status, body = _get(run.socket_path, f"http://127.0.0.1:{upstream}/after")
    assert status == 403 and b"100000 bytes are used up" in body
    info = proxy.close_run(run)
    assert info.limited == "bytes"
    cut = info.events[0]
    assert cut.verdict == "allowed" and cut.reason is not None and "--egress-limit of 100000 bytes" in cut.reason
    assert cut.received == 100_000 and answer.endswith(b"\r\n\r\n" + b"x" * 100_000)  # the cap, to the byte


def test_connections_past_at_once_are_refused_before_a_byte_is_read(proxy, tmp_path):
    run = _open(proxy, tmp_path, "pypi", EgressLimit(at_once=2))
    idle = [socket.socket(socket.AF_UNIX) for _ in range(2)]
    try:
        for sock in idle:
            sock.connect(str(run.socket_path))  # connected, and saying nothing
        deadline = time.monotonic() + 5
        while len(run.tasks) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        answer = _ask(run.socket_path, b"")
        assert answer.startswith(b"HTTP/1.1 403 Forbidden") and b"--egress-limit: 2 connections at once" in answer
    finally:
        for sock in idle:
            sock.close()
    info = proxy.close_run(run)
    assert info.refused == 1 and info.events == []


@pytest.mark.parametrize(
    ("request_line", "answer"),
    [
        (f"CONNECT {'a' * 300}.test:443", "not a host and port"),
        ("CONNECT pypi.org", "expected HOST:PORT"),
        ("CONNECT pypi.org:99999", "not a host and port"),
        ("GET /relative", "a proxy request names an http:// URL"),
        (f"GET http://{'b' * 64}.pythonhosted.org/", "does not resolve on the host"),
    ],
)
def test_odd_targets_get_one_line_and_never_a_connection(proxy, tmp_path, monkeypatch, request_line, answer):
    async def idna(host: str, port: int) -> list[str]:
        return [socket.getaddrinfo(host, port)[0][4][0]]  # the real resolver's refusal of a 64-byte label

    monkeypatch.setattr(proxy, "_resolve", idna)
    run = _open(proxy, tmp_path, "pypi,allow:*.pythonhosted.org")
    reply = _ask(run.socket_path, f"{request_line} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert reply.startswith(b"HTTP/1.1 403 ") and answer in reply.decode(), reply
    assert proxy.close_run(run).connections == 0


def test_not_a_proxy_request_gets_400_and_a_silent_client_nothing(proxy, tmp_path):
    run = _open(proxy, tmp_path, "pypi")
    assert _ask(run.socket_path, b"\x16\x03\x01 not http\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert _ask(run.socket_path, b"") == b""
    info = proxy.close_run(run)
    assert info.events == []  # nothing named a host


def test_the_journal_keeps_the_first_events_and_counts_all(proxy, upstream, tmp_path, monkeypatch):
    import pvisor_host.gateway.egress as module

    monkeypatch.setattr(module, "EVENTS_KEPT", 3)
    run = _open(proxy, tmp_path, "none")
    for n in range(5):
        assert _get(run.socket_path, f"http://h{n}.test/")[0] == 403
    info = proxy.close_run(run)
    assert (len(info.events), info.dropped, info.refused) == (3, 2, 5)
    assert info.refused_hosts == [f"h{n}.test:80" for n in range(3)]  # bounded like the events
    assert info.events[0].reason == "--egress allows no host"


# -- the record, the results, the summary ----------------------------------------------------------------------


def test_connections_are_given_the_replayed_call_they_happened_during(tmp_path):
    def line(name: str, at_ms: int, **payload: object) -> str:
        return json.dumps({"event": {"observed_at_unix_ms": at_ms, "data": {"name": name, "payload": payload}}})

    events = tmp_path / "replay-events.jsonl"
    events.write_text("\n".join([
        '{"format":"pvisor.trace/5","journal":"j"}',
        line("tool_started", 1000, batch=1, call_id="a", tool="Bash"),
        line("tool_finished", 2000, batch=1, call_id="a", return_code=0),
        line("tool_started", 3000, batch=2, call_id="b", tool="Bash"),
        line("tool_started", 3000, batch=2, call_id="c", tool="WebFetch"),
        line("tool_finished", 4000, batch=2, call_id="b", return_code=0),
        "not json",
    ]) + "\n")  # fmt: skip
    assert tool_calls(events) == [
        (1.0, 2.0, "a", "Bash"),
        (3.0, 4.0, "b", "Bash"),
        (3.0, float("inf"), "c", "WebFetch"),
    ]
    assert tool_calls(tmp_path / "missing.jsonl") == []


def test_totals_and_the_batch_stats():
    info = EgressInfo(allowed="pypi", limit=EgressLimit(), connections=3, refused=1, sent=10, received=2048,
                      hosts=["pypi.org:443"], refused_hosts=["evil.test:443"], limited="bytes")  # fmt: skip
    assert info.describe() == (
        "3 connections, 1 refused; 10 B sent, 2.0 KiB received; reached pypi.org:443; refused evil.test:443; "
        "--egress-limit bytes reached"
    )
    one = info.totals()
    assert type(one) is EgressTotals and one.hosts == info.hosts
    two = EgressTotals(connections=1, hosts=["pypi.org:443", "files.pythonhosted.org:443"])
    stats = EgressStats.over([one, two])
    assert stats is not None
    assert (stats.items, stats.connections, stats.refused, stats.limited) == (2, 4, 1, 1)
    assert stats.hosts == {"pypi.org:443": 2, "files.pythonhosted.org:443": 1}
    assert stats.refused_hosts == {"evil.test:443": 1}
    assert EgressStats.over([]) is None
    assert re.match(r"^2 items: 4 connections, 1 refused; ", stats.describe())
