"""The host-side model gateway: the sandbox's only way to its model, and the only holder of the real key.

A live continuation lets the agent call its model, and replayed tool calls of some agents see every
environment variable. So the sandbox never gets the real key: it gets the gateway as ``OPENAI_BASE_URL``
and a random per-run token as ``OPENAI_API_KEY``. The gateway accepts only registered tokens, swaps in the
real key, forwards to the upstream (streaming passed through as it arrives), and journals every exchange
per run (``model-traffic.jsonl``: time, path, status, latency, sizes, token usage, the session header; no
authorization; bodies up to a cap). An upstream error is answered with the same status and a message that
names it in words pvisor classifies (``status 429 (rate limit...)``, ``internal server error``), so the run
ends in pvisor's retryable ``model_*`` categories.

Where the gateway listens depends on ``--model-network``:

* ``unix`` (default): a unix socket in a short-lived host directory, bind-mounted read-only into a sandbox
  that has no network at all; a static relay started in the sandbox before pvisor listens on
  ``127.0.0.1:18080`` and forwards there.
* ``internal``: TCP on the gateway address of an internal Docker network created for the run (for engines
  where a unix socket cannot be shared). Note: on such a network the sandbox can also reach other services
  listening on the host's addresses.
* ``pass-through``: no gateway; the sandbox gets the upstream and the real key (with a warning).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import socketserver
import tempfile
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import docker
import requests
from docker.errors import NotFound
from pydantic import BaseModel

from ..._log import logger
from ...errors import InfrastructureError
from ...models.ownership import Ownership
from ...models.spec import ModelUpstream
from . import labels as L
from .engine import engine_errors

#: Where the relay listens inside the sandbox, and where the gateway's socket directory is mounted.
RELAY_PORT = 18080
SOCKET_MOUNT = "/pvisor-host/gateway"
_SOCKET_NAME = "gw.sock"
_ROUTES = ("chat/completions", "responses", "models")
_HOP_BY_HOP = {
    "host", "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "content-length", "authorization", "accept-encoding",
}  # fmt: skip
_USAGE_TAIL = 256 * 1024


class ModelAccess(BaseModel):
    """What one sandbox gets to reach its model (the agent profile names the variables)."""

    base_url: str
    api_key: str
    """The per-run token (the real key only with ``pass-through``); handed over in env.sh, never inspectable."""
    model: str
    container_env: dict[str, str] = {}
    """Non-secret settings for the entry shim (the relay)."""
    network: str = "none"
    socket_dir: Path | None = None
    """Host directory to mount read-only at :data:`SOCKET_MOUNT` (``unix`` mode)."""
    token: str | None = None


class _Run(BaseModel):
    run_id: str
    journal: Path


class Gateway:
    """The gateway for one ``replay`` (all its attempts) or one ``batch``: :meth:`start` it, :meth:`close` it
    (or use it as a context manager)."""

    def __init__(
        self,
        upstream: ModelUpstream,
        api_key: str,
        *,
        client: docker.DockerClient | None = None,
        ownership: Ownership | None = None,
        sandbox_uid: int | None = None,
    ) -> None:
        self.config = upstream
        self._api_key = api_key
        self._client = client
        self._ownership = ownership
        self._uid = sandbox_uid
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._socket_dir: Path | None = None
        self._network: Any = None
        self.address: str | None = None
        """``host:port`` (internal) or the socket path (unix) once started."""

    # -- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> Gateway:
        """Listen where ``--model-network`` says (nothing to start for ``pass-through``); return ``self``."""
        if self.config.network == "unix":
            self._start_unix()
        elif self.config.network == "internal":
            self._start_internal()
        return self

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening and remove the socket directory and the internal network (every path)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
        if self._network is not None:
            with engine_errors(f"remove the model network {self._network.name}"), contextlib.suppress(NotFound):
                self._network.remove()
            self._network = None

    def _serve(self, server: Any) -> None:
        server.gateway = self
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="pvisor-host-gateway", daemon=True)
        self._thread.start()

    def _start_unix(self) -> None:
        # A short path: AF_UNIX paths are limited to 108 bytes.
        self._socket_dir = Path(tempfile.mkdtemp(prefix="pvh-gw-", dir="/tmp"))
        self._socket_dir.chmod(0o755)
        path = self._socket_dir / _SOCKET_NAME
        self._serve(_UnixServer(str(path), _Handler))
        if self._uid is not None and os.geteuid() == 0:
            os.chown(path, self._uid, self._uid)
        path.chmod(0o600)
        self.address = str(path)
        logger.debug("model gateway listening on {}", path)

    def _start_internal(self) -> None:
        if self._client is None or self._ownership is None:
            raise ValueError("the internal model network needs an engine client and an ownership")
        name = f"pvisor-host-gw-{self._ownership.session}-{secrets.token_hex(3)}"
        try:
            with engine_errors("create the internal model network"):
                self._network = self._client.networks.create(
                    name, driver="bridge", internal=True, labels=L.resource_labels(self._ownership, "model-network")
                )
                self._network.reload()
            gateway_ip = network_gateway(self._network.attrs)
        except ValueError as exc:
            self.close()
            raise InfrastructureError(f"the internal model network has no usable gateway address: {exc}") from exc
        except BaseException:
            self.close()
            raise
        server = ThreadingHTTPServer((gateway_ip, 0), _Handler)
        server.daemon_threads = True
        self._serve(server)
        self.address = f"{gateway_ip}:{server.server_address[1]}"
        logger.debug("model gateway listening on {} (network {})", self.address, name)

    # -- runs ---------------------------------------------------------------------------------------------

    def access(self, run_id: str, journal: Path) -> ModelAccess:
        """Register a run (a fresh token, its journal) and say how its sandbox reaches the model."""
        model = self.config.model
        if self.config.network == "pass-through":
            logger.warning(
                "--model-network pass-through: the real key from {} enters the sandbox, "
                "where replayed tool calls can read it",
                self.config.api_key_env,
            )
            return ModelAccess(base_url=self.config.base_url, api_key=self._api_key, model=model, network="bridge")
        token = f"pvhtok-{secrets.token_urlsafe(24)}"
        with self._lock:
            self._runs[token] = _Run(run_id=run_id, journal=journal)
        if self.config.network == "unix":
            return ModelAccess(
                base_url=f"http://127.0.0.1:{RELAY_PORT}/v1",
                api_key=token,
                model=model,
                container_env={"PVISOR_HOST_RELAY": f"{RELAY_PORT} {SOCKET_MOUNT}/{_SOCKET_NAME}"},
                network="none",
                socket_dir=self._socket_dir,
                token=token,
            )
        assert self._network is not None
        return ModelAccess(
            base_url=f"http://{self.address}/v1", api_key=token, model=model, network=self._network.name, token=token
        )

    def release(self, token: str | None) -> None:
        """Forget a run's token: nothing can use it any more."""
        if token:
            with self._lock:
                self._runs.pop(token, None)

    def run_for(self, authorization: str | None) -> _Run | None:
        if not authorization or not authorization.startswith("Bearer "):
            return None
        with self._lock:
            return self._runs.get(authorization.removeprefix("Bearer ").strip())

    def journal(self, run: _Run, entry: dict[str, Any]) -> None:
        with self._lock, run.journal.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry, ensure_ascii=False) + "\n")

    # -- forwarding ---------------------------------------------------------------------------------------

    def upstream_url(self, suffix: str) -> str:
        return self.config.base_url.rstrip("/") + "/" + suffix

    def upstream_headers(self, incoming: Any) -> dict[str, str]:
        headers = {k: v for k, v in incoming.items() if k.lower() not in _HOP_BY_HOP}
        headers["Authorization"] = f"Bearer {self._api_key}"
        return headers


def network_gateway(attrs: dict[str, Any]) -> str:
    """The IPv4 address of a Docker network's gateway (the host's end of its bridge), from ``docker inspect``.

    The engine fills in ``IPAM.Config[].Gateway`` only sometimes: a freshly started docker.io 20.10 reports
    the default bridge as ``{"Subnet": "172.17.0.0/16"}`` alone, while ``docker0`` is 172.17.0.1 all the
    same. So the gateway comes from the IPAM entry when it is there, else it is the first host address of
    the subnet, which is where the engine puts the bridge's own address.

    Raises:
        ValueError: the network has no IPv4 subnet.
    """
    configs = (attrs.get("IPAM") or {}).get("Config") or []
    for config in configs:
        gateway = config.get("Gateway")
        if gateway and ipaddress.ip_address(gateway.split("/")[0]).version == 4:
            return str(gateway.split("/")[0])
    for config in configs:
        subnet = config.get("Subnet")
        if subnet:
            network = ipaddress.ip_network(subnet, strict=False)
            if network.version == 4:
                return str(next(network.hosts()))
    raise ValueError(f"network {attrs.get('Name', '?')} has no IPv4 subnet: {configs}")


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self) -> tuple[Any, Any]:
        connection, _ = super().get_request()
        return connection, ("sandbox", 0)


class _Handler(BaseHTTPRequestHandler):
    """One sandbox request: check the token, forward with the real key, stream back, journal."""

    server: Any
    # Every answer says where it ends (a length, or chunks), so no client waits for the connection to close:
    # under gVisor a Rust agent side sometimes missed the close that ended a close-delimited answer, and hung.
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return

    def do_GET(self) -> None:  # noqa: N802
        self._forward("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._forward("POST")

    def _error(self, status: int, message: str) -> bytes:
        body = json.dumps({"error": {"message": f"pvisor-host gateway: {message}", "type": "gateway_error"}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return body

    def _forward(self, method: str) -> None:
        gateway: Gateway = self.server.gateway
        started = time.monotonic()
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        run = gateway.run_for(self.headers.get("Authorization"))
        if run is None:
            logger.warning("model gateway refused a request without a valid token ({} {})", method, self.path)
            self._error(401, "invalid or missing token")
            return
        suffix = self.path.split("?", 1)[0].removeprefix("/v1/").lstrip("/")
        entry: dict[str, Any] = {
            "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "run_id": run.run_id,
            "method": method,
            "path": self.path,
            "session_id": self.headers.get("X-LiteLLM-Session-ID"),
            "request_bytes": len(body),
        }
        limit = gateway.config.body_limit
        if limit:
            entry["request_body"] = body[:limit].decode("utf-8", errors="replace")
            entry["request_body_truncated"] = len(body) > limit
        if not suffix.startswith(_ROUTES):
            sent = self._error(404, f"no model route {self.path}")
            gateway.journal(run, entry | {"status": 404, "response_bytes": len(sent), "latency_ms": 0})
            return
        try:
            status, response_bytes, head, tail, stream = self._relay(gateway, method, suffix, body)
        except requests.exceptions.Timeout:
            message = f"upstream connection timed out after {gateway.config.timeout:.0f}s"
            sent = self._error(504, message)
            status, response_bytes, head, tail, stream = 504, len(sent), sent, sent, False
        except requests.exceptions.RequestException as exc:
            sent = self._error(502, f"upstream connection error: {_reason(exc)}")
            status, response_bytes, head, tail, stream = 502, len(sent), sent, sent, False
        entry |= {
            "status": status,
            "stream": stream,
            "response_bytes": response_bytes,
            "latency_ms": round((time.monotonic() - started) * 1000, 1),
            "usage": _usage(tail),
        }
        if limit:
            entry["response_body"] = head.decode("utf-8", errors="replace")
            entry["response_body_truncated"] = response_bytes > len(head)
        gateway.journal(run, entry)

    def _relay(self, gateway: Gateway, method: str, suffix: str, body: bytes) -> tuple[int, int, bytes, bytes, bool]:
        """Forward to the upstream and pass its answer through as it arrives.

        Returns status, bytes sent, the start of the body (for the journal) and its end (for token usage,
        which streams report last) and whether it was a stream.
        """
        upstream = requests.request(
            method,
            gateway.upstream_url(suffix),
            data=body or None,
            headers=gateway.upstream_headers(self.headers),
            stream=True,
            timeout=(10, gateway.config.timeout),
        )
        with upstream:
            stream = "text/event-stream" in upstream.headers.get("Content-Type", "")
            if upstream.status_code >= 400 and not stream:
                original = upstream.content[: max(gateway.config.body_limit, 4096)]
                answer = self._error(upstream.status_code, _upstream_failure(upstream.status_code, original))
                return upstream.status_code, len(answer), original[: gateway.config.body_limit], original, False
            self.send_response(upstream.status_code)
            for key in ("Content-Type", "Cache-Control", "x-request-id", "retry-after"):
                if key in upstream.headers:
                    self.send_header(key, upstream.headers[key])
            limit = gateway.config.body_limit
            if not stream:  # one JSON answer: its length first
                content = upstream.content
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)
                return upstream.status_code, len(content), content[:limit], content[-_USAGE_TAIL:], False
            self.send_header("Transfer-Encoding", "chunked")  # a stream passes through as it arrives
            self.end_headers()
            sent = 0
            head = bytearray()
            tail = bytearray()
            for chunk in upstream.iter_content(chunk_size=None):
                if not chunk:
                    continue
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
                sent += len(chunk)
                if len(head) < limit:
                    head += chunk[: limit - len(head)]
                tail = (tail + chunk)[-_USAGE_TAIL:]
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        return upstream.status_code, sent, bytes(head), bytes(tail), stream


_STATUS_WORDS = {
    429: "rate limit: too many requests",
    500: "internal server error",
    502: "bad gateway",
    503: "service unavailable",
    504: "gateway timeout",
}


def _upstream_failure(status: int, body: bytes) -> str:
    """An error message for the agent that names the status in words pvisor classifies (rate limit, 5xx)."""
    try:
        detail = json.loads(body).get("error", {}).get("message", "")
    except (ValueError, AttributeError):
        detail = body.decode("utf-8", errors="replace")
    words = _STATUS_WORDS.get(status, "error")
    return f"upstream returned status {status} ({words}): {str(detail)[:300]}".rstrip(": ")


def _reason(exc: BaseException) -> str:
    text = str(exc)
    for marker in ("Connection refused", "Name or service not known", "No route to host", "Connection reset"):
        if marker in text:
            return marker.lower()
    return text.split("\n")[0][:200]


def _usage(data: bytes) -> dict[str, Any] | None:
    """Token usage from a JSON body or the last SSE events that report it."""
    text = data.decode("utf-8", errors="replace")
    candidates = [text]
    candidates += [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    for candidate in reversed(candidates):
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if not isinstance(value, dict):
            continue
        usage = value.get("usage") or (value.get("response") or {}).get("usage")
        if isinstance(usage, dict):
            return usage
    return None
