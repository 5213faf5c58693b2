"""``report.html``'s data, from batch directories written in a real record's shape: outcomes per call, the
diffs, the groups across items, the items without a record, the size budget, and bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pvisor_host.models.batch import ItemResult
from pvisor_host.models.observations import read_observations
from pvisor_host.report.gather import gather
from pvisor_host.report.observations import compact_diff
from pvisor_host.report.page import render_page

from conftest import invoke_cli
from trajgen import Call, Turn, claude_session, codex_rollout, write_jsonl

TEMPLATE = json.loads((Path(__file__).parents[1] / "data" / "record-template.json").read_text())
ARTIFACTS = [
    ("output/observation-comparison.json", "observation_comparison"),
    ("output/manifest.json", "playback_plan"),
    ("output/native/reconstructed-prefix.jsonl", "reconstructed_native_trajectory"),
]


def item(
    out: Path,
    item_id: str,
    calls: list[tuple[str, str, str]],
    *,
    fresh: list[str] | None = None,
    errors: set[int] = frozenset(),
    status: str = "ok",
    line: int = 1,
    next_action: dict | None = None,
) -> ItemResult:
    """One item's directory as a batch leaves it: the recorded trajectory (``calls``: tool, command, recorded
    observation), the record, pvisor's plan, comparison and reconstructed trajectory (``fresh`` observations)."""
    directory = out / item_id
    (directory / "output" / "native").mkdir(parents=True)
    fresh = fresh if fresh is not None else [observation for _, _, observation in calls]
    recorded = claude_session("Task.", [Turn([Call(tool, {"command": cmd}, result=obs)]) for tool, cmd, obs in calls])
    original = write_jsonl(out.parent / "data" / f"{item_id}.jsonl", recorded)
    rebuilt = claude_session(
        "Task.",
        [Turn([Call(tool, {"command": cmd}, result=obs, is_error=n in errors)]) for n, ((tool, cmd, _), obs) in
         enumerate(zip(calls, fresh, strict=True))],
    )  # fmt: skip
    write_jsonl(directory / "output" / "native" / "reconstructed-prefix.jsonl", rebuilt)
    ids = [f"toolu_{n + 1:02d}a" for n in range(len(calls))]
    comparison = [
        {"call_id": call_id, "tool": tool, "exact": obs == new and n not in errors, "original_is_error": False,
         "replayed_is_error": n in errors}
        for n, (call_id, (tool, _, obs), new) in enumerate(zip(ids, calls, fresh, strict=True))
    ]  # fmt: skip
    (directory / "output" / "observation-comparison.json").write_text(json.dumps(comparison))
    plan = {
        "batches": [
            {
                "ordinal": n + 1,
                "tool_calls": [{"ordinal": 1, "call_id": call_id, "name": tool, "arguments": {"command": c}}],
            }
            for n, (call_id, (tool, c, _)) in enumerate(zip(ids, calls, strict=True))
        ]
    }
    (directory / "output" / "manifest.json").write_text(json.dumps(plan))
    record = json.loads(json.dumps(TEMPLATE))
    artifacts = [
        {"path": path, "size": 1, "sha256": "0" * 64, "role": role, "format": "json"} for path, role in ARTIFACTS
    ]
    if next_action is not None:
        (directory / "output" / "next-action-comparison.json").write_text(json.dumps(next_action))
        artifacts.append({"path": "output/next-action-comparison.json", "size": 1, "sha256": "0" * 64,
                          "role": "next_action_comparison", "format": "json"})  # fmt: skip
    record.update(status=status, artifacts=artifacts, batch={"item_id": item_id, "line": line, "content_key": "k"})
    record["failure"] = None if status == "ok" else {"category": status, "message": f"it ended {status}"}
    record["inputs"]["trajectory"].update(path=str(original), size=original.stat().st_size)
    record["result"]["replayed_tool_calls"] = len(calls)
    (directory / "record.json").write_text(json.dumps(record))
    return ItemResult(id=item_id, line=line, agent="claude-code", status=status, timings=record["timings"],
                      attempts=1, path=item_id, category=None if status == "ok" else status,
                      message=None if status == "ok" else f"it ended {status}",
                      after_step=record["inputs"]["after_step"], replayed=len(calls))  # fmt: skip


@pytest.fixture
def batch_dir(tmp_path) -> tuple[Path, list[ItemResult]]:
    out = tmp_path / "out"
    (tmp_path / "data").mkdir()
    results = [
        item(out, "steady", [("Bash", "echo one", "one\n"), ("Read", "/app/a.py", "x = 1\n")], line=1),
        item(
            out,
            "drifts",
            [("Bash", "echo one", "one\n"), ("Bash", "ls /etc", "hosts\nfoo\npasswd\n")],
            fresh=["one\n", "hosts\napt\npasswd\n"],
            line=2,
        ),
        item(
            out,
            "breaks",
            [("Bash", "ls /etc", "hosts\n"), ("Bash", "make", "ok\n")],
            fresh=["hosts\nx\n", "no make\n"],
            errors={1},
            status="replay_failed",
            line=3,
        ),  # fmt: skip
        item(
            out,
            "continued",
            [("Bash", "echo one", "one\n")],
            line=4,
            next_action={
                "schema_version": "sandbox-playback.next-action-comparison/v2",
                "original": {
                    "text": "Now run the tests.",
                    "tools": [{"name": "Bash", "arguments": {"command": "pytest"}}],
                },
                "replayed": {
                    "text": "Run the tests now.",
                    "tools": [{"name": "Bash", "arguments": {"command": "make"}}],
                },
                "metrics": {
                    "ordered_tool_names_equal": True,
                    "tool_arguments_equal": False,
                    "text_comparison_status": "comparable",
                    "text_similarity": 0.61,
                },
            },  # fmt: skip
        ),
        ItemResult(
            id="refused",
            line=5,
            agent="claude-code",
            status="rejected",
            category="rejected",
            message="trajectory data/x.jsonl: does not exist",
            path="refused",
        ),  # fmt: skip
        ItemResult(id="late", line=6, agent="codex", status="not_run", message="the deadline passed"),
    ]
    return out, results


def test_calls_are_exact_diverged_or_errored_with_a_compact_diff(batch_dir):
    out, results = batch_dir
    data = gather(out, results)
    items = {i.id: i for i in data.items}
    assert [i.id for i in data.items] == ["steady", "drifts", "breaks", "continued", "refused", "late"]
    assert [(c.outcome, c.tool, c.command, c.diff) for c in items["steady"].calls] == [
        ("exact", "Bash", "echo one", None),
        ("exact", "Read", "/app/a.py", None),
    ]
    drifts = items["drifts"]
    assert (drifts.exact, drifts.diverged, drifts.errored) == (1, 1, 0)
    assert drifts.calls[1].model_dump(exclude={"original_is_error"}) == {
        "index": 1,
        "call_id": "toolu_02a",
        "tool": "Bash",
        "command": "ls /etc",
        "outcome": "diverged",
        "replayed_is_error": False,
        "diff": "@@ -1,3 +1,3 @@\n hosts\n-foo\n+apt\n passwd",
    }
    breaks = items["breaks"]
    assert [(c.outcome, c.diff) for c in breaks.calls] == [
        ("diverged", "@@ -1 +1,2 @@\n hosts\n+x"),
        ("errored", "@@ -1 +1 @@\n-ok\n+no make"),
    ]
    assert (breaks.status, breaks.category, breaks.message) == (
        "replay_failed",
        "replay_failed",
        "it ended replay_failed",
    )
    assert (breaks.mode, breaks.after_step, breaks.replayed, breaks.dir) == ("replay-only", 4, 2, "breaks")
    refused, late = items["refused"], items["late"]
    assert (refused.status, refused.calls, refused.dir) == ("rejected", [], None)  # no directory, nothing to link
    assert (late.status, late.dir, late.agent) == ("not_run", None, "codex")


def test_the_next_action_of_a_continued_item(batch_dir):
    out, results = batch_dir
    continued = next(i for i in gather(out, results).items if i.id == "continued")
    assert continued.next_action is not None
    assert continued.next_action.model_dump() == {
        "original_tools": [{"name": "Bash", "command": "pytest"}],
        "replayed_tools": [{"name": "Bash", "command": "make"}],
        "tool_names_equal": True,
        "tool_arguments_equal": False,
        "text_status": "comparable",
        "text_similarity": 0.61,
        "original_text": "Now run the tests.",
        "replayed_text": "Run the tests now.",
    }


def test_the_calls_that_diverge_most_often_by_tool_and_by_command(batch_dir):
    out, results = batch_dir
    data = gather(out, results)
    assert [(g.tool, g.command, g.diverged, g.calls, g.items) for g in data.by_tool] == [
        ("Bash", None, 3, 6, ["drifts", "breaks"]),
    ]
    assert [(g.tool, g.command, g.diverged, g.calls, g.items) for g in data.by_command] == [
        ("Bash", "ls /etc", 2, 2, ["drifts", "breaks"]),
        ("Bash", "make", 1, 1, ["breaks"]),
    ]
    assert data.counts == {"ok": 3, "replay_failed": 1, "rejected": 1, "not_run": 1}
    assert data.categories == {"replay_failed": 1, "rejected": 1}
    assert list(data.phases) == ["preflight", "image", "stage", "create", "run", "collect", "total"]
    assert data.phases["total"].model_dump() == {"count": 4, "min": 1.757, "p10": 1.757, "p50": 1.757, "p90": 1.757,
                                                 "max": 1.757}  # fmt: skip


def test_without_results_jsonl_the_items_come_from_their_records(batch_dir):
    out, results = batch_dir
    assert not (out / "results.jsonl").exists()
    data = gather(out)
    assert [(i.id, i.status, i.diverged + i.errored) for i in data.items] == [
        ("steady", "ok", 0),
        ("drifts", "ok", 1),
        ("breaks", "replay_failed", 2),
        ("continued", "ok", 0),
    ]
    (out / "results.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in results))
    assert [i.id for i in gather(out).items] == [r.id for r in results]


def test_a_moved_or_changed_original_trajectory_gives_no_diff(batch_dir):
    out, results = batch_dir
    original = out.parent / "data" / "drifts.jsonl"
    original.write_text(original.read_text() + "\n")  # not the bytes the record describes any more
    drifts = next(i for i in gather(out, results).items if i.id == "drifts")
    assert (drifts.calls[1].outcome, drifts.calls[1].diff) == ("diverged", None)


def test_the_page_embeds_the_data_so_that_no_string_can_break_out(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "data").mkdir()
    hostile = "</script><script>alert(1)</script>"
    results = [item(out, "x", [("Bash", hostile, "a\n")], fresh=[f"{hostile}\n"])]
    page = render_page(gather(out, results)).decode()
    assert page.count("</script>") == 2  # the data block's and the code's, nothing from the data
    embedded = re.search(r'<script id="report-data" type="application/json">(.*?)</script>', page, re.S)
    assert embedded is not None
    data = json.loads(embedded.group(1))
    assert data["details"]["x"]["calls"][0]["command"] == hostile
    assert data["details"]["x"]["calls"][0]["diff"] == f"@@ -1 +1 @@\n-a\n+{hostile}"
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page  # offline


def test_two_thousand_items_fit_the_budget(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "data").mkdir()
    noisy = "\n".join(f"line {n} of a long listing with some words in it" for n in range(200)) + "\n"
    changed = noisy.replace("line 7 ", "line seven ").replace("line 150 ", "LINE 150 ")
    results = []
    for n in range(2000):
        calls = [("Bash", f"cat file{k}.txt", noisy) for k in range(6)]
        results.append(item(out, f"item{n:04d}", calls, fresh=[noisy] * 3 + [changed] * 3, line=n + 1))
    data = gather(out, results)
    size = len(render_page(data))
    assert size < 2_000_000, f"report.html is {size} bytes for 2,000 items"
    assert sum(i.diverged for i in data.items) == 6000  # the counts are whole, whatever was left out
    assert sum(1 for i in data.items for c in i.calls if c.outcome == "diverged") == 6000  # every one listed
    with_diff = [i.id for i in data.items if any(c.diff for c in i.calls)]
    assert len(with_diff) == 2000  # every item kept its first diff
    assert sum(1 for i in data.items for c in i.calls if c.diff) + data.diffs_dropped == 6000
    assert data.diffs_dropped > 0 and data.exact_hidden > 1900  # the budget did bind
    assert data.by_command[0].diverged == 2000
    assert (data.by_tool[0].diverged, data.by_tool[0].calls) == (6000, 12000)  # from all calls, before fitting


def test_a_small_batch_keeps_everything(batch_dir):
    out, results = batch_dir
    data = gather(out, results)
    assert (data.diffs_dropped, data.exact_hidden) == (0, 0)
    beside_rows = len(data.model_copy(update={"rows": []}).page_json())
    tight = gather(out, results, budget=beside_rows - 40)
    assert tight.diffs_dropped == 0 and tight.exact_hidden == 1  # the exact calls go first, one item's here
    assert sum(not i.exact_listed for i in tight.items) == 1


def test_codex_observations_are_read_from_function_call_outputs(tmp_path):
    rollout = codex_rollout("Task.", [Turn([Call("exec_command", {"cmd": "ls"}, result="a\nb\n")])])
    path = write_jsonl(tmp_path / "rollout.jsonl", rollout)
    found = read_observations(path, {"call_1a", "call_9z"})
    assert list(found) == ["call_1a"]
    assert "a\nb" in found["call_1a"]


def test_compact_diff_is_cut_to_its_budget():
    recorded = "\n".join(f"row {n}" for n in range(100))
    fresh = "\n".join(f"row {n}" if n % 3 else f"ROW {n} " + "x" * 300 for n in range(100))
    diff = compact_diff(recorded, fresh, max_lines=5, max_line=40)
    lines = diff.splitlines()
    assert len(lines) == 6 and lines[-1].startswith("… ") and lines[-1].endswith(" more diff lines")
    assert all(len(line) <= 40 for line in lines[:5])
    assert compact_diff("same", "same") == ""
    assert compact_diff("a\n", "a") == "(they differ only in line endings)"
    long = "\n".join(map(str, range(3000)))
    assert compact_diff(long, long + "\nmore") == "(the first 2000 lines are the same)"
    assert compact_diff(long, "x\n" + long).splitlines()[-1] == "… (compared the first 2000 lines)"


def test_report_cli_bad_input_is_one_line(tmp_path):
    missing = invoke_cli("report", tmp_path / "nope")
    assert (missing.code, missing.error_lines) == (
        2,
        [f"pvisor-host: error: {tmp_path / 'nope'} is not a directory; pass a batch's --out directory"],
    )
    empty = invoke_cli("report", tmp_path)
    assert empty.code == 2
    assert empty.error_lines == [
        f"pvisor-host: error: {tmp_path} holds no batch results (no results.jsonl or */record.json); "
        "pass a batch's --out directory"
    ]
    (tmp_path / "results.jsonl").write_text("not json\n")
    broken = invoke_cli("report", tmp_path)
    assert broken.code == 2
    assert broken.error_lines == [
        f"pvisor-host: error: {tmp_path / 'results.jsonl'} is not a batch's results file; "
        f"rerun the batch into {tmp_path} to rewrite it"
    ]
    assert not (tmp_path / "report.html").exists()


def test_no_room_for_diffs_reads_no_trajectory(batch_dir, monkeypatch):
    import pvisor_host.report.gather as gather_module

    out, results = batch_dir
    read: list[object] = []
    monkeypatch.setattr(gather_module, "read_observations", lambda *args: read.append(args) or {})
    data = gather(out, results, budget=1)  # no room for any detail: the rows only
    assert read == []
    assert [i.calls for i in data.items] == [[]] * 6 and data.undetailed == 4  # the 4 with a directory
    assert [i.diverged + i.errored for i in data.items] == [0, 1, 2, 0, 0, 0]  # the counts are whole all the same
