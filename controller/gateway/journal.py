"""A run's model traffic, one JSON line per exchange (``model-traffic.jsonl``), and the token usage in it.

An entry holds the time, run id, method, path, the session header, sizes, status, latency, whether it was a
stream, the token usage the upstream reported and, up to the body limit, the bodies. Never an authorization
header or a token: the journal is an artifact users share.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

#: Bytes from the end of an answer kept to find its token usage (streams report it in their last events).
USAGE_TAIL = 256 * 1024


class Exchange:
    """One exchange being journaled: what came in, then what went back."""

    def __init__(self, run_id: str, method: str, path: str, session: str | None, body: bytes, limit: int) -> None:
        self.limit = limit
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
        self.sent = 0

    def answered(self, chunk: bytes) -> None:
        """Part of the answer went to the sandbox."""
        self.sent += len(chunk)
        if len(self._head) < self.limit:
            self._head += chunk[: self.limit - len(self._head)]
        self._tail += chunk
        if len(self._tail) > USAGE_TAIL:
            del self._tail[: len(self._tail) - USAGE_TAIL]

    def finish(self, status: int, *, stream: bool, latency: float, error: str | None = None) -> dict[str, Any]:
        """The entry, complete."""
        self.entry |= {
            "status": status,
            "stream": stream,
            "response_bytes": self.sent,
            "latency_ms": round(latency * 1000, 1),
            "usage": usage(bytes(self._tail)),
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
