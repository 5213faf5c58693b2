"""``compare`` on two real batches (real engine, image, pvisor): one item changed to fail, one to diverge."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

from conftest import run_cli
from trajgen import Call, Turn, claude_session, write_jsonl

DIFFERENT = "an observation the fresh run will not reproduce"


def session(second_command: str = "true", second_result: str = "") -> list[dict]:
    """Two tool batches: ``true`` (no output, recorded as none), then the given command and recording."""
    return claude_session(
        "Compare.",
        [
            Turn([Call("Bash", {"command": "true"}, result="")]),
            Turn([Call("Bash", {"command": second_command, "timeout": 600000}, result=second_result)]),
        ],
    )


def batch(
    root: Path, name: str, items: dict[str, tuple[list[dict], dict]], *args: str | Path, env: dict | None = None
) -> Path:
    lines = []
    (root / name).mkdir()
    for item_id, (events, extra) in items.items():
        trajectory = write_jsonl(root / name / f"{item_id}.jsonl", events)
        lines.append(json.dumps({"id": item_id, "trajectory": str(trajectory), "after_step": 2, **extra}))
    manifest = root / f"{name}.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    out = root / f"{name}-out"
    done = run_cli("batch", manifest, "--agent", "claude-code", "--mode", "replay-only", "--out", out, "--quiet", *args,
                   env=env)  # fmt: skip
    assert done.code == (1 if name == "new" else 0), done.stderr  # with --baseline, only the regression fails it
    return out


def test_compare_reports_exactly_the_item_that_failed_and_the_one_that_diverged(tmp_path, claude_image):
    step_summary = tmp_path / "step-summary.md"
    old = batch(
        tmp_path,
        "old",
        {"steady": (session(), {}), "breaks": (session(), {}), "drifts": (session(), {}), "retired": (session(), {})},
    )
    new = batch(
        tmp_path,
        "new",
        {
            "steady": (session(), {}),
            "breaks": (session("sleep 120"), {"timeout": "8s"}),
            "drifts": (session(second_result=DIFFERENT), {}),
            "added": (session(), {}),
        },
        "--baseline",
        tmp_path / "old-out",
        env={"GITHUB_STEP_SUMMARY": str(step_summary)},
    )
    before = {p.parent.name: json.loads(p.read_text())["status"] for p in old.glob("*/record.json")}
    assert before == dict.fromkeys(("steady", "breaks", "drifts", "retired"), "ok")

    junit = tmp_path / "compare.xml"
    done = run_cli("compare", old, new, "--json", "--junit", junit)
    assert (done.code, done.stderr) == (1, "")  # a regression: exit 1
    result = json.loads(done.stdout)
    assert [(c["kind"], c["id"]) for c in result["changes"]] == [
        ("regression", "breaks"),
        ("divergence_moved", "drifts"),
        ("gone", "retired"),
        ("new", "added"),
    ]
    assert (result["matched"], result["unchanged"]) == (3, 1)
    changes = {c["id"]: c for c in result["changes"]}
    assert changes["breaks"]["new"]["status"] == "timeout"
    assert changes["drifts"]["old"]["first_divergence"] is None  # both calls reproduced exactly
    assert changes["drifts"]["new"]["first_divergence"] == {"index": 1, "call_id": "toolu_02a", "tool": "Bash"}
    assert changes["drifts"]["new"]["status"] == "ok"  # a divergence is not a failure

    assert json.loads((new / "compare.json").read_text())["changes"] == result["changes"]  # batch --baseline
    assert ET.parse(new / "compare.xml").getroot().get("failures") == "1"
    suite = ET.parse(junit).getroot()
    assert [case.get("name") for case in suite if case.find("failure") is not None] == ["breaks"]

    table = run_cli("compare", old, new)
    assert table.code == 1
    assert table.stdout.splitlines()[-1] == (
        "3 items matched, 1 unchanged; 1 divergence moved, 1 gone, 1 new, 1 regression"
    )
    assert "diverges at call 2 (Bash toolu_02a)" in table.stdout

    # The step summary names the regression; the same batch again, against a copy of itself, has failures that
    # were failing already: --fail-on regressions (the default with a baseline) exits 0, failures 1.
    assert "| `breaks` | 2 | ok, every observation exact → timeout" in step_summary.read_text()
    shutil.copytree(new, tmp_path / "new-copy")
    manifest = tmp_path / "new.jsonl"
    again = [manifest, "--agent", "claude-code", "--mode", "replay-only", "--out", new, "--quiet", "--baseline",
             tmp_path / "new-copy"]  # fmt: skip
    same = run_cli("batch", *again)
    assert (same.code, json.loads((new / "compare.json").read_text())["changes"]) == (0, []), same.stderr
    assert run_cli("batch", *again, "--fail-on", "failures").code == 1  # breaks is not ok
