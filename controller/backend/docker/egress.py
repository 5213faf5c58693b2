"""The egress proxy on this engine: how a sandbox with ``--egress`` reaches it.

The proxy itself (the list, the caps, resolution on the host, the journal) is engine-neutral:
:class:`~pvisor_host.gateway.egress.EgressProxy`, one per process, started the first time a run asks for it.
Here each run gets a short-lived host directory holding its own unix socket, bind-mounted read-only into its
sandbox at :data:`EGRESS_MOUNT`; the sandbox keeps ``--network none``. The entry shim starts the static relay
(the one the model gateway uses) on ``127.0.0.1:`` :data:`EGRESS_PORT`, and the proxy variables, in both
cases, point ``pip``, ``npm``, ``git``, ``curl`` and Python there.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ...gateway.egress import EgressProxy, EgressRun
from ...models.egress import LOOPBACK, Egress, EgressInfo, EgressLimit
from .sockets import own_socket, socket_dir

#: Where the relay listens inside the sandbox for the egress proxy, and where the run's socket is mounted.
EGRESS_PORT = 18081
EGRESS_MOUNT = "/pvisor-host/egress"
_SOCKET_NAME = "egress.sock"
#: Hosts every tool reaches directly, never through the proxy (the model relay listens on loopback).
NO_PROXY = LOOPBACK

_proxy: EgressProxy | None = None
_proxy_lock = threading.Lock()


def egress_proxy() -> EgressProxy:
    """This process's egress proxy (started on first use; its thread ends with the process)."""
    global _proxy
    with _proxy_lock:
        if _proxy is None:
            _proxy = EgressProxy()
        return _proxy


class EgressAccess(BaseModel):
    """What one sandbox gets to reach the egress proxy."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    socket_dir: Path
    """Host directory to mount read-only at :data:`EGRESS_MOUNT`."""
    container_env: dict[str, str]
    """The relay's setting and the proxy variables (nothing secret)."""
    run: EgressRun


def proxy_env(no_proxy: list[str]) -> dict[str, str]:
    """The proxy variables, in the forms pip, npm, git, curl and Python read (curl reads ``http_proxy`` only in
    lower case; the others either)."""
    url = f"http://127.0.0.1:{EGRESS_PORT}"
    bypass = ",".join(dict.fromkeys([*NO_PROXY, *no_proxy]))
    env: dict[str, str] = {}
    for name, value in (("http_proxy", url), ("https_proxy", url), ("no_proxy", bypass)):
        env[name] = env[name.upper()] = value
    return env


@contextlib.contextmanager
def egress_access(
    run_id: str, policy: Egress, limit: EgressLimit, *, uid: int | None, no_proxy: list[str]
) -> Iterator[tuple[EgressAccess, list[EgressInfo]]]:
    """The run's socket, listening for as long as the block runs; the journal is appended to the list yielded
    when the block ends (on every path), and the socket's directory is removed."""
    directory = socket_dir("pvh-eg-")
    proxy = egress_proxy()
    journal: list[EgressInfo] = []
    try:
        run = proxy.open(run_id, policy, limit, directory / _SOCKET_NAME)
        try:
            own_socket(run.socket_path, uid)
            env = {"PVISOR_HOST_EGRESS_RELAY": f"{EGRESS_PORT} {EGRESS_MOUNT}/{_SOCKET_NAME}", **proxy_env(no_proxy)}
            yield EgressAccess(socket_dir=directory, container_env=env, run=run), journal
        finally:
            journal.append(proxy.close_run(run))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
