"""``fork``: ``replay --fork 8`` against 8 independent replays of the same trajectory (a ``batch`` of 8 items, 8
workers), interleaved, each continued against the stub model under the fork runtime (``runsc-fork``). The
trajectory's prefix is four tool calls of fixed work, about 10 s of one idle core in all. Per pair: wall time,
and the machine's core-seconds (every process's, the engine's and the sandboxes' included, from ``/proc/stat``).
Target (issue 40): the forks take at most 0.35x the core-seconds and 0.5x the wall of the 8 replays.

Then the checkpoint's time and size and a fork's start from it, from the records, for Claude Code and Codex.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import CLI, ROOT, median, scaled, spread

sys.path.insert(0, str(ROOT / "tests"))
from modelserver import StubServer  # noqa: E402
from trajgen import Call, Turn, claude_session, codex_files_session, write_jsonl  # noqa: E402

FORKS = 8
KEY = "PVH_BENCH_MODEL_KEY"
#: The prefix's tool calls: four calls that each do a fixed amount of work (as a test run or a build does, not a
#: wait), about 2.5 s of one idle core each here (:func:`_work`), then write a line.
CALLS = 4


#: Counts, inside a sandbox of the image under the fork runtime, the ``sum(range(10_000))`` one core does in 0.5 s.
_PROBE = (
    "import time\nstarted, rounds = time.process_time(), 0\nwhile time.process_time() - started < 0.5:\n"
    "    sum(range(10_000))\n    rounds += 1\nprint(rounds)"
)


def _work(tag: str) -> int:
    """Iterations of ``sum(range(10_000))`` one idle core does in 2.5 s in the image's sandbox (its Python, gVisor)."""
    import docker

    said = docker.from_env().containers.run(
        tag,
        ["python3", "-c", _PROBE],
        entrypoint=[],
        runtime="runsc-fork",
        network_mode="none",
        remove=True,
        labels={"pvisor-host.bench": "fork"},
    )
    return int(said.decode().split()[-1]) * 5


def fork(work: Path, tag: str) -> dict[str, Any]:
    """See the module docstring; without the fork runtime, what is missing (the other sections' figures stand)."""
    import docker

    info = docker.from_env().info()
    if "runsc-fork" not in (info.get("Runtimes") or {}) or not info.get("ExperimentalBuild"):
        return {"skipped": "the fork runtime (runsc-fork, experimental mode) is not on this engine: make engine-runsc"}
    rounds = scaled(3, 2)
    trajectory = write_jsonl(work / "claude.jsonl", _claude(_work(tag)))
    manifest = work / "eight.jsonl"
    manifest.write_text("".join(json.dumps({"id": f"r{n}", "trajectory": str(trajectory), "after_step": 4}) + "\n"
                                for n in range(FORKS)))  # fmt: skip
    pairs = []
    with StubServer(command="echo continued >> continued.txt") as stub:
        model = ["--model-base-url", stub.base_url, "--model", "stub-model", "--model-api-key-env", KEY,
                 "--max-steps", "8", "--runtime", "runsc-fork", "--agent", "claude-code"]  # fmt: skip
        for n in range(rounds):
            forked = _measured([CLI, "replay", "--trajectory", str(trajectory), "--after-step", "4", "--fork",
                                str(FORKS), "--out", str(work / f"forked{n}"), *model])  # fmt: skip
            alone = _measured([CLI, "batch", str(manifest), "--workers", str(FORKS), "--mode", "continue", "--out",
                               str(work / f"eight{n}"), *model])  # fmt: skip
            pairs.append((forked, alone))
    wall = [f["wall"] / a["wall"] for f, a in pairs]
    cores = [f["core_seconds"] / a["core_seconds"] for f, a in pairs]
    figures = {
        "forks": FORKS,
        "pairs": rounds,
        "fork_wall_s": round(median([f["wall"] for f, _ in pairs]), 2),
        "replays_wall_s": round(median([a["wall"] for _, a in pairs]), 2),
        "fork_core_s": round(median([f["core_seconds"] for f, _ in pairs]), 2),
        "replays_core_s": round(median([a["core_seconds"] for _, a in pairs]), 2),
        "wall_ratio": round(median(wall), 3),
        "wall_ratio_spread": spread(wall),
        "core_ratio": round(median(cores), 3),
        "core_ratio_spread": spread(cores),
        "targets": {"core_ratio": 0.35, "wall_ratio": 0.5},
    }
    prefix = [json.loads((work / f"forked{n}" / "prefix" / "record.json").read_text()) for n in range(rounds)]
    figures["prefix_run_s"] = round(median([r["timings"]["run"] for r in prefix]), 2)
    figures["claude-code"] = _checkpoint_figures(work / "forked0")
    figures["codex"] = _codex(work)
    return figures


def _measured(command: list[str]) -> dict[str, float]:
    """Wall seconds and the machine's busy core-seconds while ``command`` ran."""
    before, started = _busy(), time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, KEY: "sk-bench"})
    wall, busy = time.monotonic() - started, _busy() - before
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:3])} ... exited {done.returncode}: {done.stderr[-1500:]}")
    return {"wall": wall, "core_seconds": busy}


def _busy() -> float:
    """Seconds the machine's cores have been busy (``/proc/stat``: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _checkpoint_figures(out: Path) -> dict[str, Any]:
    prefix = json.loads((out / "prefix" / "record.json").read_text())["fork"]
    restores = [json.loads(p.read_text())["fork"]["restore_seconds"] for p in sorted(out.glob("fork-*/record.json"))]
    started = [r for r in restores if r is not None]
    return {
        "checkpoint_s": prefix["checkpoint_seconds"],
        "checkpoint_mib": round((prefix["checkpoint_bytes"] or 0) / 2**20, 1),
        "restore_s_median": round(median(started), 3) if started else None,
        "restored": f"{len(started)} of {len(restores)}",
    }


def _codex(work: Path) -> dict[str, Any]:
    trajectory = write_jsonl(work / "codex.jsonl", codex_files_session("/workspace"))
    with StubServer(command="echo continued >> continued.txt") as stub:
        _measured([CLI, "replay", "--agent", "codex", "--trajectory", str(trajectory), "--after-step", "3", "--fork",
                   "3", "--out", str(work / "codex"), "--model-base-url", stub.base_url, "--model", "stub-model",
                   "--model-api-key-env", KEY, "--max-steps", "6", "--runtime", "runsc-fork"])  # fmt: skip
    return _checkpoint_figures(work / "codex")


def _claude(rounds: int) -> list[dict[str, Any]]:
    command = "python3 -c 'for _ in range({}): sum(range(10_000))' && echo {} >> steps.txt"
    turns = [Turn([Call("Bash", {"command": command.format(rounds, n), "description": f"step {n}"}, "")])
             for n in range(1, CALLS + 1)]  # fmt: skip
    return claude_session("Compute four times.", [*turns, Turn(text="Done.")])
