"""``--verify``: the task's verifier, run in the sandbox after pvisor, and what it found.

The entry shim runs pvisor with the ``--env`` values (and the model relay); when pvisor ends it writes pvisor's
exit code to ``logs/pvisor.json`` (:data:`PVISOR_DONE`), kills every process the replay left running, empties
``/logs/verifier`` and waits. The host then collects the workspace as pvisor left it (so the verifier's own
effects, an applied test patch or ``__pycache__``, are no part of the replay's changes), and says go
(:func:`go_ahead`: a file in the read-only input directory, which only the host can write). The shim then
``exec`` s the verifier in the workspace, without the ``--env`` values in its environment: the sandbox's exit
code is the verifier's, as the engine reports it, and the host bounds it by ``--verify-timeout`` (so no
``timeout`` binary is needed in the image). A reward the verifier writes to ``/logs/verifier/reward.txt`` (a
number) or ``reward.json`` (``{"reward": x}``), as Harbor's do, counts only when it ran to its end; the directory
is the staging's, collected as ``verifier/``. Everything read here is the sandbox's, read as such: capped,
parsed defensively, never followed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ....files.archive import Budget, harvest_tree
from ....models.record import COULD_NOT_RUN_CODES, Verification
from ..container import WaitOutcome
from .collect import copy_log, open_log
from .stage import VERIFY_GO, Staging, host_says

#: Where the shim writes pvisor's exit code once pvisor has ended (in the staging's logs directory).
PVISOR_DONE = "pvisor.json"
#: The end of the verifier's output kept in the record.
TAIL = 4096
#: The most of its output kept in ``logs/verify.log``.
LOG_LIMIT = 16 * 1024 * 1024


def pvisor_exit_code(marker: Path) -> int | None:
    """pvisor's exit code, as the shim wrote it (None: unreadable)."""
    handle, _ = open_log(marker)
    with handle:
        raw = handle.read(256)
    try:
        code = json.loads(raw).get("exit_code")
    except (ValueError, AttributeError):
        return None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def go_ahead(staging: Staging) -> None:
    """Let the waiting shim start the verifier (the workspace has been collected)."""
    host_says(staging, VERIFY_GO)


def read_verification(
    command: str, staging: Staging, out: Path, budget: Budget, outcome: WaitOutcome | None, seconds: float
) -> Verification:
    """What the verifier found: ``outcome`` is how the sandbox ended once it had the go-ahead, ``seconds`` after
    it (None: it never started, because pvisor's phase ended the sandbox first)."""
    if outcome is None:
        return Verification(command=command, passed=None, note="never ran: the sandbox ended during the replay")
    _, tail = copy_log(staging.logs_dir / "verify.log", out / "logs" / "verify.log", limit=LOG_LIMIT, tail=TAIL)
    ended = outcome.exit_code is not None and not outcome.timed_out and not outcome.oom_killed
    note = None
    if outcome.timed_out:
        note = "killed at --verify-timeout"
    elif outcome.oom_killed:
        note = "killed: the sandbox ran out of memory"
    reward, source = None, None
    if ended and staging.verifier_dir is not None:
        harvest_tree(staging.verifier_dir, out / "verifier", budget)
        reward, source = _reward(out / "verifier")
    passed: bool | None = ended and outcome.exit_code == 0
    if ended and outcome.exit_code in COULD_NOT_RUN_CODES:  # the shell could not run it: no verdict on the task
        passed, reward, source = None, None, None
        what = "not executable" if outcome.exit_code == 126 else "not found"
        note = f"the shell could not run it: {what} (exit {outcome.exit_code}; is it installed in the image?)"
    elif reward is None:
        reward, source = (1.0 if passed else 0.0), "exit_code"
    return Verification(
        command=command,
        exit_code=outcome.exit_code if ended else None,
        passed=passed,
        timed_out=outcome.timed_out,
        oom_killed=outcome.oom_killed,
        seconds=round(seconds, 3),
        output_tail=tail.decode("utf-8", errors="replace"),
        reward=reward,
        reward_source=source,
        note=note,
    )


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
