"""Pulling an image by reference: progress as it arrives, retries of what a registry means as passing, and one
clear line for what it means as final.

* Passing: a rate limit (429), a 5xx, a dropped or reset connection, an unreachable registry. Retried with
  tenacity, with exponential backoff and jitter, for up to :data:`PATIENCE` seconds. A 429 honours the
  registry's ``Retry-After``: the engine does not pass it on, so the registry is asked (:mod:`.registry`),
  and every pull from that registry waits as long (:class:`Gates`), not just the one that was refused.
* Final: no such image (``image_not_found``), or credentials the registry refuses (``registry_unauthorized``):
  :class:`~pvisor_host.errors.ImageUnavailable`, at once, for that image only.

Credentials are the docker CLI's (``~/.docker/config.json``, credential helpers), which docker-py hands the
engine with each pull; they never appear in a log line or an error. The engine makes an image whole or not at
all, so an interrupted pull (Ctrl-C, ``kill -9``) leaves nothing half-made that a later run would use.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import requests
from docker.errors import APIError, ImageNotFound
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt, stop_after_delay

from ..._log import logger
from ...errors import ImageUnavailable, Interrupted, RegistryError
from ...models.image import PulledImage, PullProgress
from .engine import describe, engine_errors
from .images import Reference, repo_digest
from .registry import Registries

if TYPE_CHECKING:
    import docker

#: Seconds a pull keeps retrying what a registry means as passing (a long rate limit included).
PATIENCE = 600.0
#: Attempts of one pull, at most.
ATTEMPTS = 12
#: The longest wait between two attempts when the registry names none (seconds).
MAX_BACKOFF = 60.0

_NOT_FOUND = ("not found", "manifest unknown", "does not exist", "no such image", "name unknown")
_UNAUTHORIZED = ("unauthorized", "authentication required", "no basic auth credentials", "denied", "forbidden")
_RATE_LIMITED = ("toomanyrequests", "too many requests", "rate limit")
#: Failures another try would meet again, whatever else the text says (a certificate, a plain-HTTP registry).
_FINAL = ("x509", "certificate", "http response to https client")
#: An HTTP status the registry answered, named as a number of its own (not inside a digest).
_STATUS = re.compile(r"(?<![0-9a-f])(429|500|502|503|504)(?![0-9a-f])")
_PASSING = (
    "internal server error", "bad gateway", "service unavailable", "gateway timeout",
    "connection reset", "connection refused", "eof", "broken pipe", "i/o timeout", "timeout", "tls handshake",
    "no such host", "network is unreachable", "temporary failure", "dial tcp", "context deadline exceeded",
)  # fmt: skip


class _Passing(Exception):
    """A failure worth another attempt; ``wait`` is how long the registry asked for, when it did."""

    def __init__(self, text: str, *, wait: float | None = None) -> None:
        super().__init__(text)
        self.text = text
        self.wait = wait


class Gates:
    """When each registry may be asked again: a 429 holds every pull from it, not only the refused one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: dict[str, float] = {}

    def hold(self, registry: str, seconds: float) -> None:
        with self._lock:
            self._until[registry] = max(self._until.get(registry, 0.0), time.monotonic() + seconds)

    def wait(self, registry: str, cancel: threading.Event | None) -> None:
        """Block until the registry may be asked (a cancel ends the wait with :class:`Interrupted`)."""
        while True:
            with self._lock:
                left = self._until.get(registry, 0.0) - time.monotonic()
            if left <= 0:
                return
            if cancel is not None and cancel.wait(min(left, 1.0)):
                raise Interrupted("interrupted while waiting for a rate-limited registry")
            if cancel is None:
                time.sleep(min(left, 1.0))


def classify(reference: str, text: str, status: int | None = None) -> Exception:
    """What a failed pull means: :class:`ImageUnavailable` (final), a passing failure, or RegistryError."""
    lowered = text.lower()
    if any(marker in lowered for marker in _FINAL):
        return RegistryError(f"pulling {reference} failed: {text[:300]}")
    if status == 404 or any(marker in lowered for marker in _NOT_FOUND):
        return ImageUnavailable("image_not_found", f"image {reference} was not found in its registry ({text[:200]})")
    if status in (401, 403) or any(marker in lowered for marker in _UNAUTHORIZED):
        return ImageUnavailable(
            "registry_unauthorized",
            f"the registry refused to give {reference} ({text[:200]})",
            hint="log in to it as the docker CLI would (docker login): its credentials are used",
        )
    # The engine answers 500 for any failed pull: its status says nothing of the registry's, the text does.
    if (
        status in (429, 502, 503, 504)
        or _STATUS.search(lowered)
        or any(m in lowered for m in (*_RATE_LIMITED, *_PASSING))
    ):
        return _Passing(text)
    return RegistryError(f"pulling {reference} failed: {text[:300]}")


class Puller:
    """The pulls of one backend: what each registry has asked of us (:class:`Gates`), its credentials and
    tokens (:class:`Registries`)."""

    def __init__(self, client: docker.DockerClient, registries: Registries | None = None) -> None:
        self._client = client
        self.registries = registries or Registries()
        self.gates = Gates()

    def present(self, reference: str) -> PulledImage | None:
        """The image, when the engine has it already (nothing is pulled)."""
        with engine_errors(f"inspect image {reference}"):
            try:
                image = self._client.images.get(reference)
            except (ImageNotFound, APIError) as exc:
                if isinstance(exc, ImageNotFound) or exc.status_code in (400, 404):
                    return None
                raise
        return _pulled(reference, image.attrs, pulled=False)

    def pull(
        self,
        reference: str,
        *,
        progress: Callable[[PullProgress], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> PulledImage:
        """Make ``reference`` present: nothing to do when it is, else pull it (see the module docstring).

        Raises:
            ImageUnavailable: no such image, or the registry refuses our credentials.
            RegistryError: the registry stayed unreachable or failing for :data:`PATIENCE` seconds.
            Interrupted: ``cancel`` was set.
        """
        found = self.present(reference)
        if found is not None:
            return found
        ref = Reference(reference)
        if ref.digest is None and ref.tag is None:
            reference = f"{reference}:latest"
            ref = Reference(reference)
        host = ref.registry or "docker.io"
        started = time.monotonic()
        retrying = Retrying(
            retry=retry_if_exception_type(_Passing),
            stop=stop_after_delay(PATIENCE) | stop_after_attempt(ATTEMPTS),
            wait=lambda state: min(self._backoff(state), max(0.0, PATIENCE - (time.monotonic() - started))),
            before_sleep=lambda state: self._before_retry(reference, host, state),
            sleep=lambda seconds: _sleep(seconds, cancel, reference),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    if cancel is not None and cancel.is_set():
                        raise Interrupted(f"interrupted while pulling {reference}")
                    self.gates.wait(host, cancel)
                    downloaded = self._once(ref, progress, cancel, started)
        except _Passing as exc:
            waited = time.monotonic() - started
            raise RegistryError(f"pulling {reference} kept failing for {waited:.0f}s: {exc.text[:300]}") from None
        found = self.present(reference)
        if found is None:
            raise RegistryError(f"the engine pulled {reference} but does not have it")
        return found.model_copy(
            update={"pulled": True, "downloaded": downloaded, "seconds": time.monotonic() - started}
        )

    def _once(
        self,
        ref: Reference,
        progress: Callable[[PullProgress], None] | None,
        cancel: threading.Event | None,
        started: float,
    ) -> int:
        """One pull through the engine, its events turned into progress; the bytes downloaded."""
        layers: dict[str, tuple[int, int | None]] = {}
        try:
            events = self._client.api.pull(ref.repository, tag=ref.digest or ref.tag, stream=True, decode=True)
            for event in events:
                if cancel is not None and cancel.is_set():
                    events.close()
                    raise Interrupted(f"interrupted while pulling {ref.text}")
                if "error" in event:
                    raise classify(ref.text, str(event["error"]))  # final, or passing (see below)
                detail = event.get("progressDetail") or {}
                if event.get("status") == "Downloading" and event.get("id"):
                    total = detail.get("total")
                    layers[event["id"]] = (int(detail.get("current", 0)), int(total) if total else None)
                    if progress is not None:
                        progress(_progress(ref.text, layers, time.monotonic() - started))
        except _Passing as exc:
            raise self._asked_to_wait(ref, exc) from None
        except APIError as exc:
            raise self._asked_to_wait(ref, classify(ref.text, describe(exc), exc.status_code)) from None
        except requests.RequestException as exc:
            raise _Passing(f"the engine's connection failed ({type(exc).__name__})") from None
        return sum(current for current, _ in layers.values())

    def _asked_to_wait(self, ref: Reference, error: Exception) -> Exception:
        """A rate limit: how long the registry wants us to wait (asked of it directly), for every pull from it."""
        if isinstance(error, _Passing) and any(marker in error.text.lower() for marker in _RATE_LIMITED):
            error.wait = self.registries.retry_after(ref.text)
            if error.wait is not None:
                self.gates.hold(ref.registry or "docker.io", error.wait)
        return error

    def _before_retry(self, reference: str, host: str, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, _Passing):
            wait = state.next_action.sleep if state.next_action else 0.0
            logger.warning(
                "pulling {} failed ({}); attempt {} in {:.0f}s", reference, exc.text[:120], state.attempt_number + 1,
                wait,
            )  # fmt: skip

    @staticmethod
    def _backoff(state: RetryCallState) -> float:
        """The registry's own ``Retry-After`` when it gave one; else exponential with full jitter."""
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, _Passing) and exc.wait is not None:
            return exc.wait
        return random.uniform(0, min(MAX_BACKOFF, 2.0**state.attempt_number))


def _sleep(seconds: float, cancel: threading.Event | None, reference: str) -> None:
    """tenacity's sleep between tries, which ``cancel`` (Ctrl-C, the batch's end) cuts short."""
    if cancel is None:
        time.sleep(seconds)
    elif cancel.wait(seconds):
        raise Interrupted(f"interrupted while waiting to pull {reference} again")


def _progress(reference: str, layers: dict[str, tuple[int, int | None]], seconds: float) -> PullProgress:
    totals = [total for _, total in layers.values()]
    total = None if None in totals else sum(t for t in totals if t is not None)
    done = sum(current for current, _ in layers.values())
    return PullProgress(ref=reference, done=done, total=total, seconds=seconds)


def _pulled(reference: str, attrs: dict[str, object], *, pulled: bool) -> PulledImage:
    digest = repo_digest(reference, attrs.get("RepoDigests"))
    size = attrs.get("Size")
    return PulledImage(
        ref=reference, id=str(attrs["Id"]), digest=digest, size=size if isinstance(size, int) else 0, pulled=pulled
    )
