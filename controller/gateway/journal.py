"""A run's model traffic, one JSON line per exchange (``model-traffic.jsonl``), and the token usage in it.

An entry holds the time, run id, method, path, the session header, sizes, status, latency, whether it was a
stream, the token usage the upstream reported, the retries before the answer and the time spent waiting for a
slot in the batch's limits, any cassette drift and, up to the body limit, the bodies. Never an authorization
header or a token: the journal is an artifact users share. :func:`totals` adds a journal up for the record.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..models.gateway import ModelPrice
from ..models.record import ModelTotals
from ..units import percentile

if TYPE_CHECKING:
    from .upstream import Tries

#: Bytes from the end of an answer kept to find its token usage (streams report it in their last events).
USAGE_TAIL = 256 * 1024


class Exchange:
    """One exchange being journaled: what came in, then what went back."""

    def __init__(self, run_id: str, method: str, path: str, session: str | None, body: bytes, limit: int) -> None:
        self.limit = limit
        self.body = body
        self.call: int | None = None
        """The call's number in its run (1-based), when the run has a tape."""
        self.tokens = 0
        """Tokens the answer reported (in and out), once finished."""
        self.entry: dict[str, Any] = {
            "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "run_id": run_id,
            "method": method,
            "path": path,
            "session_id": session,
            "request_bytes": len(body),
        }
        if limit:
            self.entry["request_body"] = body[:limit].decode("utf-8", errors="replace")
            self.entry["request_body_truncated"] = len(body) > limit
        self._head = bytearray()
        self._tail = bytearray()
        self._whole: bytes | None = None
        self.sent = 0

    def answered(self, chunk: bytes, *, whole: bool = False) -> None:
        """Part of the answer went to the sandbox (``whole``: all of it, whose usage is read from all of it)."""
        if whole:
            self._whole = chunk
        self.sent += len(chunk)
        if len(self._head) < self.limit:
            self._head += chunk[: self.limit - len(self._head)]
        self._tail += chunk
        if len(self._tail) > USAGE_TAIL:
            del self._tail[: len(self._tail) - USAGE_TAIL]

    def tried(self, tries: Tries) -> None:
        """How the call went before its answer: its retries, and the time it waited for slots."""
        self.entry["retries"] = tries.retries
        self.entry["waited_ms"] = round(tries.waited * 1000, 1)

    def finish(self, status: int, *, stream: bool, latency: float, error: str | None = None) -> dict[str, Any]:
        """The entry, complete."""
        found = usage(self._whole if self._whole is not None else bytes(self._tail))
        self.tokens = tokens(found).total
        self.entry |= {
            "status": status,
            "stream": stream,
            "response_bytes": self.sent,
            "latency_ms": round(latency * 1000, 1),
            "usage": found,
        }
        if error is not None:
            self.entry["error"] = error
        if self.limit:
            self.entry["response_body"] = self._head.decode("utf-8", errors="replace")
            self.entry["response_body_truncated"] = self.sent > len(self._head)
        return self.entry


def append(journal: Path, entry: dict[str, Any]) -> None:
    """Add one entry to a run's journal."""
    with journal.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry, ensure_ascii=False) + "\n")


def usage(data: bytes) -> dict[str, Any] | None:
    """Token usage from a JSON body or the last SSE events that report it."""
    text = data.decode("utf-8", errors="replace")
    candidates = [text]
    candidates += [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    for candidate in reversed(candidates):
        if '"usage"' not in candidate:
            continue  # nothing to find there: not worth a parse
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if not isinstance(value, dict):
            continue
        found = value.get("usage") or (value.get("response") or {}).get("usage")
        if isinstance(found, dict):
            return found
    return None


class Tokens:
    """A usage report's tokens, whatever API reported it (chat completions, Responses, Anthropic): input
    counts the cached tokens too, as OpenAI's APIs count them (Anthropic's reports them beside its input)."""

    def __init__(self, found: dict[str, Any] | None) -> None:
        found = found or {}
        details = found.get("prompt_tokens_details") or found.get("input_tokens_details") or {}
        self.input = _count(found.get("prompt_tokens", found.get("input_tokens")))
        self.output = _count(found.get("completion_tokens", found.get("output_tokens")))
        self.cached = _count(details.get("cached_tokens"))
        if "cache_read_input_tokens" in found or "cache_creation_input_tokens" in found:  # Anthropic's shape
            self.cached = _count(found.get("cache_read_input_tokens"))
            self.input += self.cached + _count(found.get("cache_creation_input_tokens"))
        self.total = _count(found.get("total_tokens")) or self.input + self.output


def tokens(found: dict[str, Any] | None) -> Tokens:
    """The tokens of a usage report (none: all zero)."""
    return Tokens(found)


def _count(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and value >= 0 else 0


def totals(journal: Path, price: ModelPrice | None = None) -> ModelTotals:
    """A run's model figures, added up from its journal (see :class:`~pvisor_host.models.record.ModelTotals`)."""
    entries = [json.loads(line) for line in journal.read_text(encoding="utf-8").splitlines() if line.strip()]
    entries = [e for e in entries if e.get("path", "").split("?")[0].endswith(("/chat/completions", "/responses"))]
    counted = [tokens(e.get("usage")) for e in entries]
    latencies = sorted(float(e.get("latency_ms", 0)) for e in entries)
    drift = next((e["drift"] for e in entries if e.get("drift")), None)
    found = ModelTotals(
        calls=len(entries),
        input_tokens=sum(t.input for t in counted),
        output_tokens=sum(t.output for t in counted),
        cached_tokens=sum(t.cached for t in counted),
        retries=sum(len(e.get("retries") or []) for e in entries),
        errors=sum(1 for e in entries if int(e.get("status", 0)) >= 400 or e.get("error")),
        waited_seconds=round(sum(float(e.get("waited_ms") or 0) for e in entries) / 1000, 3),
        latency_p50_ms=percentile(latencies, 0.5) if latencies else None,
        latency_p90_ms=percentile(latencies, 0.9) if latencies else None,
        drift=drift,
    )
    if price is not None:
        found.cost = round(
            price.cost(input_tokens=found.input_tokens, output_tokens=found.output_tokens,
                       cached_tokens=found.cached_tokens), 6)  # fmt: skip
    return found
