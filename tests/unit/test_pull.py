"""Pulls without an engine: what a registry's failure means (final or passing), and how a rate limit holds
every pull from the same registry, not only the one that was refused."""

from __future__ import annotations

import threading
import time

import pytest

from pvisor_host.backend.docker.pull import Gates, _Passing, classify
from pvisor_host.backend.docker.registry import parse_retry_after
from pvisor_host.errors import ImageUnavailable, Interrupted, RegistryError

REF = "127.0.0.1:5000/task/t1:v1"


@pytest.mark.parametrize(
    ("text", "status", "kind"),
    [
        (f"manifest for {REF} not found: manifest unknown: manifest unknown", 404, "image_not_found"),
        ("pull access denied for x, repository does not exist or may require 'docker login'", 404, "image_not_found"),
        ("unauthorized: authentication required", 500, "registry_unauthorized"),
        ("toomanyrequests: injected rate limit", 500, "passing"),
        ("received unexpected HTTP status: 500 Internal Server Error", 500, "passing"),
        ('Get "http://127.0.0.1:5000/v2/": dial tcp 127.0.0.1:5000: connect: connection refused', 500, "passing"),
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
        assert found.one_line().startswith(f"{'image ' + REF if kind == 'image_not_found' else 'the registry'}")


def test_a_rate_limit_holds_every_pull_from_that_registry_for_as_long_as_it_said():
    gates = Gates()
    gates.hold("127.0.0.1:5000", 0.5)
    started = time.monotonic()
    waited: list[float] = []
    pulls = [threading.Thread(target=lambda: (gates.wait("127.0.0.1:5000", None), waited.append(time.monotonic())))
             for _ in range(3)]  # fmt: skip
    for pull in pulls:
        pull.start()
    gates.wait("ghcr.io", None)  # another registry: not held
    assert time.monotonic() - started < 0.2
    for pull in pulls:
        pull.join()
    assert len(waited) == 3 and min(waited) - started >= 0.45


def test_waiting_out_a_rate_limit_stops_at_a_cancel():
    gates, cancel = Gates(), threading.Event()
    gates.hold("reg", 30)
    threading.Timer(0.2, cancel.set).start()
    with pytest.raises(Interrupted):
        gates.wait("reg", cancel)


@pytest.mark.parametrize(("value", "seconds"), [("3", 3.0), (" 120 ", 120.0), (None, None), ("soon", None)])
def test_retry_after_in_seconds(value, seconds):
    assert parse_retry_after(value) == seconds


def test_retry_after_as_a_date_in_the_past_is_no_wait():
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
