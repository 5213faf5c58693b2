"""``compare``: two run directories written from a real record's shape, every kind of change, exact output."""

from __future__ import annotations

import hashlib
import json
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path

import pytest

from pvisor_host.errors import UsageError
from pvisor_host.fanout.compare import compare_runs, write_reports

from conftest import invoke_cli

TEMPLATE = json.loads((Path(__file__).parents[1] / "data" / "record-template.json").read_text())
CALLS = [("toolu_01a", "Bash"), ("toolu_02a", "Read"), ("toolu_03a", "Bash")]


def item(
    run: Path,
    item_id: str,
    *,
    status: str = "ok",
    category: str | None = None,
    step: int = 3,
    diverge=None,
    digest: str | None = None,
    files: dict[str, str] | None = None,
    removed: tuple[str, ...] = (),
    directory: Path | None = None,
    repeat_of: str | None = None,
    egress: list[str] | None = None,
    environment: dict[str, str | None] | None = None,
):
    """One item's directory: its record, and pvisor's observation comparison (``diverge``: the calls that differ).
    ``digest``: the registry digest of its image. ``files``: what the replay added to the workspace (path →
    content, collected), ``removed`` what it removed. ``directory``: a single replay's ``--out`` instead.
    ``egress``: the hosts it reached through the egress proxy (None: it ran without ``--egress``)."""
    directory = directory or run / item_id
    (directory / "output").mkdir(parents=True)
    record = json.loads(json.dumps(TEMPLATE))
    if files is not None or removed:
        record["workspace_changes"] = {"added": [*(files or {}), "made/"], "changed": [], "removed": list(removed)}
        for path, content in (files or {}).items():
            record["artifacts"].append({"path": f"workspace/{path}", "size": len(content), "sha256": sha(content)})
    record["image"]["digest"] = digest
    if egress is not None:
        limit = {"connections": 1000, "bytes": 4 * 1024**3, "at_once": 64}
        record["egress"] = {"allowed": "pypi", "limit": limit, "connections": len(egress), "hosts": egress}
    record["status"] = status
    record["failure"] = None if status == "ok" else {"category": category or status, "message": "it failed"}
    record["inputs"]["after_step"] = step
    if environment is not None:
        record["inputs"]["environment"] = environment
    single = directory != run / item_id
    record["batch"] = None if single else {"item_id": item_id, "line": 1, "content_key": "k", "repeat_of": repeat_of}
    (directory / "record.json").write_text(json.dumps(record))
    comparison = [
        {"call_id": call_id, "tool": tool, "exact": n not in (diverge or ()), "original_is_error": False,
         "replayed_is_error": False}
        for n, (call_id, tool) in enumerate(CALLS[:step])
    ]  # fmt: skip
    (directory / "output" / "observation-comparison.json").write_text(json.dumps(comparison))


def sha(content: str) -> str:
    return hashlib.sha256(content.encode()).hexdigest()


@pytest.fixture
def runs(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    for run in (old, new):
        item(run, "same")
        item(run, "same-failure", status="replay_failed", category="tool_error")
        item(run, "still-diverges", diverge=[1])
    item(old, "regresses")
    item(new, "regresses", status="timeout")
    item(old, "fixed", status="oom")
    item(new, "fixed")
    item(old, "other-failure", status="replay_failed", category="tool_error")
    item(new, "other-failure", status="replay_failed", category="executor_error")
    item(old, "diverges-later", diverge=[0])
    item(new, "diverges-later", diverge=[2])
    item(old, "starts-diverging")
    item(new, "starts-diverging", diverge=[1, 2])
    item(old, "diverges-more", diverge=[1])
    item(new, "diverges-more", diverge=[1, 2])  # the same first divergence, one more after it
    item(old, "other-effects", files={"a.txt": "1", "b.txt": "same"}, removed=("gone.txt",))
    item(new, "other-effects", files={"a.txt": "2", "b.txt": "same", "c.txt": "new"})
    item(old, "gone")
    item(new, "new")
    item(old, "moved-boundary", step=2)
    item(new, "moved-boundary", step=3)
    (old / ".previous" / "same").mkdir(parents=True)
    (old / ".previous" / "same" / "record.json").write_text("{}")  # set aside: not an item of this run
    return old, new


OLD_TASK = "127.0.0.1:5000/task/t1@sha256:" + "aa" * 32
NEW_TASK = "127.0.0.1:5000/task/t1@sha256:" + "bb" * 32


def test_an_item_whose_image_digest_changed_is_flagged_with_or_without_another_change(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    item(old, "same-task", digest=OLD_TASK)
    item(new, "same-task", digest=OLD_TASK)
    item(old, "new-task", digest=OLD_TASK)
    item(new, "new-task", digest=NEW_TASK)
    item(old, "new-task-fails", digest=OLD_TASK)
    item(new, "new-task-fails", status="replay_failed", category="tool_error", digest=NEW_TASK)
    result = compare_runs(old, new)
    assert [(c.kind, c.id, c.image_changed) for c in result.changes] == [
        ("regression", "new-task-fails", True),
        ("image_changed", "new-task", True),
    ]
    assert result.changes[1].describe == (
        "ok, every observation exact → ok, every observation exact; "
        "image 127.0.0.1:5000/task/t1@sha256:aaaaaaaaaaaa → 127.0.0.1:5000/task/t1@sha256:bbbbbbbbbbbb"
    )
    assert (result.matched, result.unchanged) == (3, 1)


def test_the_tools_environment_is_compared_and_pvisor_hosts_own_instructions_are_not(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    for run, tz, deadline in ((old, "UTC", "7230"), (new, "Europe/Paris", "38")):
        item(run, "a", environment={"TZ": tz, "PVISOR_HOST_DEADLINE": deadline, "KEY": None})
        item(run, "b", environment={"TZ": tz, "PVISOR_HOST_DEADLINE": deadline})
    assert compare_runs(old, new).environment == ["TZ: 'UTC' → 'Europe/Paris' (2 items)"]


def test_every_kind_of_change_regressions_first(runs):
    old, new = runs
    result = compare_runs(old, new)
    assert [(c.kind, c.id, c.after_step) for c in result.changes] == [
        ("regression", "gone", 3),  # it was ok, and the new run has no such item: a guard must see it
        ("regression", "moved-boundary", 2),
        ("regression", "regresses", 3),
        ("status_changed", "other-failure", 3),
        ("divergence_moved", "diverges-later", 3),
        ("divergence_moved", "diverges-more", 3),
        ("divergence_moved", "starts-diverging", 3),
        ("effects_changed", "other-effects", 3),
        ("new", "moved-boundary", 3),
        ("new", "new", 3),
        ("fixed", "fixed", 3),
    ]
    assert result.counts == {
        "divergence_moved": 3,
        "effects_changed": 1,
        "fixed": 1,
        "new": 2,
        "regression": 3,
        "status_changed": 1,
    }
    assert (result.matched, result.unchanged) == (10, 3)
    effects = next(c for c in result.changes if c.id == "other-effects")
    assert effects.files == ["a.txt", "c.txt", "gone.txt"]  # b.txt is the same; made/ is a directory
    assert effects.describe.endswith("; files differ: a.txt, c.txt, gone.txt")
    assert effects.new is not None and effects.new.effects["b.txt"] == sha("same")
    later = next(c for c in result.changes if c.id == "diverges-later")
    assert later.describe == "ok, diverges at call 1 (Bash toolu_01a) → ok, diverges at call 3 (Bash toolu_03a)"
    assert later.new is not None and (later.new.replayed_calls, later.new.diverged_calls) == (3, 1)
    assert result.regressions[0].describe == "ok, every observation exact → -"
    regression = result.regressions[2]
    assert regression.describe == "ok, every observation exact → timeout, every observation exact"


def test_the_cli_prints_a_table_writes_junit_where_only_regressions_fail_and_exits_1(runs, tmp_path):
    old, new = runs
    junit = tmp_path / "compare.xml"
    done = invoke_cli("compare", old, new, "--junit", junit)
    assert (done.code, done.stderr) == (1, "")
    lines = done.stdout.splitlines()
    assert lines[1].split()[:3] == ["regression", "gone", "3"]
    assert lines[-1] == (
        "10 items matched, 3 unchanged; 3 divergence moved, 1 effects changed, 1 fixed, 2 new, 3 regression, "
        "1 status changed"
    )
    suite = ET.parse(junit).getroot()
    assert (suite.get("tests"), suite.get("failures")) == ("14", "3")  # every item a case: a green run shows them
    failed = [case.get("name") for case in suite if case.find("failure") is not None]
    assert failed == ["gone (after step 3)", "moved-boundary (after step 2)", "regresses (after step 3)"]
    unchanged = [case.get("name") for case in suite if case.get("classname") == "compare.unchanged"]
    assert unchanged == ["same (after step 3)", "same-failure (after step 3)", "still-diverges (after step 3)"]


def test_json_and_no_regression_exits_0(runs):
    old, new = runs
    done = invoke_cli("compare", new, new, "--json")
    assert (done.code, done.stderr) == (0, "")
    parsed = json.loads(done.stdout)
    assert parsed["schema_version"] == "pvisor-host.compare/v1"
    assert (parsed["matched"], parsed["unchanged"], parsed["changes"]) == (12, 12, [])


def test_a_directory_that_is_not_a_batch_is_refused_in_one_line(tmp_path, runs):
    done = invoke_cli("compare", tmp_path / "missing", runs[1])  # as people type it: one line, exit 2
    assert (done.code, done.stdout) == (2, "")
    missing = tmp_path / "missing"
    assert (
        done.stderr
        == f"pvisor-host: error: {missing} is not a directory; pass a batch's or a replay's --out directory\n"
    )
    with pytest.raises(UsageError, match="holds no batch results"):
        compare_runs(tmp_path / "old" / ".previous", runs[1])
    with pytest.raises(UsageError, match="is not a directory"):
        compare_runs(tmp_path / "missing", runs[1])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--baseline", "{out}"], "--baseline {out} is the batch's own --out; pass the earlier batch's directory"),
        (["--baseline", "{missing}"], "{missing} is not a directory; pass a batch's --out directory"),
        (["--baseline", "{old}", "--plan"], "--baseline compares finished runs; it does nothing with --plan"),
        (["--fail-on", "regressions"], "--fail-on regressions needs --baseline DIR: the earlier batch to find "
                                       "regressions against"),
        (["--baseline", "{old}", "--fail-on", "sometimes"], "--fail-on 'sometimes': pass a comma list of regressions, "
                                                            "failures, verification, never"),
        (["--baseline", "{old}", "--limit", "1"], "--baseline compares whole runs: the items a slice (--limit, "
                                                  "--sample, --select) leaves out would read as gone, regressions of "
                                                  "every one that was ok (run the whole dataset against the "
                                                  "baseline, or compare the slice with an earlier run of the same)"),
    ],
)  # fmt: skip
def test_batch_baseline_is_checked_before_anything_runs(runs, tmp_path, args, message):
    old, _ = runs
    paths = {"out": tmp_path / "out", "missing": tmp_path / "missing", "old": old}
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"id": "a", "trajectory": "nowhere.jsonl", "after_step": 1}\n')
    given = [a.format(**paths) for a in args]
    done = invoke_cli("batch", manifest, "--agent", "claude-code", "--out", paths["out"], *given)
    assert (done.code, done.stdout) == (2, "")
    assert done.stderr == f"pvisor-host: error: {message.format(**paths)}\n"
    assert not paths["out"].exists()  # nothing ran, nothing was written


def test_the_step_summary_names_each_regression_and_what_it_was(runs, tmp_path, monkeypatch):
    old, new = runs
    step_summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step_summary))
    comparison = compare_runs(old, new)
    write_reports(comparison, tmp_path)
    text = step_summary.read_text()
    regressed = [c for c in comparison.changes if c.kind == "regression"]
    assert text.startswith(f"#### Against `{old}`\n\n{len(regressed)} regressed, ")
    for change in regressed:
        assert f"| `{change.id}` | {change.after_step} | {change.describe} |" in text


def test_two_single_replay_directories_are_compared_as_one_item_and_one_with_a_batchs(tmp_path, runs):
    first, second = tmp_path / "replay-1", tmp_path / "replay-2"
    item(tmp_path, "", directory=first, files={"out.txt": "one"})
    item(tmp_path, "", directory=second, files={"out.txt": "two"}, diverge=[2])
    result = compare_runs(first, second)
    assert [(c.kind, c.id, c.files) for c in result.changes] == [("divergence_moved", "t.jsonl", ["out.txt"])]
    assert compare_runs(first, first).unchanged == 1
    done = invoke_cli("compare", first, second, "--json")
    assert done.code == 0 and json.loads(done.stdout)["counts"] == {"divergence_moved": 1}
    with pytest.raises(UsageError, match="replay-1 is one replay's --out and the other a batch's"):
        compare_runs(runs[0], first)


def test_repeats_that_end_or_change_the_workspace_otherwise_are_flaky(tmp_path):
    from pvisor_host.fanout.compare import run_flaky
    from pvisor_host.fanout.results import load_results
    from pvisor_host.fanout.summary import markdown, summarize

    run = tmp_path / "run"
    for n in (1, 2, 3):
        item(run, f"steady.r{n}", repeat_of="steady", files={"a.txt": "same"})
        item(run, f"clock.r{n}", repeat_of="clock", files={"a.txt": "same", "now.txt": f"{n}"})
    item(run, "fails.r1", repeat_of="fails")
    item(run, "fails.r2", repeat_of="fails", status="timeout")
    item(run, "fails.r10", repeat_of="fails")
    item(run, "alone", files={"now.txt": "x"})
    flaky = run_flaky(run, load_results(run))
    assert [(f.id, f.repeats, f.files) for f in flaky] == [
        ("clock", ["clock.r1", "clock.r2", "clock.r3"], ["now.txt"]),
        ("fails", ["fails.r1", "fails.r2", "fails.r10"], []),  # in the repeats' order, not the ids'
    ]
    assert flaky[1].outcomes == [
        "ok, every observation exact",
        "timeout, every observation exact",
        "ok, every observation exact",
    ]
    assert [f.id for f in compare_runs(run, run).flaky] == ["clock", "fails"]
    start = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
    summary = summarize([], total=0, started=start, finished=start, interrupted=False, deadline=False)
    summary.flaky = flaky
    text = markdown(summary, tmp_path)
    assert "| `clock` | 3 | " + "; ".join(["ok, every observation exact"] * 3) + " | now.txt |" in text


def test_report_with_a_baseline_embeds_the_changes_regressions_first(runs):
    old, new = runs
    done = invoke_cli("report", new, "--baseline", old)
    assert done.code == 0, done.stderr
    page = (new / "report.html").read_text()
    data = json.loads(page.split('<script id="report-data" type="application/json">', 1)[1].split("</script>", 1)[0])
    compared = data["comparison"]
    assert (compared["baseline"], compared["matched"], compared["total"]) == (str(old), 10, 11)
    assert [(c["kind"], c["id"]) for c in compared["changes"][:4]] == [
        ("regression", "gone"),
        ("regression", "moved-boundary"),
        ("regression", "regresses"),
        ("status_changed", "other-failure"),
    ]
    assert compared["changes"][2]["was"] == "ok, every observation exact"
    assert invoke_cli("report", new).code == 0 and '"comparison":' not in (new / "report.html").read_text()


def test_two_replays_of_a_renamed_trajectory_are_still_the_pair(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    item(tmp_path, "", directory=first, files={"out.txt": "one"})
    item(tmp_path, "", directory=second, files={"out.txt": "two"})
    record = json.loads((second / "record.json").read_text())
    record["inputs"]["trajectory"]["path"] = "/data/renamed.jsonl"
    (second / "record.json").write_text(json.dumps(record))
    result = compare_runs(first, second)
    assert (result.matched, [(c.kind, c.id) for c in result.changes]) == (1, [("effects_changed", "t.jsonl")])


def test_an_item_that_reached_new_hosts_is_flagged_and_any_other_change_names_them(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    item(old, "same-hosts", egress=["pypi.org:443"])
    item(new, "same-hosts", egress=["pypi.org:443"])
    item(old, "reaches-more", egress=["pypi.org:443"])
    item(new, "reaches-more", egress=["files.pythonhosted.org:443", "pypi.org:443", "evil.test:443"])
    item(old, "fails-and-reaches", egress=[])
    item(new, "fails-and-reaches", status="replay_failed", category="tool_error", egress=["evil.test:443"])
    item(old, "had-no-egress")
    item(new, "had-no-egress", egress=["pypi.org:443"])  # no list before: nothing to call new
    result = compare_runs(old, new)
    assert [(c.kind, c.id, c.new_hosts) for c in result.changes] == [
        ("regression", "fails-and-reaches", ["evil.test:443"]),
        ("new_hosts", "reaches-more", ["files.pythonhosted.org:443", "evil.test:443"]),
    ]
    assert result.changes[1].describe.endswith("; new hosts reached: files.pythonhosted.org:443, evil.test:443")
    assert result.unchanged == 2
