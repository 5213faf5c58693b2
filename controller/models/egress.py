"""Egress: which hosts a sandbox's replayed tool calls may reach (``--egress``), the caps on what they may send
and receive there (``--egress-limit``), and the journal of what they did (``record.egress``).

``--egress`` takes a comma-separated list. An entry is ``allow:HOST[:PORT]``, a bare ``HOST[:PORT]``, or the
name of a preset (:data:`PRESETS`: ``pypi``, ``npm``, ``github``). ``HOST`` is a name, a wildcard for the
subdomains of one (``*.pythonhosted.org``: ``files.pythonhosted.org``, not ``pythonhosted.org`` itself), an IPv4
address, or an IPv6 address in brackets. Without ``:PORT`` an entry allows ports 80 and 443. ``none`` allows
nothing (every attempt is refused and journaled). Names are resolved on the host, where the proxy runs: an
address that is not public (loopback, private, link-local, cloud metadata, shared, reserved) is refused even
when an allowed name resolves to it, unless that address is listed itself.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..units import format_size, key_values, parse_size, short_size, shortlist

#: What a preset name stands for (docs/egress.md lists them too; a test keeps the two the same).
PRESETS: dict[str, tuple[str, ...]] = {
    "pypi": ("pypi.org", "files.pythonhosted.org"),
    "npm": ("registry.npmjs.org",),
    "github": ("github.com", "codeload.github.com", "objects.githubusercontent.com", "api.github.com"),
}
#: Ports an entry without one allows.
DEFAULT_PORTS = (80, 443)
#: The name a sandbox's tools reach the host's own loopback by, through the proxy (``allow:HOST_ALIAS:PORT``): the
#: sandbox's 127.0.0.1 is its own, so a service on the host (a local package index) needs a name of its own.
HOST_ALIAS = "host.pvisor.internal"
#: The sandbox's own loopback, by the names its tools call it: itself, never the host (and never proxied).
LOOPBACK = ("127.0.0.1", "localhost", "::1")
_LOOPBACK_NAMES = ("localhost", "localhost.localdomain")
#: The most journal events a record keeps (the counts cover every one).
EVENTS_KEPT = 1000

_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_ENTRY = re.compile(r"^(?P<host>\[[^\]]*\]|[^:\[\]]*)(?::(?P<port>[^:]*))?$")


class EgressRule(BaseModel):
    """One allowed destination: a host (a name, ``*.`` and a name, or an address) and its ports."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str
    """Lower case; an IPv6 address without brackets."""
    ports: tuple[int, ...] = DEFAULT_PORTS

    @property
    def wildcard(self) -> bool:
        return self.host.startswith("*.")

    @property
    def host_loopback(self) -> bool:
        """The rule names the host's own loopback (:data:`HOST_ALIAS`)."""
        return self.host == HOST_ALIAS

    @property
    def address(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
        """The address the rule names (None: a name or a wildcard)."""
        try:
            return ipaddress.ip_address(self.host)
        except ValueError:
            return None

    def matches(self, host: str, port: int) -> bool:
        """Whether ``host:port`` (a name, lower case, or an address) is what this rule allows."""
        if port not in self.ports:
            return False
        if self.wildcard:
            return host.endswith(self.host[1:]) and len(host) > len(self.host) - 1
        if self.address is not None:
            return _same_address(host, self.address)
        return host == self.host

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.ports == DEFAULT_PORTS else f"{host}:{self.ports[0]}"


class Egress(BaseModel):
    """The hosts a sandbox may reach through the egress proxy (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rules: tuple[EgressRule, ...] = ()
    presets: tuple[str, ...] = ()
    """The presets named (their hosts are among ``rules``)."""

    cli_metavar: ClassVar[str] = "allow:HOST[:PORT],…|PRESET"

    @model_validator(mode="before")
    @classmethod
    def _compact(cls, value: Any) -> Any:
        """``allow:pypi.org,*.pythonhosted.org:443,npm``, as the CLI and a manifest give it."""
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            value = ",".join(value)
        if not isinstance(value, str):
            return value
        return parse_egress(value)

    def allows(self, host: str, port: int) -> EgressRule | None:
        """The first rule that allows ``host:port``, or None."""
        host = host.lower().rstrip(".")
        return next((rule for rule in self.rules if rule.matches(host, port)), None)

    def loopback_refusal(self) -> str | None:
        """Why a rule naming loopback (``127.0.0.1``, ``localhost``, ``::1``) cannot do what a sandbox's user means
        by it, and what does (:data:`HOST_ALIAS`); None: no such rule."""
        for rule in self.rules:
            if rule.host in _LOOPBACK_NAMES or (rule.address is not None and rule.address.is_loopback):
                port = f":{rule.ports[0]}" if rule.ports != DEFAULT_PORTS else ""
                return (
                    f"allow:{rule}: {rule.host} in the sandbox is the sandbox itself, so its tools never reach the "
                    f"host's by it; to reach a service on the host's loopback, list allow:{HOST_ALIAS}{port} and "
                    f"call it by that name (http://{HOST_ALIAS}{port}/)"
                )
        return None

    def lists_address(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> bool:
        """Whether ``address`` itself is listed (for ``port``): only then may a non-public address be reached."""
        return any(rule.address is not None and _same_address(str(address), rule.address) and port in rule.ports
                   for rule in self.rules)  # fmt: skip

    def __str__(self) -> str:
        preset_hosts = {h for p in self.presets for h in PRESETS[p]}
        own = [str(r) for r in self.rules if not (r.host in preset_hosts and r.ports == DEFAULT_PORTS)]
        return ",".join([*self.presets, *(f"allow:{r}" for r in own)]) or "none"


def parse_egress(value: str) -> dict[str, Any]:
    """The fields of :class:`Egress` from its compact form; ``ValueError`` names the first bad entry."""
    rules: list[EgressRule] = []
    presets: list[str] = []
    parts = [p.strip() for p in value.split(",")]
    if parts == ["none"]:
        return {"rules": (), "presets": ()}
    for part in parts:
        if not part:
            raise ValueError(f"{value!r}: an empty entry (expected allow:HOST[:PORT] or a preset)")
        bare = part.lower()
        if bare in PRESETS:
            presets.append(bare)
            rules += [EgressRule(host=host) for host in PRESETS[bare]]
            continue
        rules.append(parse_rule(part.removeprefix("allow:")))
    return {"rules": tuple(dict.fromkeys(rules)), "presets": tuple(dict.fromkeys(presets))}


def parse_rule(text: str) -> EgressRule:
    """``HOST[:PORT]`` as one rule; ``ValueError`` says what is wrong with it in one line."""
    if "://" in text or "/" in text:
        raise ValueError(f"{text!r} is a URL; give its host (and port): allow:HOST[:PORT]")
    match = _ENTRY.match(text)
    if match is None:
        raise ValueError(f"{text!r}: expected HOST[:PORT] (an IPv6 address in brackets)")
    host, port = match["host"], match["port"]
    if not host:
        raise ValueError(f"{text!r}: the host is empty")
    ports: tuple[int, ...] = DEFAULT_PORTS
    if port is not None:
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"{text!r}: the port must be a number from 1 to 65535")
        ports = (int(port),)
    if host.startswith("["):
        try:
            six = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{text!r}: {host} is not an IPv6 address") from None
        if six.is_unspecified:
            raise ValueError(f"{text!r}: [::] is no host (it means this one)")
        return EgressRule(host=str(six), ports=ports)
    host = host.lower().rstrip(".")
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        pass
    else:
        if address.is_unspecified:
            raise ValueError(f"{text!r}: 0.0.0.0 is no host (it means this one)")
        return EgressRule(host=str(address), ports=ports)
    name = host.removeprefix("*.")
    if "*" in name or not all(_LABEL.match(label) for label in name.split(".")) or name.replace(".", "").isdigit():
        raise ValueError(f"{text!r}: {host!r} is not a host name (a wildcard is only *.NAME)")
    return EgressRule(host=host, ports=ports)


def _same_address(host: str, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")) == address
    except ValueError:
        return False


class EgressLimit(BaseModel):
    """Per-sandbox caps on egress (``--egress-limit connections=N,bytes=SIZE``): past them, new connections are
    refused with 403 and a connection that crosses the byte cap is cut; the record says so."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    connections: int = Field(default=1000, ge=1)
    """Connections the sandbox may open through the proxy, in all."""
    bytes: int = Field(default=4 * 1024**3, ge=1)
    """Bytes sent and received through the proxy, both ways together."""
    at_once: int = Field(default=64, ge=1)
    """Connections open at the same time (each holds a little host memory)."""

    @model_validator(mode="before")
    @classmethod
    def _compact(cls, value: Any) -> Any:
        """``connections=50,bytes=200m[,at_once=8]``, as the CLI takes it."""
        if not isinstance(value, str):
            return value
        keys = {spelling: name for name in cls.model_fields for spelling in (name, name.replace("_", "-"))}
        fields: dict[str, Any] = key_values(value, keys, "connections=N,bytes=SIZE[,at_once=N]")
        return fields

    @field_validator("bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return parse_size(value) if isinstance(value, str) else value

    def __str__(self) -> str:
        """The compact form, which reads back as the same caps."""
        return f"connections={self.connections},bytes={short_size(self.bytes)},at_once={self.at_once}"


Verdict = Literal["allowed", "refused"]


class EgressEvent(BaseModel):
    """One connection (or plain-HTTP request) a sandbox made through the egress proxy."""

    at: float
    """When it arrived (seconds since the epoch)."""
    host: str
    port: int
    method: str
    """``CONNECT`` for a tunnel (HTTPS), else the HTTP method."""
    path: str | None = None
    """Plain HTTP only: the path asked for (its query left out)."""
    verdict: Verdict
    reason: str | None = None
    """Why it was refused, or why an allowed one was cut (the byte cap, the upstream)."""
    address: str | None = None
    """The address the proxy connected to (after resolving on the host), or refused."""
    sent: int = 0
    """Bytes from the sandbox to the upstream."""
    received: int = 0
    """Bytes from the upstream to the sandbox."""
    duration: float = 0.0
    status: int | None = None
    """Plain HTTP: the upstream's status (403 for a refusal)."""
    call: str | None = None
    """The replayed tool call it happened during (pvisor's ``call_id``), where pvisor's events tell."""
    tool: str | None = None


#: Hosts an item's or a batch's totals name; the rest are counted.
HOSTS_KEPT = 50


class EgressTotals(BaseModel):
    """What a sandbox's tool calls did through the egress proxy, counted; one item's egress in a row of
    ``results.jsonl`` (its hosts cut at :data:`HOSTS_KEPT`), and the counts of ``record.egress``."""

    connections: int = 0
    """Connections made to an upstream."""
    refused: int = 0
    """Connections refused (not listed, a non-public address, a cap), each with its reason in ``events``."""
    sent: int = 0
    received: int = 0
    limited: Literal["connections", "bytes"] | None = None
    """Which cap was reached, if one was."""
    hosts: list[str] = []
    """``host:port`` reached, each once, in the order their first connection ended (at most :data:`EVENTS_KEPT`
    in the record; so is ``refused_hosts``)."""
    refused_hosts: list[str] = []

    def totals(self) -> EgressTotals:
        """The counts alone, the hosts cut at :data:`HOSTS_KEPT` (a row of ``results.jsonl``)."""
        fields = self.model_dump(include=set(EgressTotals.model_fields))
        fields["hosts"], fields["refused_hosts"] = self.hosts[:HOSTS_KEPT], self.refused_hosts[:HOSTS_KEPT]
        return EgressTotals.model_validate(fields)

    def describe(self) -> str:
        """One line for people: connections, refusals, bytes, the hosts."""
        return _describe(self.connections, self.refused, self.sent, self.received, self.hosts, self.refused_hosts,
                         f"--egress-limit {self.limited} reached" if self.limited else None)  # fmt: skip


class EgressInfo(EgressTotals):
    """``record.egress``: what the sandbox was allowed, what it reached or was refused, and each connection."""

    allowed: str
    """The ``--egress`` list, as given (presets by name)."""
    limit: EgressLimit
    events: list[EgressEvent] = []
    """The first :data:`EVENTS_KEPT` events; the counts cover all."""
    dropped: int = 0
    """Events past :data:`EVENTS_KEPT`, counted but not kept."""


class EgressStats(BaseModel):
    """A batch's egress in ``summary.json``: over the items that ran with ``--egress``."""

    items: int
    connections: int
    refused: int
    sent: int
    received: int
    limited: int
    """Items that reached a cap."""
    hosts: dict[str, int]
    """``host:port`` → items that reached it (the :data:`HOSTS_KEPT` most reached)."""
    refused_hosts: dict[str, int]
    """``host:port`` → items refused it."""

    def describe(self) -> str:
        """One line for people: connections, refusals, bytes, the most reached and refused hosts."""
        limited = f"{self.limited} items reached --egress-limit" if self.limited else None
        return f"{self.items} items: " + _describe(
            self.connections, self.refused, self.sent, self.received,
            [f"{h} ({n})" for h, n in self.hosts.items()], [f"{h} ({n})" for h, n in self.refused_hosts.items()],
            limited,
        )  # fmt: skip

    @classmethod
    def over(cls, totals: list[EgressTotals]) -> EgressStats | None:
        if not totals:
            return None

        def most(lists: list[list[str]]) -> dict[str, int]:
            counted: dict[str, int] = {}
            for hosts in lists:
                for host in hosts:
                    counted[host] = counted.get(host, 0) + 1
            return dict(sorted(counted.items(), key=lambda kv: (-kv[1], kv[0]))[:HOSTS_KEPT])

        return cls(
            items=len(totals), connections=sum(t.connections for t in totals), refused=sum(t.refused for t in totals),
            sent=sum(t.sent for t in totals), received=sum(t.received for t in totals),
            limited=sum(t.limited is not None for t in totals), hosts=most([t.hosts for t in totals]),
            refused_hosts=most([t.refused_hosts for t in totals]),
        )  # fmt: skip


def _describe(
    connections: int,
    refused: int,
    sent: int,
    received: int,
    hosts: list[str],
    refused_hosts: list[str],
    limited: str | None,
) -> str:
    parts = [
        f"{connections} connections, {refused} refused",
        f"{format_size(sent)} sent, {format_size(received)} received",
    ]
    if hosts:
        parts.append(f"reached {shortlist(hosts, 5)}")
    if refused_hosts:
        parts.append(f"refused {shortlist(refused_hosts, 5)}")
    if limited:
        parts.append(limited)
    return "; ".join(parts)
