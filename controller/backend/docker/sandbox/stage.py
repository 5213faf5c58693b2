"""Stage stage: the per-run directory the sandbox sees, built on the host before the container starts.

Layout under ``<out>/.pvisor-host-staging/`` (removed on every path when the run ends)::

    input/       bound read-only at /pvisor-host/input: the trajectory copy (0444), entry.sh,
                 env.sh (0400, the sandbox user's: values of --env variables)
    workspace/   bound read-write at the workspace path: a fresh copy of --workspace-dir, or of the
                 image's own directory there (--image-workspace), or empty
    run/         bound read-write at /pvisor-host/run: pvisor's --state-dir and --output-dir roots
    logs/        bound read-write at /pvisor-host/logs: stdout.log and stderr.log, where entry.sh sends the
                 sandbox's output. The directory is ours: a sandbox user other than ours (as root, pvisor-host
                 runs sandboxes as 65532) may write to the two files but cannot replace them (nor add others)

The staging root is ours alone (0700): no other local user reaches into a running sandbox's files.

The trajectory is copied (and hashed while copying) so the sandbox reads exactly the bytes the record
names, whatever happens to the host file meanwhile, and so its permissions suit the sandbox user.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ....errors import InfrastructureError, UsageError
from ....files.digest import hash_file
from ....files.space import disk_full
from ....files.trees import Entry, chown_tree, copy_tree, remove_tree
from ....models.replay import STAGING_NAME
from ....models.spec import parse_user

INPUT_MOUNT = "/pvisor-host/input"
#: In the input directory: where ``--env`` values and the model's token are handed over (the sandbox user's, 0400).
ENV_FILE = "env.sh"
RUN_MOUNT = "/pvisor-host/run"
LOGS_MOUNT = "/pvisor-host/logs"
#: The streams entry.sh writes to, in the logs directory.
LOG_FILES = ("stdout.log", "stderr.log")
#: What entry.sh writes in the logs directory when the sandbox ends itself at its own deadline (empty: it did not).
DEADLINE_FILE = "deadline.json"
#: With ``--verify``: the verifier's script (in the input directory), and what entry.sh writes: the verifier's
#: output, pvisor's exit code once it has ended (see :mod:`.verify`).
VERIFY_SCRIPT = "verify.sh"
VERIFY_FILES = ("verify.log", "pvisor.json")
#: Where a verifier writes its reward (Harbor's convention): a directory of the staging, bound read-write.
VERIFIER_MOUNT = "/logs/verifier"
#: With ``--fork`` (:mod:`.gate`): the gate in the input directory, the mark it leaves in the run directory at the
#: boundary, and the go-ahead the host puts in a restored copy's input directory.
FORK_GATE = "fork-gate"
FORK_REACHED = "fork.reached"
FORK_GO = "fork.go"
#: The file in the input directory that lets the shim start the verifier (:mod:`.verify`).
VERIFY_GO = "verify.go"


class Staging(BaseModel):
    """A staged run directory."""

    model_config = ConfigDict(frozen=True)

    root: Path
    input_dir: Path
    workspace_dir: Path
    run_dir: Path
    logs_dir: Path
    trajectory_in_sandbox: str
    workspace_before: list[Entry]
    trajectory_filled: list[str] = []
    """Keys of the trajectory's saved config filled with the agent's own defaults in the copy the sandbox reads."""
    staged_sha256: str | None = None
    """That copy's sha256, when it differs from the trajectory's."""
    workspace_origin: Path | None = None
    """Where the files the workspace started from are on the host (``--workspace-dir``, or the copy out of the
    image): the patch of ``--collect changes`` is made against them. None: it started empty."""
    verifier_dir: Path | None = None
    """With ``--verify``: bound read-write at /logs/verifier, where a verifier writes its reward."""
    gate: str | None = None
    """With ``--fork``: where the sandbox sees the gate pvisor launches the agent through (:mod:`.gate`)."""


def staging_root(out_dir: Path) -> Path:
    """Where a run's staging directory lives (inside the run directory, removed after the run)."""
    return out_dir / STAGING_NAME


def _sandbox_owner(uid: int, gid: int) -> tuple[int | None, int | None]:
    """Owner to give staged files: the sandbox user when we can chown (as root), else leave ours."""
    if os.geteuid() == 0 and uid != 0:
        return uid, gid
    return None, None


def planned_staging(root: Path, trajectory: Path) -> Staging:
    """The layout :func:`stage` creates under ``root``, without creating anything (for ``batch --plan``)."""
    return Staging(
        root=root,
        input_dir=root / "input",
        workspace_dir=root / "workspace",
        run_dir=root / "run",
        logs_dir=root / "logs",
        trajectory_in_sandbox=f"{INPUT_MOUNT}/{_sandbox_name(trajectory.name)}",
        workspace_before=[],
    )


def stage(
    root: Path,
    *,
    trajectory: Path,
    trajectory_sha256: str,
    workspace_source: Path | None,
    user: str,
    env: dict[str, str],
    workspace_seed: Callable[[Path], tuple[list[Entry], Path]] | None = None,
    fill: Callable[[bytes], tuple[bytes, list[str]]] | None = None,
    verify: str | None = None,
) -> Staging:
    """Create the staging directory under ``root`` for one run (see the module docstring). ``fill`` gives the
    trajectory's bytes with what its saved config lacks filled in, and the keys it filled (mini-swe-agent)."""
    uid, gid = parse_user(user)
    owner_uid, owner_gid = _sandbox_owner(uid, gid)
    layout = planned_staging(root, trajectory)
    root.mkdir(mode=0o700)
    input_dir = layout.input_dir
    input_dir.mkdir(mode=0o755)

    copy = input_dir / Path(layout.trajectory_in_sandbox).name
    shutil.copyfile(trajectory, copy)
    if hash_file(copy)[1] != trajectory_sha256:
        raise UsageError(f"trajectory {trajectory} changed while pvisor-host was checking it", hint="run again")
    filled: list[str] = []
    staged_sha256 = None
    if fill is not None:
        derived, filled = fill(copy.read_bytes())
        if filled:
            copy.write_bytes(derived)
            staged_sha256 = hash_file(copy)[1]
    copy.chmod(0o444)

    entry = input_dir / "entry.sh"
    entry.write_bytes(resources.files("pvisor_host.assets").joinpath("entry.sh").read_bytes())
    entry.chmod(0o555)
    if env:
        env_file = input_dir / ENV_FILE
        env_file.write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items()), encoding="utf-8")
        env_file.chmod(0o400)
        if owner_uid is not None:
            os.chown(env_file, owner_uid, owner_gid if owner_gid is not None else owner_uid)

    if verify is not None:
        script = input_dir / VERIFY_SCRIPT
        script.write_text(verify + "\n", encoding="utf-8")
        script.chmod(0o555)

    workspace = layout.workspace_dir
    origin: Path | None = None
    if workspace_source is not None:
        before = copy_tree(workspace_source, workspace, uid=owner_uid, gid=owner_gid)
        origin = workspace_source
    elif workspace_seed is not None:
        before, origin = workspace_seed(workspace)
        if owner_uid is not None:
            chown_tree(workspace, owner_uid, owner_gid if owner_gid is not None else owner_uid)
    else:
        workspace.mkdir(mode=0o755)
        before = []
        if owner_uid is not None:
            os.chown(workspace, owner_uid, owner_gid if owner_gid is not None else owner_uid)
    run_dir = layout.run_dir
    run_dir.mkdir(mode=0o700)
    if owner_uid is not None:
        os.chown(run_dir, owner_uid, owner_gid or owner_uid)
    layout.logs_dir.mkdir(mode=0o755)
    for name in (*LOG_FILES, DEADLINE_FILE, *(VERIFY_FILES if verify is not None else ())):
        (layout.logs_dir / name).touch(mode=0o600)
        (layout.logs_dir / name).chmod(0o622)  # the sandbox user may write (it is not us, as root); only we read
    verifier = None
    if verify is not None:
        verifier = root / "verifier"
        verifier.mkdir(mode=0o755)
        if owner_uid is not None:
            os.chown(verifier, owner_uid, owner_gid if owner_gid is not None else owner_uid)
    return layout.model_copy(
        update={
            "workspace_before": before,
            "trajectory_filled": filled,
            "staged_sha256": staged_sha256,
            "workspace_origin": origin,
            "verifier_dir": verifier,
        }
    )


def _sandbox_name(name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name).lstrip(".")
    if not safe or safe in {"entry.sh", ENV_FILE, VERIFY_SCRIPT, VERIFY_GO, FORK_GATE, FORK_GO}:
        safe = "trajectory" + (Path(name).suffix or ".jsonl")
    return safe


def copy_staging(staging: Staging, root: Path) -> Staging:
    """A copy of ``staging``'s directories under ``root`` but :data:`ENV_FILE` (``--fork``: a restored fork's
    processes hold its values already, and no copy of it ever exists): ``cp -a``, which keeps owners, modes and
    times, so the restored processes find their files as they left them (the standard library's copies keep no
    owner). Nothing of it is left when it fails.

    Raises:
        InfrastructureError: a copy failed (``cp``'s own words).
    """
    root.mkdir(mode=0o700)
    moved: dict[str, Path] = {}
    try:
        for field in ("input_dir", "workspace_dir", "run_dir", "logs_dir", "verifier_dir"):
            source: Path | None = getattr(staging, field)
            if source is None:
                continue
            target = moved[field] = root / source.name
            if field != "input_dir":
                _cp(source, target)
                continue
            target.mkdir()
            for entry in source.iterdir():
                if entry.name != ENV_FILE:
                    _cp(entry, target / entry.name)
            info = source.stat()
            os.chown(target, info.st_uid, info.st_gid)
            shutil.copystat(source, target)  # last: the copies above would change its times
    except BaseException:
        remove_tree(root)
        raise
    return staging.model_copy(update={"root": root, **moved})


def _cp(source: Path, target: Path) -> None:
    done = subprocess.run(["cp", "-a", "--", str(source), str(target)], capture_output=True, text=True, check=False)
    if done.returncode != 0 and re.search(r"No space left on device|Disk quota exceeded", done.stderr):
        raise disk_full(target)
    if done.returncode != 0:
        raise InfrastructureError(f"cp -a {source.name}: {done.stderr.strip()[-300:]}")


def host_says(staging: Staging, name: str) -> None:
    """Put the go-ahead ``name`` in the input directory, which the sandbox reads and only the host can write (the
    verifier's, :data:`VERIFY_GO`; a restored fork's, :data:`FORK_GO`)."""
    (staging.input_dir / name).touch(mode=0o444)


def remove_staging(root: Path) -> None:
    """Delete a staging directory, whatever the sandbox did to directory permissions inside it."""
    remove_tree(root)
