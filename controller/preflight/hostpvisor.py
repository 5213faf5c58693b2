"""The pinned pvisor on the host, used to validate a replay exactly as the sandbox will.

``pvisor-sandbox`` is a dependency of pvisor-host, so its static binaries sit next to our own console
script. Before any container starts, :func:`prepare_only` runs ``pvisor replay --prepare-only`` on the
host against a throw-away workspace: it parses the trajectory and selects the boundary with the same
code the sandbox runs, without executing a single tool.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .._version import PVISOR_VERSION
from ..errors import InfrastructureError, PreflightRejected, PrerequisiteError
from ..models.replay import PvisorPlan
from ..models.result import ReplayResult, ResultFailure, parse_result

#: Where pre-flight's throw-away pvisor directories go: memory, where the host has it (a dataset makes one per
#: trajectory file, and removing them from a disk costs more than pvisor's run).
_SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
#: Seconds the host's pvisor may take to parse a trajectory (it takes milliseconds).
_TIMEOUT = 120


_BINARY_LOCK = threading.Lock()


def pvisor_binary() -> Path:
    """The host's ``pvisor`` executable at the pinned version, found once (see :func:`_pvisor_binary`)."""
    with _BINARY_LOCK:
        return _pvisor_binary()


@cache
def _pvisor_binary() -> Path:
    """The host's ``pvisor`` executable at the pinned version.

    Raises:
        PrerequisiteError: pvisor is missing or reports another version.
        InfrastructureError: pvisor hung or could not be run.
    """
    candidates = [Path(sysconfig.get_path("scripts")) / "pvisor", Path(sys.executable).parent / "pvisor"]
    found = shutil.which("pvisor")
    if found:
        candidates.append(Path(found))
    for candidate in candidates:
        if candidate.is_file():
            break
    else:
        raise PrerequisiteError(
            "pvisor is not installed on the host", hint=f"pip install pvisor-sandbox=={PVISOR_VERSION}"
        )
    version = _run([str(candidate), "--version"], timeout=30).stdout.decode(errors="replace").strip()
    if version != f"pvisor {PVISOR_VERSION}":
        raise PrerequisiteError(
            f"{candidate} reports {version!r}; pvisor-host needs pvisor {PVISOR_VERSION}",
            hint=f"pip install pvisor-sandbox=={PVISOR_VERSION}",
        )
    return candidate


def prepare_only(
    *,
    agent: str,
    trajectory: Path,
    after_step: int,
    run_id: str,
    session_id: str | None = None,
    boundary_user_prompt: str | None = None,
) -> tuple[ReplayResult, PvisorPlan]:
    """Run ``pvisor replay --prepare-only`` on the host in a temporary directory.

    Raises:
        PreflightRejected: pvisor reported a failure (its category and message are kept).
        ResultProtocolError: pvisor printed no v3 result.
        InfrastructureError: pvisor hung or could not be run.
    """
    extra = ["--run-id", run_id]
    if session_id:
        extra += ["--session-id", session_id]
    if boundary_user_prompt:
        extra += ["--boundary-user-prompt", boundary_user_prompt]
    with tempfile.TemporaryDirectory(prefix="pvisor-host-preflight-") as scratch:
        root = Path(scratch)
        done = _prepare_only(root, agent, trajectory, after_step, extra)
        if done.returncode != 0 and not done.stdout.strip():
            # clap argument errors print usage text on stderr and no JSON.
            message = done.stderr.decode(errors="replace").strip().splitlines()
            raise PreflightRejected("configuration_error", message[0] if message else f"exit {done.returncode}")
        _, result = parse_result(done.stdout)
        if result.failure is not None:
            raise PreflightRejected(result.failure.category, result.failure.message)
        manifest = root / "output" / run_id / "manifest.json"
        tool_calls = _manifest_tool_calls(manifest)
    return result, PvisorPlan(
        after_step=after_step, prefix_model_turns=result.prefix_model_turns or after_step, tool_calls=tool_calls
    )


def _manifest_tool_calls(manifest: Path) -> int:
    try:
        boundary = json.loads(manifest.read_text(encoding="utf-8")).get("boundary", {})
        return int(boundary.get("tool_calls", 0))
    except (OSError, ValueError, TypeError):
        return 0


_BATCHES = re.compile(r"^requested after-step (\d+), trajectory has (\d+) complete batches$")


class Probe(BaseModel):
    """What one ``pvisor replay --prepare-only`` at one boundary said (see :mod:`.survey`)."""

    after_step: int
    failure: ResultFailure | None = None
    """pvisor's refusal (None: it accepted the boundary)."""
    complete: int | None = None
    """The trajectory's complete batches, when pvisor refused a boundary past the last one (its message says)."""
    prefix_model_turns: int | None = None
    batches: list[list[str]] | None = None
    """When accepted: the tool names of each batch up to the boundary (pvisor's ``manifest.json``)."""


def probe(agent: str, trajectory: Path, after_step: int) -> Probe:
    """Run ``pvisor replay --prepare-only`` at ``after_step`` on the host and say what it found.

    Raises:
        ResultProtocolError: pvisor printed no v3 result.
        InfrastructureError: pvisor hung or could not be run.
    """
    with tempfile.TemporaryDirectory(prefix="pvisor-host-probe-", dir=_SCRATCH) as scratch:
        root = Path(scratch)
        done = _prepare_only(root, agent, trajectory.absolute(), after_step, ["--run-id", "probe"])
        if done.returncode != 0 and not done.stdout.strip():
            message = done.stderr.decode(errors="replace").strip().splitlines()
            failure = ResultFailure(category="configuration_error", message=message[0] if message else "no result")
            return Probe(after_step=after_step, failure=failure)
        _, result = parse_result(done.stdout)
        if result.failure is not None:
            found = _BATCHES.match(result.failure.message)
            complete = int(found.group(2)) if found else None
            return Probe(after_step=after_step, failure=result.failure, complete=complete)
        manifest = _read_json(root / "output" / "probe" / "manifest.json")
    batches = [[str(call.get("name")) for call in batch.get("tool_calls", [])] for batch in manifest.get("batches", [])]
    return Probe(after_step=after_step, prefix_model_turns=result.prefix_model_turns, batches=batches)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _prepare_only(
    root: Path, agent: str, trajectory: Path, after_step: int, extra: list[str]
) -> subprocess.CompletedProcess[bytes]:
    """``pvisor replay --prepare-only`` with its workspace, state and output under the scratch ``root``."""
    with _RUNS_LOCK:
        _RUNS[0] += 1
    (root / "workspace").mkdir()
    command = [
        str(pvisor_binary()), "replay", "--agent", agent, "--trajectory", str(trajectory),
        "--after-step", str(after_step), "--prepare-only", "--workspace", str(root / "workspace"),
        "--state-dir", str(root / "state"), "--output-dir", str(root / "output"), *extra,
    ]  # fmt: skip
    return _run(command, timeout=_TIMEOUT, cwd=root)


_RUNS = [0]
_RUNS_LOCK = threading.Lock()


def runs() -> int:
    """How many pre-flight runs of the host's pvisor this process has made (``batch --plan`` says)."""
    with _RUNS_LOCK:
        return _RUNS[0]


def _run(command: list[str], *, timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    """Run the host's pvisor; a pvisor that hangs or cannot be started is an infrastructure error.

    Raises:
        InfrastructureError: pvisor did not finish within ``timeout`` seconds, or could not be executed.
    """
    try:
        return subprocess.run(command, capture_output=True, timeout=timeout, cwd=cwd, check=False)
    except subprocess.TimeoutExpired:
        raise InfrastructureError(
            f"the host's pvisor did not finish `{' '.join(command[1:3])}` within {timeout:.0f} s",
            hint="check the host's load, then run again",
        ) from None
    except OSError as exc:
        raise InfrastructureError(f"the host's pvisor {command[0]} cannot be run: {exc.strerror}") from None
