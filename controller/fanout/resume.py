"""An item across the runs of its batch: what an earlier run left for it (its content key, its record), the host
checks it runs under its run id and directory when it runs again, and setting that earlier run aside.

An item whose record says its filesystem was full (``disk_full``) is never finished: it runs again.

Each item has a content key — sha256 over the trajectory's sha256, the image id (and the agent image an
injected runtime comes from), the workspace directory's content and every option that changes the
outcome. An item whose directory holds a complete record with the same key is skipped (unless it failed
and ``--rerun-failed``); anything else in its directory is moved to ``.previous/<id>/<time>/`` first, so
nothing is lost.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from ..files.trees import remove_tree
from ..models.batch import FINAL_STATUSES
from ..models.record import ReplayRecord, fork_dir_name, load_record
from ..models.replay import FORK_WORK, STAGING_NAME, TrajectoryInfo
from ..models.spec import ReplaySpec
from ..preflight.checks import CheckedInputs, check_trajectory_inputs

if TYPE_CHECKING:
    from .manifest import BatchItem

#: Options that do not change an item's outcome, so changing them does not rerun it.
NOT_OUTCOME: dict[str, bool | set[str]] = {
    **dict.fromkeys(
        ("trajectory", "out", "run_id", "workspace_dir", "attempts", "retry_backoff", "start_timeout"), True
    ),
    "upstream": {"body_limit"},
}


#: An image as a content key sees it: its id, and the agent image an injected runtime came from.
ImageIdentity = tuple[str, str | None]


def content_key(spec: ReplaySpec, trajectory_sha256: str, image: ImageIdentity, workspace_sha256: str | None) -> str:
    """The item's identity for resuming (see the module docstring)."""
    options = spec.model_dump(mode="json", exclude=NOT_OUTCOME)
    if spec.egress is None:  # no egress: its caps change nothing, and the keys stay those of before --egress existed
        del options["egress"], options["egress_limit"]
    if spec.fork is None:  # the same for --fork
        del options["fork"], options["fork_strict"]
    material = {
        "options": options,
        "trajectory": trajectory_sha256,
        "image": image[0],
        "agent_image": image[1],
        "workspace": workspace_sha256,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def finished_record(run_dir: Path, key: str, rerun_failed: bool) -> ReplayRecord | None:
    """The record of an item that finished earlier, if it is complete, has the same key and need not rerun."""
    try:
        record = load_record(run_dir / "record.json")
    except (OSError, ValueError):
        return None
    if record.batch is None or record.batch.content_key != key or record.status not in FINAL_STATUSES:
        return None
    if record.failure is not None and record.failure.disk_full:
        return None  # the host's disk, not the item: it runs again once there is space
    if rerun_failed and record.status != "ok":
        return None
    return record


def finished_earlier(
    item: BatchItem,
    trajectory: TrajectoryInfo,
    image: ImageIdentity | None,
    workspace_sha256: str | None,
    *,
    out: Path,
    rerun_failed: bool,
) -> tuple[str | None, list[ReplayRecord] | None]:
    """The item's content key (None: its image is not known yet) and what it came to in an earlier run that need
    not run again, a record per row (None: it runs), the same for the run and the plan: its record, or with
    ``fork: K`` each fork's (the prefix's for each, when it stood alone: ``fork.alone``)."""
    if image is None:
        return None, None
    key = content_key(item.spec, trajectory.sha256, image, workspace_sha256)
    run_dir = out / item.id
    if item.spec.fork is None:
        record = finished_record(run_dir, key, rerun_failed)
        return key, [record] if record is not None else None
    prefix = finished_record(run_dir / fork_dir_name(None), key, rerun_failed=False)
    if prefix is None or prefix.fork is None:
        return key, None
    if prefix.fork.alone:  # no fork ran: each fork's row is the prefix's record
        outcomes = [prefix] * item.spec.fork
    else:
        forks = [finished_record(run_dir / fork_dir_name(k), key, rerun_failed=False)
                 for k in range(1, item.spec.fork + 1)]  # fmt: skip
        if None in forks:
            return key, None
        outcomes = [f for f in forks if f is not None]
    if rerun_failed and any(not r.ok for r in outcomes):  # judged by its rows
        return key, None
    return key, outcomes


def check_item(item: BatchItem, trajectory: TrajectoryInfo, out: Path) -> CheckedInputs:
    """The item's host checks, the same for the run and the plan (pvisor's verdict from its trajectory's survey).

    Raises:
        UsageError: the first problem found, in one line.
    """
    return check_trajectory_inputs(
        item.spec, trajectory, per_file=True, run_id=item_run_id(item.id), out_dir=out / item.id
    )


def set_aside(out: Path, item_id: str) -> None:
    """Move whatever an earlier run left in the item's directory to ``.previous/<id>/<time>/``."""
    run_dir = out / item_id
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return
    # A controller killed mid-run leaves its staging behind, env.sh with secret values included, and a forked
    # replay its checkpoint (the sandbox's memory) and its copies: drop them.
    stagings = [run_dir / STAGING_NAME, *run_dir.glob(f"attempts/*/{STAGING_NAME}"), *run_dir.glob(f"*/{STAGING_NAME}")]
    for staging in [*stagings, run_dir / FORK_WORK]:
        remove_tree(staging)
    target = out / ".previous" / item_id / datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%f")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(run_dir), str(target))


def item_run_id(item_id: str) -> str:
    """A run id for the item's first attempt: its id made pvisor-safe, plus a unique suffix."""
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', item_id)[:80]}-{secrets.token_hex(3)}"
