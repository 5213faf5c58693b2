"""The egress proxy: the sandbox's replayed tool calls reach the hosts ``--egress`` lists, and nothing else.

An HTTP forward proxy on the host, for plain HTTP (a request in absolute form) and HTTPS (``CONNECT``
tunnels). Each run gets a unix socket of its own (:meth:`EgressProxy.open`), bind-mounted into its sandbox,
which has no network: the same static relay that carries the model gateway listens on ``127.0.0.1`` inside
and forwards there, and the proxy variables point the tools at it. So the socket a connection arrives on says
which run it is, and no credential is needed in the sandbox.

For each connection the proxy decides on the host:

1. the destination must be listed (:meth:`~pvisor_host.models.egress.Egress.allows`);
2. the run's caps must have room (:class:`~pvisor_host.models.egress.EgressLimit`);
3. the name is resolved here, and only public addresses are used, unless an address is listed itself.
   The proxy connects to exactly the address it checked, so a name that answers differently the next time
   (DNS rebinding) gains nothing.

A refusal is ``403`` with one line saying why (``pvisor-host egress: refused evil.example:443: not in
--egress``), which is what ``curl``, ``pip`` or ``git`` print. Every connection, allowed or not, is journaled
with the bytes each way (:class:`~pvisor_host.models.egress.EgressEvent`); the run's record keeps the journal.

HTTP framing is h11's (a well-kept sans-I/O library: it parses the request head, CONNECT's authority form and
bodies of either framing, and frames the answer), on asyncio streams, in one event loop on a thread of its
own. aiohttp, which the model gateway uses, has no way to hand over the raw connection after a ``CONNECT``.
A plain-HTTP connection carries one request (the answer says ``Connection: close``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import h11

from ..models.egress import EVENTS_KEPT, Egress, EgressEvent, EgressInfo, EgressLimit

T = TypeVar("T")

#: Seconds to connect to an upstream, and to read a request head.
CONNECT_TIMEOUT = 10.0
#: The largest request head the proxy reads (bytes).
MAX_HEAD = 64 * 1024
#: Bytes read at a time.
CHUNK = 64 * 1024
#: Request headers that are the proxy's business, never forwarded.
_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"proxy-authenticate", b"te",
    b"trailer", b"upgrade", b"transfer-encoding", b"content-length",
})  # fmt: skip

_REASONS = {400: b"Bad Request", 403: b"Forbidden", 502: b"Bad Gateway"}

Resolver = Callable[[str, int], Awaitable[list[str]]]
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class Refusal(Exception):
    """A connection the proxy will not make; the message is the one line the sandbox gets."""


async def resolve(host: str, port: int) -> list[str]:
    """The addresses ``host`` has, resolved on this host."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def public(address: Address) -> bool:
    """Whether ``address`` is on the public internet (not loopback, private, link-local and so cloud metadata,
    shared, reserved or multicast). An IPv4 address mapped into IPv6 is judged as itself."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


def kind(address: Address) -> str:
    """What a non-public address is, in a word or two (for the refusal's one line)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    for word, test in (("loopback", address.is_loopback), ("link-local", address.is_link_local),
                       ("private", address.is_private), ("multicast", address.is_multicast)):  # fmt: skip
        if test:
            return f"a {word} address" + (" (cloud metadata)" if str(address) == "169.254.169.254" else "")
    return "not a public address"


class EgressRun:
    """One sandbox's egress: its list, its caps, and its journal (touched only by the proxy's loop, read once
    the run is closed)."""

    def __init__(self, run_id: str, policy: Egress, limit: EgressLimit, socket_path: Path) -> None:
        self.run_id = run_id
        self.policy = policy
        self.limit = limit
        self.socket_path = socket_path
        self.info = EgressInfo(allowed=str(policy), limit=limit)
        self.open = 0
        self.used = 0
        """Bytes through its connections so far, both ways (the byte cap's count)."""
        self.server: asyncio.AbstractServer | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    def journal(self, event: EgressEvent) -> None:
        info = self.info
        target = f"{event.host}:{event.port}"
        if event.verdict == "allowed":
            info.sent += event.sent
            info.received += event.received
            if target not in info.hosts:
                info.hosts.append(target)
        else:
            info.refused += 1
            if target not in info.refused_hosts:
                info.refused_hosts.append(target)
        if len(info.events) < EVENTS_KEPT:
            info.events.append(event)
        else:
            info.dropped += 1

    @property
    def bytes_left(self) -> int:
        return self.limit.bytes - self.used


class EgressProxy:
    """The egress proxy of this process: :meth:`open` a run (its own socket), :meth:`close_run` it to get its
    journal; :meth:`close` stops everything. Thread-safe."""

    def __init__(self, *, resolver: Resolver = resolve) -> None:
        self._resolve = resolver
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="pvisor-host-egress", daemon=True)
                self._thread.start()
            return self._loop

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._started()).result(timeout=60)

    def close(self) -> None:
        """Stop the loop (idempotent); runs still open are cut."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=30)
        loop.close()

    # -- runs ---------------------------------------------------------------------------------------------

    def open(self, run_id: str, policy: Egress, limit: EgressLimit, socket_path: Path, uid: int | None) -> EgressRun:
        """Listen for ``run_id`` on the unix socket ``socket_path`` (made now, for ``uid`` alone)."""
        run = EgressRun(run_id, policy, limit, socket_path)

        async def listen() -> None:
            run.server = await asyncio.start_unix_server(
                lambda reader, writer: self._accept(run, reader, writer), path=str(socket_path), limit=MAX_HEAD
            )

        self._call(listen())
        if uid is not None and os.geteuid() == 0:
            os.chown(socket_path, uid, uid)
        socket_path.chmod(0o600)
        return run

    def close_run(self, run: EgressRun) -> EgressInfo:
        """Stop listening for ``run``, cut what it still has open, and return its journal."""

        async def stop() -> None:
            if run.server is not None:
                run.server.close()
            for task in list(run.tasks):
                task.cancel()
            await asyncio.gather(*run.tasks, return_exceptions=True)

        self._call(stop())
        with contextlib.suppress(OSError):
            run.socket_path.unlink()
        return run.info

    # -- one connection ---------------------------------------------------------------------------------------

    def _accept(self, run: EgressRun, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self._serve(run, reader, writer))
        run.tasks.add(task)
        task.add_done_callback(run.tasks.discard)

    async def _serve(self, run: EgressRun, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        event = EgressEvent(at=time.time(), host="?", port=0, method="?", verdict="refused")
        started = time.monotonic()
        run.open += 1
        try:
            request = await asyncio.wait_for(_next_event(conn, reader), CONNECT_TIMEOUT)
            if not isinstance(request, h11.Request):
                return  # the sandbox hung up, or sent no request: nothing to journal
            method = request.method.decode("ascii", "replace")
            host, port, path, problem = _target(method, request.target.decode("ascii", "replace"))
            event = event.model_copy(update={"host": host, "port": port, "method": method, "path": path})
            if problem is not None:
                raise Refusal(problem)
            address = await self._decide(run, host, port)
            event.address, event.verdict = address, "allowed"
            try:
                upstream = await asyncio.wait_for(asyncio.open_connection(address, port), CONNECT_TIMEOUT)
            except (OSError, TimeoutError) as exc:
                event.status, event.reason = 502, f"could not connect: {_describe(exc)}"
                await _refuse(conn, writer, f"pvisor-host egress: {host}:{port}: {event.reason}", status=502)
                return
            if method == "CONNECT":
                await self._tunnel(run, conn, reader, writer, upstream, event)
            else:
                await self._forward(run, conn, request, reader, writer, upstream, event)
        except Refusal as exc:
            event.reason = str(exc)
            event.status = 403
            await _refuse(conn, writer, f"pvisor-host egress: refused {event.host}:{event.port}: {exc}")
        except (OSError, TimeoutError) as exc:  # a request head that never came, or an exchange broken off
            event.reason = event.reason or f"broken off: {_describe(exc)}"
        except h11.ProtocolError as exc:
            event.reason = f"not an HTTP proxy request: {exc}"
            await _refuse(conn, writer, f"pvisor-host egress: {event.reason}", status=400)
        except asyncio.CancelledError:
            event.reason = event.reason or "the sandbox ended"
            raise
        finally:
            run.open -= 1
            writer.close()
            event.duration = round(time.monotonic() - started, 4)
            if event.host != "?":
                run.journal(event)

    async def _decide(self, run: EgressRun, host: str, port: int) -> str:
        """The address to connect to for ``host:port``, or :class:`Refusal` with the reason."""
        info = run.info
        if run.policy.allows(host, port) is None:
            raise Refusal("not in --egress" if run.policy.rules else "--egress allows no host")
        if info.limited == "bytes" or run.bytes_left <= 0:
            info.limited = "bytes"
            raise Refusal(f"--egress-limit: the sandbox's {run.limit.bytes} bytes are used up")
        if info.connections >= run.limit.connections:
            info.limited = "connections"
            raise Refusal(f"--egress-limit: the sandbox's {run.limit.connections} connections are used up")
        if run.open > run.limit.at_once:
            raise Refusal(f"--egress-limit: {run.limit.at_once} connections at once")
        try:
            literal: Address | None = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        try:
            found = [str(literal)] if literal is not None else await self._resolve(host, port)
        except OSError as exc:
            raise Refusal(f"{host} does not resolve on the host ({exc.strerror or exc})") from None
        usable = [a for a in found if public(ipaddress.ip_address(a)) or run.policy.lists_address(
            ipaddress.ip_address(a), port)]  # fmt: skip
        if not usable:
            first = ipaddress.ip_address(found[0]) if found else None
            what = f"{first}, {kind(first)}" if first is not None else "no address"
            raise Refusal(f"{host} resolves to {what} (allowed only when the address itself is listed)")
        info.connections += 1
        return usable[0]

    async def _tunnel(
        self,
        run: EgressRun,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        event: EgressEvent,
    ) -> None:
        writer.write(conn.send(h11.Response(status_code=200, reason=b"Connection established", headers=[])))
        await writer.drain()
        up_reader, up_writer = upstream
        leftover, _ = conn.trailing_data
        try:
            if leftover:
                up_writer.write(leftover)
                event.sent += len(leftover)
            await _pump(run, event, reader, writer, up_reader, up_writer)
        finally:
            up_writer.close()

    async def _forward(
        self,
        run: EgressRun,
        conn: h11.Connection,
        request: h11.Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        event: EgressEvent,
    ) -> None:
        up_reader, up_writer = upstream
        client = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        try:
            headers = [(k, v) for k, v in request.headers if k.lower() not in _HOP and k.lower() != b"host"]
            framing = [(k, v) for k, v in request.headers if k.lower() in (b"content-length", b"transfer-encoding")]
            authority = event.host if event.port == 80 else f"{event.host}:{event.port}"
            target = urlsplit(request.target.decode("ascii", "replace"))
            origin = (target.path or "/") + (f"?{target.query}" if target.query else "")
            up_writer.write(client.send(h11.Request(
                method=request.method, target=origin.encode(),
                headers=[(b"host", authority.encode()), *headers, *framing, (b"connection", b"close")],
            )))  # fmt: skip
            while True:  # the request body, as it arrives
                part = await _next_event(conn, reader)
                if isinstance(part, h11.Data):
                    _count(run, event, "sent", len(part.data))
                    up_writer.write(client.send(part))
                    await up_writer.drain()
                elif isinstance(part, h11.EndOfMessage):
                    up_writer.write(client.send(part))
                    await up_writer.drain()
                    break
                else:
                    raise OSError("the sandbox hung up mid-request")
            answer = await _next_event(client, up_reader)
            while isinstance(answer, h11.InformationalResponse):  # 100 Continue: the body was sent already
                answer = await _next_event(client, up_reader)
            if not isinstance(answer, h11.Response):
                raise OSError("the upstream sent no answer")
            event.status = answer.status_code
            passed = [(k, v) for k, v in answer.headers if k.lower() not in _HOP]
            framing = [(k, v) for k, v in answer.headers if k.lower() in (b"content-length", b"transfer-encoding")]
            writer.write(conn.send(h11.Response(
                status_code=answer.status_code, reason=answer.reason,
                headers=[*passed, *framing, (b"connection", b"close")],
            )))  # fmt: skip
            while True:
                part = await _next_event(client, up_reader)
                if isinstance(part, h11.Data):
                    _count(run, event, "received", len(part.data))
                    writer.write(conn.send(part))
                    await writer.drain()
                elif isinstance(part, h11.EndOfMessage):
                    writer.write(conn.send(part) or b"")
                    await writer.drain()
                    break
                else:
                    raise OSError("the upstream hung up mid-answer")
        except _Cut as exc:
            event.reason = str(exc)
        finally:
            up_writer.close()


class _Cut(Exception):
    """The run's byte cap was reached: the connection is cut."""


def _count(run: EgressRun, event: EgressEvent, way: str, size: int) -> None:
    """Count ``size`` bytes of ``event`` (``sent`` or ``received``); past the run's byte cap, :class:`_Cut`."""
    setattr(event, way, getattr(event, way) + size)
    run.used += size
    if run.bytes_left < 0:
        run.info.limited = "bytes"
        raise _Cut(f"cut: the sandbox's --egress-limit of {run.limit.bytes} bytes was reached")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return getattr(exc, "strerror", None) or str(exc) or exc.__class__.__name__


async def _pump(
    run: EgressRun,
    event: EgressEvent,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
) -> None:
    """Copy both ways until both ends are done, counting bytes; the byte cap cuts both."""

    async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter, way: str) -> None:
        while data := await source.read(CHUNK):
            _count(run, event, way, len(data))
            sink.write(data)
            await sink.drain()
        with contextlib.suppress(OSError):
            if sink.can_write_eof():
                sink.write_eof()

    tasks = [asyncio.ensure_future(copy(reader, up_writer, "sent")),
             asyncio.ensure_future(copy(up_reader, writer, "received"))]  # fmt: skip
    try:
        for finished in asyncio.as_completed(tasks):
            await finished
    except _Cut as exc:
        event.reason = str(exc)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
    """The next h11 event, reading from ``reader`` as it needs (``h11.ConnectionClosed`` at the end)."""
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await reader.read(CHUNK))


def _target(method: str, target: str) -> tuple[str, int, str | None, str | None]:
    """The host, port and path a proxy request names (authority form for CONNECT, absolute form otherwise), and
    what is wrong with it, if anything (:class:`Refusal` when not even a host can be told)."""
    if method == "CONNECT":
        host, sep, port = target.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise Refusal(f"CONNECT {target[:200]}: expected HOST:PORT")
        return host.strip("[]").lower(), int(port), None, None
    parts = urlsplit(target)
    if not parts.hostname:
        raise Refusal(f"{method} {target[:200]}: a proxy request names an http:// URL (HTTPS goes by CONNECT)")
    try:
        number = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise Refusal(f"{target[:200]}: a bad port") from None
    problem = None
    if parts.scheme != "http":
        problem = f"{method} {parts.scheme}://: a proxy request names an http:// URL (HTTPS goes by CONNECT)"
    return parts.hostname.lower(), number, parts.path or "/", problem


async def _refuse(conn: h11.Connection, writer: asyncio.StreamWriter, line: str, status: int = 403) -> None:
    """Answer with ``status`` and ``line`` (when the connection can still take an answer)."""
    body = (line + "\n").encode()
    with contextlib.suppress(h11.LocalProtocolError, OSError):
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            writer.write(conn.send(h11.Response(status_code=status, reason=_REASONS.get(status, b""), headers=[
                (b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"), (b"x-pvisor-host-egress", b"refused"),
            ])))  # fmt: skip
            writer.write(conn.send(h11.Data(data=body)))
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()
