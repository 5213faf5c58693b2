"""Pulling an image by reference: progress as it arrives, retries of what a registry means as passing, and one
clear line for what it means as final.

* Passing: a rate limit (429), a 5xx, a dropped or reset connection, a timeout. Retried with
  tenacity, with exponential backoff and jitter, for up to :data:`PATIENCE` seconds. A 429 honours the
  registry's ``Retry-After``: the engine does not pass it on, so the registry is asked (:mod:`.registry`),
  and every pull from that registry waits as long (:class:`Gates`), not just the one that was refused.
* Final: no such image (``image_not_found``), credentials the registry refuses (``registry_unauthorized``), or a
  registry whose name does not resolve or that refuses connections (``registry_unreachable``: a host without
  it, or a typo): :class:`~pvisor_host.errors.ImageUnavailable`, at once, for that image only.

Questions to a registry itself (a manifest, a configuration: :func:`Puller.ask`) follow the same rules, with
the same patience, so an outage ends the same way whether a pull or a lookup met it, on one engine or on a
cluster's driver. Docker Hub's pull limit for anonymous users is named as such, with the way out (log in, or
pull through a mirror), rather than waited for: it lasts hours.

Credentials are the docker CLI's (``~/.docker/config.json``, credential helpers), which docker-py hands the
engine with each pull; they never appear in a log line or an error, and neither do signed blob URLs
(:func:`.engine.scrub`). The engine makes an image whole or not at all, so an interrupted pull (Ctrl-C,
``kill -9``) leaves nothing half-made that a later run would use. A cancel closes the pull's connection at
once (:class:`_Events`): the engine stops pulling, and nobody waits for the next progress event.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import requests
from docker.errors import APIError, ImageNotFound
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt, stop_after_delay

from ...._log import logger
from ....errors import ImageUnavailable, Interrupted, RegistryError
from ....models.image import PulledImage, PullProgress
from ....signals import pause
from ..engine import describe, engine_errors, scrub
from .images import Reference, repo_digest
from .registry import ManifestError, Registries, unreachable

if TYPE_CHECKING:
    import docker

T = TypeVar("T")

#: Seconds a pull keeps retrying what a registry means as passing (a long rate limit included); the
#: ``PVISOR_HOST_REGISTRY_PATIENCE`` variable sets another.
PATIENCE = 600.0
PATIENCE_ENV = "PVISOR_HOST_REGISTRY_PATIENCE"


def patience() -> float:
    """:data:`PATIENCE`, or what ``$PVISOR_HOST_REGISTRY_PATIENCE`` says (seconds)."""
    try:
        return max(0.0, float(os.environ.get(PATIENCE_ENV) or PATIENCE))
    except ValueError:
        return PATIENCE


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
    """When each registry may be asked again: a 429 holds every pull from it, not only the refused one.
    ``clock`` and ``pause`` are the time it goes by (tests pass their own)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        pause: Callable[[float, threading.Event | None, str], None] = pause,
    ) -> None:
        self._lock = threading.Lock()
        self._until: dict[str, float] = {}
        self._clock = clock
        self._pause = pause

    def hold(self, registry: str, seconds: float) -> None:
        with self._lock:
            self._until[registry] = max(self._until.get(registry, 0.0), self._clock() + seconds)

    def wait(self, registry: str, cancel: threading.Event | None) -> None:
        """Block until the registry may be asked (a cancel ends the wait with :class:`Interrupted`)."""
        while True:
            with self._lock:
                left = self._until.get(registry, 0.0) - self._clock()
            if left <= 0:
                return
            self._pause(min(left, 1.0), cancel, "waiting for a rate-limited registry")


def classify(reference: str, text: str, status: int | None = None) -> Exception:
    """What a failed pull means: :class:`ImageUnavailable` (final), a passing failure, or RegistryError."""
    text = scrub(text)
    lowered = text.lower()
    if _hub(reference) and any(marker in lowered for marker in _RATE_LIMITED) and "limit" in lowered:
        return hub_limit(reference)
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
    why = unreachable(text)
    if why is not None:
        return unreachable_registry(reference, why)
    # The engine answers 500 for any failed pull: its status says nothing of the registry's, the text does.
    if (
        status in (429, 502, 503, 504)
        or _STATUS.search(lowered)
        or any(m in lowered for m in (*_RATE_LIMITED, *_PASSING))
    ):
        return _Passing(text)
    return RegistryError(f"pulling {reference} failed: {text[:300]}")


def unreachable_registry(reference: str, why: str) -> ImageUnavailable:
    """A registry whose name does not resolve, or that refuses connections: final at once (waiting would change
    nothing on a host without it), naming the image and the registry."""
    registry = Reference(reference).registry or "docker.io"
    return ImageUnavailable(
        "registry_unreachable",
        f"image {reference} is not here and its registry {registry} {why}",
        hint="check the name; a host without that registry runs only the images it has (docker load) or pulls them "
        "through --registry-mirror / --image-rewrite",
    )


def hub_limit(reference: str) -> RegistryError:
    """Docker Hub's pull limit: named, not waited for (it lasts hours)."""
    return RegistryError(
        f"pulling {reference}: Docker Hub's pull rate limit was reached (anonymous pulls: 10 an hour per address; "
        "100 with a free login)",
        hint="log in to Docker Hub (docker login), or pull through a mirror (--registry-mirror HOST)",
    )


def _hub(reference: str) -> bool:
    return Reference(reference).registry is None


def registry_fault(reference: str, exc: ManifestError) -> Exception:
    """What a registry's refusal to answer a lookup means, as :func:`classify` says of a pull's."""
    if exc.status == 404:
        return ImageUnavailable("image_not_found", f"image {reference} was not found in its registry")
    if exc.status in (401, 403):
        return ImageUnavailable(
            "registry_unauthorized",
            f"the registry refused to give {reference} (HTTP {exc.status})",
            hint="log in to it as the docker CLI would (docker login): its credentials are used",
        )
    if exc.status == 429 and _hub(reference) and (exc.retry_after is None or exc.retry_after > patience()):
        return hub_limit(reference)
    if exc.unreachable is not None:
        return unreachable_registry(reference, exc.unreachable)
    if not exc.answered or exc.status in (429, 500, 502, 503, 504):
        return _Passing(scrub(str(exc)), wait=exc.retry_after)
    return RegistryError(f"asking the registry for {reference} failed: {scrub(str(exc))[:300]}")


class Puller:
    """The pulls of one backend: what each registry has asked of us (:class:`Gates`), its credentials and
    tokens (:class:`Registries`)."""

    def __init__(self, client: docker.DockerClient, registries: Registries | None = None) -> None:
        self._client = client
        self.registries = registries or Registries()
        self.gates = Gates()

    def present(self, reference: str) -> PulledImage | None:
        """The image, when the engine has it already (nothing is pulled): by its own name, or as pulled from its
        source (a mirror's digest reference has no tag to name it by)."""
        for name in dict.fromkeys((reference, self.registries.mirrors.source(reference))):
            with engine_errors(f"inspect image {name}"):
                try:
                    image = self._client.images.get(name)
                except (ImageNotFound, APIError) as exc:
                    if isinstance(exc, ImageNotFound) or exc.status_code in (400, 404):
                        continue
                    raise
            return _pulled(reference, image.attrs, pulled=False, source=self.registries.mirrors.source(reference))
        return None

    def _name_as(self, source: str, reference: str) -> None:
        """Give the image pulled as ``source`` the dataset's name ``reference`` (a digest is no name to give),
        and drop the source's tag: the image is known by one name, the one it was asked for."""
        wanted = Reference(reference)
        if wanted.tag is None:
            return
        with engine_errors(f"name {source} as {reference}"):
            self._client.images.get(source).tag(wanted.repository, wanted.tag)
            if Reference(source).tag is not None:
                self._client.images.remove(source, noprune=True)

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
        if Reference(reference).digest is None and Reference(reference).tag is None:
            reference = f"{reference}:latest"
        source = self.registries.mirrors.source(reference)  # where it really comes from (a mirror, a rewrite)
        ref = Reference(source)
        started = time.monotonic()
        downloaded = self._patiently(
            f"pulling {reference}", source, lambda: self._once(ref, progress, cancel, started), cancel
        )
        if source != reference:
            self._name_as(source, reference)
        found = self.present(reference)
        if found is None:
            raise RegistryError(f"the engine pulled {source} but does not have it")
        return found.model_copy(
            update={"pulled": True, "downloaded": downloaded, "seconds": time.monotonic() - started}
        )

    def ask(self, reference: str, question: Callable[[], T], *, cancel: threading.Event | None = None) -> T:
        """``question`` put to ``reference``'s registry (a manifest, a configuration), with a pull's patience:
        passing failures retried, a rate limit waited out as the registry asks.

        Raises:
            ImageUnavailable: no such image, or the registry refuses our credentials.
            RegistryError: the registry stayed unreachable or failing, or its answer could not be read.
            Interrupted: ``cancel`` was set.
        """

        source = self.registries.mirrors.source(reference)  # the registry really asked (a mirror, a rewrite)

        def once() -> T:
            try:
                return question()
            except ManifestError as exc:
                fault = registry_fault(source, exc)
                if isinstance(fault, _Passing) and fault.wait is not None:
                    self.gates.hold(Reference(source).registry or "docker.io", fault.wait)
                raise fault from None

        return self._patiently(f"asking the registry for {reference}", source, once, cancel)

    def _patiently(self, what: str, reference: str, call: Callable[[], T], cancel: threading.Event | None) -> T:
        """``call`` retried while it fails in a passing way, for up to :data:`PATIENCE` seconds."""
        host = Reference(reference).registry or "docker.io"
        started = time.monotonic()
        limit = patience()
        retrying = Retrying(
            retry=retry_if_exception_type(_Passing),
            stop=stop_after_delay(limit) | stop_after_attempt(ATTEMPTS),
            wait=lambda state: min(self._backoff(state), max(0.0, limit - (time.monotonic() - started))),
            before_sleep=lambda state: self._before_retry(what, state),
            sleep=lambda seconds: pause(seconds, cancel, f"waiting to pull {reference} again"),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    if cancel is not None and cancel.is_set():
                        raise Interrupted(f"interrupted while {what}")
                    self.gates.wait(host, cancel)
                    return call()
        except _Passing as exc:
            waited = time.monotonic() - started
            raise RegistryError(f"{what} kept failing for {waited:.0f}s: {exc.text[:300]}") from None
        raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover

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
            for event in _Events(self._client, ref, cancel):
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
            error.wait = self.registries.retry_after(ref.text, resolved=True)
            if error.wait is not None:
                self.gates.hold(ref.registry or "docker.io", error.wait)
        return error

    def _before_retry(self, what: str, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, _Passing):
            wait = state.next_action.sleep if state.next_action else 0.0
            logger.warning(
                "{} failed ({}); attempt {} in {:.0f}s", what, exc.text[:120], state.attempt_number + 1, wait,
            )  # fmt: skip

    @staticmethod
    def _backoff(state: RetryCallState) -> float:
        """The registry's own ``Retry-After`` when it gave one; else exponential with full jitter."""
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, _Passing) and exc.wait is not None:
            return exc.wait
        return random.uniform(0, min(MAX_BACKOFF, 2.0**state.attempt_number))


class _Events:
    """The events of one pull through the engine, read on a thread of their own, so that a cancel is seen at
    once rather than at the next event (a throttled blob may send none for minutes): the pull's connection is
    then shut, which makes the engine stop the pull, and :class:`Interrupted` is raised."""

    _capture = threading.local()
    _hook_lock = threading.Lock()

    def __init__(self, client: docker.DockerClient, ref: Reference, cancel: threading.Event | None) -> None:
        self._api = client.api
        self._ref = ref
        self._cancel = cancel
        self._queue: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._response: requests.Response | None = None
        self._hook(self._api)

    @classmethod
    def _hook(cls, api: Any) -> None:
        """Keep each pull's response (its reading thread asked for it): the way to its connection."""

        def keep(response: requests.Response, *args: object, **kwargs: object) -> None:
            if getattr(cls._capture, "wanted", False):
                cls._capture.response = response

        with cls._hook_lock:
            if not getattr(api, "_pvisor_host_keeps_responses", False):
                api.hooks["response"].append(keep)
                api._pvisor_host_keeps_responses = True

    def __iter__(self) -> Iterator[dict[str, Any]]:
        reader = threading.Thread(target=self._read, name="pvisor-host-pull-events", daemon=True)
        reader.start()
        while True:
            try:
                kind, value = self._queue.get(timeout=0.2)
            except queue.Empty:
                kind, value = "", None
            if self._cancel is not None and self._cancel.is_set():
                self._shut()
                raise Interrupted(f"interrupted while pulling {self._ref.text}")
            if kind == "event":
                yield value
            elif kind == "end":
                return
            elif kind == "error":
                raise value

    def _read(self) -> None:
        self._capture.wanted = True
        try:
            events = self._api.pull(self._ref.repository, tag=self._ref.digest or self._ref.tag, stream=True,
                                    decode=True)  # fmt: skip
            self._response = getattr(self._capture, "response", None)
            if self._cancel is not None and self._cancel.is_set():
                self._shut()
            for event in events:
                self._queue.put(("event", event))
            self._queue.put(("end", None))
        except BaseException as exc:  # noqa: BLE001 - handed to the pulling thread, which raises it
            self._queue.put(("error", exc))
        finally:
            self._capture.wanted = False
            self._capture.response = None

    def _shut(self) -> None:
        """Shut the pull's connection (the engine then stops pulling; the reading thread ends)."""
        response = self._response
        if response is None:
            return
        connection = getattr(response.raw, "_connection", None) or getattr(response.raw, "connection", None)
        sock = getattr(connection, "sock", None)
        with contextlib.suppress(OSError):
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(Exception):
            response.close()


def _progress(reference: str, layers: dict[str, tuple[int, int | None]], seconds: float) -> PullProgress:
    totals = [total for _, total in layers.values()]
    total = None if None in totals else sum(t for t in totals if t is not None)
    done = sum(current for current, _ in layers.values())
    return PullProgress(ref=reference, done=done, total=total, seconds=seconds)


def _pulled(reference: str, attrs: dict[str, object], *, pulled: bool, source: str | None = None) -> PulledImage:
    digests = attrs.get("RepoDigests")
    digest = repo_digest(reference, digests) or (repo_digest(source, digests) if source else None)
    size = attrs.get("Size")
    return PulledImage(
        ref=reference, id=str(attrs["Id"]), digest=digest, size=size if isinstance(size, int) else 0, pulled=pulled
    )
