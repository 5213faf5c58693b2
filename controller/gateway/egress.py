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
   (DNS rebinding) gains nothing. One name is the host's own: ``host.pvisor.internal`` (listed with its port)
   is the host's loopback, where a local package index, say, listens; the sandbox's own ``127.0.0.1`` is the
   sandbox, so loopback addresses and ``localhost`` cannot be listed (the one line says to use the name).

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
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import h11

from ..models.egress import EVENTS_KEPT, Egress, EgressEvent, EgressInfo, EgressLimit
from .loop import LoopThread

T = TypeVar("T")

#: Seconds to connect to an upstream, and to read a request head.
CONNECT_TIMEOUT = 10.0
#: The largest request head the proxy reads (bytes).
MAX_HEAD = 64 * 1024
#: Bytes read at a time.
CHUNK = 64 * 1024
#: Headers that are the proxy's business, never passed on as they came (the body's framing is passed on, so
#: that h11 frames the body as it came).
_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"proxy-authenticate", b"te",
    b"trailer", b"upgrade", b"host",
})  # fmt: skip

_REASONS = {400: b"Bad Request", 403: b"Forbidden", 502: b"Bad Gateway"}

Resolver = Callable[[str, int], Awaitable[list[str]]]
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

#: IPv6 prefixes that carry an IPv4 address in their last 32 bits (NAT64, RFC 6052 and 8215; IPv4-compatible,
#: deprecated; IPv4-translated, RFC 2765): judged as that IPv4 address.
_EMBEDDING = tuple(ipaddress.IPv6Network(n) for n in ("64:ff9b::/96", "64:ff9b:1::/48", "::/96", "::ffff:0:0:0/96"))
#: The longest host name DNS allows.
MAX_HOST = 253
#: Where a connection to :data:`~pvisor_host.models.egress.HOST_ALIAS` goes: the host's own loopback.
HOST_LOOPBACK = "127.0.0.1"


class Refusal(Exception):
    """A connection the proxy will not make; the message is the one line the sandbox gets."""


async def resolve(host: str, port: int) -> list[str]:
    """The addresses ``host`` has, resolved on this host."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def judged(address: Address) -> Address | None:
    """The address a connection to ``address`` really reaches, as far as the host can tell: an IPv4 address
    mapped, embedded (NAT64, IPv4-compatible, IPv4-translated) or 6to4-encoded in an IPv6 one is that IPv4
    address; a Teredo address is None (its IPv4 end is not to be judged from here)."""
    if isinstance(address, ipaddress.IPv4Address):
        return address
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return None
    if any(address in network for network in _EMBEDDING):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


def public(address: Address) -> bool:
    """Whether ``address`` is on the public internet (not loopback, private, link-local and so cloud metadata,
    shared, reserved or multicast), judged as what it really reaches (:func:`judged`)."""
    real = judged(address)
    return real is not None and real.is_global and not real.is_multicast


def kind(address: Address) -> str:
    """What a non-public address is, in a word or two (for the refusal's one line)."""
    real = judged(address)
    if real is None:
        return "a Teredo address"
    for word, test in (("loopback", real.is_loopback), ("link-local", real.is_link_local),
                       ("private", real.is_private), ("multicast", real.is_multicast)):  # fmt: skip
        if test:
            return f"a {word} address" + (" (cloud metadata)" if str(real) == "169.254.169.254" else "")
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
        self.attempts = 0
        """Connections that named a host (allowed or not): the connection cap's count."""
        self.used = 0
        """Bytes through its connections so far, both ways (the byte cap's count)."""
        self.server: asyncio.AbstractServer | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self._seen: dict[str, set[str]] = {"allowed": set(), "refused": set()}

    def journal(self, event: EgressEvent) -> None:
        info = self.info
        target = f"{event.host}:{event.port}"
        if event.verdict == "allowed":
            info.sent += event.sent
            info.received += event.received
            hosts = info.hosts
        else:
            info.refused += 1
            hosts = info.refused_hosts
        seen = self._seen[event.verdict]
        if target not in seen and len(seen) < EVENTS_KEPT:  # bounded, like the events
            seen.add(target)
            hosts.append(target)
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
        self._loop = LoopThread("pvisor-host-egress")

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self._loop.call(coroutine)

    def close(self) -> None:
        """Stop the loop (idempotent); runs still open are cut."""
        self._loop.close()

    # -- runs ---------------------------------------------------------------------------------------------

    def open(self, run_id: str, policy: Egress, limit: EgressLimit, socket_path: Path) -> EgressRun:
        """Listen for ``run_id`` on the unix socket ``socket_path`` (made now; who may use it is the caller's)."""
        run = EgressRun(run_id, policy, limit, socket_path)

        async def listen() -> None:
            run.server = await asyncio.start_unix_server(
                lambda reader, writer: self._accept(run, reader, writer), path=str(socket_path), limit=MAX_HEAD
            )

        self._call(listen())
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
        if len(run.tasks) >= run.limit.at_once:  # refused before a byte is read: it holds nothing here
            line = f"pvisor-host egress: refused: --egress-limit: {run.limit.at_once} connections at once\n"
            writer.write(f"HTTP/1.1 403 Forbidden\r\ncontent-length: {len(line)}\r\nconnection: close\r\n\r\n{line}"
                         .encode())  # fmt: skip
            writer.close()
            run.info.refused += 1
            return
        task = asyncio.ensure_future(self._serve(run, reader, writer))
        run.tasks.add(task)
        task.add_done_callback(run.tasks.discard)

    async def _serve(self, run: EgressRun, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        event = EgressEvent(at=time.time(), host="?", port=0, method="?", verdict="refused")
        started = time.monotonic()
        try:
            request = await asyncio.wait_for(_next_event(conn, reader), CONNECT_TIMEOUT)
            if not isinstance(request, h11.Request):
                return  # the sandbox hung up, or sent no request: nothing to journal
            method = request.method.decode("ascii", "replace")
            host, port, path, problem = _target(method, request.target.decode("ascii", "replace"))
            event = event.model_copy(update={"host": host, "port": port, "method": method, "path": path})
            run.attempts += 1  # before any wait: connections asking at once cannot all slip under the cap
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
            run.info.connections += 1
            if method == "CONNECT":
                await self._tunnel(run, conn, reader, writer, upstream, event)
            else:
                await self._forward(run, conn, request, reader, writer, upstream, event)
        except Refusal as exc:
            event.reason, event.status = str(exc), 403
            named = f" {event.host}:{event.port}" if event.host != "?" else ""
            await _refuse(conn, writer, f"pvisor-host egress: refused{named}: {exc}")
        except (OSError, TimeoutError) as exc:  # a request head that never came, or an exchange broken off
            event.reason = event.reason or f"broken off: {_describe(exc)}"
        except h11.ProtocolError as exc:  # the sandbox's side (the upstream's is an OSError: see _upstream_event)
            event.reason = f"not an HTTP proxy request: {exc}"
            await _refuse(conn, writer, f"pvisor-host egress: {event.reason}", status=400)
        except asyncio.CancelledError:
            event.reason = event.reason or "the sandbox ended"
            raise
        finally:
            writer.close()
            event.duration = round(time.monotonic() - started, 4)
            if event.host != "?":
                run.journal(event)

    async def _decide(self, run: EgressRun, host: str, port: int) -> str:
        """The address to connect to for ``host:port``, or :class:`Refusal` with the reason."""
        info = run.info
        rule = run.policy.allows(host, port)
        if rule is None:
            raise Refusal("not in --egress" if run.policy.rules else "--egress allows no host")
        if run.bytes_left <= 0:
            info.limited = "bytes"
            raise Refusal(f"--egress-limit: the sandbox's {run.limit.bytes} bytes are used up")
        if run.attempts > run.limit.connections:
            info.limited = "connections"
            raise Refusal(f"--egress-limit: the sandbox's {run.limit.connections} connections are used up")
        try:
            literal: Address | None = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        if rule.host_loopback:  # listed by the host's own name for its loopback: the one way there
            return HOST_LOOPBACK
        try:
            found = [str(literal)] if literal is not None else await self._resolve(host, port)
        except (OSError, ValueError) as exc:  # UnicodeError too: a label IDNA cannot encode
            raise Refusal(f"{host} does not resolve on the host ({getattr(exc, 'strerror', None) or exc})") from None
        addresses = [ipaddress.ip_address(a.split("%")[0]) for a in found]
        usable = [str(a) for a in addresses if public(a) or run.policy.lists_address(a, port)]
        if not usable:
            what = f"{addresses[0]}, {kind(addresses[0])}" if addresses else "no address"
            raise Refusal(f"{host} resolves to {what} (allowed only when the address itself is listed)")
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
        try:
            leftover, _ = conn.trailing_data  # what the sandbox sent right after its CONNECT
            await _carry(run, event, "sent", leftover, up_writer)
            await _pump(run, event, reader, writer, up_reader, up_writer)
        except _Cut as exc:
            event.reason = str(exc)
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
            host = f"[{event.host}]" if ":" in event.host else event.host
            authority = host if event.port == 80 else f"{host}:{event.port}"
            target = urlsplit(request.target.decode("ascii", "replace"))
            origin = (target.path or "/") + (f"?{target.query}" if target.query else "")
            up_writer.write(client.send(h11.Request(
                method=request.method, target=origin.encode(),
                headers=[(b"host", authority.encode()), *_passed(request.headers), (b"connection", b"close")],
            )))  # fmt: skip
            while True:  # the request body, as it arrives
                part = await _next_event(conn, reader)
                if isinstance(part, h11.Data):
                    await _carry(run, event, "sent", part.data, up_writer, _framed(client))
                elif isinstance(part, h11.EndOfMessage):
                    up_writer.write(client.send(part))
                    await up_writer.drain()
                    break
                else:
                    raise OSError("the sandbox hung up mid-request")
            answer = await _upstream_event(client, up_reader)
            while isinstance(answer, h11.InformationalResponse):  # 100 Continue: the body was sent already
                answer = await _upstream_event(client, up_reader)
            if not isinstance(answer, h11.Response):
                raise OSError("the upstream sent no answer")
            event.status = answer.status_code
            writer.write(conn.send(h11.Response(
                status_code=answer.status_code, reason=answer.reason,
                headers=[*_passed(answer.headers), (b"connection", b"close")],
            )))  # fmt: skip
            while True:
                part = await _upstream_event(client, up_reader)
                if isinstance(part, h11.Data):
                    await _carry(run, event, "received", part.data, writer, _framed(conn))
                elif isinstance(part, h11.EndOfMessage):
                    writer.write(conn.send(part) or b"")
                    await writer.drain()
                    break
                else:
                    raise OSError("the upstream hung up mid-answer")
        except _Cut as exc:  # what fitted under the cap has reached the sandbox; the connection is cut here
            event.reason = str(exc)
        finally:
            up_writer.close()


class _Cut(Exception):
    """The run's byte cap was reached: the connection is cut."""


async def _carry(run: EgressRun, event: EgressEvent, way: str, data: bytes, sink: asyncio.StreamWriter,
                 frame: Callable[[bytes], bytes] = bytes) -> None:  # fmt: skip
    """Pass ``data`` (going ``sent`` or ``received``) on to ``sink``, counted, as much of it as the run's byte cap
    leaves room for (``frame`` makes the bytes to write of it); :class:`_Cut` when that was not all of it."""
    taken = data[: max(0, run.bytes_left)]
    setattr(event, way, getattr(event, way) + len(taken))
    run.used += len(taken)
    if taken:
        sink.write(frame(taken))
        await sink.drain()
    if len(taken) < len(data):
        run.info.limited = "bytes"
        raise _Cut(f"cut: the sandbox's --egress-limit of {run.limit.bytes} bytes was reached")


def _framed(conn: h11.Connection) -> Callable[[bytes], bytes]:
    """Body bytes as ``conn`` puts them on the wire (a chunk's framing included)."""
    return lambda data: conn.send(h11.Data(data=data)) or b""


def _passed(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers passed on: not the proxy's own (hop-by-hop, ``Host``)."""
    return [(k, v) for k, v in headers if k.lower() not in _HOP]


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
    """Copy both ways until both ends are done, counting bytes; the byte cap cuts both (:class:`_Cut`)."""

    async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter, way: str) -> None:
        while data := await source.read(CHUNK):
            await _carry(run, event, way, data, sink)
        with contextlib.suppress(OSError):
            if sink.can_write_eof():
                sink.write_eof()

    tasks = [asyncio.ensure_future(copy(reader, up_writer, "sent")),
             asyncio.ensure_future(copy(up_reader, writer, "received"))]  # fmt: skip
    try:
        for finished in asyncio.as_completed(tasks):
            await finished
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


async def _upstream_event(client: h11.Connection, reader: asyncio.StreamReader) -> Any:
    """The upstream's next h11 event; an answer that is not HTTP is an :class:`OSError` (the sandbox gets 502)."""
    try:
        return await _next_event(client, reader)
    except h11.ProtocolError as exc:
        raise OSError(f"the upstream's answer is not HTTP ({exc})") from None


def _target(method: str, target: str) -> tuple[str, int, str | None, str | None]:
    """The host (lower case, no trailing dot), port and path a proxy request names (authority form for CONNECT,
    absolute form otherwise), and what is wrong with it, if anything (:class:`Refusal` when not even a host can be
    told)."""
    if method == "CONNECT":
        host, sep, port = target.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise Refusal(f"CONNECT {target[:200]}: expected HOST:PORT")
        host, number, path, scheme = host.strip("[]"), int(port), None, "http"
    else:
        parts = urlsplit(target)
        if not parts.hostname:
            raise Refusal(f"{method} {target[:200]}: a proxy request names an http:// URL (HTTPS goes by CONNECT)")
        try:
            number = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise Refusal(f"{target[:200]}: a bad port") from None
        host, path, scheme = parts.hostname, parts.path or "/", parts.scheme
    host = host.lower().rstrip(".")
    if not host or len(host) > MAX_HOST or not 0 < number < 65536:
        raise Refusal(f"{method} {target[:200]}: not a host and port")
    problem = None
    if scheme != "http":
        problem = f"{method} {scheme}://: a proxy request names an http:// URL (HTTPS goes by CONNECT)"
    return host, number, path, problem


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
