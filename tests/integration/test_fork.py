"""``--fork K`` for real: Claude Code replayed to the boundary under gVisor (``runsc-fork``, which ``make test``
registers with the engine's experimental mode), checkpointed there, and continued K times from the checkpoint
through the model gateway, against a stub model on the host.

* The prefix's tool calls run once: a call that reaches a host service through ``--egress`` is seen there once,
  and a file the prefix appends to holds one line in every fork; each fork reaches the model through a gateway of
  its own, and its record says so.
* With a model cassette served back, each fork's workspace and result are a plain replay's, timings aside.
* Ctrl-C while the forks continue leaves nothing behind: no container, no checkpoint, no copy, no socket.

Without the fork runtime these tests skip locally and fail when ``CI=true``: CI must run them.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from pvisor_host.models.egress import HOST_ALIAS

from conftest import IN_CI, default_signals, run_cli
from modelserver import StubServer
from trajgen import Call, Turn, claude_session, write_jsonl

pytestmark = pytest.mark.docker

FORK_RUNTIME = ("--runtime", "runsc-fork")
KEY = {"PVH_TEST_MODEL_KEY": "sk-test-REAL-upstream-key-fork"}


@pytest.fixture(scope="module", autouse=True)
def fork_runtime(docker_client) -> None:
    info = docker_client.info()
    if "runsc-fork" not in (info.get("Runtimes") or {}) or not info.get("ExperimentalBuild"):
        message = "the fork runtime (runsc-fork, experimental mode) is not on this engine; `make test` sets it up"
        if IN_CI:
            pytest.fail(f"CI=true and {message}")
        pytest.skip(message)


def prefix(*calls: str) -> list[dict]:
    """A Claude Code session whose prefix is ``calls``, one Bash call per step, ending with a text turn."""
    turns = [Turn([Call("Bash", {"command": command, "description": f"step {n}"}, "")]) for n, command in
             enumerate(calls, 1)]  # fmt: skip
    return claude_session("Fork at the boundary.", [*turns, Turn(text="Done.")])


def model(stub: StubServer, *extra: str) -> tuple[str, ...]:
    return ("--model-base-url", stub.base_url, "--model", "stub-model", "--model-api-key-env", "PVH_TEST_MODEL_KEY",
            *extra)  # fmt: skip


def records(out: Path, forks: int) -> tuple[dict, list[dict]]:
    read = lambda d: json.loads((out / d / "record.json").read_text())  # noqa: E731
    return read("prefix"), [read(f"fork-{k}") for k in range(1, forks + 1)]


def our_containers(docker_client, run_id: str) -> list:
    return docker_client.containers.list(all=True, filters={"label": f"pvisor-host.run={run_id}"}) + [
        c for c in docker_client.containers.list(all=True, filters={"label": "pvisor-host.role=replay"})
        if c.labels.get("pvisor-host.run", "").startswith(f"{run_id}-f")
    ]  # fmt: skip


class _Hits(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        self.hits.append(self.path)
        body = f"hit {len(self.hits)}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_k_forks_continue_from_one_prefix_whose_calls_ran_once(tmp_path, claude_image):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hits)
    _Hits.hits = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    fetch = f"python3 -c \"import urllib.request as u; print(u.urlopen('http://{HOST_ALIAS}:{port}/prefix').read())\""
    trajectory = write_jsonl(tmp_path / "t.jsonl", prefix("echo once >> once.txt", f"{fetch} > fetched.txt"))
    out = tmp_path / "run"
    try:
        with StubServer(command="echo continued >> continued.txt") as stub:
            result = run_cli(
                "replay", "--agent", "claude-code", "--trajectory", trajectory, "--after-step", "2", "--max-steps",
                "6", *model(stub), "--egress", f"allow:{HOST_ALIAS}:{port}", "--fork", "3", "--run-id", "fk",
                "--timeout", "300s", "--out", out, *FORK_RUNTIME, env=KEY,
            )  # fmt: skip
            calls = stub.model.model_requests()
    finally:
        server.shutdown()
    assert result.code == 0, result.stderr
    head, forks = records(out, 3)
    assert _Hits.hits == ["/prefix"]  # once, not once per fork
    assert (head["status"], head["run_id"], head["result"]) == ("ok", "fk", None)
    assert head["model"]["requests"] == 0  # nothing asked the model before the boundary
    assert head["fork"] | {"checkpoint_seconds": 0, "checkpoint_bytes": 0} == {
        "role": "prefix", "of": "fk", "index": None, "forks": 3, "reached": True, "checkpoint_error": None,
        "alone": False, "restored": None, "fallback": None, "checkpoint_seconds": 0, "checkpoint_bytes": 0,
        "restore_seconds": None,
    }  # fmt: skip
    assert head["fork"]["checkpoint_bytes"] > 0 and set(head["timings"]) >= {"run", "checkpoint"}
    assert [e["host"] for e in head["egress"]["events"]] == [HOST_ALIAS]
    assert (out / "prefix" / "workspace" / "fetched.txt").read_text() == "b'hit 1\\n'\n"
    for k, fork in enumerate(forks, 1):
        workspace = out / f"fork-{k}" / "workspace"
        assert (fork["status"], fork["run_id"], fork["result"]["phase"]) == ("ok", f"fk-f{k}", "continued")
        assert (fork["fork"]["role"], fork["fork"]["of"], fork["fork"]["index"], fork["fork"]["restored"]) == (
            "fork", "fk", k, True)  # fmt: skip
        assert fork["fork"]["restore_seconds"] > 0
        assert (workspace / "once.txt").read_text() == "once\n"  # the prefix's call, run once, before the copy
        assert (workspace / "fetched.txt").read_text() == "b'hit 1\\n'\n"
        assert (workspace / "continued.txt").read_text() == "continued\n"  # its own continuation, once
        assert fork["model"]["totals"]["calls"] >= 1  # through its own gateway, journaled in its own directory
        assert (
            len((out / f"fork-{k}" / "model-traffic.jsonl").read_text().splitlines())
            == fork["model"]["totals"]["calls"]
        )
        assert fork["limits"] == head["limits"]  # the prefix's hardening, limits and runtime
        assert [c["match"] for c in fork["observations"]["calls"]] == ["exact", "exact"]
        assert fork["container"]["command"] == head["container"]["command"]
    assert len(calls) == sum(f["model"]["totals"]["calls"] for f in forks)  # none before the boundary
    assert not (out / ".pvisor-host-fork").exists()
    texts = [p.read_text(errors="replace") for p in out.rglob("*") if p.is_file()]
    assert not any(KEY["PVH_TEST_MODEL_KEY"] in t or "pvhtok-" in t for t in texts)  # neither key nor token


def test_forks_served_one_cassette_end_as_a_plain_replay_does(tmp_path, claude_image):
    trajectory = write_jsonl(tmp_path / "t.jsonl", prefix("echo one > a.txt", "echo two >> a.txt"))
    tapes = tmp_path / "tapes"
    common = ("replay", "--agent", "claude-code", "--trajectory", trajectory, "--after-step", "2", "--max-steps", "6",
              "--timeout", "300s", *FORK_RUNTIME)  # fmt: skip
    with StubServer(command="echo continued >> a.txt && cat a.txt") as stub:
        plain = run_cli(*common, *model(stub, "--model-cassette", "record", str(tapes)), "--run-id", "cas9z", "--out",
                        tmp_path / "plain" / "run", env=KEY)  # fmt: skip
    assert plain.code == 0, plain.stderr
    served = ("--model-base-url", "http://127.0.0.1:9/v1", "--model", "stub-model", "--model-cassette", "replay",
              str(tapes))  # fmt: skip
    forked = run_cli(*common, *served, "--fork", "2", "--run-id", "cas9z", "--out", tmp_path / "forked" / "run")
    assert forked.code == 0, forked.stderr
    alone = json.loads((tmp_path / "plain" / "run" / "record.json").read_text())
    _, forks = records(tmp_path / "forked" / "run", 2)
    ignore = {"started_at", "finished_at", "duration_ms", "timings"}
    for k, fork in enumerate(forks, 1):
        run_dir = tmp_path / "forked" / "run" / f"fork-{k}"
        files = sorted(p.relative_to(run_dir / "workspace").as_posix() for p in (run_dir / "workspace").rglob("*"))
        plain_workspace = tmp_path / "plain" / "run" / "workspace"
        assert files == sorted(p.relative_to(plain_workspace).as_posix() for p in plain_workspace.rglob("*"))
        assert (run_dir / "workspace" / "a.txt").read_text() == "one\ntwo\ncontinued\n"
        # pvisor launched the agent through the gate, which execs the image's own CLI (docs/fork.md)
        assert fork["result"]["agent"]["entrypoint"] == "/pvisor-host/input/fork-gate"
        result, plain = fork["result"], alone["result"]
        result = result | {"agent": result["agent"] | {"entrypoint": plain["agent"]["entrypoint"]}}
        assert _without(result, ignore) == _without(plain, ignore)
        assert fork["observations"] == alone["observations"]
        assert fork["model"]["totals"]["calls"] == alone["model"]["totals"]["calls"]


def _hardening(attrs: dict) -> dict:
    host = attrs["HostConfig"]
    keys = ("Runtime", "NetworkMode", "CapDrop", "CapAdd", "ReadonlyRootfs", "SecurityOpt", "Privileged")
    return {key: host.get(key) for key in keys} | {"User": attrs["Config"]["User"]}


def _without(document: object, keys: set[str]) -> object:
    if isinstance(document, dict):
        return {k: _without(v, keys) for k, v in document.items() if k not in keys}
    if isinstance(document, list):
        return [_without(v, keys) for v in document]
    return document


def test_a_batchs_forks_are_rows_of_their_own_and_a_rerun_skips_them(tmp_path, claude_image):
    data = write_jsonl(tmp_path / "t.jsonl", prefix("echo once >> once.txt"))
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(json.dumps({"id": "a", "trajectory": str(data), "after_step": 1, "fork": 2}) + "\n"
                        + json.dumps({"id": "b", "trajectory": str(data), "after_step": 1}) + "\n")  # fmt: skip
    out = tmp_path / "out"
    with StubServer(command="echo continued >> continued.txt") as stub:
        args = ("batch", manifest, "--agent", "claude-code", "--max-steps", "6", *model(stub), "--out", out,
                "--workers", "2", *FORK_RUNTIME)  # fmt: skip
        first = run_cli(*args, env=KEY)
        assert first.code == 0, first.stderr
        again = run_cli(*args, env=KEY)
    assert again.code == 0, again.stderr
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    shape = sorted((r["id"], r["fork_of"], r["fork_index"], r["status"], r["path"], r["skipped"]) for r in rows)
    assert shape == [
        ("a.f1", "a", 1, "ok", "a/fork-1", True),
        ("a.f2", "a", 2, "ok", "a/fork-2", True),
        ("b", None, None, "ok", "b", True),
    ]  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["items"], summary["counts"]) == (3, {"ok": 3})
    suite = ET.parse(out / "junit.xml").getroot().find("testsuite")
    assert suite is not None and sorted(c.get("name") for c in suite.iter("testcase")) == ["a.f1", "a.f2", "b"]
    prefix_record = json.loads((out / "a" / "prefix" / "record.json").read_text())
    assert (prefix_record["fork"]["role"], prefix_record["batch"]["item_id"]) == ("prefix", "a")
    assert json.loads((out / "a" / "fork-2" / "record.json").read_text())["batch"]["item_id"] == "a.f2"
    for k in (1, 2):
        assert (out / "a" / f"fork-{k}" / "workspace" / "once.txt").read_text() == "once\n"


def test_ctrl_c_while_the_forks_continue_leaves_nothing_behind(tmp_path, claude_image, docker_client):
    trajectory = write_jsonl(tmp_path / "t.jsonl", prefix("echo once >> once.txt"))
    out = tmp_path / "run"
    sockets = set(Path("/tmp").glob("pvh-[ge][wg]-*"))
    with StubServer(command="sleep 120") as stub:
        child = subprocess.Popen(
            [sys.executable, "-m", "pvisor_host", "replay", "--agent", "claude-code", "--trajectory", str(trajectory),
             "--after-step", "1", "--max-steps", "6", *model(stub), "--fork", "2", "--run-id", "fkint", "--timeout",
             "300s", "--out", str(out), *FORK_RUNTIME],
            env={**os.environ, **KEY}, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 240
            while len(stub.model.model_requests()) < 2 and time.monotonic() < deadline and child.poll() is None:
                time.sleep(0.1)  # each fork has asked its model: both continue
            assert len(stub.model.model_requests()) >= 2, child.stderr.read() if child.poll() is not None else ""
            hardening = {
                c.labels["pvisor-host.run"]: _hardening(c.attrs) for c in our_containers(docker_client, "fkint")
            }
            child.send_signal(signal.SIGINT)
            _, stderr = child.communicate(timeout=120)
        finally:
            child.kill()
    assert child.returncode == 130, stderr
    assert hardening == dict.fromkeys(("fkint-f1", "fkint-f2"), {
        "Runtime": "runsc-fork", "NetworkMode": "none", "CapDrop": ["ALL"], "CapAdd": None, "ReadonlyRootfs": True,
        "SecurityOpt": ["no-new-privileges"], "Privileged": False, "User": "65532:65532",
    })  # fmt: skip  # each fork, as it ran: the hardening of any replay
    assert our_containers(docker_client, "fkint") == []
    assert not (out / ".pvisor-host-fork").exists()
    assert not list(out.rglob(".pvisor-host-staging"))
    assert set(Path("/tmp").glob("pvh-[ge][wg]-*")) <= sockets  # every fork's gateway socket is gone
    for k in (1, 2):
        assert json.loads((out / f"fork-{k}" / "record.json").read_text())["status"] == "interrupted"
