"""The model proxy: token in, real key out, answers passed through as they arrive, every exchange journaled.

A live continuation lets the agent call its model, and replayed tool calls of some agents see every
environment variable. So the sandbox never gets the real key: it gets a random per-run token
(:meth:`ModelProxy.grant`). The proxy accepts only granted tokens, swaps in the real key, forwards to the
upstream, passes the answer back (a stream chunk by chunk, as it arrives), and journals the exchange in the
run's ``model-traffic.jsonl`` (:mod:`.journal`). An upstream error is answered with the same status and a
message that names it in words pvisor classifies (``status 429 (rate limit...)``, ``internal server
error``), so the run ends in pvisor's retryable ``model_*`` categories.

HTTP is aiohttp's, on both sides, in one event loop on a thread of its own: request bodies of any framing
(a length or chunks), keep-alive, answers that always say where they end (a length, or chunks ending in a
last chunk: under gVisor an agent once missed the close that ended a close-delimited answer, and hung), and
a pooled, kept-alive connection to the upstream. A stream the upstream breaks off after its first bytes is
ended cleanly for the agent (the last chunk, never a second status line) and the journal says what broke.
aiohttp was chosen over the standard library's server, which leaves request framing to its caller, and over
httpx, which has no server side: one library, one loop, for both.
"""

from __future__ import annotations

import asyncio
import errno
import json
import secrets
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from .._log import logger
from ..models.spec import ModelUpstream
from . import journal
from .journal import Exchange

T = TypeVar("T")

#: The model API routes a sandbox may call (under ``/v1/``).
ROUTES = ("chat/completions", "responses", "models")
#: Request headers that are the proxy's own business, never forwarded as they came.
_NOT_FORWARDED = frozenset({
    "host", "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "content-length", "authorization", "accept-encoding",
})  # fmt: skip
#: Answer headers passed back to the sandbox.
_PASSED_BACK = ("Content-Type", "Cache-Control", "x-request-id", "retry-after")
_STATUS_WORDS = {
    429: "rate limit: too many requests",
    500: "internal server error",
    502: "bad gateway",
    503: "service unavailable",
    504: "gateway timeout",
}
#: Seconds to connect to the upstream.
CONNECT_TIMEOUT = 10.0


class _Run:
    def __init__(self, run_id: str, journal_path: Path) -> None:
        self.run_id = run_id
        self.journal = journal_path


class ModelProxy:
    """The proxy for one ``replay`` (all its attempts) or one ``batch``: :meth:`start` it, make it listen
    (:meth:`listen_unix`, :meth:`listen_tcp`), :meth:`grant` each run a token, and :meth:`close` it."""

    def __init__(self, upstream: ModelUpstream, api_key: str) -> None:
        self.config = upstream
        self._api_key = api_key
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    # -- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> ModelProxy:
        """Start its event loop and its connection pool (it listens nowhere yet); returns ``self``."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pvisor-host-gateway", daemon=True)
        self._thread.start()
        self._call(self._setup())
        return self

    async def _setup(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            skip_auto_headers=("Accept-Encoding",),  # answers arrive as sent, so their usage can be read
            trust_env=True,  # HTTPS_PROXY and friends, as for any other client on this host
        )
        app = web.Application(client_max_size=256 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()

    def listen_unix(self, path: str) -> None:
        """Also listen on the unix socket ``path`` (made now)."""
        assert self._runner is not None
        self._call(web.UnixSite(self._runner, path).start())

    def listen_tcp(self, host: str, port: int = 0) -> int:
        """Also listen on ``host:port`` (0: any free port); returns the port."""
        assert self._runner is not None
        site = web.TCPSite(self._runner, host, port)
        self._call(site.start())
        server = site._server  # aiohttp names no public accessor for a site's bound port
        assert isinstance(server, asyncio.base_events.Server)
        return int(server.sockets[0].getsockname()[1])

    def close(self) -> None:
        """Stop listening, close the upstream connections and the loop (idempotent)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._teardown(), loop).result(timeout=30)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=30)
            loop.close()

    async def _teardown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=60)

    # -- runs ---------------------------------------------------------------------------------------------

    def grant(self, run_id: str, journal_path: Path) -> str:
        """A fresh token for one run; its exchanges go to ``journal_path``."""
        token = f"pvhtok-{secrets.token_urlsafe(24)}"
        with self._lock:
            self._runs[token] = _Run(run_id, journal_path)
        return token

    def revoke(self, token: str | None) -> None:
        """Forget a run's token: nothing can use it any more."""
        if token:
            with self._lock:
                self._runs.pop(token, None)

    def _run_for(self, authorization: str | None) -> _Run | None:
        if not authorization or not authorization.startswith("Bearer "):
            return None
        with self._lock:
            return self._runs.get(authorization.removeprefix("Bearer ").strip())

    # -- one request --------------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        body = await request.read()  # whatever its framing: a length, or chunks
        run = self._run_for(request.headers.get("Authorization"))
        if run is None:
            method, path = request.method, request.path
            logger.warning("model gateway refused a request without a valid token ({} {})", method, path)
            return _error(401, "invalid or missing token")
        exchange = Exchange(
            run.run_id, request.method, request.path_qs, request.headers.get("X-LiteLLM-Session-ID"), body,
            self.config.body_limit,
        )  # fmt: skip
        suffix = request.path.removeprefix("/v1/").lstrip("/")
        if not suffix.startswith(ROUTES):
            answer = _error(404, f"no model route {request.path}")
            return self._done(run, exchange, answer, started)
        try:
            upstream = await self._forward(request, suffix, body)
        except TimeoutError:
            answer = _error(504, f"upstream connection timed out after {self.config.timeout:.0f}s")
            return self._done(run, exchange, answer, started)
        except aiohttp.ClientError as exc:
            answer = _error(502, f"upstream connection error: {_reason(exc)}")
            return self._done(run, exchange, answer, started)
        async with upstream:
            if "text/event-stream" in upstream.headers.get("Content-Type", ""):
                return await self._stream(request, upstream, run, exchange, started)
            try:
                content = await upstream.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                answer = _error(502, f"upstream failed while answering: {_reason(exc)}")
                return self._done(run, exchange, answer, started)
            if upstream.status >= 400:
                answer = _error(upstream.status, _upstream_failure(upstream.status, content))
            else:
                answer = web.Response(status=upstream.status, body=content, headers=_passed_back(upstream))
            return self._done(run, exchange, answer, started)

    async def _forward(self, request: web.Request, suffix: str, body: bytes) -> aiohttp.ClientResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        headers["Authorization"] = f"Bearer {self._api_key}"
        url = self.config.base_url.rstrip("/") + "/" + suffix
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT, sock_read=self.config.timeout)
        return await self._session.request(
            request.method, url, params=request.query, data=body or None, headers=headers, timeout=timeout
        )

    async def _stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        run: _Run,
        exchange: Exchange,
        started: float,
    ) -> web.StreamResponse:
        """Pass a stream through as it arrives; a break on either side ends it cleanly and is journaled."""
        answer = web.StreamResponse(status=upstream.status, headers=_passed_back(upstream))
        answer.enable_chunked_encoding()
        await answer.prepare(request)
        error = None
        try:
            async for chunk in upstream.content.iter_any():
                await answer.write(chunk)
                exchange.answered(chunk)
        except (TimeoutError, aiohttp.ClientError) as exc:
            error = f"the upstream broke off the stream after {exchange.sent} bytes: {_reason(exc)}"
        except ConnectionResetError:
            error = f"the sandbox went away after {exchange.sent} bytes of the stream"
        if error is None or not error.startswith("the sandbox"):
            await answer.write_eof()  # the last chunk: the agent sees a complete, if short, answer
        latency = time.monotonic() - started
        journal.append(run.journal, exchange.finish(upstream.status, stream=True, latency=latency, error=error))
        return answer

    def _done(self, run: _Run, exchange: Exchange, answer: web.Response, started: float) -> web.Response:
        """Journal an answer of known length, then give it."""
        if answer.body is not None:
            exchange.answered(bytes(answer.body))  # type: ignore[arg-type]
        entry = exchange.finish(answer.status, stream=False, latency=time.monotonic() - started)
        journal.append(run.journal, entry)
        return answer


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": f"pvisor-host gateway: {message}", "type": "gateway_error"}}
    return web.json_response(body, status=status)


def _passed_back(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {key: upstream.headers[key] for key in _PASSED_BACK if key in upstream.headers}


def _upstream_failure(status: int, body: bytes) -> str:
    """An error message for the agent that names the status in words pvisor classifies (rate limit, 5xx)."""
    try:
        detail = json.loads(body).get("error", {}).get("message", "")
    except (ValueError, AttributeError):
        detail = body.decode("utf-8", errors="replace")
    words = _STATUS_WORDS.get(status, "error")
    return f"upstream returned status {status} ({words}): {str(detail)[:300]}".rstrip(": ")


_ERRNO_WORDS = {
    errno.ECONNREFUSED: "connection refused",
    errno.EHOSTUNREACH: "no route to host",
    errno.ENETUNREACH: "network is unreachable",
    errno.ECONNRESET: "connection reset",
}


def _reason(exc: BaseException) -> str:
    """A short reason in words (pvisor and people both read it)."""
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return f"name or service not known ({exc.host})"
    if isinstance(exc, aiohttp.ClientConnectorError) and exc.os_error.errno in _ERRNO_WORDS:
        return _ERRNO_WORDS[exc.os_error.errno]
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return text.split("\n")[0][:200]
