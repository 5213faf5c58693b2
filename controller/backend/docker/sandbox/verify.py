"""``--verify``: what the task's verifier, run in the sandbox after pvisor, found.

The entry shim runs the command (``/pvisor-host/input/verify.sh``) in the workspace once pvisor has ended,
whatever pvisor's outcome, with coreutils' ``timeout`` at ``--verify-timeout`` where the image has it (the
container's wall limit bounds it where it does not). It writes the verifier's output to ``logs/verify.log`` and
its exit code and clock to ``logs/verify.json``, both files of the host's staging that the sandbox may write but
not replace. A verifier may also leave a reward in ``/logs/verifier/reward.txt`` (a number) or
``reward.json`` (``{"reward": x}``), as Harbor's do; the directory is the staging's, collected as
``verifier/``. Everything read here is the sandbox's and read as such: capped, parsed defensively.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ....models.record import Verification
from .collect import open_log
from .stage import Staging

#: The end of the verifier's output kept in the record.
TAIL = 4096
#: The most of its output kept in ``logs/verify.log``.
LOG_LIMIT = 16 * 1024 * 1024
#: ``timeout``'s exit codes for a command it ended (TERM, then KILL after its grace).
_TIMED_OUT = (124, 137)


def read_verification(command: str, staging: Staging, out: Path, *, timed_out: bool) -> Verification:
    """The verifier's verification, from what the shim and the verifier left (``timed_out``: the container ran
    past its wall limit, so the verifier may never have finished)."""
    output = _copy_log(staging.logs_dir / "verify.log", out / "logs" / "verify.log")
    facts = _facts(staging.logs_dir / "verify.json")
    code = facts.get("exit_code")
    exit_code = code if isinstance(code, int) else None
    started, ended = facts.get("started"), facts.get("ended")
    seconds = round(ended - started, 3) if isinstance(started, int | float) and isinstance(ended, int | float) else None
    killed = timed_out and exit_code is None or exit_code in _TIMED_OUT
    passed = exit_code == 0 and not killed
    reward, source = _reward(out / "verifier")
    if reward is None:
        reward, source = (1.0 if passed else 0.0), "exit_code"
    return Verification(
        command=command,
        exit_code=exit_code,
        passed=passed,
        timed_out=killed,
        seconds=seconds,
        output_tail=output[-TAIL:].decode("utf-8", errors="replace"),
        reward=reward,
        reward_source=source,
    )


def _copy_log(source: Path, target: Path) -> bytes:
    """Copy the verifier's log (cut at :data:`LOG_LIMIT`); return its end."""
    handle, size = open_log(source)
    with handle, target.open("wb") as sink:
        left = LOG_LIMIT
        while left > 0 and (chunk := handle.read(min(left, 2**20))):
            sink.write(chunk)
            left -= len(chunk)
        handle.seek(max(0, min(size, LOG_LIMIT) - TAIL))
        return handle.read(TAIL)


def _facts(path: Path) -> dict[str, object]:
    handle, _ = open_log(path)
    with handle:
        raw = handle.read(4096)
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _reward(verifier: Path) -> tuple[float | None, str | None]:
    """A reward the verifier wrote (harvested, so never a link): reward.txt's number, else reward.json's."""
    text = verifier / "reward.txt"
    if text.is_file() and not text.is_symlink():
        number = _number(text.read_bytes()[:256].decode("utf-8", errors="replace").strip())
        if number is not None:
            return number, "reward.txt"
    document = verifier / "reward.json"
    if document.is_file() and not document.is_symlink():
        try:
            value = json.loads(document.read_bytes()[:65536])
        except ValueError:
            value = None
        if isinstance(value, dict):
            value = value.get("reward")
        number = _number(value)
        if number is not None:
            return number, "reward.json"
    return None, None


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
