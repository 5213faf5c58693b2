"""Backends: where sandboxes run, behind one seam (:class:`~pvisor_host.backend.base.Backend`).

Nothing outside this package imports docker; :func:`open_backend` imports a backend's module only when one
is opened, so commands that need no engine never load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Backend, ModelGateway

if TYPE_CHECKING:
    from ..models.ownership import Ownership

__all__ = ["Backend", "ModelGateway", "open_backend"]


def open_backend(
    *,
    ownership: Ownership | None = None,
    pool_size: int = 10,
    timeout: float = 120,
    docker_host: str | None = None,
) -> Backend:
    """The Docker engine at ``docker_host`` (default: ``DOCKER_HOST``, else the default socket), checked with a
    ping.

    ``pool_size`` should cover the threads that use the backend at once; ``timeout`` bounds one engine request.

    Raises:
        PrerequisiteError: no engine answers.
    """
    from ..models.ownership import Ownership
    from .docker import DockerBackend

    return DockerBackend.connect(
        ownership or Ownership.current(), pool_size=pool_size, timeout=timeout, docker_host=docker_host
    )
