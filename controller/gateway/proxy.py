"""The model proxy: token in, real key out, answers passed through as they arrive, every exchange journaled.

A live continuation lets the agent call its model, and replayed tool calls of some agents see every
environment variable. So the sandbox never gets the real key: it gets a random per-run token
(:meth:`ModelProxy.grant`). The proxy accepts only granted tokens, swaps in the real key, forwards to the
upstream, passes the answer back (a stream chunk by chunk, as it arrives), and journals the exchange in the
run's ``model-traffic.jsonl`` (:mod:`.journal`). Each upstream call takes a slot in the batch's limits
(:mod:`.limits`) and is retried while the upstream says "not now" and nothing has reached the agent
(:mod:`.upstream`). Only what outlasts the retry budget reaches the agent: the same status, with a message
that names it in words pvisor classifies (``status 429 (rate limit...)``, ``internal server error``), so the
run ends in pvisor's retryable ``model_*`` categories. A run given a tape (:mod:`.cassette`) has its calls
kept on it, or answered from it with no upstream at all.

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
import contextlib
import json
import re
import secrets
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from aiohttp.helpers import get_env_proxy_for_url
from yarl import URL

from .._log import logger
from ..models.spec import ModelUpstream
from . import journal, upstream
from .cassette import Tape, TapeEntry, request_json
from .journal import Exchange
from .limits import Limits, local_limits
from .loop import LoopThread
from .upstream import Refused, Tries, reason

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
#: The largest request body a sandbox may send (a long context is a few MB of JSON); a larger one is refused
#: with 413 before more of it is read, so a sandbox cannot make the host buffer what it likes.
MAX_REQUEST_BODY = 32 * 1024**2
#: Requests of one run (one sandbox) in flight at once; past it, 429 at once. With the body cap, what one
#: sandbox can make the gateway hold is bounded (``MAX_REQUESTS_PER_RUN * MAX_REQUEST_BODY``, and far less in
#: practice: an agent has one or two calls in flight).
MAX_REQUESTS_PER_RUN = 8


class _Run:
    def __init__(self, run_id: str, journal_path: Path, tape: Tape | None) -> None:
        self.run_id = run_id
        self.journal = journal_path
        self.tape = tape
        self.in_flight = 0
        """Its requests being handled now (only the gateway's event loop touches it)."""


class ModelProxy:
    """The proxy for one ``replay`` (all its attempts) or one ``batch``: :meth:`start` it, make it listen
    (:meth:`listen_unix`, :meth:`listen_tcp`), :meth:`grant` each run a token, and :meth:`close` it."""

    def __init__(self, upstream: ModelUpstream, api_key: str | None, *, limits: Limits | None = None) -> None:
        self.config = upstream
        self._api_key = api_key
        self._echoes = _echoes(api_key)
        self.limits = limits if limits is not None else local_limits(upstream)
        """The limits every upstream call takes a slot in: this proxy's own, or a batch's (a cluster's)."""
        self._runs: dict[tuple[str | None, str], _Run] = {}
        """By (the socket it must arrive on, or None: any; its token)."""
        self._lock = threading.Lock()
        self._loop = LoopThread("pvisor-host-gateway")
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._proxy: URL | None = None
        self._proxy_auth: aiohttp.BasicAuth | None = None

    # -- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> ModelProxy:
        """Start its event loop and its connection pool (it listens nowhere yet); returns ``self``."""
        self._call(self._setup())
        return self

    async def _setup(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            skip_auto_headers=("Accept-Encoding",),  # answers arrive as sent, so their usage can be read
            # Not aiohttp's trust_env: it would also take credentials from ~/.netrc, which clash with the key.
            # HTTPS_PROXY and friends are read once instead, as for any other client on this host.
        )
        if self.config.base_url is not None:
            with contextlib.suppress(LookupError):
                self._proxy, self._proxy_auth = get_env_proxy_for_url(URL(self.config.base_url))
        app = web.Application(client_max_size=MAX_REQUEST_BODY)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5)
        await self._runner.setup()

    def listen_unix(self, path: str) -> web.UnixSite:
        """Also listen on the unix socket ``path`` (made now); the site, to :meth:`stop_listening` on it."""
        assert self._runner is not None
        site = web.UnixSite(self._runner, path)
        self._call(site.start())
        return site

    def stop_listening(self, site: web.UnixSite) -> None:
        """Stop listening on ``site`` (its connections end)."""
        self._call(site.stop())

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
        self._loop.close(self._teardown)

    async def _teardown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        # Requests still in flight (a sandbox that never hung up) end now, their slots and journals with them.
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self._loop.call(coroutine)

    # -- runs ---------------------------------------------------------------------------------------------

    def grant(
        self, run_id: str, journal_path: Path, tape: Tape | None = None, *, token: str | None = None,
        socket: str | None = None,
    ) -> str:  # fmt: skip
        """A fresh token for one run; its exchanges go to ``journal_path``, and to ``tape`` (or come from it).

        A fork (``--fork``) holds its prefix's ``token``, as every other fork of it does: it is granted that token
        on a ``socket`` of its own, and its requests are told apart by the socket they arrive on."""
        token = token or f"pvhtok-{secrets.token_urlsafe(24)}"
        with self._lock:
            if (socket, token) in self._runs:
                raise ValueError("that token is another run's on this socket")
            self._runs[(socket, token)] = _Run(run_id, journal_path, tape)
        return token

    def revoke(self, token: str | None, socket: str | None = None) -> None:
        """Forget a run's token (on ``socket``, for a fork): nothing can use it any more."""
        if token:
            with self._lock:
                self._runs.pop((socket, token), None)

    def _run_for(self, authorization: str | None, socket: object) -> _Run | None:
        """The run a request is from: by its token, on the socket it arrived on (a fork's), else on any."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        token = authorization.removeprefix("Bearer ").strip()
        with self._lock:
            found = self._runs.get((socket, token)) if isinstance(socket, str) else None
            return found or self._runs.get((None, token))

    # -- one request --------------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        socket = request.transport.get_extra_info("sockname") if request.transport is not None else None
        run = self._run_for(request.headers.get("Authorization"), socket)  # before a byte of the body is read
        if run is None:
            method, path = request.method, request.path
            logger.warning("model gateway refused a request without a valid token ({} {})", method, path)
            return _error(401, "invalid or missing token")
        if run.in_flight >= MAX_REQUESTS_PER_RUN:
            logger.warning("model gateway refused run {}: {} requests in flight already", run.run_id, run.in_flight)
            return _error(429, f"too many requests at once from this sandbox (at most {MAX_REQUESTS_PER_RUN})")
        run.in_flight += 1
        try:
            return await self._handle_run(request, run, started)
        finally:
            run.in_flight -= 1

    async def _handle_run(self, request: web.Request, run: _Run, started: float) -> web.StreamResponse:
        try:
            length = request.content_length or 0
            if length > MAX_REQUEST_BODY:  # said up front: not a byte of it is read
                raise web.HTTPRequestEntityTooLarge(max_size=MAX_REQUEST_BODY, actual_size=length)
            body = await request.read()  # whatever its framing: a length, or chunks; at most MAX_REQUEST_BODY
        except web.HTTPRequestEntityTooLarge:
            logger.warning("model gateway refused run {}: a request body over {} bytes", run.run_id, MAX_REQUEST_BODY)
            answer = _error(413, f"request body larger than {MAX_REQUEST_BODY // 1024**2} MiB")
            refused = Exchange(run.run_id, request.method, request.path_qs, None, b"", self.config.body_limit)
            refused.answered(bytes(answer.body) if isinstance(answer.body, bytes) else b"", whole=True)
            journal.append(run.journal, refused.finish(413, stream=False, latency=time.monotonic() - started))
            return answer  # journaled, never taped: the recording holds only what reached the model
        exchange = Exchange(
            run.run_id, request.method, request.path_qs, request.headers.get("X-LiteLLM-Session-ID"), body,
            self.config.body_limit,
        )  # fmt: skip
        if run.tape is not None:
            exchange.call = run.tape.next_call()
            exchange.entry["call"] = exchange.call
        suffix = _route(request)
        if suffix is None:
            return self._done(run, exchange, _error(404, f"no model route {request.path}"), started)
        if run.tape is not None and run.tape.replaying:
            return await self._serve_tape(request, run, exchange, body, started)
        tries = Tries()
        try:
            call = await upstream.call(
                lambda: self._forward(request, suffix, body), self.limits, self.config.retry_budget, tries
            )
        except Refused as refused:
            exchange.tried(tries)
            refused.body = self._scrubbed(refused.body)
            return self._done(run, exchange, _refusal(refused), started)
        except TimeoutError:
            exchange.tried(tries)
            answer = _error(504, f"upstream connection timed out after {self.config.timeout:.0f}s")
            return self._done(run, exchange, answer, started)
        except aiohttp.ClientError as exc:
            exchange.tried(tries)
            return self._done(run, exchange, _error(502, f"upstream connection error: {reason(exc)}"), started)
        exchange.tried(tries)
        try:
            return await self._answer(request, call.response, run, exchange, started)
        finally:
            await call.close(exchange.tokens)

    async def _answer(
        self, request: web.Request, response: aiohttp.ClientResponse, run: _Run, exchange: Exchange, started: float
    ) -> web.StreamResponse:
        if "text/event-stream" in response.headers.get("Content-Type", ""):
            return await self._stream(request, response, run, exchange, started)
        try:
            content = self._scrubbed(await response.read())
        except (TimeoutError, aiohttp.ClientError) as exc:
            answer = _error(502, f"upstream failed while answering: {reason(exc)}")
            return self._done(run, exchange, answer, started)
        if response.status >= 400:
            answer = _error(response.status, _upstream_failure(response.status, content))
        else:
            answer = web.Response(status=response.status, body=content, headers=_passed_back(response))
        return self._done(run, exchange, answer, started)

    async def _forward(self, request: web.Request, suffix: str, body: bytes) -> aiohttp.ClientResponse:
        assert self._session is not None and self.config.base_url is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        headers["Authorization"] = f"Bearer {self._api_key}"
        url = self.config.base_url.rstrip("/") + "/" + suffix
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT, sock_read=self.config.timeout)
        return await self._session.request(
            request.method, url, params=request.query, data=body or None, headers=headers, timeout=timeout,
            proxy=self._proxy, proxy_auth=self._proxy_auth,
        )  # fmt: skip

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
        kept = bytearray() if run.tape is not None else None
        try:
            async for data in upstream.content.iter_any():
                chunk = self._scrubbed(data)  # a key split across two chunks is not caught: upstreams echo it whole
                try:
                    await answer.write(chunk)
                except ConnectionResetError:  # aiohttp's ClientConnectionResetError is a ClientError too
                    error = f"the sandbox went away after {exchange.sent} bytes of the stream"
                    break
                exchange.answered(chunk)
                if kept is not None:
                    kept += chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            error = f"the upstream broke off the stream after {exchange.sent} bytes: {reason(exc)}"
        finally:
            if error is None or not error.startswith("the sandbox"):
                with contextlib.suppress(ConnectionResetError):
                    await answer.write_eof()  # the last chunk: the agent sees a complete, if short, answer
            latency = time.monotonic() - started
            entry = exchange.finish(upstream.status, stream=True, latency=latency, error=error)
            journal.append(run.journal, entry)
            if kept is not None:
                self._taped(run, exchange, answer, bytes(kept), stream=True)
        return answer

    def _scrubbed(self, content: bytes) -> bytes:
        """An answer of the upstream without the real key in it, whole or masked as upstreams echo a wrong one
        (``sk-abc123************wxyz``): neither the sandbox, the journal nor the cassette gets it."""
        if self._echoes is None or not content:
            return content
        return self._echoes.sub(b"<the key>", content)

    def _done(self, run: _Run, exchange: Exchange, answer: web.Response, started: float) -> web.Response:
        """Journal an answer of known length (and tape it), then give it."""
        content = bytes(answer.body) if isinstance(answer.body, bytes | bytearray) else b""
        exchange.answered(content, whole=True)
        entry = exchange.finish(answer.status, stream=False, latency=time.monotonic() - started)
        journal.append(run.journal, entry)
        self._taped(run, exchange, answer, content, stream=False)
        return answer

    # -- cassettes ----------------------------------------------------------------------------------------

    def _taped(
        self, run: _Run, exchange: Exchange, answer: web.StreamResponse, content: bytes, *, stream: bool
    ) -> None:
        """Keep an answered call on the run's tape (when it records one)."""
        if run.tape is None or run.tape.replaying:
            return
        run.tape.record(
            TapeEntry(
                call=exchange.call or 0,
                run_id=run.run_id,
                method=exchange.entry["method"],
                path=exchange.entry["path"],
                request=request_json(exchange.body),
                status=answer.status,
                content_type=answer.content_type,
                stream=stream,
                answer=content.decode("utf-8", errors="replace"),
            )
        )

    async def _serve_tape(
        self, request: web.Request, run: _Run, exchange: Exchange, body: bytes, started: float
    ) -> web.StreamResponse:
        """Answer from the run's tape: call *n* gets answer *n*; a request that differs is drift."""
        assert run.tape is not None and exchange.call is not None
        entry, drift = run.tape.serve(exchange.call, request_json(body), run.run_id)
        if drift is not None:
            exchange.entry["drift"] = drift.model_dump()
        if drift is not None and (entry is None or self.config.on_drift == "fail"):
            where = drift.field + (f" message {drift.message}" if drift.message is not None else "")
            message = f"cassette drift at call {exchange.call}: {where} differs from the recording"
            return self._done(run, exchange, _error(400, message), started)
        assert entry is not None  # no recorded answer is drift
        if not entry.stream:
            answer = web.Response(status=entry.status, body=entry.answer.encode(), content_type=entry.content_type)
            return self._done(run, exchange, answer, started)
        stream = web.StreamResponse(status=entry.status, headers={"Content-Type": entry.content_type})
        stream.enable_chunked_encoding()
        await stream.prepare(request)
        data = entry.answer.encode()
        await stream.write(data)
        await stream.write_eof()
        exchange.answered(data)
        journal.append(run.journal, exchange.finish(entry.status, stream=True, latency=time.monotonic() - started))
        return stream


def _echoes(key: str | None) -> re.Pattern[bytes] | None:
    """The key as an upstream may echo it: whole, or its first and last characters around a mask (OpenAI's
    "Incorrect API key provided: sk-proj-********abcd"), so a user can tell which key it was."""
    if not key or len(key) < 8:
        return None
    whole, head, tail = (re.escape(part.encode()) for part in (key, key[:3], key[-4:]))
    return re.compile(whole + b"|" + head + rb"[\w-]{0,12}(?:\*{3,}|\.{3}|\xe2\x80\xa6)[\w*-]{0,8}?" + tail)


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


def _route(request: web.Request) -> str | None:
    """The model API path a sandbox asked for, under ``/v1/`` (``chat/completions``, ``responses/<id>``, ...),
    or None when it is not one: the real key is never sent anywhere else on the upstream. Dot segments and
    encoded slashes or dots are refused (``responses/%2e%2e/admin`` would leave the API's path)."""
    raw = request.raw_path.split("?", 1)[0].lower()
    if "%2e" in raw or "%2f" in raw or "%5c" in raw:
        return None
    suffix = request.path.removeprefix("/v1/").lstrip("/")
    segments = suffix.split("/")
    if any(segment in ("", ".", "..") or "\\" in segment for segment in segments):
        return None
    if not any(suffix == route or suffix.startswith(route + "/") for route in ROUTES):
        return None
    return suffix


def _refusal(refused: Refused) -> web.Response:
    """What the agent gets once the upstream's refusals outlasted the retry budget: its status and words, or
    the connection's failure."""
    if refused.status is not None:
        return _error(refused.status, _upstream_failure(refused.status, refused.body))
    if isinstance(refused.error, TimeoutError):
        return _error(504, "upstream connection timed out")
    return _error(502, f"upstream connection error: {reason(refused.error or Exception('failed'))}")
