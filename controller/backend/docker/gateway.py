"""The model gateway on this engine: where the proxy listens, and how a sandbox reaches it.

The proxy itself (tokens, forwarding with the real key, streams, the journal) is engine-neutral:
:class:`~pvisor_host.gateway.proxy.ModelProxy`. This module puts it where ``--model-network`` says:

* ``unix`` (default): a unix socket in a short-lived host directory, bind-mounted read-only into a sandbox
  that has no network at all; a static relay started in the sandbox before pvisor listens on
  ``127.0.0.1:18080`` and forwards there.
* ``internal``: TCP on the gateway address of an internal Docker network created for the run (for engines
  where a unix socket cannot be shared). Note: on such a network the sandbox can also reach other services
  listening on the host's addresses.
* ``pass-through``: no gateway; the sandbox gets the upstream and the real key (with a warning).

The sandbox gets the gateway as ``OPENAI_BASE_URL`` and its run's token as ``OPENAI_API_KEY``
(:class:`ModelAccess`), never the real key (but with ``pass-through``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import secrets
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import docker
from docker.errors import NotFound
from pydantic import BaseModel

from ..._log import logger
from ...errors import InfrastructureError
from ...gateway.cassette import Tape
from ...gateway.limits import Limits
from ...models.ownership import Ownership
from ...models.spec import ModelUpstream
from . import labels as L
from .engine import engine_errors
from .sockets import own_socket, socket_dir

if TYPE_CHECKING:  # aiohttp (about 0.1 s to import) loads when a gateway starts, not with every replay
    from ...gateway.proxy import ModelProxy

#: Where the relay listens inside the sandbox, and where the gateway's socket directory is mounted.
RELAY_PORT = 18080
SOCKET_MOUNT = "/pvisor-host/gateway"
_SOCKET_NAME = "gw.sock"


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
    socket: str | None = None
    """A fork's own socket (``--fork``), which its requests must arrive on: every fork holds the same token."""


class Gateway:
    """The model gateway of one ``replay`` (all its attempts) or one ``batch`` on this engine: the proxy
    (:class:`~pvisor_host.gateway.proxy.ModelProxy`), listening where ``--model-network`` says. :meth:`start` it,
    :meth:`close` it (or use it as a context manager)."""

    def __init__(
        self,
        upstream: ModelUpstream,
        api_key: str | None,
        *,
        client: docker.DockerClient | None = None,
        ownership: Ownership | None = None,
        sandbox_uid: int | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.config = upstream
        self._api_key = api_key
        self._client = client
        self._ownership = ownership
        self._uid = sandbox_uid
        self._limits = limits
        self._proxy: ModelProxy | None = None
        self._socket_dir: Path | None = None
        self._network: Any = None
        self._forks: dict[str, tuple[Any, Path]] = {}
        """A fork's socket path: its site and directory (:meth:`access` with a ``token``), under ``_forks_lock``."""
        self._forks_lock = threading.Lock()
        self.address: str | None = None
        """``host:port`` (internal) or the socket path (unix) once started."""

    # -- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> Gateway:
        """Listen where ``--model-network`` says (nothing to start for ``pass-through``); return ``self``."""
        if not self.config.gateway:
            return self
        from ...gateway.proxy import ModelProxy

        try:
            self._proxy = ModelProxy(self.config, self._api_key, limits=self._limits).start()
            if self.config.network == "unix":
                self._start_unix(self._proxy)
            else:
                self._start_internal(self._proxy)
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening and remove the socket directories and the internal network (every path)."""
        with self._forks_lock:
            forks, self._forks = list(self._forks.values()), {}
        for _, directory in forks:
            shutil.rmtree(directory, ignore_errors=True)
        if self._proxy is not None:
            self._proxy.close()
            self._proxy = None
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
        if self._network is not None:
            with engine_errors(f"remove the model network {self._network.name}"), contextlib.suppress(NotFound):
                self._network.remove()
            self._network = None

    def _start_unix(self, proxy: ModelProxy) -> None:
        self._socket_dir = socket_dir("pvh-gw-")
        path = self._socket_dir / _SOCKET_NAME
        proxy.listen_unix(str(path))
        own_socket(path, self._uid)
        self.address = str(path)
        logger.debug("model gateway listening on {}", path)

    def _start_internal(self, proxy: ModelProxy) -> None:
        if self._client is None or self._ownership is None:
            raise ValueError("the internal model network needs an engine client and an ownership")
        name = f"pvisor-host-gw-{self._ownership.session}-{secrets.token_hex(3)}"
        with engine_errors("create the internal model network"):
            self._network = self._client.networks.create(
                name, driver="bridge", internal=True, labels=L.resource_labels(self._ownership, "model-network")
            )
            self._network.reload()
        try:
            gateway_ip = network_gateway(self._network.attrs)
        except ValueError as exc:
            raise InfrastructureError(f"the internal model network has no usable gateway address: {exc}") from exc
        port = proxy.listen_tcp(gateway_ip)
        self.address = f"{gateway_ip}:{port}"
        logger.debug("model gateway listening on {} (network {})", self.address, name)

    # -- runs ---------------------------------------------------------------------------------------------

    def access(self, run_id: str, journal: Path, tape: Tape | None = None, *, token: str | None = None) -> ModelAccess:
        """Register a run (a fresh token; its journal, its cassette tape) and say how its sandbox reaches the
        model. A fork (``--fork``) passes the ``token`` its restored pvisor holds, which its prefix's other forks
        hold too: it gets a socket of its own, and its requests are its own by the socket they arrive on."""
        model = self.config.model
        if self._proxy is None:  # pass-through
            logger.warning(
                "--model-network pass-through: the real key from {} enters the sandbox, "
                "where replayed tool calls can read it",
                self.config.api_key_env,
            )
            assert self.config.base_url is not None and self._api_key is not None  # pass-through needs both
            return ModelAccess(base_url=self.config.base_url, api_key=self._api_key, model=model, network="bridge")
        if token is not None:
            return self._fork_access(self._proxy, run_id, journal, tape, token)
        token = self._proxy.grant(run_id, journal, tape)
        if self.config.network == "unix":
            assert self._socket_dir is not None
            return self._unix_access(token, self._socket_dir)
        assert self._network is not None
        return ModelAccess(
            base_url=f"http://{self.address}/v1", api_key=token, model=model, network=self._network.name, token=token
        )

    def _fork_access(self, proxy: ModelProxy, run_id: str, journal: Path, tape: Tape | None, token: str) -> ModelAccess:
        if self.config.network != "unix":
            raise ValueError("a fork reaches the gateway through a socket of its own: --model-network unix")
        directory = socket_dir("pvh-gw-")
        path = directory / _SOCKET_NAME
        with self._forks_lock:
            self._forks[str(path)] = (None, directory)
        try:
            site = proxy.listen_unix(str(path))
            with self._forks_lock:
                self._forks[str(path)] = (site, directory)
            own_socket(path, self._uid)
            proxy.grant(run_id, journal, tape, token=token, socket=str(path))
        except BaseException:
            self._forget_fork(str(path))
            raise
        return self._unix_access(token, directory, socket=str(path))

    def _unix_access(self, token: str, directory: Path, socket: str | None = None) -> ModelAccess:
        """How a sandbox with no network reaches the gateway: the relay, to the socket in ``directory``."""
        return ModelAccess(
            base_url=f"http://127.0.0.1:{RELAY_PORT}/v1", api_key=token, model=self.config.model,
            container_env={"PVISOR_HOST_RELAY": f"{RELAY_PORT} {SOCKET_MOUNT}/{_SOCKET_NAME}"}, network="none",
            socket_dir=directory, token=token, socket=socket,
        )  # fmt: skip

    def release(self, model: ModelAccess) -> None:
        """Forget a run's token (and a fork's socket): nothing can use it any more."""
        if self._proxy is not None:
            self._proxy.revoke(model.token, model.socket)
        if model.socket is not None:
            self._forget_fork(model.socket)

    def _forget_fork(self, socket: str) -> None:
        with self._forks_lock:
            site, directory = self._forks.pop(socket, (None, None))
        if site is not None and self._proxy is not None:
            with contextlib.suppress(Exception):  # a site that never started listening
                self._proxy.stop_listening(site)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


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
