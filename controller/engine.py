"""The Docker engine: connecting, classifying its errors, and retrying only the transient ones.

Every engine call of pvisor-host goes through the ``docker`` SDK (never the docker CLI). Calls that are
safe to repeat (inspect, create, remove, pull) are wrapped in :func:`retrying`, which retries only
errors :func:`is_transient` recognises (a dropped connection, an engine that is briefly busy) with
exponential backoff; everything else surfaces at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import docker
import requests
from docker.errors import APIError, DockerException, NotFound
from loguru import logger
from tenacity import RetryCallState, retry, retry_if_exception, stop_after_attempt, wait_exponential

from .errors import InfrastructureError, PrerequisiteError

T = TypeVar("T")

#: Seconds a single engine API request may take before it counts as failed (waits use their own).
API_TIMEOUT = 120

_TRANSIENT_MARKERS = (
    "connection reset",
    "connection refused",
    "broken pipe",
    "i/o timeout",
    "context deadline exceeded",
    "tls handshake timeout",
    "temporarily unavailable",
    "try again",
    "too many requests",
    "toomanyrequests",
    "service unavailable",
    "removal of container",  # "removal of container X is already in progress"
    "is already in progress",
)


def is_transient(exc: BaseException) -> bool:
    """True for engine errors worth retrying: dropped connections, busy engine, rate limits, 5xx blips."""
    if isinstance(exc, requests.exceptions.ConnectionError | requests.exceptions.ChunkedEncodingError):
        # A read timeout is wrapped in ConnectionError by docker-py waits; those are not retried here.
        return not isinstance(exc, requests.exceptions.ReadTimeout)
    if isinstance(exc, APIError) and not isinstance(exc, NotFound):
        text = str(exc.explanation or exc).lower()
        if exc.status_code in (429, 502, 503, 504):
            return True
        return any(marker in text for marker in _TRANSIENT_MARKERS)
    return False


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    logger.warning("transient engine error, retrying (attempt {}): {}", state.attempt_number, exc)


def retrying(attempts: int = 4, max_wait: float = 8.0) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorator: retry transient engine errors with exponential backoff, then re-raise the last one."""
    return retry(
        retry=retry_if_exception(is_transient),
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=0.25, max=max_wait),
        before_sleep=_log_retry,
        reraise=True,
    )


def engine_address() -> str:
    """Where the SDK will look for the engine (``DOCKER_HOST`` or the default socket)."""
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def connect(timeout: int = API_TIMEOUT, pool_size: int = 10) -> docker.DockerClient:
    """A client for the engine at ``DOCKER_HOST`` (or the default socket), checked with a ping.

    The client is safe to share between threads; ``pool_size`` should cover the threads that use it at once.

    Raises:
        PrerequisiteError: no engine answers there.
    """
    address = engine_address()
    try:
        client = docker.from_env(timeout=timeout, max_pool_size=pool_size)
        client.ping()
    except (DockerException, requests.exceptions.RequestException, OSError) as exc:
        reason = str(exc).split("\n")[0][:200]
        raise PrerequisiteError(
            f"no Docker engine answers at {address}: {reason}",
            hint="start dockerd (`make engine` installs and starts one on Debian) or set DOCKER_HOST",
        ) from exc
    return client


def engine_failure(action: str, exc: BaseException) -> InfrastructureError:
    """Wrap an SDK error in an :class:`InfrastructureError` that names what was being done."""
    detail = exc.explanation if isinstance(exc, APIError) and exc.explanation else str(exc)
    return InfrastructureError(f"Docker engine failed to {action}: {detail}")
