"""pvisor's result protocol, ``sandbox-playback.result/v3``, as typed models.

pvisor prints exactly one JSON line on stdout, in one of two shapes: the full result (also written to
``result.json``) and the early-failure shape printed before any output directory exists (``phase``
and ``quality`` are ``null``; ``agent``, ``after_step``, the counters and ``metadata`` are absent).
Both parse into :class:`ReplayResult`. Any other ``schema_version`` is a :class:`ResultProtocolError`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import ResultProtocolError

RESULT_SCHEMA = "sandbox-playback.result/v3"

FailureCategory = Literal[
    "configuration_error",
    "trajectory_error",
    "unsupported_agent",
    "unsupported_version",
    "workspace_error",
    "executor_error",
    "ambiguous_execution",
    "continuation_error",
    "model_rate_limit",
    "model_internal_error",
    "model_connection_error",
    "internal_error",
]


class _Model(BaseModel):
    # Unknown keys inside v3 are kept, not rejected: pvisor may add fields without a version bump.
    model_config = ConfigDict(extra="allow", frozen=True)


class ResultAgent(_Model):
    """The agent pvisor probed (or, in prepare-only, the pinned one)."""

    type: str
    version: str
    entrypoint: str | None = None
    launch_source: Literal["explicit_entrypoint", "runtime_manifest", "prepare_only"] | str
    disallowed_tools: list[str] = []


class ResultArtifact(_Model):
    """One artifact pvisor wrote, with its path inside the sandbox."""

    role: str
    format: str
    path: str


class ResultFailure(_Model):
    """Why pvisor failed: its category (which fixes the exit code) and message."""

    category: FailureCategory | str
    message: str


class ReplayResult(_Model):
    """A parsed ``sandbox-playback.result/v3`` object (full or early-failure shape)."""

    schema_version: Literal["sandbox-playback.result/v3"]
    phase: Literal["prepared", "replayed", "continued"] | None
    quality: Literal["verified", "degraded"] | None
    agent_status: Literal["not_started", "completed", "max_steps", "failed"]
    run_id: str | None
    agent: ResultAgent | None = None
    after_step: int | None = None
    replayed_tool_calls: int | None = None
    prefix_model_turns: int | None = None
    continued_steps: int | None = None
    state_dir: str | None = None
    output_dir: str | None = None
    artifacts: list[ResultArtifact] = []
    failure: ResultFailure | None = None
    retryable: bool = False
    metadata: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        """pvisor reported success (``failure`` is null)."""
        return self.failure is None

    @property
    def early_failure(self) -> bool:
        """The failure happened before pvisor allocated its output directory (``phase`` is null)."""
        return self.phase is None


def last_json_line(stdout: bytes) -> bytes | None:
    """pvisor's result line: the last non-blank line of ``stdout`` (pvisor prints exactly one). When a tool
    wrote to the container's stdout without a final newline, the result is glued to the end of that output:
    then it is the shortest suffix of the line, from a ``{``, that is a JSON object."""
    for line in reversed(stdout.splitlines()):
        if line.strip():
            return _glued_object(line.strip())
    return None


def _glued_object(line: bytes, tries: int = 256) -> bytes:
    if line.startswith(b"{"):
        return line
    start = len(line)
    for _ in range(tries):
        start = line.rfind(b"{", 0, start)
        if start < 0:
            break
        try:
            if isinstance(json.loads(line[start:]), dict):
                return line[start:]
        except ValueError:
            continue
    return line


def parse_result(stdout: bytes) -> tuple[bytes, ReplayResult]:
    """Find pvisor's JSON line in ``stdout`` and parse it.

    Returns the raw line (as pvisor printed it) and the typed result.

    Raises:
        ResultProtocolError: no line, not a JSON object, an unknown schema version, or a v3 object
            that does not have the v3 shape.
    """
    line = last_json_line(stdout)
    if line is None:
        raise ResultProtocolError("pvisor printed no result on stdout")
    try:
        value = json.loads(line)
    except ValueError as exc:
        raise ResultProtocolError(f"pvisor's stdout is not JSON: {line[:200]!r}") from exc
    if not isinstance(value, dict):
        raise ResultProtocolError(f"pvisor's stdout is JSON but not an object: {line[:200]!r}")
    schema = value.get("schema_version")
    if schema != RESULT_SCHEMA:
        raise ResultProtocolError(
            f"pvisor printed a result with schema_version {schema!r}; this pvisor-host understands {RESULT_SCHEMA}",
            hint="use the pinned pvisor-sandbox 0.3.1 or upgrade pvisor-host",
        )
    try:
        return line, ReplayResult.model_validate(value)
    except ValidationError as exc:
        raise ResultProtocolError(f"pvisor's {RESULT_SCHEMA} result has an unexpected shape: {exc}") from exc
