"""`pvisor-host batch` and `gc` against the real engine, the real sandbox image and the real pvisor: mixed
outcomes and their reports, resume, interruption at random moments, kill -9 then gc, and retries.

Cleanup speed (16 running sandboxes gone after Ctrl-C) is printed here and measured in the closing notes;
like every timing goal it is not asserted in a test."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from docker.errors import NotFound

from conftest import run_cli, start_cli
from trajgen import Call, Turn, claude_files_session, claude_session, write_jsonl

pytestmark = pytest.mark.docker

HOG = "python3 -c 'b = bytearray(1 << 30); print(len(b))'"


def ok_session(n: int) -> list[dict]:
    """A valid session whose bytes differ per ``n`` (so each item has its own trajectory and content key)."""
    return claude_session(
        f"Task number {n}.",
        [
            Turn([Call("Bash", {"command": f"echo {n} > n.txt", "description": "write"})]),
            Turn([Call("Bash", {"command": "cat n.txt", "description": "read"}, f"{n}")]),
        ],
    )


def one_call(command: str, n: int = 0) -> list[dict]:
    return claude_session(f"Run {n}.", [Turn([Call("Bash", {"command": command, "timeout": 120000})])])


def mixed_manifest(root: Path) -> tuple[Path, dict[str, str]]:
    """40 items: 32 ok, 2 malformed, 2 of another Claude version (both refused by pvisor's pre-flight on the
    host), 2 timeouts, 2 OOM kills."""
    root.mkdir(parents=True, exist_ok=True)
    lines: list[dict] = []
    expected: dict[str, str] = {}
    for n in range(32):
        write_jsonl(root / f"ok{n:02d}.jsonl", ok_session(n))
        lines.append({"id": f"ok{n:02d}", "trajectory": f"ok{n:02d}.jsonl", "after_step": 1 + n % 2})
        expected[f"ok{n:02d}"] = "ok"
    for n in range(2):
        (root / f"broken{n}.jsonl").write_text('{"type": "user", "message": {"content": "x"\n')
        lines.append({"id": f"broken{n}", "trajectory": f"broken{n}.jsonl", "after_step": 1})
        expected[f"broken{n}"] = "rejected"
        write_jsonl(
            root / f"old{n}.jsonl",
            claude_session(f"Old {n}.", [Turn([Call("Bash", {"command": "true"})])], version="2.1.0"),
        )
        lines.append({"id": f"old{n}", "trajectory": f"old{n}.jsonl", "after_step": 1})
        expected[f"old{n}"] = "rejected"
        write_jsonl(root / f"slow{n}.jsonl", one_call("sleep 60", n))
        lines.append({"id": f"slow{n}", "trajectory": f"slow{n}.jsonl", "after_step": 1, "timeout": "3s"})
        expected[f"slow{n}"] = "timeout"
        write_jsonl(root / f"hog{n}.jsonl", one_call(HOG, n))
        hog = {"id": f"hog{n}", "trajectory": f"hog{n}.jsonl", "after_step": 1, "memory": "200m", "tmp_size": "16m"}
        lines.append(hog)
        expected[f"hog{n}"] = "oom"
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return manifest, expected


def batch(manifest: Path, out: Path, *args: str | Path, env: dict[str, str] | None = None):
    return run_cli(
        "batch", "--manifest", manifest, "--agent", "claude-code", "--mode", "replay-only", "--out", out, *args, env=env
    )


def summary_of(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def record_of(path: Path) -> dict:
    return json.loads((path / "record.json").read_text())


def test_mixed_outcomes_reports_resume_and_rerun(tmp_path, claude_image, containers_created):
    manifest, expected = mixed_manifest(tmp_path / "data")
    out = tmp_path / "out"
    step_summary = tmp_path / "step-summary.md"
    step_summary.write_text("earlier step\n")

    result = batch(manifest, out, "--workers", "4", env={"GITHUB_STEP_SUMMARY": str(step_summary)})
    assert result.code == 1, result.stderr
    summary = summary_of(out)
    assert summary["counts"] == {"ok": 32, "oom": 2, "rejected": 4, "timeout": 2}
    assert summary["categories"] == {"oom": 2, "timeout": 2, "trajectory_error": 2, "unsupported_version": 2}
    assert (summary["items"], summary["ran"], summary["skipped"], summary["interrupted"]) == (40, 36, 0, False)
    assert sorted(summary["failed"]) == sorted(k for k, v in expected.items() if v != "ok")
    assert summary["timings"]["run"]["p50"] > 0 and summary["replays_per_minute"] > 0
    for item, status in expected.items():
        if status == "rejected":  # refused by pvisor on the host: no sandbox, no record
            assert not (out / item / "record.json").exists(), item
            continue
        record = record_of(out / item)
        assert record["status"] == status, item
        assert record["batch"]["item_id"] == item and len(record["batch"]["content_key"]) == 64
        assert record["attempts"] == []  # nothing here is worth a retry (OOM only with --retry-oom)
    rows = {row["id"]: row for row in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert rows["broken0"]["category"] == "trajectory_error"
    assert "Claude trajectory requires exact version 2.1.220" in rows["old0"]["message"]

    suite = ET.parse(out / "junit.xml").getroot().find("testsuite")
    assert suite is not None
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("40", "8", "0")
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    assert set(cases) == set(expected)
    failure = cases["old1"].find("failure")
    assert failure is not None and failure.get("type") == "unsupported_version"
    assert cases["ok00"].find("failure") is None
    markdown = step_summary.read_text()
    assert markdown.startswith("earlier step\n### pvisor-host batch\n")
    assert "| ok | 32 |" in markdown and "| trajectory_error | 2 |" in markdown

    # The same command again: every item has a complete record with the same key, so nothing runs.
    since = time.time()
    again = batch(manifest, out, "--workers", "4")
    assert again.code == 1, again.stderr
    resumed = summary_of(out)
    assert (resumed["ran"], resumed["skipped"]) == (0, 36)  # the four refused are refused again, on the host
    assert resumed["counts"] == summary["counts"] and resumed["categories"] == summary["categories"]
    assert [c for c in containers_created(since) if "pvisor-host.run" in c] == []

    # Edit one trajectory: exactly that item reruns, and its earlier run is kept aside.
    write_jsonl(tmp_path / "data" / "ok07.jsonl", ok_session(1007))
    before = record_of(out / "ok07")
    since = time.time()
    edited = batch(manifest, out, "--workers", "4")
    assert edited.code == 1, edited.stderr
    assert (summary_of(out)["ran"], summary_of(out)["skipped"]) == (1, 35)
    assert len([c for c in containers_created(since) if "pvisor-host.run" in c]) == 1
    after = record_of(out / "ok07")
    assert after["status"] == "ok" and after["batch"]["content_key"] != before["batch"]["content_key"]
    (kept,) = (out / ".previous" / "ok07").iterdir()
    assert record_of(kept)["run_id"] == before["run_id"]

    # --rerun-failed reruns the four that failed in a sandbox (the refused four are refused again on the host);
    # --allow-failures turns the eight failures into exit 0.
    rerun = batch(manifest, out, "--workers", "4", "--rerun-failed", "--allow-failures", "20%")
    assert rerun.code == 0, rerun.stderr
    assert (summary_of(out)["ran"], summary_of(out)["counts"]) == (4, summary["counts"])


def interruptible_manifest(root: Path, items: int, command: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for n in range(items):
        write_jsonl(root / f"t{n:02d}.jsonl", one_call(command, n))
        lines.append({"id": f"t{n:02d}", "trajectory": f"t{n:02d}.jsonl", "after_step": 1})
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return manifest


def replay_containers(client) -> list:
    return client.containers.list(all=True, filters={"label": "pvisor-host.role=replay"})


@pytest.fixture
def start_batch():
    """Start a batch in the background; any still running when the test ends is interrupted and awaited,
    so a failing test cannot leave a batch (and its sandboxes) running."""
    started: list[subprocess.Popen[str]] = []

    def start(manifest: Path, out: Path, *args: str) -> subprocess.Popen[str]:
        process = start_cli(
            "batch", "--manifest", manifest, "--agent", "claude-code", "--mode", "replay-only", "--out", out, *args
        )
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            process.communicate(timeout=120)


def wait_for_containers(client, count: int, process: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    running = {"label": "pvisor-host.role=replay", "status": "running"}
    while len(client.containers.list(sparse=True, filters=running)) < count:
        if process.poll() is not None or time.monotonic() > deadline:
            process.send_signal(signal.SIGINT)
            _, stderr = process.communicate(timeout=120)
            pytest.fail(f"{count} sandboxes never ran at once: exit {process.returncode}: {stderr}")
        time.sleep(0.1)


def test_sigint_at_random_moments_leaves_nothing_and_resumes_to_the_same_summary(
    tmp_path, docker_client, claude_image, start_batch
):
    manifest = interruptible_manifest(tmp_path / "data", 12, "sleep 1 && echo done > done.txt")
    reference = tmp_path / "reference"
    clean = batch(manifest, reference, "--workers", "4")
    assert clean.code == 0, clean.stderr
    out = tmp_path / "out"
    seed = random.randrange(1 << 30)
    moments = random.Random(seed).sample([0.3, 0.8, 1.5, 2.2, 3.0, 4.0], 3)
    for moment in moments:
        before = {path: path.stat().st_mtime_ns for path in out.glob("*/record.json")}
        (out / "summary.json").unlink(missing_ok=True)  # so a summary found below is this run's
        process = start_batch(manifest, out, "--workers", "4")
        time.sleep(moment)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
        assert process.returncode in (130, 0), f"seed {seed}, moment {moment}: {stderr}"
        assert replay_containers(docker_client) == [], f"seed {seed}, moment {moment}: containers left"
        for record in out.glob("*/record.json"):  # atomically written: every record parses
            json.loads(record.read_text())
        if process.returncode == 130 and (out / "summary.json").exists():
            assert summary_of(out)["interrupted"] is True
            rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
            assert len(rows) == 12 and all(row["after_step"] == 1 for row in rows), f"seed {seed}, moment {moment}"
            assert sum(summary_of(out)["counts"].values()) == 12  # the counts add up: not_run for what never ran
        elif process.returncode == 130:  # interrupted while starting up, before the batch began
            after = {path: path.stat().st_mtime_ns for path in out.glob("*/record.json")}
            assert after == before, f"seed {seed}, moment {moment}: items ran but no summary"
    final = batch(manifest, out, "--workers", "4")
    assert final.code == 0, final.stderr
    summary, expected = summary_of(out), summary_of(reference)
    assert summary["counts"] == expected["counts"] == {"ok": 12}
    assert summary["categories"] == expected["categories"] and summary["interrupted"] is False
    assert not list(out.rglob(".pvisor-host-staging"))


def test_ctrl_c_stops_16_running_sandboxes_and_a_second_one_does_not_skip_cleanup(
    tmp_path, docker_client, claude_image, start_batch
):
    manifest = interruptible_manifest(tmp_path / "data", 20, "sleep 120")
    out = tmp_path / "out"
    process = start_batch(manifest, out, "--workers", "16", "--memory", "256m")
    wait_for_containers(docker_client, 16, process)
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    time.sleep(0.2)
    process.send_signal(signal.SIGINT)  # impatient user: the cleanup still finishes
    _, stderr = process.communicate(timeout=120)
    print(f"16 running sandboxes stopped and removed in {time.monotonic() - started:.1f}s")
    assert process.returncode == 130, stderr
    assert replay_containers(docker_client) == []
    summary = summary_of(out)
    assert summary["interrupted"] is True and summary["counts"].get("interrupted", 0) >= 16
    interrupted = [record_of(path.parent) for path in out.glob("*/record.json")]
    assert len(interrupted) == 16 and {r["status"] for r in interrupted} == {"interrupted"}
    assert "pvisor-host: interrupted" in stderr


def dead_owner() -> str:
    """The owner id of a process that has exited (its pid may be reused, its start time will not)."""
    from pvisor_host.models.ownership import process_start_ticks

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    ticks = process_start_ticks(child.pid)
    child.wait()
    return f"{socket.gethostname()}/{child.pid}/{ticks}"


def test_a_closed_terminal_stops_the_batch_and_removes_its_sandboxes(
    tmp_path, docker_client, claude_image, start_batch
):
    """SIGHUP with stderr already gone (the terminal or the CI step's parent went away): still a full cleanup."""
    manifest = interruptible_manifest(tmp_path / "data", 6, "sleep 120")
    out = tmp_path / "out"
    process = start_batch(manifest, out, "--workers", "3")
    wait_for_containers(docker_client, 3, process)
    assert process.stderr is not None
    process.stderr.close()
    process.send_signal(signal.SIGHUP)
    assert process.wait(timeout=120) == 130
    assert replay_containers(docker_client) == []
    assert summary_of(out)["counts"] == {"interrupted": 6}


def test_kill_9_then_gc_removes_only_orphans(tmp_path, docker_client, claude_image, base_image, start_batch):
    from pvisor_host.backend.docker import labels as L
    from pvisor_host.models.ownership import Ownership

    # A crashed earlier run may have left orphans of its own: sweep them, so the listing below is this test's.
    assert run_cli("gc").code == 0
    manifest = interruptible_manifest(tmp_path / "data", 4, "sleep 120")
    out = tmp_path / "out"
    process = start_batch(manifest, out, "--workers", "4")
    wait_for_containers(docker_client, 4, process)
    process.kill()
    process.communicate(timeout=30)
    orphans = {c.name for c in replay_containers(docker_client)}
    assert len(orphans) == 4

    def labels(owner: str) -> dict[str, str]:
        return {L.MANAGED: "true", L.ROLE: "test", L.OWNER: owner, L.SESSION: "gc-test"}

    me = Ownership.current().owner
    dead = dead_owner()
    # Names unique to this run, so that leftovers of an earlier one cannot collide with them.
    tag = uuid.uuid4().hex[:8]
    orphan, live, other, unlabelled = (f"pvh-gc-test-{tag}-{n}" for n in ("orphan", "live", "other-host", "unlabelled"))
    network = docker_client.networks.create(orphan, internal=True, labels=labels(dead))
    volume = docker_client.volumes.create(orphan, labels=labels(dead))
    keep = [
        docker_client.containers.create(base_image, "true", name=live, labels=labels(me)),
        docker_client.containers.create(base_image, "true", name=other, labels=labels("elsewhere/1/1")),
        docker_client.containers.create(base_image, "true", name=unlabelled),
    ]
    try:
        listed = run_cli("gc", "--dry-run", "--json")
        assert listed.code == 0, listed.stderr
        found = json.loads(listed.stdout)
        names = {(r["kind"], r["name"]) for r in found["orphans"]}
        assert names == {("container", n) for n in orphans} | {
            ("network", orphan),
            ("volume", orphan),
        }
        assert {c.name for c in replay_containers(docker_client)} == orphans  # a dry run removes nothing

        removed = run_cli("gc")
        assert removed.code == 0, removed.stderr
        assert replay_containers(docker_client) == []
        assert docker_client.networks.list(names=[orphan]) == []
        assert orphan not in {v.name for v in docker_client.volumes.list()}
        for container in keep:
            container.reload()  # still there: a live owner, another host, and no labels at all
        assert run_cli("gc", "--json").stdout.count('"kind"') == 0
    finally:
        for container in keep:
            container.remove(force=True)
        for leftover in (network, volume):
            with contextlib.suppress(NotFound):  # removed by gc, as it should be
                leftover.remove()

    # The killed batch left staging (env.sh included) in its item directories; the next run clears it.
    rerun = batch(manifest, out, "--workers", "4", "--timeout", "2s")
    assert rerun.code == 1, rerun.stderr
    assert summary_of(out)["counts"] == {"timeout": 4}
    assert not list(out.rglob(".pvisor-host-staging"))


def test_transient_engine_errors_are_retried_and_trajectory_errors_are_not(tmp_path, claude_image, monkeypatch):
    """In-process, so the engine calls can be made to fail: the first container create answers 503 (retried
    in place), the first container start fails (a fresh sandbox, attempt 2); a broken trajectory is refused."""
    import docker.api.client as client
    import docker.api.container as api
    from docker.errors import APIError

    from pvisor_host import cli

    failures = {"create": 1, "start": 1}
    real_create, real_post = api.ContainerApiMixin.create_container, client.APIClient._post

    def create(self, *args, **kwargs):
        if failures["create"]:
            failures["create"] -= 1
            raise APIError("injected", explanation="service unavailable (injected)", response=_Response(503))
        return real_create(self, *args, **kwargs)

    def post(self, url, *args, **kwargs):  # the start request, however it is made (with a timeout of its own)
        if url.endswith("/start") and "/containers/" in url and failures["start"]:
            failures["start"] -= 1
            raise APIError("injected", explanation="cannot start container (injected)", response=_Response(500))
        return real_post(self, url, *args, **kwargs)

    monkeypatch.setattr(api.ContainerApiMixin, "create_container", create)
    monkeypatch.setattr(client.APIClient, "_post", post)
    root = tmp_path / "data"
    root.mkdir()
    write_jsonl(root / "good.jsonl", claude_files_session())
    (root / "broken.jsonl").write_text('{"type": "user"\n')
    manifest = root / "m.jsonl"
    manifest.write_text(
        json.dumps({"id": "good", "trajectory": "good.jsonl", "after_step": 2})
        + "\n"
        + json.dumps({"id": "broken", "trajectory": "broken.jsonl", "after_step": 1})
        + "\n"
    )
    out = tmp_path / "out"
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.getsignal(sig) for sig in handled}  # main() sets them up for a CLI process
    try:
        with pytest.raises(SystemExit) as exited:
            cli.main(["batch", "--manifest", str(manifest), "--agent", "claude-code", "--mode", "replay-only",
                      "--out", str(out), "--workers", "1", "--retry-backoff", "1s"])  # fmt: skip
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert exited.value.code == 1
    assert failures == {"create": 0, "start": 0}
    good = record_of(out / "good")
    assert good["status"] == "ok"
    assert [(a["attempt"], a["status"]) for a in good["attempts"]] == [(1, "infra_error"), (2, "ok")]
    assert "cannot start container (injected)" in good["attempts"][0]["failure"]["message"]
    assert record_of(out / "good" / "attempts" / "1")["status"] == "infra_error"
    # a broken trajectory is refused by pvisor on the host, once: no sandbox, no attempt, no record
    rows = {row["id"]: row for row in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert (rows["broken"]["status"], rows["broken"]["category"], rows["broken"]["attempts"]) == (
        "rejected",
        "trajectory_error",
        0,
    )
    assert not (out / "broken" / "record.json").exists() and not (out / "broken" / "attempts").exists()


class _Response:
    """Just enough of a requests response for docker's APIError to report a status code."""

    def __init__(self, status: int) -> None:
        self.status_code = status
        self.reason = "injected"
        self.url = "http+docker://localhost/injected"


def test_plan_starts_nothing_and_its_keys_are_the_run_keys(tmp_path, claude_image, containers_created):
    root = tmp_path / "data"
    root.mkdir()
    write_jsonl(root / "a.jsonl", claude_files_session())
    (root / "broken.jsonl").write_text('{"type": "user"\n')
    write_jsonl(root / "v1.2.jsonl", claude_files_session())  # its item ids hold a '.', which a run id may not
    out = tmp_path / "out"
    since = time.time()
    planned = run_cli(
        "batch", "--trajectories", root / "*.jsonl", "--after-step", "all", "--agent", "claude-code",
        "--mode", "replay-only", "--out", out, "--plan", "--json", "--memory", "1g",
    )  # fmt: skip
    assert planned.code == 1, planned.stderr  # the broken trajectory is rejected by the host pvisor, as the run would
    plans = {p["id"]: p for p in json.loads(planned.stdout)}
    assert list(plans) == [
        *[f"a-after{n}" for n in range(1, 6)],
        "broken-after1",
        *[f"v1.2-after{n}" for n in range(1, 6)],
    ]
    assert {plans[f"v1.2-after{n}"]["action"] for n in range(1, 6)} == {"run"}
    assert plans["broken-after1"]["action"] == "reject"
    assert "trajectory_error" in plans["broken-after1"]["reason"]
    first = plans["a-after1"]
    assert first["action"] == "run" and first["image"] == claude_image and first["limits"]["memory"] == 2**30
    assert f"{out}/a-after1/.pvisor-host-staging/input:/pvisor-host/input:ro" in first["mounts"]
    assert first["command"][3:8] == ["replay", "--agent", "claude-code", "--trajectory", "/pvisor-host/input/a.jsonl"]
    assert [c for c in containers_created(since) if "pvisor-host.run" in c] == []
    assert not out.exists()

    ran = run_cli(
        "batch", "--trajectories", root / "a.jsonl", "--after-step", "all", "--agent", "claude-code",
        "--mode", "replay-only", "--out", out, "--memory", "1g",
    )  # fmt: skip
    assert ran.code == 0, ran.stderr
    for item in ("a-after1", "a-after5"):
        assert record_of(out / item)["batch"]["content_key"] == plans[item]["content_key"]
    replanned = run_cli(
        "batch", "--trajectories", root / "a.jsonl", "--after-step", "all", "--agent", "claude-code",
        "--mode", "replay-only", "--out", out, "--plan", "--json", "--memory", "1g",
    )  # fmt: skip
    assert {p["action"] for p in json.loads(replanned.stdout)} == {"skip"}


DATA = Path(__file__).resolve().parents[1] / "data" / "trajectories"


def test_plan_and_run_agree_verdict_by_verdict(tmp_path, claude_image, containers_created):
    """One mixed manifest, planned then run: every item the plan rejects, the run rejects with the same words,
    and every item the plan runs ends ok. What the host can tell starts no sandbox, in either."""
    root = tmp_path / "data"
    root.mkdir()
    write_jsonl(root / "good.jsonl", claude_files_session())
    (root / "opencode.jsonl").write_bytes((DATA / "opencode-contract-shape.jsonl").read_bytes())
    lines = [
        {"id": "good1", "trajectory": "good.jsonl", "after_step": 1},
        {"id": "good5", "trajectory": "good.jsonl", "after_step": 5},
        {"id": "unbuildable", "trajectory": "opencode.jsonl", "after_step": 1},  # OpenCode 1.17.7: not here
        {"id": "past-the-end", "trajectory": "good.jsonl", "after_step": 9},
        {"id": "no-workspace", "trajectory": "good.jsonl", "after_step": 1, "image": claude_image,
         "image_workspace": True, "workspace_path": "/srv/nothing-here"},
    ]  # fmt: skip
    manifest = root / "m.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    common = ("--mode", "replay-only", "--memory", "1g", "--out", tmp_path / "out")
    since = time.time()
    planned = run_cli("batch", manifest, *common, "--plan", "--json")
    assert planned.code == 1, planned.stderr  # as the run exits: three items not ok
    assert [c for c in containers_created(since) if "pvisor-host.run" in c] == []
    verdicts = {p["id"]: (p["action"], p["reason"]) for p in json.loads(planned.stdout)}
    assert {item: action for item, (action, _) in verdicts.items()} == {
        "good1": "run", "good5": "run", "unbuildable": "reject", "past-the-end": "reject", "no-workspace": "reject",
    }  # fmt: skip
    assert verdicts["unbuildable"][1].startswith("cannot build opencode 1.17.7 here: OpenCode 1.17.7 is not on")
    assert verdicts["past-the-end"][1] == (
        "pvisor rejected the replay (trajectory_error): requested after-step 9, trajectory has 5 complete batches"
    )
    assert verdicts["no-workspace"][1] == (
        "--image-workspace: the image has nothing at /srv/nothing-here (pass the right --workspace-path)"
    )
    text = run_cli("batch", manifest, *common, "--plan")  # one line per item, then the total
    assert text.code == 1
    assert text.stdout.splitlines()[:2] == [
        f"good1  claude-code  after 1  {claude_image}  run",
        f"good5  claude-code  after 5  {claude_image}  run",
    ]
    assert "5 items: 2 to run, 0 to skip, 3 rejected" in text.stdout.splitlines()

    since = time.time()
    ran = run_cli("batch", manifest, *common)
    assert ran.code == 1, ran.stderr
    rows = {row["id"]: row for row in map(json.loads, (tmp_path / "out" / "results.jsonl").read_text().splitlines())}
    for item, (action, reason) in verdicts.items():
        if action == "run":
            assert rows[item]["status"] == "ok", item
        else:
            assert (rows[item]["status"], rows[item]["message"]) == ("rejected", reason), item
            assert not (tmp_path / "out" / item).exists(), item  # refused before its directory was made
    started = [c for c in containers_created(since) if c.get("pvisor-host.role") == "replay"]
    assert len(started) == 2  # the two good items' sandboxes, nothing for the rejected ones
    listed = [line.split()[0] for line in ran.stdout.splitlines() if line.startswith("  ")]
    assert listed == ["unbuildable", "past-the-end", "no-workspace"]  # under the table: each item not ok


def test_a_reason_every_item_shares_is_one_line_and_nothing_runs(tmp_path, claude_image, containers_created):
    """No --mode (continue) and no model, a cassette that is not there, an agent that cannot be built here: the
    whole batch is refused in one line, exit 2, before any pull or sandbox, and nothing is written."""
    root = tmp_path / "data"
    root.mkdir()
    write_jsonl(root / "t.jsonl", claude_files_session())
    (root / "o.jsonl").write_bytes((DATA / "opencode-contract-shape.jsonl").read_bytes())
    out = tmp_path / "out"
    since = time.time()
    cases = {
        ("--trajectories", root / "t.jsonl"): "pvisor-host: error: every item: --mode continue lets the agent call "
        "its model, which --network none cannot reach (pass --model-base-url URL --model NAME --model-api-key-env "
        "VAR: a host-side gateway keeps the key)",
        ("--trajectories", root / "t.jsonl", "--model", "m", "--model-cassette", "replay", tmp_path / "nowhere"):
        f"pvisor-host: error: every item: --model-cassette replay {tmp_path / 'nowhere'}: no such directory (record "
        "one with --model-cassette record DIR)",
        ("--trajectories", root / "o.jsonl", "--mode", "replay-only"): "pvisor-host: error: every item: cannot build "
        "opencode 1.17.7 here: ",
        ("--trajectories", root / "t.jsonl", "--mode", "replay-only", "--memory", "4"): "pvisor-host: error: "
        "--memory: 4 is 4 bytes, less than the 6 MiB a sandbox needs at least (sizes take a unit: did you mean 4g?)",
    }  # fmt: skip
    for args, line in cases.items():
        result = run_cli("batch", *args, "--after-step", "1,2", "--out", out)
        assert result.code == 2, result.stderr
        assert len(result.error_lines) == 1 and result.error_lines[0].startswith(line), result.stderr
        assert not out.exists()
    assert containers_created(since) == []


def test_a_task_image_whose_registry_does_not_resolve_fails_at_once(tmp_path, claude_image, containers_created):
    """A host without a registry: an image that is not here fails its items in about a second, not after minutes
    of backoff, with one line naming the image and its registry; --plan says the same."""
    root = tmp_path / "data"
    root.mkdir()
    for n in range(3):
        write_jsonl(root / f"t{n}.jsonl", claude_files_session(f"/w{n}"))
    args = ("--trajectories", root / "*.jsonl", "--after-step", "1", "--image", "nosuch.invalid/task:{stem}",
            "--inject", "--mode", "replay-only", "--out", tmp_path / "out")  # fmt: skip
    planned = run_cli("batch", *args, "--plan", "--json")
    assert planned.code == 1, planned.stderr
    reasons = {p["id"]: p["reason"] for p in json.loads(planned.stdout)}
    started = time.monotonic()
    ran = run_cli("batch", *args)
    took = time.monotonic() - started
    assert ran.code == 1, ran.stderr
    print(f"a batch of 3 unresolvable images ended in {took:.1f} s")
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [(r["status"], r["category"]) for r in rows] == [("rejected", "registry_unreachable")] * 3
    for row in rows:
        assert row["message"].startswith(
            f"image nosuch.invalid/task:{row['id'].removesuffix('-after1')} is not here and its registry "
            "nosuch.invalid does not resolve"
        )
        assert reasons[row["id"]] == row["message"]
