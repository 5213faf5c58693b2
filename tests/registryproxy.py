"""A registry that misbehaves on purpose: a proxy in front of a real registry (a test aid, never a registry).

The engine pulls through it (``127.0.0.1:PORT``, which it trusts without TLS) and it passes everything on to
the real registry, except what the test asks for: answer every manifest request with a status for a while
(429 with a ``Retry-After`` naming what is left of the while, 500), drop a connection in the middle of a
blob, or send blobs slowly. (The engine asks for a manifest twice, HEAD then GET, and gives up only when both
fail: hence faults for a while, not for a number of requests.) Every request is recorded with the time it
arrived, who sent it (its User-Agent) and the status it got.
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict


@dataclass
class Seen:
    at: float
    method: str
    path: str
    status: int
    agent: str
    retry_after: str | None = None


@dataclass
class _Rule:
    kind: str  # "manifest" or "blob"
    times: int = 0
    until: float = 0.0
    status: int = 0
    retry_after: bool = False
    drop: bool = False


@dataclass
class RegistryProxy:
    """Serve on ``127.0.0.1`` (any free port) in front of ``upstream`` (``host:port``)."""

    upstream: str
    """The real registry (``host:port``)."""
    requests: list[Seen] = field(default_factory=list)
    _rules: list[_Rule] = field(default_factory=list)
    slow_blobs: float | None = None
    """Bytes per second blobs are sent at (None: as fast as they come)."""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def registry(self) -> str:
        return self.upstream

    # -- what it does to the next requests -----------------------------------------------------------------

    def fail_manifests(self, status: int, seconds: float, *, retry_after: bool = False) -> None:
        """Answer every manifest request with ``status`` for ``seconds`` from now (with ``retry_after``, a 429
        says how many of them are left)."""
        with self._lock:
            self._rules.append(
                _Rule("manifest", until=time.monotonic() + seconds, status=status, retry_after=retry_after)
            )

    def drop_blobs(self, times: int = 1) -> None:
        with self._lock:
            self._rules.append(_Rule("blob", times=times, drop=True))

    def answered(self, status: int) -> list[Seen]:
        with self._lock:
            return [seen for seen in self.requests if seen.status == status]

    def _rule_for(self, kind: str) -> _Rule | None:
        now = time.monotonic()
        with self._lock:
            for rule in self._rules:
                if rule.kind == kind and now < rule.until:
                    return rule
                if rule.kind == kind and rule.times > 0:
                    rule.times -= 1
                    return rule
        return None

    # -- serving ------------------------------------------------------------------------------------------

    def __enter__(self) -> RegistryProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=2**30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        await self._runner.cleanup()
        await self._session.close()

    def _record(self, request: web.Request, status: int, retry_after: str | None = None) -> None:
        agent = request.headers.get("User-Agent", "")
        with self._lock:
            self.requests.append(Seen(time.monotonic(), request.method, request.path, status, agent, retry_after))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        kind = "manifest" if "/manifests/" in request.path else "blob" if "/blobs/" in request.path else ""
        rule = self._rule_for(kind) if kind else None
        if rule is not None and rule.status:
            left = max(1, math.ceil(rule.until - time.monotonic()))
            headers = {"Retry-After": str(left)} if rule.retry_after else {}
            self._record(request, rule.status, headers.get("Retry-After"))
            if rule.status == 429:  # as registries say it (the engine reports "toomanyrequests: ...")
                body = {"errors": [{"code": "TOOMANYREQUESTS", "message": "injected rate limit"}]}
                return web.json_response(body, status=429, headers=headers)
            return web.Response(status=rule.status, text="injected failure", headers=headers)  # a bare 5xx
        headers = CIMultiDict(  # every header as sent: the engine's Accept comes several times
            (k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")
        )
        body = await request.read()
        url = f"http://{self.upstream}{request.path_qs}"
        async with self._session.request(request.method, url, headers=headers, data=body or None,
                                         allow_redirects=False) as upstream:  # fmt: skip
            self._record(request, upstream.status)
            answer = web.StreamResponse(status=upstream.status, headers=_passed(upstream.headers))
            await answer.prepare(request)
            sent = 0
            async for chunk in upstream.content.iter_chunked(64 * 1024):
                if rule is not None and rule.drop and sent > 0:
                    assert request.transport is not None
                    request.transport.close()  # the middle of a blob: the connection just goes
                    return answer
                if self.slow_blobs and kind == "blob":
                    await asyncio.sleep(len(chunk) / self.slow_blobs)
                await answer.write(chunk)
                sent += len(chunk)
            await answer.write_eof()
            return answer


def _passed(headers: Any) -> dict[str, str]:
    skip = ("transfer-encoding", "connection", "keep-alive")
    return {k: v for k, v in headers.items() if k.lower() not in skip}
