"""A stand-in for the Docker engine's HTTP API on a unix socket, to make the engine fail on purpose.

It answers ``/_ping`` and ``/version`` like docker.io 20.10 (so the SDK connects), logs every request, and
answers everything else as its ``answer`` function says: a status and a JSON body, or ``None`` to drop the
connection without a word (a crashed engine). A test aid, not an engine: the CLI under test runs for real
and talks to it through the real docker SDK.
"""

from __future__ import annotations

import json
import socketserver
import tempfile
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

Answer = Callable[[str, str], tuple[int, dict[str, Any]] | None]

VERSION = {
    "Version": "20.10.24+dfsg1",
    "ApiVersion": "1.41",
    "MinAPIVersion": "1.12",
    "Os": "linux",
    "Components": [{"Name": "Engine", "Version": "20.10.24+dfsg1"}, {"Name": "runc", "Version": "1.1.5"}],
}


def failing(method: str, path: str) -> tuple[int, dict[str, Any]]:
    """Every call fails with a 500."""
    return 500, {"message": "injected failure"}


def dropping(method: str, path: str) -> None:
    """Every call loses its connection."""
    return


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = True

    def get_request(self) -> tuple[Any, Any]:
        connection, _ = super().get_request()
        return connection, ("engine-client", 0)


class _Handler(BaseHTTPRequestHandler):
    server: Any
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return

    def _any(self) -> None:
        engine: FakeEngine = self.server.engine
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        engine.requests.append((self.command, self.path))
        if engine.silent.is_set():  # a stuck engine: it takes the request and never answers
            engine.released.wait()
            return
        bare = self.path.split("?", 1)[0]
        if bare.endswith("/_ping"):
            self._send(200, b"OK", "text/plain")
            return
        if bare.endswith("/version"):
            self._send(200, json.dumps(VERSION).encode(), "application/json")
            return
        answer = engine.answer(self.command, self.path)
        if answer is None:
            self.close_connection = True
            self.connection.close()
            return
        status, body = answer
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Api-Version", "1.41")
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = do_PUT = do_HEAD = _any  # noqa: N815


class FakeEngine:
    """Use as a context manager; ``env`` points a CLI process at it."""

    def __init__(self, answer: Answer = failing) -> None:
        self.answer = answer
        self.requests: list[tuple[str, str]] = []
        self.silent = threading.Event()
        """Set: every request is taken and never answered (until ``released``)."""
        self.released = threading.Event()
        self._dir = Path(tempfile.mkdtemp(prefix="pvh-fake-engine-"))
        self.socket = self._dir / "docker.sock"
        self._server = _Server(str(self.socket), _Handler)
        self._server.engine = self

    @property
    def env(self) -> dict[str, str]:
        return {"DOCKER_HOST": f"unix://{self.socket}"}

    def __enter__(self) -> FakeEngine:
        # shutdown() waits for the loop's next look: every 20 ms, not the default half second
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.released.set()
        self._server.shutdown()
        self._server.server_close()
        self.socket.unlink(missing_ok=True)
        self._dir.rmdir()
