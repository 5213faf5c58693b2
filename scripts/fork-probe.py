#!/usr/bin/env python3
"""Can a pvisor-host sandbox be checkpointed and restored K times? The probes behind the fork section of
docs/performance.md (issue 40). Not part of the suite: they need gVisor (``runsc``) registered with the engine
and the engine's experimental mode on (``"experimental": true`` in daemon.json: Docker 20.10 restores a
checkpoint only then), and they leave the engine as they found it.

    python scripts/fork-probe.py [K]              # mid-call: checkpoint during a replayed tool call
    python scripts/fork-probe.py --boundary [K]   # at the boundary: K live continuations from one prefix

``FORK_PROBE_RUNTIME`` names the engine's gVisor runtime (default ``runsc``) and ``FORK_PROBE_RUNSC`` its binary
(default ``runsc`` on the PATH): the boundary needs gVisor 20240729 or later (docs/performance.md says why).

**Mid-call** replays a two-call trajectory under ``--runtime runsc`` (the second call sleeps 15 s), checkpoints
the sandbox 6 s into that sleep, and restores it K times; each copy's pvisor finishes the interrupted call and
writes its own v3 result; the first call ran once.

**At the boundary** runs a real continuation (Claude Code 2.1.220 behind pvisor-host's model gateway, a stub
model) in an image whose agent entrypoint is a gate: pvisor's version probe passes through it; the agent's
launch, which comes once pvisor has replayed the prefix and rebuilt the context, marks the boundary in the run
directory and waits for a go-ahead file in the input directory before it execs the real CLI. The probe
checkpoints the sandbox at that mark, then restores it K times, each copy with its own copies of the mounted
directories and its own gateway socket (a gateway of its own forwarding to a stub model of its own, which
answers with a command naming the copy), and gives each its go-ahead. pvisor, still the parent, finishes each
copy's continuation and writes its own v3 result; the prefix's appending call is in each copy once, and no
model call came before the boundary.

In both, the checkpoint is ``runsc checkpoint`` (Docker's own checkpoint API fails here once the image passes a
few MB: "failed to read checkpoint reader: failed to Lchown .../checkpoint.img"), each copy is a container with
the original's configuration (the hardening included) and its own copies of the bind-mounted directories
(owners kept), the image goes into each one's checkpoint directory (Docker 20.10 refuses ``--checkpoint-dir``:
"custom checkpointdir is not supported"), and each starts from it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import docker.errors

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from modelserver import StubServer  # noqa: E402
from trajgen import Call, Turn, claude_session, write_jsonl  # noqa: E402

#: Where Docker 20.10's runc.v2 shim keeps its runtimes' state, runsc's included.
RUNSC_ROOT = "/var/run/docker/runtime-runc/moby"
#: The engine's name of the gVisor runtime to probe, and its binary (``FORK_PROBE_RUNTIME``, ``FORK_PROBE_RUNSC``).
RUNTIME = os.environ.get("FORK_PROBE_RUNTIME", "runsc")
RUNSC = os.environ.get("FORK_PROBE_RUNSC", "runsc")
#: The gate at the agent's entrypoint (``$0.real`` is the real CLI): see the module docstring.
GATE = """#!/bin/sh
case "${1:-}" in --version | -v | -V) exec "$0.real" "$@" ;; esac
: >/pvisor-host/run/fork.reached
until [ -e /pvisor-host/input/fork.go ]; do sleep 0.05; done
exec "$0.real" "$@"
"""
KEY_ENV = "PVH_FORK_PROBE_KEY"


def mid_call(forks: int) -> int:
    client = _engine()
    with contextlib.ExitStack() as cleanup:
        work = _work(cleanup)
        trajectory = write_jsonl(work / "t.jsonl", claude_session("Fork.", [
            Turn([Call("Bash", {"command": "echo prefix >> a.txt && head -c 50000000 /dev/urandom > /tmp/blob"},
                       "")]),
            Turn([Call("Bash", {"command": "sleep 15; echo after >> a.txt; cat a.txt"}, "prefix\nafter\n")]),
        ]))  # fmt: skip
        replay = _replay(cleanup, trajectory, work / "prefix", "--after-step", "2", "--mode", "replay-only")
        sandbox = _running(client, replay)
        time.sleep(6)  # into the second call's sleep
        attrs, figures = _checkpoint(sandbox, work, replay)
        replay.communicate(timeout=120)  # the prefix's controller sees its sandbox gone, and removes it
        restores: dict[str, float] = {}
        for k in range(forks):
            restores |= _restore(cleanup, client, attrs, work, k)
        outcomes = []
        for k, container_id in enumerate(restores):
            code = client.api.wait(container_id, timeout=120)["StatusCode"]
            outcomes.append({"exit": code, "failure": _result(work / f"fork{k}").get("failure"),
                             "a.txt": (work / f"fork{k}" / _name("/workspace") / "a.txt").read_text()})  # fmt: skip
        figures |= {"restore_seconds": list(restores.values()), "forks": outcomes}
        sys.stdout.write(json.dumps(figures, indent=2) + "\n")
    good = [(o["exit"], o["failure"], o["a.txt"]) == (0, None, "prefix\nafter\n") for o in outcomes]
    return 0 if len(good) == forks > 0 and all(good) else 1


def at_boundary(forks: int) -> int:
    from pvisor_host.backend.docker.gateway import Gateway
    from pvisor_host.models.spec import ModelUpstream

    client = _engine()
    with contextlib.ExitStack() as cleanup:
        work = _work(cleanup)
        gated = _gated_image(client, cleanup)
        # The prefix appends to once.txt (a copy that ran it again would have it twice), then writes f.txt.
        trajectory = write_jsonl(work / "t.jsonl", claude_session("Fork at the boundary.", [
            Turn([Call("Bash", {"command": "echo once >> once.txt", "description": "note it"}, "")]),
            Turn([Call("Bash", {"command": "echo hi > f.txt", "description": "create f.txt"}, "")]),
            Turn(text="Done."),
        ]))  # fmt: skip
        first = cleanup.enter_context(StubServer(command="echo prefix-model > continued.txt"))
        started = time.monotonic()
        replay = _replay(
            cleanup, trajectory, work / "prefix", "--after-step", "2", "--mode", "continue", "--max-steps", "8",
            "--image", gated, "--model-base-url", first.base_url, "--model", "stub-model",
            "--model-api-key-env", KEY_ENV, "--timeout", "5m",
        )  # fmt: skip
        sandbox = _running(client, replay)
        _until(lambda: any((work / "prefix").glob("**/run/fork.reached")), replay, "the gate was not reached")
        to_the_gate = time.monotonic() - started
        attrs, figures = _checkpoint(sandbox, work, replay, skip=("/pvisor-host/gateway",))
        replay.communicate(timeout=120)
        calls_before_the_gate = len(first.model.model_requests())
        env = dict(line.split("=", 1) for line in (work / "mounts" / _name("/pvisor-host/input") / "env.sh")
                   .read_text().splitlines())  # fmt: skip
        token = shlex.split(env["OPENAI_API_KEY"])[0]  # the run's gateway token, in pvisor's memory in every copy
        uid = int(attrs["Config"]["User"].split(":")[0])
        stubs = []
        restores: dict[str, float] = {}
        for k in range(forks):
            stub = cleanup.enter_context(StubServer(command=f"echo fork-{k} > continued.txt"))
            stubs.append(stub)
            upstream = ModelUpstream(base_url=stub.base_url, model="stub-model", api_key_env=KEY_ENV)
            gateway = cleanup.enter_context(Gateway(upstream, "sk-fork-probe", sandbox_uid=uid))
            proxy = gateway._proxy  # a gateway per copy: the token every copy holds is that copy's run there
            proxy.grant(f"fork{k}", work / f"journal{k}.jsonl", token=token)
            restores |= _restore(cleanup, client, attrs, work, k, sockets={"/pvisor-host/gateway": gateway})
        released = time.monotonic()
        for k in range(forks):
            (work / f"fork{k}" / _name("/pvisor-host/input") / "fork.go").touch()
        outcomes = []
        for k, container_id in enumerate(restores):
            code = client.api.wait(container_id, timeout=300)["StatusCode"]
            result = _result(work / f"fork{k}")
            workspace = work / f"fork{k}" / _name("/workspace")
            outcomes.append({
                "exit": code, "phase": result.get("phase"), "failure": result.get("failure"),
                **{name: _text(workspace / name) for name in ("once.txt", "f.txt", "continued.txt")},
                "model_calls": len(stubs[k].model.model_requests()),
            })  # fmt: skip
        continued = time.monotonic() - released
        figures |= {"to_the_gate_seconds": round(to_the_gate, 1), "restore_seconds": list(restores.values()),
                    "continuations_seconds": round(continued, 1), "model_calls_before_the_gate":
                    calls_before_the_gate, "forks": outcomes}  # fmt: skip
        sys.stdout.write(json.dumps(figures, indent=2) + "\n")
    good = [(o["exit"], o["phase"], o["failure"], o["once.txt"], o["f.txt"], o["continued.txt"]) ==
            (0, "continued", None, "once\n", "hi\n", f"fork-{k}\n") and o["model_calls"] > 0
            for k, o in enumerate(outcomes)]  # fmt: skip
    return 0 if len(good) == forks > 0 and all(good) and calls_before_the_gate == 0 else 1


# -- what both share ----------------------------------------------------------------------------------------


def _work(cleanup: contextlib.ExitStack) -> Path:
    work = Path(tempfile.mkdtemp(prefix="pvh-fork-"))
    cleanup.callback(shutil.rmtree, work, ignore_errors=True)
    return work


def _replay(cleanup: contextlib.ExitStack, trajectory: Path, out: Path, *args: str) -> subprocess.Popen[str]:
    """``pvisor-host replay`` of the prefix, under its own run id; interrupted (and waited for) when the probe ends
    while it still runs."""
    run_id = f"fork-probe-{secrets.token_hex(4)}"
    replay = subprocess.Popen(
        [sys.executable, "-m", "pvisor_host", "replay", "--agent", "claude-code", "--trajectory", str(trajectory),
         "--runtime", RUNTIME, "--out", str(out), "--run-id", run_id, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, KEY_ENV: "sk-fork-probe"},
        # Its own session: a Ctrl-C of the probe reaches it once, through _stop (a second one would make it give up
        # on its cleanup); SIGINT at its default even when the probe runs as a background job.
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    replay.run_id = run_id  # type: ignore[attr-defined]
    cleanup.callback(_stop, replay)
    return replay


def _stop(replay: subprocess.Popen[str]) -> str:
    """Interrupt the prefix's controller once (it removes its sandbox) and wait for it: its stderr."""
    if replay.poll() is None:
        replay.send_signal(signal.SIGCONT)
        replay.send_signal(signal.SIGINT)
    try:
        return replay.communicate(timeout=120)[1] or ""
    except subprocess.TimeoutExpired:
        replay.kill()
        return replay.communicate()[1] or ""
    except ValueError:  # read already
        return ""


def _until(done: Callable[[], bool], replay: subprocess.Popen[str], what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if replay.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"fork-probe: {what}: {_stop(replay)[-2000:]}")
        time.sleep(0.05)


def _engine() -> docker.DockerClient:
    client = docker.from_env(timeout=300)
    if not client.version().get("Experimental"):
        raise SystemExit("fork-probe: the engine's experimental mode is off: Docker restores a checkpoint only then")
    return client


def _running(client: docker.DockerClient, replay: subprocess.Popen[str]) -> Any:
    found: list[Any] = []

    def running() -> bool:
        found[:] = client.containers.list(filters={"label": f"pvisor-host.run={replay.run_id}", "status": "running"})
        return bool(found)

    _until(running, replay, "the replay did not start")
    found[0].reload()
    return found[0]


def _checkpoint(sandbox: Any, work: Path, replay: subprocess.Popen[str],
                skip: tuple[str, ...] = ()) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """Checkpoint the sandbox into ``work/checkpoint`` and copy its bind-mounted directories (but ``skip``) into
    ``work/mounts``, with its controller stopped meanwhile (it would remove them once it sees the sandbox gone):
    the sandbox's configuration, and the figures."""
    attrs = sandbox.attrs
    image = work / "checkpoint"
    replay.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        subprocess.run([RUNSC, "--root", RUNSC_ROOT, "checkpoint", "--image-path", str(image), sandbox.id],
                       check=True)  # fmt: skip
        taken = time.monotonic() - started
        mounts = work / "mounts"
        mounts.mkdir()
        for mount in attrs["HostConfig"]["Mounts"]:
            if mount["Type"] == "bind" and mount["Target"] not in skip:
                subprocess.run(["cp", "-a", mount["Source"], str(mounts / _name(mount["Target"]))], check=True)
    finally:
        replay.send_signal(signal.SIGCONT)
    size = sum(p.stat().st_size for p in image.rglob("*") if p.is_file())
    return attrs, {"checkpoint_seconds": round(taken, 2), "checkpoint_mib": round(size / 2**20, 1)}


def _restore(cleanup: contextlib.ExitStack, client: docker.DockerClient, attrs: dict[str, Any], work: Path, k: int,
             *, sockets: dict[str, Any] | None = None) -> dict[str, float]:  # fmt: skip
    """Create copy ``k`` (its own copies of the mounted directories; ``sockets``: a mount target served by a
    gateway of its own instead), removed when the probe ends, and start it from the checkpoint: its id, and the
    seconds its start took."""
    api = client.api
    own = work / f"fork{k}"
    own.mkdir()
    host = copy.deepcopy(attrs["HostConfig"])
    for mount in host["Mounts"]:
        if mount["Type"] != "bind":
            continue
        if sockets and mount["Target"] in sockets:
            mount["Source"] = str(Path(sockets[mount["Target"]].address).parent)
            continue
        mount["Source"] = str(own / _name(mount["Target"]))
        subprocess.run(["cp", "-a", str(work / "mounts" / _name(mount["Target"])), mount["Source"]], check=True)
    config = attrs["Config"]
    created = api.create_container(
        config["Image"], command=config["Cmd"], entrypoint=config["Entrypoint"], user=config["User"],
        working_dir=config["WorkingDir"], environment=config["Env"], host_config=host,
        labels=config["Labels"], name=f"{attrs['Name'].lstrip('/')}-fork{k}",
    )  # fmt: skip
    cleanup.callback(_remove, api, created["Id"])
    shutil.copytree(work / "checkpoint", Path(f"/var/lib/docker/containers/{created['Id']}/checkpoints/probe"))
    started = time.monotonic()
    answer = api._post(api._url("/containers/{0}/start", created["Id"]), params={"checkpoint": "probe"})
    api._raise_for_status(answer)
    return {created["Id"]: round(time.monotonic() - started, 2)}


def _remove(api: Any, container_id: str) -> None:
    with contextlib.suppress(docker.errors.APIError):
        api.remove_container(container_id, force=True)


def _text(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def _result(own: Path) -> dict[str, Any]:
    """pvisor's v3 result: the last line of the copy's stdout."""
    lines = (own / _name("/pvisor-host/logs") / "stdout.log").read_text().splitlines()
    return dict(json.loads(lines[-1])) if lines else {"failure": "no result"}


def _gated_image(client: docker.DockerClient, cleanup: contextlib.ExitStack) -> str:
    """pvisor-host's Claude Code image with :data:`GATE` at the agent's entrypoint (the CLI moved beside it)."""
    from pvisor_host.backend.docker import DockerBackend
    from pvisor_host.models.image import BuildOptions, BuildPlan
    from pvisor_host.models.ownership import Ownership
    from pvisor_host.models.profiles import get_profile

    profile = get_profile("claude-code")
    built = DockerBackend(client, Ownership.current()).ensure_image(BuildPlan(profile=profile), BuildOptions()).built
    assert built is not None
    entry, user = profile.entrypoint, client.images.get(built.tag).attrs["Config"].get("User") or "root"
    with tempfile.TemporaryDirectory() as context:
        (Path(context) / "gate").write_text(GATE)
        (Path(context) / "gate").chmod(0o755)
        (Path(context) / "Dockerfile").write_text(f"FROM {built.tag}\nUSER root\nRUN mv {entry} {entry}.real\n"
                                                  f"COPY gate {entry}\nUSER {user}\n")  # fmt: skip
        image, _ = client.images.build(path=context, rm=True, forcerm=True)
    cleanup.callback(_remove_image, client, image.id)  # done last of all (the copies that use it go first)
    tag = f"pvh-fork-probe/gated:{image.id.removeprefix('sha256:')[:12]}"
    image.tag(*tag.split(":"))
    return tag


def _remove_image(client: docker.DockerClient, image_id: str) -> None:
    with contextlib.suppress(docker.errors.APIError):
        client.images.remove(image_id, force=True)


def _name(target: str) -> str:
    return target.strip("/").replace("/", "_")


if __name__ == "__main__":
    arguments = sys.argv[1:]
    boundary = "--boundary" in arguments
    count = int(next((a for a in arguments if a != "--boundary"), "3"))
    sys.exit(at_boundary(count) if boundary else mid_call(count))
