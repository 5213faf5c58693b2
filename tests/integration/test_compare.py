"""``compare`` on two real batches (real engine, image, pvisor): one item changed to fail, one to diverge."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

from browser import Browser
from conftest import run_cli
from trajgen import Call, Turn, claude_session, write_jsonl

DIFFERENT = "an observation the fresh run will not reproduce"
#: A call whose observation is the same every run (none) and whose effect is not: a file of fresh content.
RANDOM = "cat /proc/sys/kernel/random/uuid > out.txt"


def session(second_command: str = "true", second_result: str = "", version: str = "2.1.220") -> list[dict]:
    """Two tool batches: ``true`` (no output, recorded as none), then the given command and recording; another
    ``version`` than the pinned one is a trajectory pvisor refuses (``rejected`` before any sandbox)."""
    return claude_session(
        "Compare.",
        [
            Turn([Call("Bash", {"command": "true"}, result="")]),
            Turn([Call("Bash", {"command": second_command, "timeout": 600000}, result=second_result)]),
        ],
        version=version,
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


def test_compare_reports_exactly_the_item_that_failed_and_the_one_that_diverged(tmp_path, claude_image, chromium):
    step_summary = tmp_path / "step-summary.md"
    old = batch(
        tmp_path,
        "old",
        {
            "steady": (session(), {}),
            "breaks": (session(), {}),
            "drifts": (session(), {}),
            "random": (session(RANDOM), {}),
            "retired": (session(), {}),
            "rejects": (session(), {}),
        },
    )
    new = batch(
        tmp_path,
        "new",
        {
            "steady": (session(), {}),
            "breaks": (session("sleep 120"), {"timeout": "8s"}),
            "drifts": (session(second_result=DIFFERENT), {}),
            "random": (session(RANDOM), {}),  # the same calls, the same (empty) observations, another file
            "added": (session(), {}),
            "rejects": (session(version="2.1.219"), {}),  # ok before, now refused by pvisor: a regression
            "added-broken": (session(version="2.1.219"), {}),  # new and refused: a new failure
        },
        "--baseline",
        tmp_path / "old-out",
        env={"GITHUB_STEP_SUMMARY": str(step_summary)},
    )
    before = {p.parent.name: json.loads(p.read_text())["status"] for p in old.glob("*/record.json")}
    assert before == dict.fromkeys(("steady", "breaks", "drifts", "random", "retired", "rejects"), "ok")

    junit = tmp_path / "compare.xml"
    done = run_cli("compare", old, new, "--json", "--junit", junit)
    assert (done.code, done.stderr) == (1, "")  # a regression: exit 1
    result = json.loads(done.stdout)
    assert [(c["kind"], c["id"]) for c in result["changes"]] == [
        ("regression", "breaks"),
        ("regression", "rejects"),  # rejected at pre-flight: no record, a row all the same
        ("regression", "retired"),  # ok before, gone now
        ("new_failure", "added-broken"),
        ("divergence_moved", "drifts"),
        ("effects_changed", "random"),
        ("new", "added"),
    ]
    assert (result["matched"], result["unchanged"]) == (5, 1)
    assert json.loads(done.stdout)["changes"][1]["new"]["category"] == "unsupported_version"
    changes = {c["id"]: c for c in result["changes"]}
    assert changes["breaks"]["new"]["status"] == "timeout"
    assert changes["drifts"]["old"]["first_divergence"] is None  # both calls reproduced exactly
    assert changes["drifts"]["new"]["first_divergence"] == {"index": 1, "call_id": "toolu_02a", "tool": "Bash"}
    assert changes["drifts"]["new"]["status"] == "ok"  # a divergence is not a failure
    assert changes["random"]["files"] == ["out.txt"] and changes["random"]["new"]["diverged"] == []

    assert json.loads((new / "compare.json").read_text())["changes"] == result["changes"]  # batch --baseline
    assert ET.parse(new / "compare.xml").getroot().get("failures") == "4"
    suite = ET.parse(junit).getroot()
    assert [case.get("name") for case in suite if case.find("failure") is not None] == [
        "breaks (after step 2)", "rejects (after step 2)", "retired (after step 2)", "added-broken (after step 2)",
    ]  # fmt: skip
    assert suite.get("tests") == "8"  # every item is a test case, the unchanged one too

    table = run_cli("compare", old, new)
    assert table.code == 1
    assert table.stdout.splitlines()[-1] == (
        "5 items matched, 1 unchanged; 1 divergence moved, 1 effects changed, 1 new, 1 new failure, 3 regression"
    )
    assert "diverges at call 2 (Bash toolu_02a)" in table.stdout

    # report.html (written again by batch --baseline) shows the same side by side, regressions first.
    with Browser(chromium) as browser:
        page = browser.open((new / "report.html").as_uri())
        page.wait_for("!document.getElementById('comparison').hidden")
        rows = page.js(
            "[...document.querySelectorAll('#by-change tr.change-row')].map(r => [...r.cells].map(c => c.innerText))"
        )
        rows = [[cell.strip() for cell in row] for row in rows]
        assert [row[:3] for row in rows] == [
            ["regression", "breaks", "2"], ["regression", "rejects", "2"], ["regression", "retired", "2"],
            ["new failure", "added-broken", "2"], ["divergence moved", "drifts", "2"],
            ["effects changed", "random", "2"], ["new", "added", "2"],
        ]  # fmt: skip
        assert rows[0][3:5] == ["ok, every observation exact", "timeout"]
        assert rows[5][5] == "out.txt"
        totals = page.js("document.getElementById('comparison-totals').textContent")
        assert totals.endswith(
            "5 items matched, 1 unchanged; 1 divergence moved, 1 effects changed, 1 new, 1 new failure, 3 regression."
        )

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


def test_two_replays_of_one_trajectory_whose_file_effects_differ(tmp_path, claude_image):
    trajectory = write_jsonl(tmp_path / "random.jsonl", session(RANDOM))
    outs = [tmp_path / "first", tmp_path / "second"]
    for out in outs:
        done = run_cli("replay", "--agent", "claude-code", "--trajectory", trajectory, "--after-step", "2",
                       "--mode", "replay-only", "--out", out)  # fmt: skip
        assert done.code == 0, done.stderr
    done = run_cli("compare", *outs, "--json")
    assert (done.code, done.stderr) == (0, "")
    (change,) = json.loads(done.stdout)["changes"]
    assert (change["kind"], change["id"], change["files"]) == ("effects_changed", "random.jsonl", ["out.txt"])


def test_repeat_reports_an_item_whose_effects_depend_on_time_as_flaky(tmp_path, claude_image, chromium):
    steady = write_jsonl(tmp_path / "steady.jsonl", session())
    clock = write_jsonl(tmp_path / "clock.jsonl", session(RANDOM))
    manifest = tmp_path / "repeat.jsonl"
    manifest.write_text(
        "".join(json.dumps({"id": t.stem, "trajectory": str(t), "after_step": 2}) + "\n" for t in (steady, clock))
    )
    out = tmp_path / "out"
    step_summary = tmp_path / "step-summary.md"
    done = run_cli("batch", manifest, "--agent", "claude-code", "--mode", "replay-only", "--repeat", "3", "--out", out,
                   "--json", env={"GITHUB_STEP_SUMMARY": str(step_summary)})  # fmt: skip
    assert done.code == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (summary["items"], summary["counts"]) == (6, {"ok": 6})
    assert sorted(p.name for p in out.iterdir() if (p / "record.json").is_file()) == [
        "clock.r1", "clock.r2", "clock.r3", "steady.r1", "steady.r2", "steady.r3",
    ]  # fmt: skip
    (flaky,) = summary["flaky"]
    assert (flaky["id"], flaky["repeats"], flaky["files"]) == (
        "clock",
        ["clock.r1", "clock.r2", "clock.r3"],
        ["out.txt"],
    )
    assert "| `clock` | 2 |" in step_summary.read_text()
    compared = run_cli("compare", out, out, "--json")
    assert [f["id"] for f in json.loads(compared.stdout)["flaky"]] == ["clock"]
    with Browser(chromium) as browser:  # the report lists it too
        page = browser.open((out / "report.html").as_uri())
        page.wait_for("!document.getElementById('flaky').hidden")
        cells = page.js("[...document.querySelectorAll('#by-flaky tr.flaky-row td')].map(td => td.innerText.trim())")
        assert cells[:2] + cells[3:] == ["clock", "2", "out.txt"]
        assert cells[2].splitlines() == ["ok, every observation exact"] * 3
