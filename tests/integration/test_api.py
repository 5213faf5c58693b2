"""The public Python API against the real engine, through the shipped examples: six items with two failing,
leaving the loop after three (nothing left running, three complete records, the rest run on the second
call), the same with asyncio, and two batches at once from two threads."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest

import pvisor_host

from conftest import ROOT

pytestmark = pytest.mark.docker


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ours_running(client) -> list[str]:
    return [c.name for c in client.containers.list(all=True, filters={"label": "pvisor-host.role=replay"})]


def complete_records(out: Path) -> dict[str, dict]:
    """Item id → record, for the items that ended with a final status."""
    records = {p.parent.name: json.loads(p.read_text()) for p in out.glob("*/record.json")}
    return {item: r for item, r in records.items() if r["status"] != "interrupted"}


def test_six_items_two_of_them_failing(tmp_path, claude_image):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "api_batch.py"), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(line.split()[:3] for line in done.stdout.splitlines()[:6])
    assert lines == [
        ["step1", "ok"], ["step2", "ok"], ["step3", "ok"], ["step4", "ok"],
        ["step7", "rejected", "trajectory_error"], ["step9", "rejected", "trajectory_error"],
    ]  # fmt: skip
    assert done.stderr == ""  # the library prints nothing and installs no log sink
    records = complete_records(tmp_path / "out")
    assert {item: r["status"] for item, r in records.items()} == {
        "step1": "ok", "step2": "ok", "step3": "ok", "step4": "ok"
    }  # fmt: skip
    rows = {row["id"]: row for row in map(json.loads, (tmp_path / "out" / "results.jsonl").read_text().splitlines())}
    assert "trajectory has 4 complete batches" in rows["step9"]["message"]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["counts"] == {"ok": 4, "rejected": 2}


def test_leaving_the_loop_stops_the_batch_and_a_second_call_runs_only_the_rest(
    tmp_path, claude_image, docker_client, capfd
):
    resume = example("api_resume")
    out = tmp_path / "out"
    finished = resume.first_three(out)
    assert len(finished) == 3
    assert ours_running(docker_client) == []  # every sandbox of the batch is gone once the loop is left
    done = complete_records(out)
    assert set(finished) <= set(done)
    for item in finished:
        record = done[item]
        assert record["status"] == "ok" and record["result"]["phase"] == "replayed"
        assert all((out / item / a["path"]).is_file() for a in record["artifacts"])
    assert json.loads((out / "summary.json").read_text())["interrupted"] is (len(done) < 6)
    assert capfd.readouterr() == ("", "")

    again = pvisor_host.batch(resume.SPECS, out=out, workers=2)
    ran = [r.id for r in again if not r.skipped]
    assert again.summary is not None and again.summary.counts == {"ok": 6}
    assert again.summary.skipped == len(done) and again.summary.ran == len(ran) == 6 - len(done)
    assert not set(ran) & set(done)  # only the rest ran
    assert ours_running(docker_client) == []


def test_the_asyncio_form_stops_and_resumes_the_same_way(tmp_path, claude_image, docker_client):
    asynchronous = example("api_async")
    out = tmp_path / "out"
    finished = asyncio.run(asynchronous.first_three(out))
    assert len(finished) == 3
    assert ours_running(docker_client) == []
    done = complete_records(out)
    assert set(finished) <= set(done) and all(done[item]["status"] == "ok" for item in finished)
    results = asyncio.run(asynchronous.the_rest(out))
    ran = [r.id for r in results if not r.skipped]
    assert sorted(ran + list(done)) == sorted(f"item{n}" for n in range(6))  # only the rest ran
    assert all(r.status == "ok" for r in results)
    assert ours_running(docker_client) == []
    assert asyncio.run(asynchronous.main(tmp_path / "again")) == 0  # the loop kept ticking all along


def test_two_batches_at_once_from_two_threads(tmp_path, claude_image, docker_client):
    trajectory = ROOT / "examples" / "claude-code-demo.jsonl"
    outcomes: dict[str, object] = {}

    def run(name: str, host: str | None) -> None:
        items = [{"id": f"{name}{n}", "trajectory": trajectory, "after_step": n} for n in (1, 2, 3)]
        batch = pvisor_host.batch(
            items, out=tmp_path / name, workers=2, defaults={"agent": "claude-code", "mode": "replay-only"},
            docker_host=host,
        )  # fmt: skip
        outcomes[name] = [r.id for r in batch], batch.summary

    threads = [
        threading.Thread(target=run, args=(n, h)) for n, h in (("a", None), ("b", "unix:///var/run/docker.sock"))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    for name in ("a", "b"):
        ids, summary = outcomes[name]  # type: ignore[misc]
        assert sorted(ids) == [f"{name}1", f"{name}2", f"{name}3"]
        assert summary.counts == {"ok": 3} and not summary.interrupted
    assert ours_running(docker_client) == []
