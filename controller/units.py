"""Human-friendly durations (``90s``, ``5m``, ``1h30m``) and sizes (``512m``, ``2GiB``)."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

from .errors import UsageError

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)", re.IGNORECASE)
_SIZE_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}

#: What :func:`parse_duration` and :func:`parse_size` accept, as JSON Schema (a manifest's durations and sizes).
DURATION_JSON_SCHEMA = {
    "anyOf": [
        {"type": "number", "exclusiveMinimum": 0},
        {
            "type": "string",
            "pattern": r"^\s*(\d+(\.\d+)?|(\d+(\.\d+)?([mM][sS]|[sSmMhHdD]))+)\s*$",
            "examples": ["90s", "5m", "1h30m"],
        },
    ]
}
SIZE_JSON_SCHEMA = {
    "anyOf": [
        {"type": "integer", "exclusiveMinimum": 0},
        {
            "type": "string",
            "pattern": r"^\s*\d+(\.\d+)?\s*[kKmMgGtT]?[iI]?[bB]?\s*$",
            "examples": ["512m", "2g", "1GiB"],
        },
    ]
}


def parse_duration(text: str, *, flag: str | None = None, zero: bool = False) -> float:
    """Parse ``30``, ``30s``, ``5m``, ``1h30m`` or ``250ms`` into seconds (> 0; or 0 too, with ``zero``).

    A bare number means seconds.
    """
    where = f"{flag}: " if flag else ""
    value = text.strip().lower()
    if re.fullmatch(r"\d+(?:\.\d+)?", value):
        seconds = float(value)
    else:
        parts = _DURATION_PART.findall(value)
        if not parts or "".join(n + u for n, u in parts) != value:
            raise UsageError(
                f"{where}{text!r} is not a duration",
                hint="use a number of seconds or units like 90s, 5m, 1h30m",
            )
        seconds = sum(float(n) * _DURATION_SECONDS[u] for n, u in parts)
    if seconds < 0 or (seconds == 0 and not zero):
        raise UsageError(f"{where}{text!r} must be greater than zero")
    return seconds


def parse_size(text: str, *, flag: str | None = None) -> int:
    """Parse ``1073741824``, ``512m``, ``512MiB``, ``2g`` or ``2GB`` into bytes (> 0).

    Units are binary (k = 1024), as Docker's own ``--memory`` flag reads them.
    """
    where = f"{flag}: " if flag else ""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise UsageError(f"{where}{text!r} is not a size", hint="use bytes or units like 512m, 2g, 1GiB")
    number, unit, _ = match.groups()
    size = int(float(number) * 1024 ** _SIZE_POWER[unit.lower()])
    if size <= 0:
        raise UsageError(f"{where}{text!r} must be greater than zero")
    return size


def format_size(size: int) -> str:
    """Render bytes as a short binary-unit string (``1.5 GiB``)."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    """Render seconds compactly (``850ms``, ``12.3s``, ``4m05s``)."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}m{rest:02d}s"


def key_values(text: str, keys: dict[str, str], expected: str) -> dict[str, str]:
    """A model's fields from its compact form on the command line, ``key=value,key=value`` (``keys``: each key
    the form may say → the field it sets); ``ValueError`` names the first part that is not one of them."""
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in keys:
            raise ValueError(f"{part!r}: expected {expected}")
        fields[keys[key.strip()]] = value.strip()
    return fields


def shortlist(items: list[str], shown: int = 3) -> str:
    """``a, b, c and 4 more``: the first ``shown`` of ``items``, and how many are left out."""
    left = len(items) - shown
    return ", ".join(items[:shown]) + (f" and {left} more" if left > 0 else "")


def short_size(size: int) -> str:
    """Bytes as the shortest string :func:`parse_size` reads back exactly (``4g``, ``64k``, ``1500``)."""
    for unit, power in (("t", 4), ("g", 3), ("m", 2), ("k", 1)):
        if size % 1024**power == 0:
            return f"{size // 1024**power}{unit}"
    return str(size)


def short_duration(seconds: float) -> str:
    """Seconds as the shortest string :func:`parse_duration` reads back exactly (``2h``, ``5m``, ``1h30m``)."""
    if seconds != int(seconds):
        return f"{seconds:g}s"
    left, parts = int(seconds), []
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, left = divmod(left, length)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts) or "0s"


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def parse_retry_after(value: str | None) -> float | None:
    """An HTTP ``Retry-After`` as seconds: a number of seconds (a decimal one too, as some model APIs send), or
    an HTTP date; None when there is none or it cannot be read."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def host_slots(per_cpu: int, memory: int, *, most: int | None = None) -> int:
    """Sandboxes this host runs at once: ``per_cpu`` per CPU, no more than its memory holds at ``memory`` bytes
    each (at least one; at most ``most``)."""
    import os

    cpus = os.cpu_count() or 1
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 * 1024**3
    slots = max(1, min(per_cpu * cpus, total // max(memory, 1)))
    return min(slots, most) if most is not None else slots
