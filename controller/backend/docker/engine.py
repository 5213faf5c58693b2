"""The Docker engine: connecting, the one map of its errors, and the one retry policy for idempotent calls.

Every engine call of pvisor-host goes through the ``docker`` SDK (never the docker CLI), from this package
only. :func:`engine_errors` (a context manager and decorator) turns any SDK or transport error into an
:class:`~pvisor_host.errors.InfrastructureError` that names what was being done, so no engine failure
surfaces as anything but exit 6 with one line. :func:`retrying` retries the calls that are safe to repeat
(inspect, create, remove, list, pull) when :func:`is_transient` recognises the error (a dropped connection,
a busy engine, an unreachable registry), with exponential backoff; everything else surfaces at once.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from typing import TypeVar

import docker
import requests
from docker.errors import APIError, DockerException, NotFound
from tenacity import RetryCallState, retry, retry_if_exception, stop_after_attempt, wait_exponential

from ..._log import logger
from ...errors import InfrastructureError, PrerequisiteError, PvisorHostError

T = TypeVar("T")

#: Seconds a single engine API request may take before it counts as failed (waits use their own).
API_TIMEOUT = 120
#: What the SDK and its transport raise: the errors :func:`engine_errors` maps.
ENGINE_ERRORS = (DockerException, requests.exceptions.RequestException)

_TRANSIENT_MARKERS = (
    # the engine, or the way to it
    "connection reset",
    "connection refused",
    "broken pipe",
    "i/o timeout",
    "context deadline exceeded",
    "temporarily unavailable",
    "try again",
    "service unavailable",
    "removal of container",  # "removal of container X is already in progress"
    "is already in progress",
    # a registry behind it (pulls)
    "tls handshake timeout",
    "too many requests",
    "toomanyrequests",
    "no such host",
    "dial tcp",
    "network is unreachable",
    "temporary failure",
    "client.timeout",
)


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: dropped connections, a busy engine, rate limits, 5xx blips and a
    registry that cannot be reached (after the retries, a pull gives up and says so)."""
    if isinstance(exc, requests.exceptions.ConnectionError | requests.exceptions.ChunkedEncodingError):
        # A read timeout is wrapped in ConnectionError by docker-py waits; those are not retried here.
        return not isinstance(exc, requests.exceptions.ReadTimeout)
    if isinstance(exc, APIError) and not isinstance(exc, NotFound):
        if exc.status_code in (429, 502, 503, 504):
            return True
        return any(marker in describe(exc).lower() for marker in _TRANSIENT_MARKERS)
    return False


#: A URL's query: where a registry's signed blob URLs carry their signature (``X-Amz-Signature=...``).
_QUERY = re.compile(r"(\bhttps?://[^\s\"'?]+)\?[^\s\"']*", re.IGNORECASE)


def timed_out(exc: BaseException) -> bool:
    """A request that ran out of its time (docker-py's transport may wrap the read timeout in a ConnectionError):
    the engine took it and did not answer, unlike one refused, with no socket to reach, or whose connection could
    not be made in time (an engine away on the network)."""
    text = str(exc).lower()
    if isinstance(exc, requests.exceptions.ConnectTimeout) or "connect timeout" in text:
        return False
    return isinstance(exc, requests.exceptions.ReadTimeout) or "timed out" in text


def request_within(api: docker.APIClient, method: str, path: str, seconds: float, *args: str, **params: object) -> None:
    """One engine request that may take ``seconds`` at most (``path`` formatted with ``args``, as docker-py's
    own ``_url``): docker-py's methods take no timeout of their own (they use the client's), so the request is
    made as they make it, with one.

    Raises:
        docker.errors.APIError: the engine's error answer.
        requests.exceptions.RequestException: no answer in time (:func:`timed_out`), or none at all.
    """
    answer = getattr(api, f"_{method}")(api._url(path, *args), params=params or None, timeout=seconds)
    api._raise_for_status(answer)


def scrub(text: str) -> str:
    """``text`` without the queries of the URLs it quotes: a registry's error may quote a signed blob URL, whose
    signature must not reach a log line or a record."""
    return _QUERY.sub(r"\1?…", text)


def describe(exc: BaseException) -> str:
    """The engine's own words for an error, on one line (signed URLs cut, see :func:`scrub`)."""
    text = exc.explanation if isinstance(exc, APIError) and exc.explanation else str(exc)
    text = scrub(str(text).strip().replace("\n", " "))
    return text[:300] or type(exc).__name__


def _log_retry(level: str) -> Callable[[RetryCallState], None]:
    def log(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        detail = describe(exc) if exc is not None else "?"
        logger.log(level, "transient engine error, retrying (attempt {}): {}", state.attempt_number, detail)

    return log


def retrying(
    attempts: int = 4, max_wait: float = 8.0, *, quiet: bool = False
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorator for idempotent engine calls: retry transient errors with exponential backoff, then re-raise
    the last one. ``quiet`` logs the retries only with ``--verbose`` (pulls: an unreachable registry is said
    once, in the error or in the fallback's own line)."""
    return retry(
        retry=retry_if_exception(is_transient),
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=0.25, max=max_wait),
        before_sleep=_log_retry("DEBUG" if quiet else "WARNING"),
        reraise=True,
    )


@contextlib.contextmanager
def engine_errors(action: str) -> Iterator[None]:
    """Map any engine error raised in the block to an :class:`InfrastructureError` saying
    ``Docker engine failed to <action>: <the engine's words>``. Our own errors pass through unchanged.

    Also a decorator: ``@engine_errors("list containers")``.
    """
    try:
        yield
    except PvisorHostError:
        raise
    except ENGINE_ERRORS as exc:
        raise InfrastructureError(f"Docker engine failed to {action}: {describe(exc)}") from exc


def engine_address(docker_host: str | None = None) -> str:
    """Where the SDK will look for the engine: ``docker_host``, else ``DOCKER_HOST``, else the default socket."""
    return docker_host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def connect(timeout: float = API_TIMEOUT, pool_size: int = 10, docker_host: str | None = None) -> docker.DockerClient:
    """A client for the engine at ``docker_host`` (default: ``DOCKER_HOST``, else the default socket), checked
    with a ping. The client is safe to share between threads; ``pool_size`` should cover the threads that use
    it at once.

    Raises:
        PrerequisiteError: no engine answers there.
    """
    address = engine_address(docker_host)
    try:
        if docker_host is None:
            client = docker.from_env(timeout=int(timeout), max_pool_size=pool_size)
        else:
            client = docker.DockerClient(base_url=docker_host, timeout=int(timeout), max_pool_size=pool_size)
        client.ping()
    except (*ENGINE_ERRORS, OSError) as exc:
        reason = str(exc).split("\n")[0][:200]
        raise PrerequisiteError(
            f"no Docker engine answers at {address}: {reason}",
            hint="start dockerd (`make engine` installs and starts one on Debian) or set DOCKER_HOST",
        ) from exc
    return client
