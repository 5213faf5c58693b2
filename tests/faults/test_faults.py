"""``make test-faults``: faults a batch must survive with nothing lost and nothing leaked, against the real
engine. After each: every finished item has a complete record, a rerun redoes only the unfinished ones, and
no labelled container, volume or network of ours remains.

These take minutes and one of them restarts the engine, so they are not part of ``make test``; ``.ci/run``
runs both.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pvisor_host.errors import ExitCode
from pvisor_host.signals import GIVE_UP_AFTER

from conftest import IN_CI, ROOT, run_cli, start_cli
from modelserver import StubServer
from trajgen import Call, Turn, claude_files_session, claude_session, write_jsonl

pytestmark = [pytest.mark.docker, pytest.mark.faults]

DEMO = ROOT / "examples" / "claude-code-demo.jsonl"  # four complete tool batches
PIDFILE = Path("/var/run/pvisor-host-dockerd.pid")


def ours(client, *, role: str | None = None) -> list:
    label = ["pvisor-host.managed=true"] + ([f"pvisor-host.role={role}"] if role else [])
    return client.containers.list(all=True, filters={"label": label}, sparse=True)


def nothing_of_ours_left(client, before: set[str]) -> None:
    deadline = time.monotonic() + 20
    while True:
        left = {c.id for c in ours(client)} - before
        left |= {n.id for n in client.networks.list(filters={"label": "pvisor-host.owner"})} - before
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"left behind: {left}"


def manifest(root: Path, items: int, *, command: str | None = None, **fields: object) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for n in range(items):
        if command is None:
            trajectory, after = DEMO, 1 + n % 4
        else:
            trajectory = write_jsonl(root / f"t{n}.jsonl", probe(command.replace("N", str(n))))
            after = 1
        lines.append(json.dumps({"id": f"i{n:03d}", "trajectory": str(trajectory), "after_step": after, **fields}))
    path = root / "m.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def probe(command: str) -> list[dict]:
    return claude_session("Fault.", [Turn([Call("Bash", {"command": command, "timeout": 600000})])])


def batch(path: Path, out: Path, *args: str | Path, env: dict[str, str] | None = None, timeout: float = 900):
    return run_cli(
        "batch", path, "--agent", "claude-code", "--mode", "replay-only", "--out", out, *args, env=env, timeout=timeout
    )


def finished(process: subprocess.Popen[str], seconds: float) -> str:
    """The stderr of a batch started with ``start_cli``, once it exits; one still running after ``seconds`` is
    interrupted (so that it removes its sandboxes), killed if that does not end it, and the test fails."""
    try:
        return process.communicate(timeout=seconds)[1]
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        try:
            stderr = process.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            process.kill()
            stderr = process.communicate()[1]
        pytest.fail(f"the batch ran past {seconds:.0f} s and was interrupted: {stderr[-3000:]}")


def records(out: Path) -> dict[str, dict]:
    found = {}
    for path in out.glob("*/record.json"):
        found[path.parent.name] = json.loads(path.read_text())  # a half-written record would not parse
    return found


def complete(record: dict, run_dir: Path) -> bool:
    return record["status"] != "interrupted" and all((run_dir / a["path"]).is_file() for a in record["artifacts"])


# -- the engine restarts mid-batch ----------------------------------------------------------------------------


def engine_is_ours() -> bool:
    try:
        pid = int(PIDFILE.read_text())
    except (OSError, ValueError):
        return False
    return host_dockerds() == [str(pid)]


def host_dockerds() -> list[str]:
    """The machine's own dockerd processes (not the engines of cluster nodes, which run in containers)."""
    pids = subprocess.run(["pgrep", "-x", "dockerd"], capture_output=True, text=True).stdout.split()
    in_container = re.compile(r"docker[-/][0-9a-f]{64}")
    return [pid for pid in pids if not in_container.search(Path(f"/proc/{pid}/cgroup").read_text(errors="replace"))]


def restart_engine() -> None:
    """Stop the dockerd that `make test` started and start it again (scripts/ensure-engine.sh)."""
    pid = int(PIDFILE.read_text())
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.5)  # what the engine's users see: nothing answers for a while
    subprocess.run([str(ROOT / "scripts" / "ensure-engine.sh")], check=True, capture_output=True)


def test_an_engine_restart_mid_batch_retries_the_running_items_and_leaves_no_container(tmp_path, docker_client):
    if not engine_is_ours():
        message = "the engine was not started by scripts/ensure-engine.sh; this test restarts only its own"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    path = manifest(tmp_path / "data", 10, command="sleep 4 && echo N > done.txt")
    out = tmp_path / "out"
    process = start_cli(
        "batch", path, "--agent", "claude-code", "--mode", "replay-only", "--out", out, "--workers", "4",
        "--retry-backoff", "3s", "--attempts", "4",
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while len(docker_client.containers.list(filters={"label": "pvisor-host.role=replay"})) < 4:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1]
        time.sleep(0.2)
    restart_engine()
    stderr = finished(process, 600)
    assert process.returncode == 0, stderr
    import docker

    client = docker.from_env()
    assert json.loads((out / "summary.json").read_text())["counts"] == {"ok": 10}
    done = records(out)
    assert len(done) == 10 and all(complete(r, out / item) for item, r in done.items())
    retried = [item for item, r in done.items() if r["attempts"]]
    assert retried, "no item was running when the engine went away"
    for item in retried:
        assert done[item]["attempts"][0]["status"] == "infra_error"
    # The sandboxes the restart interrupted could not be removed while the engine was away: the batch itself
    # removed them once it answered again, before it exited.
    assert ours(client, role="replay") == []
    assert "remove it with `pvisor-host gc`" not in stderr


def test_an_engine_restart_while_forks_continue_leaves_nothing_behind(tmp_path, docker_client):
    """``--fork 2``, the engine stopped and started again while both forks continue: each fork's record says the
    engine went away, the command exits with the infrastructure's code, and nothing of the run is left: no
    container, no checkpoint, no copy, no socket."""
    info = docker_client.info()
    missing = [m for m, ok in (("the engine was not started by scripts/ensure-engine.sh", engine_is_ours()),
               ("the fork runtime (runsc-fork, experimental mode) is missing", "runsc-fork" in info["Runtimes"]
                and info.get("ExperimentalBuild"))) if not ok]  # fmt: skip
    if missing:
        if IN_CI:
            pytest.fail("; ".join(missing))
        pytest.skip("; ".join(missing))
    trajectory = write_jsonl(tmp_path / "t.jsonl", claude_session("Fork.", [
        Turn([Call("Bash", {"command": "echo once >> once.txt", "description": "once"}, "")]), Turn(text="Done."),
    ]))  # fmt: skip
    out = tmp_path / "run"
    sockets = set(Path("/tmp").glob("pvh-[ge][wg]-*"))
    with StubServer(command="sleep 120") as stub:
        process = start_cli(
            "replay", "--agent", "claude-code", "--trajectory", trajectory, "--after-step", "1", "--max-steps", "6",
            "--model-base-url", stub.base_url, "--model", "stub-model", "--model-api-key-env", "PVH_FAULT_KEY",
            "--fork", "2", "--runtime", "runsc-fork", "--run-id", "fkeng", "--out", out, env={"PVH_FAULT_KEY": "k"},
        )  # fmt: skip
        deadline = time.monotonic() + 180
        while len(stub.model.model_requests()) < 2:  # both forks have asked their model: both continue
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1]
            time.sleep(0.1)
        restart_engine()
        stderr = finished(process, 300)
    assert process.returncode == ExitCode.INFRASTRUCTURE, stderr
    for k in (1, 2):
        record = json.loads((out / f"fork-{k}" / "record.json").read_text())
        assert (record["status"], record["fork"]["restored"]) == ("infra_error", True), record["failure"]
    import docker

    client = docker.from_env()
    assert [c for c in ours(client, role="replay") if c.labels.get("pvisor-host.run", "").startswith("fkeng")] == []
    assert not (out / ".pvisor-host-fork").exists() and not list(out.rglob(".pvisor-host-staging"))
    assert set(Path("/tmp").glob("pvh-[ge][wg]-*")) <= sockets


# -- the output directory's filesystem fills up ----------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=700k", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_stops_the_batch_with_one_line_and_a_rerun_finishes_it(tmp_path, small_disk, docker_client):
    before = {c.id for c in ours(docker_client)}
    path = manifest(tmp_path / "data", 20, command="head -c 150000 /dev/urandom > blob-N.bin")
    out = small_disk / "out"
    # One at a time, so that items finish before the disk fills: two items at once (a 150 KB blob collected,
    # and its patch, each) can fill the 700 KB together before either has finished.
    result = batch(path, out, "--workers", "1")
    assert result.code == 6, result.stderr
    lines = [line for line in result.error_lines if "is full" in line]
    assert len(lines) == 1, result.stderr
    assert re.fullmatch(
        rf"pvisor-host: error: the filesystem at {small_disk} is full \([\d.]+ (B|KiB) free\); each item here needs "
        r"about [\d.]+ (KiB|MiB); free space and run the same command again to finish",
        lines[0],
    ), lines[0]
    assert "internal" not in result.stderr and "Traceback" not in result.stderr
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None
    done = records(out)  # every record present parses: none is half-written
    finished = {item for item, r in done.items() if r["status"] == "ok" and complete(r, out / item)}
    assert finished and len(finished) < 20
    # The disk's fault is never the replay's: an item that hit it is an infrastructure failure, disk_full.
    assert all(r["status"] == "ok" or r["failure"]["category"] == "disk_full" for r in done.values())
    assert all(r["status"] in ("ok", "infra_error") for r in done.values())
    if summary is not None:
        assert summary["categories"].get("disk_full", 0) >= 1
        assert "replay_failed" not in summary["counts"]
    nothing_of_ours_left(docker_client, before)
    # Free the space (a bigger filesystem) and rerun: the finished items are skipped, the rest run.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    again = batch(path, out, "--workers", "2")
    assert again.code == 0, again.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"] == {"ok": 20} and summary["skipped"] == len(finished)


# -- a sandbox produces far too much ---------------------------------------------------------------------------


def controller_peak_rss(*args: str | Path) -> tuple[subprocess.CompletedProcess[str], int]:
    report = Path("/tmp") / f"pvh-rss-{os.getpid()}-{time.monotonic_ns()}"
    done = subprocess.run(
        ["/usr/bin/time", "-f", "%M", "-o", str(report), str(ROOT / ".venv" / "bin" / "pvisor-host"), *map(str, args)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    peak = int(report.read_text().strip().splitlines()[-1]) * 1024
    report.unlink()
    return done, peak


def test_an_artifact_far_above_the_collect_limit_is_capped_in_bounded_memory(tmp_path):
    trajectory = write_jsonl(
        tmp_path / "big.jsonl", probe("head -c 2500000000 /dev/zero > big.bin && echo ok > small.txt")
    )
    out = tmp_path / "run"
    done, peak = controller_peak_rss(
        "replay", "--agent", "claude-code", "--trajectory", trajectory, "--after-step", "1", "--mode", "replay-only",
        "--out", out, "--collect-limit", "200m", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["collection"]["truncated"] is True
    assert {s["path"]: s["reason"] for s in record["collection"]["skipped"]}["big.bin"].startswith("size cap reached")
    assert (out / "workspace" / "small.txt").read_text() == "ok\n" and not (out / "workspace" / "big.bin").exists()
    assert peak < 150 * 2**20, f"peak RSS {peak / 2**20:.0f} MiB"


def test_a_flood_on_stdout_and_stderr_is_capped_and_the_result_still_parsed(tmp_path):
    # A tool writes straight into the sandbox's log files, past the cap, tries to replace them, and floods the
    # container's own streams (PID 1's: the engine keeps no logs of a sandbox, so that goes nowhere).
    flood = (
        "head -c 100000000 /dev/zero | tr '\\0' x >> /pvisor-host/logs/stdout.log; "
        "head -c 100000000 /dev/zero >> /pvisor-host/logs/stderr.log; "
        "rm -f /pvisor-host/logs/stdout.log; mv /pvisor-host/logs/stderr.log /pvisor-host/logs/gone; "
        "head -c 100000000 /dev/zero > /proc/1/fd/1; echo ok > done.txt"
    )
    trajectory = write_jsonl(tmp_path / "flood.jsonl", probe(flood))
    out = tmp_path / "run"
    done, peak = controller_peak_rss(
        "replay", "--agent", "claude-code", "--trajectory", trajectory, "--after-step", "1", "--mode", "replay-only",
        "--out", out, "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout)
    assert record["status"] == "ok" and record["result"]["phase"] == "replayed"  # parsed despite the flood
    assert record["collection"]["logs_truncated"] is True
    assert (out / "logs" / "stdout.log").stat().st_size == 64 * 2**20
    assert (out / "logs" / "stderr.log").stat().st_size == 64 * 2**20
    assert peak < 150 * 2**20, f"peak RSS {peak / 2**20:.0f} MiB"


def test_a_tool_that_ignores_sigterm_and_forks_is_still_killed_at_the_timeout(tmp_path, docker_client):
    stubborn = "trap '' TERM; while :; do (trap '' TERM; sleep 300) & sleep 0.05; done"
    trajectory = write_jsonl(tmp_path / "stubborn.jsonl", probe(stubborn))
    out = tmp_path / "run"
    started = time.monotonic()
    result = run_cli(
        "replay", "--agent", "claude-code", "--trajectory", trajectory, "--after-step", "1", "--mode", "replay-only",
        "--out", out, "--timeout", "8s", "--pids", "128",
    )  # fmt: skip
    assert result.code == 4, result.stderr
    assert time.monotonic() - started < 60
    record = json.loads((out / "record.json").read_text())
    assert record["status"] == "timeout" and record["limits"]["pids"] == 128
    assert docker_client.containers.list(all=True, filters={"name": record["container"]["name"]}) == []


# -- no sandbox outlives its purpose ---------------------------------------------------------------------------


def require_our_engine() -> int:
    """The pid of the dockerd scripts/ensure-engine.sh started (these tests pause or reconfigure only that one)."""
    if not engine_is_ours():
        message = "the engine was not started by scripts/ensure-engine.sh; this test changes only its own"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return int(PIDFILE.read_text())


def sandboxes_of(client, out: Path, *, running: bool = True) -> list:
    return client.containers.list(all=not running, filters={"label": f"pvisor-host.out={out}"}, sparse=True)


def until(condition, seconds: float, what: str, process: subprocess.Popen[str] | None = None) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if process is not None and process.poll() is not None:
            pytest.fail(f"{what}: the batch exited {process.returncode} first: {process.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"{what}: not within {seconds:.0f} s"
        time.sleep(0.2)


def test_a_killed_controllers_sandboxes_end_themselves_and_the_rerun_removes_them(tmp_path, docker_client):
    path = manifest(tmp_path / "data", 2, command="sleep 300")
    out = tmp_path / "out"
    args = ("batch", path, "--agent", "claude-code", "--mode", "replay-only", "--out", out, "--workers", "2",
            "--timeout", "10s")  # fmt: skip
    process = start_cli(*args)
    until(lambda: len(sandboxes_of(docker_client, out)) == 2, 120, "two sandboxes running", process)
    process.kill()  # kill -9: nothing of the controller runs on
    process.communicate()
    # Each ends itself at its --timeout plus 30 s, counted from its own start: no gc, nobody else.
    until(lambda: not sandboxes_of(docker_client, out), 10 + 30 + 15, "the sandboxes stopped themselves")
    stopped = sandboxes_of(docker_client, out, running=False)
    assert len(stopped) == 2
    assert {docker_client.containers.get(c.id).attrs["State"]["ExitCode"] for c in stopped} == {124}
    rerun = run_cli(*args)
    assert f"removed what a dead earlier run into {out} left: 2 containers" in rerun.stderr, rerun.stderr
    assert json.loads((out / "summary.json").read_text())["counts"] == {"timeout": 2}
    assert sandboxes_of(docker_client, out, running=False) == []


class HangingRuntime:
    """A runtime registered with the engine whose ``create`` never returns (a wrapper of runc that sleeps): the
    stand-in for runc 1.1.5 hanging in ``runc init``."""

    name = "pvh-hang"
    script = Path("/usr/local/bin/pvh-hang-runtime")

    def release(self) -> None:
        """End the wrappers' sleeps: the hung creates return, failed, and the engine can remove the sandboxes."""
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError, ValueError):
                if str(self.script) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    subprocess.run(["pkill", "-KILL", "-P", entry.name], check=False)


DAEMON_JSON = Path("/etc/docker/daemon.json")
#: What scripts/ensure-engine.sh leaves beside a daemon.json it wrote.
OURS = Path("/etc/docker/.pvisor-host-wrote-daemon.json")
HANG_SCRIPT = """#!/bin/sh
# create never returns
for arg in "$@"; do
    if [ "$arg" = create ]; then sleep 3600; exit 1; fi
done
exec runc "$@"
"""


@pytest.fixture
def hanging_runtime(docker_client) -> Iterator[HangingRuntime]:
    """:class:`HangingRuntime`, registered for the test (daemon.json and SIGHUP: only a daemon.json that
    scripts/ensure-engine.sh wrote, as it only rewrites its own), then released, its sandboxes removed, and
    unregistered: the engine as it was, however the test ends."""
    pid = require_our_engine()
    if DAEMON_JSON.exists() and not OURS.exists():
        message = f"{DAEMON_JSON} belongs to someone else; this test registers a runtime only in its own"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    runtime = HangingRuntime()
    before = DAEMON_JSON.read_text() if DAEMON_JSON.exists() else None
    config = json.loads(before or "{}")
    config.setdefault("runtimes", {})[runtime.name] = {"path": str(runtime.script)}

    def registered() -> bool:
        return runtime.name in docker_client.info()["Runtimes"]

    def write(text: str) -> None:  # whole or not at all: the engine reads it again at each SIGHUP
        staged = DAEMON_JSON.with_name(f".{DAEMON_JSON.name}.pvh-test")
        staged.write_text(text)
        staged.replace(DAEMON_JSON)

    try:
        runtime.script.write_text(HANG_SCRIPT)
        runtime.script.chmod(0o755)
        write(json.dumps(config))
        os.kill(pid, signal.SIGHUP)
        until(registered, 30, "the engine knows the runtime")
        yield runtime
    finally:
        runtime.release()
        for container in docker_client.containers.list(all=True, filters={"label": "pvisor-host.managed"}):
            if container.attrs["HostConfig"].get("Runtime") == runtime.name:
                container.remove(force=True)
        if before is None:
            DAEMON_JSON.unlink(missing_ok=True)
        else:
            write(before)
        os.kill(pid, signal.SIGHUP)
        runtime.script.unlink(missing_ok=True)
        until(lambda: not registered(), 30, "the engine forgot the runtime")


def test_a_start_that_hangs_in_the_runtime_is_an_infra_error_within_its_bound_and_the_batch_finishes(
    tmp_path, docker_client, hanging_runtime
):
    before = {c.id for c in ours(docker_client)}
    out = tmp_path / "out"
    result = batch(manifest(tmp_path / "data", 2), out, "--runtime", hanging_runtime.name, "--start-timeout", "5s",
                   "--workers", "2", "--retry-backoff", "1s", timeout=300)  # fmt: skip
    assert result.code == ExitCode.INFRASTRUCTURE, result.stderr
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["status"], r["category"], r["attempts"]) for r in rows] == [("infra_error", "start_timeout", 2)] * 2
    hung = ("the engine did not start the sandbox within 5.0s: `pvh-hang-runtime create` hangs (--start-timeout "
            "gives it longer; `pvisor-host doctor` names runtimes known to hang)")  # fmt: skip
    assert [row["message"] for row in rows] == [hung, hung]
    # what the engine could not remove while its runtime hung is named, then gc's once the runtime returns
    unremoved = [line for line in result.error_lines if "); remove it with `pvisor-host gc`" in line]
    assert len(unremoved) == 4, result.stderr  # two sandboxes an item, each still in its runtime's create
    hanging_runtime.release()
    until(lambda: not run_cli("gc").code and not (set(c.id for c in ours(docker_client)) - before), 60,
          "gc removed the hung sandboxes")  # fmt: skip


def test_a_second_ctrl_c_ends_the_batch_within_its_bound_while_the_engine_is_paused(tmp_path, docker_client):
    pid = require_our_engine()
    path = manifest(tmp_path / "data", 2, command="sleep 300")
    out = tmp_path / "out"
    process = start_cli("batch", path, "--agent", "claude-code", "--mode", "replay-only", "--out", out,
                        "--workers", "2", "--timeout", "60s")  # fmt: skip
    try:
        until(lambda: len(sandboxes_of(docker_client, out)) == 2, 120, "two sandboxes running", process)
        names = sorted(c.attrs["Names"][0].lstrip("/") for c in sandboxes_of(docker_client, out))
        # Whatever becomes of this test (even its process killed), the engine runs again within 30 s.
        subprocess.Popen(["sh", "-c", f"sleep 30; kill -CONT {pid}"], start_new_session=True)
        os.kill(pid, signal.SIGSTOP)  # the engine answers nothing from now on
        try:
            process.send_signal(signal.SIGINT)
            time.sleep(1)
            process.send_signal(signal.SIGINT)
            try:
                _, stderr = process.communicate(timeout=GIVE_UP_AFTER + 4)
            except subprocess.TimeoutExpired:
                process.kill()
                stderr = process.communicate()[1]
                pytest.fail(f"still running {GIVE_UP_AFTER + 4:.0f} s after the second Ctrl-C: {stderr}")
        finally:
            os.kill(pid, signal.SIGCONT)
        assert process.returncode == 130, stderr
        assert stderr.splitlines()[-1] == (
            f"pvisor-host: gave up waiting for the engine; not removed: container {names[0]}, container {names[1]} "
            "(the next run into the same --out, or pvisor-host gc, removes them)"
        ), stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        cleaned = run_cli("gc")
    assert cleaned.code == 0, cleaned.stderr
    assert sandboxes_of(docker_client, out, running=False) == []


# -- two batches at once -------------------------------------------------------------------------------------


def test_two_batches_side_by_side_finish_correctly_and_never_touch_each_other(tmp_path, docker_client):
    before = {c.id for c in ours(docker_client)}
    big = manifest(tmp_path / "big", 200)
    small = manifest(tmp_path / "small", 40)
    seen: dict[str, set[str]] = {}
    together = threading.Event()  # a moment when both batches had sandboxes on the engine
    stop = threading.Event()

    def watch() -> None:  # which batch's sessions the running sandboxes belong to
        while not stop.is_set():
            now = set()
            for c in ours(docker_client, role="replay"):
                labels = c.attrs.get("Labels") or {}
                now.add(labels.get("pvisor-host.session", "?"))
                seen.setdefault(labels.get("pvisor-host.session", "?"), set()).add(c.attrs["Names"][0])
            if len(now) >= 2:
                together.set()
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    first = start_cli("batch", big, "--agent", "claude-code", "--mode", "prepare-only", "--workers", "8",
                      "--out", tmp_path / "out-big", "--quiet")  # fmt: skip
    second = batch(small, tmp_path / "out-small", "--workers", "2")
    stderr = finished(first, 600)
    stop.set()
    watcher.join(timeout=5)
    assert first.returncode == 0, stderr
    assert second.code == 0, second.stderr
    assert json.loads((tmp_path / "out-big" / "summary.json").read_text())["counts"] == {"ok": 200}
    assert json.loads((tmp_path / "out-small" / "summary.json").read_text())["counts"] == {"ok": 40}
    assert len(seen) == 2  # two sessions, each cancelling and removing only its own
    assert together.is_set(), "the two batches never had sandboxes at the same time"
    big_ids = {r["run_id"] for r in records(tmp_path / "out-big").values()}
    small_ids = {r["run_id"] for r in records(tmp_path / "out-small").values()}
    assert len(big_ids) == 200 and len(small_ids) == 40 and not big_ids & small_ids
    nothing_of_ours_left(docker_client, before)


# -- a secret goes nowhere -----------------------------------------------------------------------------------


def test_a_model_key_is_found_nowhere_after_a_continuation(tmp_path, docker_client):
    key = "sk-FAULT-TEST-needle-7d2f0c9a"
    trajectory = write_jsonl(tmp_path / "t.jsonl", claude_files_session("/workspace"))
    out = tmp_path / "run"
    inspected: list[str] = []
    stop = threading.Event()

    def inspect_everything() -> None:  # every container the run creates, while it exists
        while not stop.is_set():
            for c in ours(docker_client):
                with contextlib.suppress(Exception):  # gone meanwhile
                    inspected.append(json.dumps(docker_client.api.inspect_container(c.id)))
            time.sleep(0.05)

    watcher = threading.Thread(target=inspect_everything, daemon=True)
    watcher.start()
    with StubServer(command="echo continued > continued.txt && sleep 1") as stub:
        result = run_cli(
            "--verbose", "replay", "--agent", "claude-code", "--trajectory", trajectory, "--after-step", "4",
            "--max-steps", "8", "--model-base-url", stub.base_url, "--model", "stub-model",
            "--model-api-key-env", "PVH_FAULT_KEY", "--out", out, "--json", env={"PVH_FAULT_KEY": key},
        )  # fmt: skip
    stop.set()
    watcher.join(timeout=5)
    assert result.code == 0, result.stderr
    assert inspected, "no container was seen while the replay ran"
    assert key not in result.stdout and key not in result.stderr
    assert not [c for c in inspected if key in c]
    images = [
        json.dumps(docker_client.api.inspect_image(i.id))
        for i in docker_client.images.list(filters={"label": "pvisor-host.managed"})
    ]
    assert not [i for i in images if key in i]
    leaked = [p for p in out.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert leaked == []
    assert not (out / ".pvisor-host-staging").exists()  # the staging (its env.sh) is gone with the run
    shutil.rmtree(out)
