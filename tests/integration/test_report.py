"""``report.html`` of a real mixed batch (real engine, image, pvisor, a stub model for the continuation),
opened in headless Chromium: the DOM shows the counts, the rows, a working filter and sort, and the
diverged call with its diff; a screenshot is taken (``PVISOR_HOST_SCREENSHOT=path`` keeps a copy)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from browser import Browser
from conftest import run_cli
from modelserver import StubServer
from trajgen import Call, Turn, claude_files_session, claude_session, linked_copy, write_jsonl

pytestmark = pytest.mark.docker

HOG = "python3 -c 'b = bytearray(1 << 30); print(len(b))'"
LISTING = "printf 'alpha\\nbeta\\ngamma\\n'"


def one(command: str, result: str = "") -> list[dict]:
    return claude_session("Run it.", [Turn([Call("Bash", {"command": command, "timeout": 120000}, result)])])


@pytest.fixture(scope="module")
def mixed_batch(tmp_path_factory, claude_image) -> Path:
    """ok (exact), ok but diverging, replay_failed (a stale Claude tool: the host's prepare-only pre-flight lets it
    by, the sandbox's replay refuses it), timeout, oom, and a live continuation."""
    root = tmp_path_factory.mktemp("report")
    items = {
        "exact": (one("echo same", "same\n"), {}),
        "drifts": (one(LISTING, "alpha\nBETA\ngamma\n"), {}),
        "stale": (claude_session("Plan it.", [Turn([Call("TodoWrite", {"todos": []}, "ok")])]), {}),
        "slow": (one("sleep 60"), {"timeout": "3s"}),
        "hog": (one(HOG), {"memory": "200m", "tmp_size": "16m"}),
        "continues": (claude_files_session(), {"after_step": 4, "mode": "continue", "max_steps": 8}),
    }
    lines = []
    for item_id, (events, extra) in items.items():
        write_jsonl(root / f"{item_id}.jsonl", events)
        lines.append(json.dumps({"id": item_id, "trajectory": f"{item_id}.jsonl", "after_step": 1, **extra}))
    manifest = root / "manifest.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    out = root / "out"
    with StubServer() as stub:
        done = run_cli(
            "batch", manifest, "--agent", "claude-code", "--mode", "replay-only", "--out", out, "--quiet",
            "--model-base-url", stub.base_url, "--model", "stub-model", "--model-api-key-env", "PVH_TEST_MODEL_KEY",
            env={"PVH_TEST_MODEL_KEY": "sk-test-report-key"},
        )  # fmt: skip
    assert done.code == 1, done.stderr  # three items are not ok
    return out


def statuses(out: Path) -> dict[str, str]:
    return {p.parent.name: json.loads(p.read_text())["status"] for p in out.glob("*/record.json")}


def test_batch_writes_the_report_and_report_rewrites_it(mixed_batch):
    page = mixed_batch / "report.html"
    assert page.is_file()
    assert statuses(mixed_batch) == {
        "exact": "ok",
        "drifts": "ok",
        "stale": "replay_failed",
        "slow": "timeout",
        "hog": "oom",
        "continues": "ok",
    }
    first = page.read_text()
    page.unlink()
    done = run_cli("report", mixed_batch)
    assert done.code == 0, done.stderr
    assert done.stdout.startswith(f"wrote {page} (") and done.stdout.endswith(" KiB)\n")
    second = page.read_text()
    assert len(second) == len(first) and "sk-test-report-key" not in second


def test_the_page_in_a_real_browser(mixed_batch, chromium, tmp_path):
    with Browser(chromium) as browser:
        page = browser.open((mixed_batch / "report.html").as_uri())
        page.wait_for("document.querySelectorAll('#items tr.item').length > 0")

        bars = page.js(
            "[...document.querySelectorAll('#chart-status g.bar')].map(g => [g.dataset.name, +g.dataset.count])"
        )
        assert dict(bars) == {"ok": 3, "replay_failed": 1, "timeout": 1, "oom": 1}
        categories = page.js("[...document.querySelectorAll('#chart-category g.bar')].map(g => g.dataset.name)")
        assert sorted(categories) == ["oom", "timeout", "trajectory_error"]
        assert page.js("[...document.querySelectorAll('#chart-phases g.phase')].map(g => g.dataset.phase)") == [
            "preflight", "image", "stage", "create", "run", "collect", "total",
        ]  # fmt: skip

        rows = "[...document.querySelectorAll('#items tr.item')].map(r => r.dataset.id)"
        manifest_order = ["exact", "drifts", "stale", "slow", "hog", "continues"]
        assert page.js(rows) == manifest_order
        assert page.js("document.getElementById('shown').textContent") == "6 of 6 items"
        cells = page.js(
            "[...document.querySelectorAll('#items tr.item[data-id=slow] td')].map(td => td.textContent.trim())"
        )
        assert cells[:3] + cells[4:5] == ["timeout", "▸ slow", "claude-code", "1"]
        assert cells[3] == _record(mixed_batch / "slow")["image"]["ref"]  # the image column
        links = page.js("[...document.querySelectorAll('#items tr.item[data-id=drifts] td.files a')].map(a => a.href)")
        assert links == [
            (mixed_batch / "drifts" / "record.json").as_uri(),
            (mixed_batch / "drifts" / "logs").as_uri() + "/",
            (mixed_batch / "drifts").as_uri() + "/",
        ]

        # The filter: by status, by text, and by "diverged".
        set_control(page, "filter-status", "timeout", "change")
        assert page.js(rows) == ["slow"]
        assert page.js("document.getElementById('shown').textContent") == "1 of 6 items"
        assert page.js("location.hash") == "#status=timeout"
        set_control(page, "filter-status", "", "change")
        set_control(page, "filter-text", "source observation", "input")
        assert page.js(rows) == ["stale"]
        set_control(page, "filter-text", "", "input")
        page.js("document.getElementById('filter-diverged').click()")
        diverging = {  # a call whose observation differs only in whitespace reproduced: it is no divergence
            name
            for name in statuses(mixed_batch)
            if any(
                call["match"] == "diverged"
                for call in (_record(mixed_batch / name)["observations"] or {}).get("calls", [])
            )
        }
        assert "drifts" in diverging and "exact" not in diverging
        assert set(page.js(rows)) == diverging
        page.js("document.getElementById('filter-diverged').click()")

        # The sort: by duration, longest first after two clicks; by item id.
        page.js("document.querySelector('th[data-key=duration]').click()")
        page.js("document.querySelector('th[data-key=duration]').click()")
        # the page's rows have each duration to the hundredth of a second (gather's _compact); equal ones stay in
        # manifest order
        totals = {name: round(_record(mixed_batch / name)["timings"]["total"], 2) for name in statuses(mixed_batch)}
        assert page.js(rows) == sorted(totals, key=lambda name: (-totals[name], manifest_order.index(name)))
        assert page.js("document.querySelector('th[data-key=duration]').className") == "num desc"
        page.js("document.querySelector('th[data-key=id]').click()")
        assert page.js(rows) == sorted(totals)

        # The diverged call, with its diff, in the item's details.
        page.js("document.querySelector('#items tr.item[data-id=drifts] a.toggle').click()")
        detail = "#items tr.detail[data-id=drifts]"
        assert page.js(f"document.querySelector('{detail} p').textContent") == (
            "0 of 1 replayed calls reproduced their observation exactly, 1 diverged."
        )
        call = page.js(
            f"[...document.querySelectorAll('{detail} tr.call')].map(r => [r.dataset.outcome, "
            "r.querySelector('code').textContent, r.querySelector('pre.diff').textContent])"
        )
        assert call == [["diverged", LISTING, "@@ -1,3 +1,3 @@\n alpha\n-BETA\n+beta\n gamma"]]
        assert page.js(f"document.querySelector('{detail} pre.diff .del').textContent") == "-BETA"

        # Across items: the command that diverged, by command.
        groups = page.js(
            "[...document.querySelectorAll('#by-command tr.group')].map(r => [...r.cells].map(c => c.textContent))"
        )
        assert ["Bash", LISTING, "1", "1", "drifts"] in groups

        # The continued item's next action against the recording's (Edit recorded; the stub runs Bash).
        page.js("document.querySelector('#items tr.item[data-id=continues] a.toggle').click()")
        next_action = page.js("document.querySelector('#items tr.detail[data-id=continues] .next-action').textContent")
        assert next_action.startswith("Next action: different tools; neither has text.")
        assert "recordedEdit /workspace/g.txt" in next_action
        assert "continuedBash echo continued > continued.txt" in next_action

        shot = page.screenshot(tmp_path / "report.png", full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    keep = os.environ.get("PVISOR_HOST_SCREENSHOT")
    if keep:
        shutil.copyfile(shot, keep)


def set_control(page, element_id: str, value: str, event: str) -> None:
    """What a person typing into (or choosing in) a control does: the value changes, the event fires."""
    page.js(
        f"(() => {{ const e = document.getElementById({json.dumps(element_id)}); e.value = {json.dumps(value)}; "
        f"e.dispatchEvent(new Event({json.dumps(event)})); }})()"
    )


def _record(item_dir: Path) -> dict:
    return json.loads((item_dir / "record.json").read_text())


def _comparison(item_dir: Path) -> list[dict]:
    path = item_dir / "output" / "observation-comparison.json"
    return json.loads(path.read_text()) if path.exists() else []


def test_the_report_of_a_hundred_thousand_items(mixed_batch, chromium, tmp_path):
    """Within 10 MB and 300 MB of memory to write, every item in its aggregates, its rows paged and filtered."""
    big = linked_copy(mixed_batch, tmp_path / "big", 100_000)
    cli = str(Path(sys.executable).parent / "pvisor-host")
    process = subprocess.Popen([cli, "report", str(big)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    assert process.returncode == 0, process.stderr.read() if process.stderr else ""
    assert usage.ru_maxrss * 1024 <= 300 * 2**20, f"writing the report took {usage.ru_maxrss // 1024} MiB"
    page = big / "report.html"
    assert page.stat().st_size <= 10 * 2**20, f"report.html is {page.stat().st_size} bytes"
    with Browser(chromium, timeout=90) as browser:
        view = browser.open(page.as_uri())
        view.wait_for("document.querySelectorAll('#items tr.item').length > 0")
        assert view.js("document.getElementById('shown').textContent") == "100000 of 100000 items"
        assert view.js("document.querySelectorAll('#items tr.item').length") == 100  # one page at a time
        assert view.js("document.getElementById('page').textContent") == "page 1 of 1000"
        bars = view.js(
            "[...document.querySelectorAll('#chart-status g.bar')].map(g => [g.dataset.name, +g.dataset.count])"
        )
        assert sum(count for _, count in bars) == 100_000  # the aggregates count every item
        set_control(view, "filter-status", "timeout", "change")
        assert view.js("document.getElementById('shown').textContent") == "16667 of 100000 items"
        view.js("document.getElementById('page-next').click()")
        assert view.js("document.getElementById('page').textContent") == "page 2 of 167"
        ids = view.js("[...document.querySelectorAll('#items tr.item')].map(r => r.dataset.id)")
        assert len(ids) == 100 and all(i.startswith("slow-") for i in ids)
        set_control(view, "filter-status", "", "change")
        set_control(view, "filter-text", "drifts-000007", "input")
        assert view.js("[...document.querySelectorAll('#items tr.item')].map(r => r.dataset.id)") == ["drifts-000007"]
