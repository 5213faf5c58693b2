"""Pulls without an engine: what a registry's failure means (final or passing), and how a rate limit holds
every pull from the same registry, not only the one that was refused."""

from __future__ import annotations

import threading

import pytest

from pvisor_host.backend.docker.engine import scrub
from pvisor_host.backend.docker.image.images import Reference
from pvisor_host.backend.docker.image.pull import ATTEMPTS, Gates, Puller, _Events, _Passing, classify, registry_fault
from pvisor_host.backend.docker.image.registry import ManifestError, Registries, parse_retry_after
from pvisor_host.errors import ExitCode, ImageUnavailable, Interrupted, RegistryError

REF = "127.0.0.1:5000/task/t1:v1"


@pytest.mark.parametrize(
    ("text", "status", "kind"),
    [
        (f"manifest for {REF} not found: manifest unknown: manifest unknown", 404, "image_not_found"),
        ("pull access denied for x, repository does not exist or may require 'docker login'", 404, "image_not_found"),
        ("unauthorized: authentication required", 500, "registry_unauthorized"),
        ("toomanyrequests: injected rate limit", 500, "passing"),
        ("received unexpected HTTP status: 500 Internal Server Error", 500, "passing"),
        ('Get "http://127.0.0.1:5000/v2/": dial tcp 127.0.0.1:5000: connect: connection refused', 500,
         "registry_unreachable"),
        ('Get "https://nosuch.invalid/v2/": dial tcp: lookup nosuch.invalid on 10.0.0.53:53: no such host', 500,
         "registry_unreachable"),
        ("read tcp 10.0.0.2:5123->10.0.0.9:5000: read: connection reset by peer", 500, "passing"),
        ("unexpected EOF", None, "passing"),
        ("invalid reference format", 400, "final"),
        # the engine's 500 says nothing of the registry: a certificate stays wrong, a digest is not a status
        ('Get "https://reg:5000/v2/": x509: certificate signed by unknown authority', 500, "final"),
        ('Get "https://reg:5000/v2/": http: server gave HTTP response to HTTPS client', 500, "final"),
        ("failed to register layer: sha256:50450c7d1e9f apply: invalid tar header", 500, "final"),
    ],
)  # fmt: skip
def test_what_a_failed_pull_means(text, status, kind):
    found = classify(REF, text, status)
    if kind == "passing":
        assert isinstance(found, _Passing)
    elif kind == "final":
        assert isinstance(found, RegistryError)
    else:
        assert isinstance(found, ImageUnavailable) and found.category == kind
        assert found.one_line().startswith(f"{'the registry' if kind == 'registry_unauthorized' else 'image ' + REF}")


class Time:
    """A clock that moves only when a wait asks it to."""

    def __init__(self) -> None:
        self.now = 100.0
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.now

    def pause(self, seconds: float, cancel: threading.Event | None, what: str) -> None:
        self.pauses.append(seconds)
        self.now += seconds
        if cancel is not None and cancel.is_set():
            raise Interrupted(f"interrupted while {what}")


def test_a_rate_limit_holds_every_pull_from_that_registry_for_as_long_as_it_said():
    clock = Time()
    gates = Gates(clock=clock, pause=clock.pause)
    gates.hold("127.0.0.1:5000", 2.5)
    gates.wait("ghcr.io", None)  # another registry: not held
    assert clock.pauses == []
    gates.wait("127.0.0.1:5000", None)
    assert clock.pauses == [1.0, 1.0, 0.5] and clock.now == 102.5  # as long as it said, in steps a cancel cuts
    gates.hold("127.0.0.1:5000", 1.0)
    gates.hold("127.0.0.1:5000", 0.5)  # a shorter hold does not shorten the longer one
    gates.wait("127.0.0.1:5000", None)
    assert clock.now == 103.5


def test_waiting_out_a_rate_limit_stops_at_a_cancel():
    clock, cancel = Time(), threading.Event()
    gates = Gates(clock=clock, pause=clock.pause)
    gates.hold("reg", 30)
    cancel.set()
    with pytest.raises(Interrupted):
        gates.wait("reg", cancel)
    assert clock.pauses == [1.0]


@pytest.mark.parametrize(("value", "seconds"), [("3", 3.0), (" 120 ", 120.0), (None, None), ("soon", None)])
def test_retry_after_in_seconds(value, seconds):
    assert parse_retry_after(value) == seconds


def test_retry_after_as_a_date_in_the_past_is_no_wait():
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0


# -- one outcome per fault, signed URLs, Docker Hub, credentials ------------------------------------------------


def test_a_signed_blob_url_in_an_error_keeps_its_place_not_its_signature():
    text = (
        'error pulling x: Get "https://prod.s3.amazonaws.com/blobs/sha256?X-Amz-Algorithm=AWS4&X-Amz-Credential=AKIA'
        '&X-Amz-Signature=deadbeef": net/http: TLS handshake timeout'
    )
    found = classify(REF, text)
    assert isinstance(found, _Passing)
    assert found.text == (
        'error pulling x: Get "https://prod.s3.amazonaws.com/blobs/sha256?…": net/http: TLS handshake timeout'
    )
    assert "AKIA" not in scrub(text) and "deadbeef" not in scrub(text)


def test_docker_hubs_pull_limit_is_named_at_once_with_the_way_out():
    found = classify("python:3.11", "toomanyrequests: You have reached your pull rate limit. You may increase ...")
    assert isinstance(found, RegistryError) and found.category == "registry_error"
    assert found.one_line() == (
        "pulling python:3.11: Docker Hub's pull rate limit was reached (anonymous pulls: 10 an hour per address; "
        "100 with a free login) (log in to Docker Hub (docker login), or pull through a mirror "
        "(--registry-mirror HOST))"
    )
    assert isinstance(classify(REF, "toomanyrequests: You have reached your pull rate limit"), _Passing)  # not Hub


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (ManifestError("r: not found in the registry", status=404), "image_not_found"),
        (ManifestError("r: the registry refused (HTTP 401: unauthorized)", status=401), "registry_unauthorized"),
        (ManifestError("reg: cannot reach the registry (ConnectionError)"), "passing"),
        (ManifestError("r: the registry answered HTTP 503", status=503), "passing"),
        (ManifestError("r: the registry answered HTTP 429", status=429, retry_after=3.0), "passing"),
        (ManifestError("r: the registry answered HTTP 400", status=400), "final"),
    ],
)  # fmt: skip
def test_a_registry_lookup_fails_as_a_pull_would(error, kind):
    found = registry_fault(REF, error)
    if kind == "passing":
        assert isinstance(found, _Passing) and found.wait == error.retry_after
    elif kind == "final":
        assert isinstance(found, RegistryError)
    else:
        assert isinstance(found, ImageUnavailable) and found.category == kind


def test_an_outage_of_a_registry_lookup_is_retried_then_ends_as_a_pulls_does(monkeypatch):
    monkeypatch.setattr(Puller, "_backoff", staticmethod(lambda state: 0.0))
    puller = Puller(client=None)  # type: ignore[arg-type]  # a lookup never touches the engine
    asked = []

    def outage() -> None:
        asked.append(1)
        raise ManifestError("127.0.0.1:5000: cannot reach the registry (ConnectionError)")

    with pytest.raises(RegistryError) as raised:
        puller.ask(REF, outage)
    assert len(asked) == ATTEMPTS
    assert raised.value.category == "registry_error" and raised.value.exit_code == ExitCode.INFRASTRUCTURE
    assert raised.value.message.startswith(f"asking the registry for {REF} kept failing for ")
    answers = iter([ManifestError("r: the registry answered HTTP 502", status=502), "manifest"])

    def blip() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert puller.ask(REF, blip) == "manifest"


def test_credentials_never_go_to_a_token_service_over_plain_http(monkeypatch):
    registries = Registries()
    monkeypatch.setattr(registries, "_credentials", lambda host: ("user", "secret"))
    sent = []

    class Answer:
        status_code = 200

        @staticmethod
        def json() -> dict:
            return {"token": "t"}

    def get(url, params=None, auth=None, timeout=None):
        sent.append((url, auth))
        return Answer()

    monkeypatch.setattr(registries._session, "get", get)
    scope = "repository:task:pull"
    assert registries._authorize("reg.example", 'Bearer realm="http://auth.example/token"', scope) == "Bearer t"
    assert registries._authorize("reg.example", 'Bearer realm="https://auth.example/token"', scope) == "Bearer t"
    assert sent == [("http://auth.example/token", None), ("https://auth.example/token", ("user", "secret"))]


class StalledEngine:
    """An engine whose pull sends one event, then nothing (a throttled blob)."""

    def __init__(self) -> None:
        self.api = self
        self.hooks: dict[str, list] = {"response": []}
        self.release = threading.Event()
        self.stalled_until_the_end = False

    def pull(self, repository, tag=None, stream=True, decode=True):
        yield {"status": "Downloading", "id": "l1", "progressDetail": {"current": 1, "total": 10}}
        self.release.wait(30)
        self.stalled_until_the_end = True  # the stall ended (released, or 30 s passed) before anything else


def test_a_cancel_ends_a_stalled_pull_at_once():
    engine = StalledEngine()
    cancel = threading.Event()
    seen = []
    stream = _Events(engine, Reference(REF), cancel)  # type: ignore[arg-type]

    def follow() -> None:
        for event in stream:
            seen.append(event["id"])
            cancel.set()  # Ctrl-C, while the engine sends nothing more

    with pytest.raises(Interrupted, match=f"interrupted while pulling {REF}"):
        follow()
    assert seen == ["l1"]
    assert not engine.stalled_until_the_end  # the cancel was seen at once, not after the stalled pull's end
    engine.release.set()
