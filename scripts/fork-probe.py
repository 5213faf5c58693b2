#!/usr/bin/env python3
"""Can a pvisor-host sandbox be checkpointed mid-replay and restored K times? The probe behind the fork section
of docs/performance.md (issue 40). Not part of the suite: it needs gVisor (``runsc``) registered with the engine
and the engine's experimental mode on (``"experimental": true`` in daemon.json: Docker 20.10 restores a
checkpoint only then), and it leaves the engine as it found it.

    python scripts/fork-probe.py [K]

It replays a two-call trajectory under ``--runtime runsc`` (the second call sleeps 15 s), checkpoints the
sandbox 6 s into that sleep with ``runsc checkpoint`` (Docker's own checkpoint API fails here once the image
passes a few MB: "failed to read checkpoint reader: failed to Lchown .../checkpoint.img"), copies the
sandbox's bind-mounted directories (owners kept), then creates K containers with the same configuration
(the hardening included) and each its own copies, puts the image in each one's checkpoint directory (Docker
20.10 refuses ``--checkpoint-dir``: "custom checkpointdir is not supported"), and starts each from it. Each
copy's pvisor finishes the interrupted call and writes its own v3 result; the first call ran once.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import docker

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from trajgen import Call, Turn, claude_session, write_jsonl  # noqa: E402

#: Where Docker 20.10's runc.v2 shim keeps its runtimes' state, runsc's included.
RUNSC_ROOT = "/var/run/docker/runtime-runc/moby"


def main(forks: int) -> int:
    client = docker.from_env(timeout=300)
    api = client.api
    if not client.version().get("Experimental"):
        sys.stderr.write("fork-probe: the engine's experimental mode is off: Docker restores a checkpoint only then\n")
        return 3
    work = Path(tempfile.mkdtemp(prefix="pvh-fork-"))
    trajectory = write_jsonl(work / "t.jsonl", claude_session("Fork.", [
        Turn([Call("Bash", {"command": "echo prefix >> a.txt && head -c 50000000 /dev/urandom > /tmp/blob"}, "")]),
        Turn([Call("Bash", {"command": "sleep 15; echo after >> a.txt; cat a.txt"}, "prefix\nafter\n")]),
    ]))  # fmt: skip
    replay = subprocess.Popen(
        [sys.executable, "-m", "pvisor_host", "replay", "--agent", "claude-code", "--trajectory", str(trajectory),
         "--after-step", "2", "--mode", "replay-only", "--runtime", "runsc", "--out", str(work / "prefix")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (running := client.containers.list(filters={"label": "pvisor-host.role=replay", "status": "running"})):
        if replay.poll() is not None or time.monotonic() > deadline:
            sys.stderr.write(f"fork-probe: the replay did not start: {replay.communicate()[1][-2000:]}\n")
            return 1
        time.sleep(0.1)
    sandbox = running[0]
    sandbox.reload()
    attrs = sandbox.attrs
    time.sleep(6)  # into the second call's sleep
    image = work / "checkpoint"
    started = time.monotonic()
    subprocess.run(["runsc", "--root", RUNSC_ROOT, "checkpoint", "--image-path", str(image), sandbox.id], check=True)
    taken = time.monotonic() - started
    mounts = work / "mounts"
    mounts.mkdir()
    for mount in attrs["HostConfig"]["Mounts"]:
        if mount["Type"] == "bind":
            subprocess.run(["cp", "-a", mount["Source"], str(mounts / _name(mount["Target"]))], check=True)
    replay.communicate(timeout=120)  # the prefix's controller sees its sandbox gone, and removes it
    size = sum(p.stat().st_size for p in image.rglob("*") if p.is_file())
    figures: dict[str, object] = {"checkpoint_seconds": round(taken, 2), "checkpoint_mib": round(size / 2**20, 1)}
    restores, copies = [], []
    try:
        for k in range(forks):
            own = work / f"fork{k}"
            own.mkdir()
            host = copy.deepcopy(attrs["HostConfig"])
            for mount in host["Mounts"]:
                if mount["Type"] == "bind":
                    mount["Source"] = str(own / _name(mount["Target"]))
                    subprocess.run(["cp", "-a", str(mounts / _name(mount["Target"])), mount["Source"]], check=True)
            config = attrs["Config"]
            created = api.create_container(
                config["Image"], command=config["Cmd"], entrypoint=config["Entrypoint"], user=config["User"],
                working_dir=config["WorkingDir"], environment=config["Env"], host_config=host,
                labels=config["Labels"], name=f"{attrs['Name'].lstrip('/')}-fork{k}",
            )  # fmt: skip
            copies.append(created["Id"])
            target = Path(f"/var/lib/docker/containers/{created['Id']}/checkpoints/probe")
            shutil.copytree(image, target)
            started = time.monotonic()
            answer = api._post(api._url("/containers/{0}/start", created["Id"]), params={"checkpoint": "probe"})
            api._raise_for_status(answer)
            restores.append(round(time.monotonic() - started, 2))
        outcomes = []
        for k, container_id in enumerate(copies):
            code = api.wait(container_id, timeout=120)["StatusCode"]
            logs = work / f"fork{k}" / _name("/pvisor-host/logs")
            result = json.loads((logs / "stdout.log").read_text().splitlines()[-1])
            workspace = (work / f"fork{k}" / _name("/workspace") / "a.txt").read_text()
            outcomes.append({"exit": code, "failure": result["failure"], "a.txt": workspace})
    finally:
        for container_id in copies:
            api.remove_container(container_id, force=True)
    figures |= {"restore_seconds": restores, "forks": outcomes}
    sys.stdout.write(json.dumps(figures, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(o["exit"] == 0 and o["a.txt"] == "prefix\nafter\n" for o in outcomes) else 1


def _name(target: str) -> str:
    return target.strip("/").replace("/", "_")


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3))
