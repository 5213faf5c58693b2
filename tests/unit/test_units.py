import pytest

from pvisor_host.errors import UsageError
from pvisor_host.units import format_duration, format_size, parse_duration, parse_size, short_duration, short_size


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 30.0),
        ("90s", 90.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("250ms", 0.25),
        ("1.5h", 5400.0),
        ("2d", 172800.0),
    ],
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "5 minutes", "-5s", "0", "0s", "5x", "m5", "1h 30m"])
def test_bad_durations_name_the_flag(text):
    with pytest.raises(UsageError, match="--timeout"):
        parse_duration(text, flag="--timeout")


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1024", 1024),
        ("512m", 512 * 2**20),
        ("512MiB", 512 * 2**20),
        ("2g", 2 * 2**30),
        ("2GB", 2 * 2**30),
        ("1k", 1024),
    ],
)
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "big", "-1g", "0", "1q", "g"])
def test_bad_sizes(text):
    with pytest.raises(UsageError, match="--memory"):
        parse_size(text, flag="--memory")


def test_formatting():
    assert format_size(512) == "512 B"
    assert format_size(3 * 2**30) == "3.0 GiB"
    assert format_duration(0.25) == "250ms"
    assert format_duration(12.34) == "12.3s"
    assert format_duration(245) == "4m05s"


@pytest.mark.parametrize(
    ("size", "text"),
    [(4 * 1024**3, "4g"), (64 * 1024, "64k"), (1536 * 1024**2, "1536m"), (1500, "1500"), (2**40, "1t")],
)
def test_a_size_is_shown_as_the_shortest_string_that_reads_back(size, text):
    assert short_size(size) == text and parse_size(text) == size


@pytest.mark.parametrize(("seconds", "text"), [(7200, "2h"), (300, "5m"), (5400, "1h30m"), (5, "5s"), (0.25, "0.25s")])
def test_a_duration_is_shown_as_the_shortest_string_that_reads_back(seconds, text):
    assert short_duration(seconds) == text and parse_duration(text) == seconds


def test_retry_after_is_read_once_for_registries_and_model_apis():
    from pvisor_host.gateway.upstream import retry_after
    from pvisor_host.units import parse_retry_after

    assert parse_retry_after("1.5") == 1.5 and parse_retry_after("-3") == 0.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0 and parse_retry_after("soon") is None
    assert retry_after({"retry-after-ms": "250", "Retry-After": "9"}) == 0.25
    assert retry_after({"Retry-After": "2"}) == 2.0 and retry_after({}) is None
