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
from ..models.record import PvisorRequest
from ..models.replay import PvisorPlan
from ..models.result import ReplayResult, ResultFailure, parse_result

#: Where pre-flight's throw-away pvisor directories go: memory, where the host has it (a dataset makes one per
#: trajectory file, and removing them from a disk costs more than pvisor's run).
_SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
#: The free memory there that makes it the scratch (a trajectory's prefix is copied once per run).
_SCRATCH_ROOM = 512 * 1024 * 1024
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


def prepare_only(request: PvisorRequest, trajectory: Path, run_id: str) -> tuple[ReplayResult, PvisorPlan]:
    """Run ``pvisor replay --prepare-only`` on the host at the request's boundary, with the request's own flags:
    as the sandbox will run it.

    Raises:
        PreflightRejected: pvisor reported a failure (its category and message are kept).
        ResultProtocolError: pvisor printed no v3 result.
        InfrastructureError: pvisor hung, could not be run, or failed for a reason of the host's.
    """
    result, manifest = _ask(request, trajectory, run_id)
    if result.failure is not None:
        raise PreflightRejected(result.failure.category, result.failure.message)
    turns = result.prefix_model_turns or request.after_step
    tool_calls = sum(len(batch) for batch in _tools(manifest))
    return result, PvisorPlan(after_step=request.after_step, prefix_model_turns=turns, tool_calls=tool_calls)


_BATCHES = re.compile(r"^requested after-step (\d+), trajectory has (\d+) complete batches$")
#: pvisor's failure categories that say something about the host (its disk, its processes), not the trajectory.
_HOST_CATEGORIES = frozenset({"executor_error", "internal_error", "workspace_error", "ambiguous_execution"})


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
    """Run ``pvisor replay --prepare-only`` at ``after_step`` on the host and say what it found: the trajectory's
    verdict at that boundary, shared by every item that replays the file to it, so no item's flags are passed
    (in prepare-only none of them changes what pvisor parses and selects: ``--max-steps`` is not checked, stale
    observations only when tools run, and the other values are checked on the host as pvisor checks them).

    Raises:
        ResultProtocolError: pvisor printed no v3 result.
        InfrastructureError: pvisor hung, could not be run, or failed for a reason of the host's.
    """
    bare = PvisorRequest(  # the boundary alone, no item's flags
        agent=agent, after_step=after_step, mode="prepare-only", max_steps=None, boundary_user_prompt=None,
        disable_thinking=False, allow_stale_observations=False, session_id=None,
    )  # fmt: skip
    result, manifest = _ask(bare, trajectory.absolute(), "probe")
    if result.failure is not None:
        found = _BATCHES.match(result.failure.message)
        return Probe(after_step=after_step, failure=result.failure, complete=int(found.group(2)) if found else None)
    return Probe(after_step=after_step, prefix_model_turns=result.prefix_model_turns, batches=_tools(manifest))


def _ask(request: PvisorRequest, trajectory: Path, run_id: str) -> tuple[ReplayResult, dict[str, Any]]:
    """pvisor's result and (when it wrote one) its ``manifest.json``, from a ``--prepare-only`` run in a scratch
    directory. A refusal of the request itself (clap's usage errors print no JSON) is a ``configuration_error``
    result; a pvisor that was killed, or failed for the host's reasons, is an infrastructure error.

    Raises:
        ResultProtocolError: pvisor printed no v3 result.
        InfrastructureError: see above.
    """
    with _scratch() as scratch:
        root = Path(scratch)
        done = _prepare_only(root, request, trajectory, run_id)
        if done.returncode < 0:
            raise InfrastructureError(f"the host's pvisor was killed by signal {-done.returncode} during pre-flight")
        if done.returncode != 0 and not done.stdout.strip():
            lines = done.stderr.decode(errors="replace").strip().splitlines()
            if not any(line.startswith(("error:", "Usage:")) for line in lines):
                detail = lines[0] if lines else f"exit {done.returncode}"
                raise InfrastructureError(f"the host's pvisor failed during pre-flight: {detail}")
            failure = ResultFailure(category="configuration_error", message=lines[0])
            return ReplayResult.model_validate({**_EARLY, "failure": failure.model_dump()}), {}
        _, result = parse_result(done.stdout)
        if result.failure is not None and result.failure.category in _HOST_CATEGORIES:
            raise InfrastructureError(
                f"the host's pvisor failed during pre-flight ({result.failure.category}): {result.failure.message}"
            )
        manifest = _read_json(root / "output" / run_id / "manifest.json") if result.failure is None else {}
    return result, manifest


#: The fields of pvisor's early-failure shape, for a refusal that printed no JSON.
_EARLY: dict[str, Any] = {
    "schema_version": "sandbox-playback.result/v3", "phase": None, "quality": None, "agent_status": "not_started",
    "run_id": None, "state_dir": None, "output_dir": None, "artifacts": [], "retryable": False,
}  # fmt: skip


def _tools(manifest: dict[str, Any]) -> list[list[str]]:
    """The tool names of each batch of pvisor's ``manifest.json``."""
    batches = manifest.get("batches")
    return [
        [str(call.get("name")) for call in batch.get("tool_calls", []) if isinstance(call, dict)]
        for batch in (batches if isinstance(batches, list) else [])
        if isinstance(batch, dict)
    ]


def _scratch() -> tempfile.TemporaryDirectory[str]:
    """A throw-away directory for one pvisor run: in memory where the host has room there (a dataset makes one
    per trajectory file, and removing them from a disk costs more than pvisor's run), else on disk."""
    try:
        roomy = _SCRATCH is not None and shutil.disk_usage(_SCRATCH).free >= _SCRATCH_ROOM
    except OSError:
        roomy = False
    return tempfile.TemporaryDirectory(prefix="pvisor-host-preflight-", dir=_SCRATCH if roomy else None)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _prepare_only(
    root: Path, request: PvisorRequest, trajectory: Path, run_id: str
) -> subprocess.CompletedProcess[bytes]:
    """``pvisor replay --prepare-only`` of ``request`` (the sandbox's command line, its paths under the scratch
    ``root``)."""
    with _RUNS_LOCK:
        _RUNS[0] += 1
    (root / "workspace").mkdir()
    argv = request.argv(
        trajectory=str(trajectory), workspace=str(root / "workspace"), state_dir=str(root / "state"),
        output_dir=str(root / "output"), run_id=run_id, prepare_only=True,
    )  # fmt: skip
    return _run([str(pvisor_binary()), *argv], timeout=_TIMEOUT, cwd=root)


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
