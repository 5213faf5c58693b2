"""``--egress`` for real: a Claude Code replay in the product's sandbox whose tool calls fetch over HTTP and
HTTPS and ``pip install`` from a package index, through the host's egress proxy, with the sandbox on
``--network none``. The upstreams are HTTP and HTTPS servers this module starts on the host's end of the
engine's bridge (a private address, so it must be listed as such); a name that resolves to it comes from an
``/etc/hosts`` of the test's own, bind-mounted in a mount namespace the test makes for the pvisor-host process."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import ssl
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from pvisor_host.backend.docker.gateway import network_gateway
from pvisor_host.models.egress import HOST_ALIAS

from browser import Browser
from conftest import CliResult, default_signals
from trajgen import Call, Turn, claude_session, write_jsonl

pytestmark = pytest.mark.docker

PACKAGE = "pvhdemo"
NAME = "inside.pvh.test"  # resolves to the bridge's (private) address on the host, in the test's /etc/hosts
FETCH = ("python3 -c \"import ssl, sys, urllib.request as u\ntry: print(u.urlopen(sys.argv[1], "
         "context=ssl._create_unverified_context(), timeout=30).read().decode())\nexcept Exception as e: "
         "print('failed:', e, e.read().decode() if hasattr(e, 'read') else '')\" ")  # fmt: skip


def _wheel() -> tuple[str, bytes]:
    """A one-module wheel, ``pvhdemo``, with its RECORD."""
    name = f"{PACKAGE}-1.0-py3-none-any.whl"
    files = {
        f"{PACKAGE}/__init__.py": b'VALUE = "from the local index"\n',
        f"{PACKAGE}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 1.0\n".encode(),
        f"{PACKAGE}-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = (
        "".join(
            f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
            for path, data in files.items()
        )
        + f"{PACKAGE}-1.0.dist-info/RECORD,,\n"
    )
    files[f"{PACKAGE}-1.0.dist-info/RECORD"] = record.encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return name, buffer.getvalue()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    wheel = _wheel()

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        wheel_name, wheel = self.wheel
        kind = "text/plain"
        if self.path.startswith("/big/"):
            body = b"x" * int(self.path.removeprefix("/big/"))
        elif self.path.rstrip("/") == f"/simple/{PACKAGE}":
            body = f'<html><body><a href="/packages/{wheel_name}">{wheel_name}</a></body></html>'.encode()
            kind = "text/html"
        elif self.path == f"/packages/{wheel_name}":
            body = wheel
        else:
            body = f"egress ok {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def upstreams(docker_client, tmp_path_factory):
    """(address, HTTP port, HTTPS port, an unlisted port, a port on the host's loopback): servers on the bridge's
    host address, and one on the host's own 127.0.0.1."""
    address = network_gateway(docker_client.networks.get("bridge").attrs)
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=pvh-test", "-days", "1",
                    "-keyout", str(folder / "key.pem"), "-out", str(folder / "cert.pem")],
                   check=True, capture_output=True)  # fmt: skip
    plain = http.server.ThreadingHTTPServer((address, 0), _Handler)
    secure = http.server.ThreadingHTTPServer((address, 0), _Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "cert.pem", folder / "key.pem")
    secure.socket = context.wrap_socket(secure.socket, server_side=True)
    unlisted = http.server.ThreadingHTTPServer((address, 0), _Handler)
    local = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)  # a package index on the host's loopback
    servers = (plain, secure, unlisted, local)
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield (
        address,
        plain.server_address[1],
        secure.server_address[1],
        unlisted.server_address[1],
        local.server_address[1],
    )
    for server in servers:
        server.shutdown()
        server.server_close()


def pvisor_host(tmp_path: Path, address: str, *args: str | Path) -> CliResult:
    """``pvisor-host ARGS`` in a mount namespace of its own, whose ``/etc/hosts`` also names :data:`NAME`."""
    hosts = tmp_path / "hosts"
    hosts.write_text(Path("/etc/hosts").read_text() + f"\n{address} {NAME}\n")
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts),
               sys.executable, "-m", "pvisor_host", *map(str, args)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, preexec_fn=default_signals)
    return CliResult(done.returncode, done.stdout, done.stderr)


def observations(run_dir: Path) -> dict[str, str]:
    """The fresh observation of each replayed call (pvisor's reconstructed prefix), by call id."""
    found = {}
    for line in (run_dir / "output" / "native" / "reconstructed-prefix.jsonl").read_text().splitlines():
        content = json.loads(line).get("message", {}).get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("type") == "tool_result":
                text = part.get("content")
                found[part["tool_use_id"]] = text if isinstance(text, str) else json.dumps(text)
    return found


def session(tmp_path: Path, name: str, commands: list[str]) -> Path:
    calls = [Call("Bash", {"command": command}, "recorded\n") for command in commands]
    return write_jsonl(tmp_path / f"{name}.jsonl", claude_session("Fetch.", [Turn([c]) for c in calls]))


def pip_install(address: str, port: int, target: str = "/tmp/pkgs") -> str:
    return (f"/opt/pvisor/bin/pip install --quiet --no-cache-dir --disable-pip-version-check --target {target} "
            f"--index-url http://{address}:{port}/simple/ --trusted-host {address} {PACKAGE} 2>&1 | tail -n 3; "
            f"python3 -c \"import sys; sys.path.insert(0, '{target}'); import {PACKAGE}; print({PACKAGE}.VALUE)\" "
            "2>&1 | tail -n 1")  # fmt: skip


def test_a_replay_reaches_the_listed_hosts_and_is_refused_the_rest_each_call_journaled(
    tmp_path, claude_image, upstreams, docker_client
):
    address, port, tls, unlisted, local = upstreams
    trajectory = session(tmp_path, "egress", [
        FETCH + f"http://{address}:{port}/allowed",
        FETCH + f"http://{address}:{unlisted}/unlisted",
        FETCH + f"http://{NAME}:{unlisted}/private",
        FETCH + f"https://{address}:{tls}/secure",
        pip_install(address, port),
        pip_install(HOST_ALIAS, local, "/tmp/local"),  # the host's own loopback, by the name for it
    ])  # fmt: skip
    out = tmp_path / "run"
    # the name is listed, the address it resolves to is not (for that port): refused
    egress = f"allow:{address}:{port},allow:{address}:{tls},allow:{NAME}:{unlisted},allow:{HOST_ALIAS}:{local}"
    loopback = pvisor_host(
        tmp_path,
        address,
        "replay",
        "--agent",
        "claude-code",
        "--trajectory",
        trajectory,
        "--after-step",
        "6",
        "--mode",
        "replay-only",
        "--egress",
        f"allow:127.0.0.1:{local}",
    )
    assert (loopback.code, loopback.stderr) == (2, (
        f"pvisor-host: error: --egress allow:127.0.0.1:{local}: 127.0.0.1 in the sandbox is the sandbox itself, so "
        f"its tools never reach the host's by it; to reach a service on the host's loopback, list allow:{HOST_ALIAS}:"
        f"{local} and call it by that name (http://{HOST_ALIAS}:{local}/)\n"
    ))  # fmt: skip
    done = pvisor_host(tmp_path, address, "replay", "--agent", "claude-code", "--trajectory", trajectory,
                       "--after-step", "6", "--mode", "replay-only", "--out", out, "--egress", egress,
                       "--json")  # fmt: skip
    assert done.code == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["status"] == "ok" and record["limits"]["network"] == "none"  # the sandbox has no network
    seen = observations(out)
    assert seen["toolu_01a"] == "egress ok /allowed\n"
    assert seen["toolu_02a"].startswith("failed: HTTP Error 403: Forbidden pvisor-host egress: refused "
                                        f"{address}:{unlisted}: not in --egress")  # fmt: skip
    assert seen["toolu_03a"].startswith(
        f"failed: HTTP Error 403: Forbidden pvisor-host egress: refused {NAME}:{unlisted}: {NAME} resolves to "
        f"{address}, a private address (allowed only when the address itself is listed)"
    )
    assert seen["toolu_04a"] == "egress ok /secure\n"  # through a CONNECT tunnel
    assert seen["toolu_05a"] == "from the local index\n"
    assert seen["toolu_06a"] == "from the local index\n"  # pip through the proxy to the host's 127.0.0.1
    journal = record["egress"]
    assert journal["allowed"] == egress
    assert journal["hosts"] == [f"{address}:{port}", f"{address}:{tls}", f"{HOST_ALIAS}:{local}"]
    assert journal["refused_hosts"] == [f"{address}:{unlisted}", f"{NAME}:{unlisted}"]
    assert (journal["refused"], journal["limited"], journal["dropped"]) == (2, None, 0)
    by_call: dict[str, list[tuple[str, str, str]]] = {}
    for event in journal["events"]:
        by_call.setdefault(event["call"], []).append((event["method"], f"{event['host']}:{event['port']}",
                                                      event["verdict"]))  # fmt: skip
    assert by_call["toolu_01a"] == [("GET", f"{address}:{port}", "allowed")]
    assert by_call["toolu_02a"] == [("GET", f"{address}:{unlisted}", "refused")]
    assert by_call["toolu_03a"] == [("GET", f"{NAME}:{unlisted}", "refused")]
    assert by_call["toolu_04a"] == [("CONNECT", f"{address}:{tls}", "allowed")]
    assert {e for e in by_call["toolu_05a"]} == {("GET", f"{address}:{port}", "allowed")}  # the index, the wheel
    wheel = next(e for e in journal["events"] if e["path"] == f"/packages/{_Handler.wheel[0]}")
    assert wheel["received"] == len(_Handler.wheel[1]) and wheel["status"] == 200
    assert {e["address"] for e in journal["events"] if e["call"] == "toolu_06a"} == {"127.0.0.1"}
    assert journal["connections"] == len(journal["events"]) - 2
    assert docker_client.containers.list(all=True, filters={"label": f"pvisor-host.run={record['run_id']}"}) == []


def test_a_batch_journals_an_unlisted_index_and_a_cut_download_and_the_report_shows_both(
    tmp_path, claude_image, upstreams, chromium
):
    address, port, tls, *_ = upstreams
    index = session(tmp_path, "index", [pip_install(address, port)])
    download = session(tmp_path, "download", [FETCH + f"http://{address}:{port}/big/3000000 | wc -c"])
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in [
        {"id": "unlisted-index", "trajectory": str(index), "after_step": 1, "egress": f"allow:{address}:{tls}"},
        {"id": "capped", "trajectory": str(download), "after_step": 1, "egress": f"allow:{address}:{port}",
         "egress_limit": "bytes=200k"},
    ]))  # fmt: skip
    out = tmp_path / "batch"
    done = pvisor_host(tmp_path, address, "batch", manifest, "--agent", "claude-code", "--mode", "replay-only",
                       "--out", out, "--json", "--quiet")  # fmt: skip
    assert done.code == 0, done.stderr
    summary = json.loads(done.stdout)
    refused = json.loads((out / "unlisted-index" / "record.json").read_text())["egress"]
    assert refused["hosts"] == [] and refused["refused_hosts"] == [f"{address}:{port}"]
    assert {e["reason"] for e in refused["events"]} == {"not in --egress"}
    assert observations(out / "unlisted-index")["toolu_01a"].endswith(f"No module named '{PACKAGE}'\n")
    capped = json.loads((out / "capped" / "record.json").read_text())["egress"]
    assert capped["limited"] == "bytes"
    [cut] = capped["events"]
    assert cut["reason"] == "cut: the sandbox's --egress-limit of 204800 bytes was reached"
    assert cut["received"] == 204_800  # the cap, to the byte
    assert int(observations(out / "capped")["toolu_01a"].split()[-1]) < 3_000_000  # the tool saw it cut short
    stats = summary["egress"]
    assert (stats["items"], stats["limited"], stats["refused"]) == (2, 1, refused["refused"])
    assert stats["hosts"] == {f"{address}:{port}": 1} and stats["refused_hosts"] == {f"{address}:{port}": 1}
    rows = {json.loads(line)["id"]: json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()}
    assert rows["capped"]["egress_limited"] == "bytes"

    with Browser(chromium) as browser:
        page = browser.open((out / "report.html").as_uri())
        page.wait_for("document.querySelectorAll('#items tr.item').length > 0")
        cells = page.js("Object.fromEntries([...document.querySelectorAll('#items tr.item')].map("
                        "r => [r.dataset.id, r.querySelector('td.egress').textContent]))")  # fmt: skip
        assert cells == {"unlisted-index": f"0 {refused['refused']} refused", "capped": "1"}
        assert page.js("document.getElementById('egress').hidden") is False
        assert page.js("document.getElementById('egress-totals').textContent").startswith(
            f"2 items with --egress: 1 connections, {refused['refused']} refused, "
        )
        hosts = "[...document.querySelectorAll('#ID tr.egress-host')].map(r => r.textContent)"
        assert page.js(hosts.replace("ID", "egress-reached")) == [f"{address}:{port}1"]
        assert page.js(hosts.replace("ID", "egress-refused")) == [f"{address}:{port}1"]
