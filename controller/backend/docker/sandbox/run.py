"""Run stage: one prepared replay's attempt in one hardened container, from staging to ``record.json``.

:func:`run_attempt` stages the run directory (:mod:`.stage`), runs ``pvisor replay`` in a container made by
:func:`~.container.sandbox_container` (removed on every path), waits with the timeout, collects logs and
trees (:mod:`.collect`), parses pvisor's result, and writes ``result.json`` and ``record.json`` atomically
(:mod:`.outcome`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import docker
from docker.models.containers import Container

from ...._log import logger
from ....errors import DiskFull, InfrastructureError, Interrupted, UsageError
from ....files.archive import Budget
from ....files.atomic import write_atomic
from ....files.space import full_disk_raises, is_full
from ....files.trees import Entry
from ....gateway.cassette import Tape
from ....models.gateway import MODEL_CASSETTE
from ....models.ownership import Ownership
from ....models.record import ContainerInfo, ForkInfo, ReplayRecord, save_record
from ....models.replay import Attempt, PreparedReplay
from ....models.result import parse_result
from ....models.spec import parse_user
from ....signals import deferred_interrupts
from ....units import format_duration
from .. import container as sandbox
from .. import state as usage
from ..checkpoint import CheckpointFailed
from ..container import Leftovers
from ..egress import egress_access
from ..gateway import Gateway, ModelAccess
from ..image.files import ImageFiles
from . import launch
from .collect import collect_logs, collect_trees, collect_workspace, open_log, warn_if_cut
from .gate import add_gate
from .gate import reached as gate_reached
from .native import fill_config
from .outcome import MODEL_JOURNAL, AttemptState, build_record
from .seed import Seeds
from .stage import DEADLINE_FILE, Staging, remove_staging, stage, staging_root
from .starts import StartSlots
from .verify import PVISOR_DONE, go_ahead, pvisor_exit_code, read_verification


def run_attempt(
    client: docker.DockerClient,
    ownership: Ownership,
    prepared: PreparedReplay,
    attempt: Attempt,
    *,
    gateway: Gateway | None = None,
    cancel: threading.Event | None = None,
    leftovers: Leftovers | None = None,
    seeds: Seeds | None = None,
    files: ImageFiles | None = None,
    starts: StartSlots | None = None,
    way: Way | None = None,
) -> ReplayRecord:
    """Run one attempt in a fresh sandbox and return its record (also written to its ``record.json``); ``way``
    says how the sandbox comes to be when it is not staged fresh and started (``--fork``, :mod:`.fork`).

    An attempt that ran always yields a record, whatever its status. Ctrl-C (or ``cancel``) removes the
    container, writes a record with status ``interrupted`` and raises :class:`Interrupted`. A container the
    engine could not remove goes to ``leftovers``, to be removed once it answers again.

    Raises:
        DiskFull: the run directory's filesystem has no space left (no record could be written).
    """
    way = way or Way()
    model = None
    if gateway is not None:
        journal, tape = attempt.run_dir / MODEL_JOURNAL, _tape(prepared, attempt)
        # By the run id pvisor knows (a fork's is its prefix's): the one its requests carry, which a tape masks.
        model = gateway.access(attempt.pvisor_id, journal, tape, token=way.token)
    try:
        with full_disk_raises(attempt.run_dir):
            fill = _config_fill(prepared, files or ImageFiles(client, ownership)) if way.staged is None else None
            return _run(
                client, ownership, prepared, attempt, model, cancel, leftovers, seeds or Seeds(), fill, starts, way
            )
    finally:
        if gateway is not None and model is not None:
            gateway.release(model)


@dataclasses.dataclass
class Way:
    """How an attempt's sandbox comes to be, when not as a plain replay's (staged fresh, started by the engine):
    ``--fork``'s prefix (:attr:`boundary`) and its copies (the other fields), see :mod:`.fork`."""

    boundary: Callable[[Container, Staging, sandbox.ContainerSpec, str | None, float], ForkInfo] | None = None
    """The prefix's: stage the gate, and once the sandbox reaches it, checkpoint it (the sandbox stops; given its
    container, staging, spec, gateway token and the seconds since it started): its fork information."""
    staged: Callable[[Path], Staging] | None = None
    """A copy's: its staging (copied from the prefix's at the boundary; given the root a plain replay's has)."""
    before_start: Callable[[Container], None] | None = None
    """A copy's: give the created container the checkpoint (before it waits for a start slot)."""
    start: Callable[[Container], float] | None = None
    """A copy's: start the created container from the checkpoint (the seconds it took), then let it go."""
    start_lock: threading.Lock | None = None
    """A copy's: held around its start (one start from a checkpoint at a time), before it takes a start slot."""
    token: str | None = None
    """A copy's: the gateway token pvisor holds in its memory (the prefix's)."""
    fork: ForkInfo | None = None
    """Its place among a prefix and its forks, for its record."""
    timeout: float | None = None
    """A copy's: its ``--timeout``, what the prefix left of it (the sandbox's own deadline is restored with it)."""


def _tape(prepared: PreparedReplay, attempt: Attempt) -> Tape | None:
    """The attempt's cassette tape: recorded into its run directory, or served from the cassette's."""
    upstream = prepared.spec.continuation
    if upstream is None or upstream.cassette is None:
        return None
    if upstream.cassette.replaying:
        volatile = [*prepared.profile.continuation.volatile, *upstream.cassette_masks]
        return Tape(upstream.cassette.tape(prepared.name), replaying=True, volatile=volatile)
    return Tape(attempt.run_dir / MODEL_CASSETTE, replaying=False)


def _run(
    client: docker.DockerClient,
    ownership: Ownership,
    prepared: PreparedReplay,
    attempt: Attempt,
    model: ModelAccess | None,
    cancel: threading.Event | None,
    leftovers: Leftovers | None,
    seeds: Seeds,
    fill: Callable[[bytes], tuple[bytes, list[str]]] | None,
    starts: StartSlots | None,
    way: Way,
) -> ReplayRecord:
    state = AttemptState(prepared, attempt)
    state.used_gateway = model is not None
    state.model_token = model.token if model is not None else None
    state.fork = way.fork
    if way.fork is not None and way.fork.role == "fork":
        state.timings = {}  # the host's checks and the image were the prefix's, and are in its record
    out = attempt.run_dir
    out.mkdir(parents=True, exist_ok=True)
    clock = time.monotonic()
    staging: Staging | None = None
    cspec: sandbox.ContainerSpec | None = None
    info: ContainerInfo | None = None
    try:
        secrets = launch.secret_env(prepared, model, {name: os.environ[name] for name in prepared.spec.env})
        state.secret_names = sorted(secrets)
        if way.staged is not None:
            staging = way.staged(staging_root(out))
        else:
            staging = stage(
                staging_root(out),
                trajectory=prepared.trajectory.path,
                trajectory_sha256=prepared.trajectory.sha256,
                workspace_source=prepared.spec.workspace_dir,
                user=prepared.user,
                env=secrets,
                workspace_seed=_image_seed(client, ownership, prepared, seeds),
                fill=fill,
                verify=prepared.spec.verify,
            )
        if way.boundary is not None:
            staging = add_gate(staging, prepared.image.agent_entrypoint)
        clock = state.phase("stage", clock)
        with contextlib.ExitStack() as stack:
            egress = None
            if prepared.spec.egress is not None:
                egress, state.egress_journal = stack.enter_context(egress_access(
                    attempt.run_id, prepared.spec.egress, prepared.spec.egress_limit,
                    uid=parse_user(prepared.user)[0], no_proxy=launch.model_hosts(model),
                ))  # fmt: skip
            cspec = launch.container_spec(prepared, attempt, staging, ownership=ownership, model=model, egress=egress)
            info = ContainerInfo(name=cspec.name, command=cspec.command)
            _run_container(client, state, cspec, info, staging, cancel, clock, leftovers, starts, way)
    except KeyboardInterrupt:
        state.interrupted = True
    except DiskFull:
        raise  # a write of ours found the host's disk full (--fork's copies): no record can be written either
    except InfrastructureError as exc:
        state.infra_error = exc.one_line()
        state.infra_category = exc.category if isinstance(exc, sandbox.StartHung) else None
    except UsageError:
        if staging is None:  # the staging itself was refused (e.g. --image-workspace): nothing ran
            remove_staging(staging_root(out))
        raise
    finally:
        if staging is not None:
            with deferred_interrupts():
                remove_staging(staging.root)
    if staging is None or cspec is None or info is None:
        raise Interrupted("interrupted before the sandbox started; nothing ran")
    record = build_record(state, staging, cspec, info, ownership)
    save_record(record, out)
    if state.interrupted:
        raise Interrupted("interrupted; the container was removed and record.json says status interrupted")
    return record


def _config_fill(prepared: PreparedReplay, files: ImageFiles) -> Callable[[bytes], tuple[bytes, list[str]]] | None:
    """What fills a saved config the agent's runner needs and the trajectory lacks (mini-swe-agent's agent
    templates), from the agent's own defaults in its image; None when there is nothing to fill from, or the
    mode starts no runner."""
    path = prepared.profile.trajectory.config_defaults
    if path is None or prepared.spec.mode == "prepare-only":
        return None
    raw = files.read(prepared.image.id, path)
    try:
        defaults = json.loads(raw) if raw is not None else None
    except ValueError:
        defaults = None
    if not isinstance(defaults, dict):
        logger.debug("{} has no readable {}: the trajectory's config is passed as it is", prepared.image.ref, path)
        return None

    def fill(data: bytes) -> tuple[bytes, list[str]]:
        try:
            document = json.loads(data)
        except ValueError:
            return data, []  # pvisor reports what is wrong with it
        filled = fill_config(document, defaults) if isinstance(document, dict) else []
        return (json.dumps(document, ensure_ascii=False).encode(), filled) if filled else (data, [])

    return fill


def _image_seed(
    client: docker.DockerClient, ownership: Ownership, prepared: PreparedReplay, seeds: Seeds
) -> Callable[[Path], tuple[list[Entry], Path]] | None:
    if not prepared.spec.image_workspace:
        return None
    budget = Budget(prepared.spec.collect_limit)
    image, path = prepared.image.id, prepared.workspace_path
    place = seeds.root or prepared.out_dir.parent  # the batch's folder, say
    return lambda dest: seeds.fill(client, ownership, image, path, dest, budget, place=place)


def _run_container(
    client: docker.DockerClient,
    state: AttemptState,
    cspec: sandbox.ContainerSpec,
    info: ContainerInfo,
    staging: Staging,
    cancel: threading.Event | None,
    clock: float,
    leftovers: Leftovers | None,
    starts: StartSlots | None,
    way: Way,
) -> None:
    prepared = state.prepared
    spec = prepared.spec
    out = state.attempt.run_dir
    with sandbox.sandbox_container(client, cspec, leftovers=leftovers) as box:
        info.id = box.id
        built = prepared.built
        usage.record_use(prepared.image.id, prepared.image.runtime_volume, built.id if built else None)
        if way.before_start is not None:
            way.before_start(box)
        clock = state.phase("create", clock)
        timeout = way.timeout if way.timeout is not None else spec.timeout
        with (
            way.start_lock or contextlib.nullcontext(),
            starts.holding(cancel) if starts is not None else contextlib.nullcontext(),
        ):
            if cancel is not None and cancel.is_set():
                raise KeyboardInterrupt  # stopped while it waited for its turn: it never starts
            if way.start is not None:
                restored = way.start(box)
                if state.fork is not None:
                    state.fork = state.fork.model_copy(update={"restore_seconds": restored, "restored": True})
            else:
                sandbox.start(box, spec.start_timeout)
        started = time.monotonic()  # the sandbox's own deadline counts from about here
        logger.info(
            "running {} {} (after step {}) in container {} [{}]",
            prepared.profile.agent,
            spec.mode,
            spec.after_step,
            box.short_id,
            cspec.name,
        )
        if cancel is not None and cancel.is_set():
            raise KeyboardInterrupt  # the batch was cancelled while this sandbox started
        pvisor_done = staging.logs_dir / PVISOR_DONE
        if way.boundary is not None:  # the prefix runs to the gate, where it is checkpointed (and stops)
            verifier = spec.verify is not None  # pvisor may end before the boundary, its verifier waiting
            until = lambda: gate_reached(staging) or (verifier and pvisor_done.stat().st_size > 0)  # noqa: E731
            state.outcome = sandbox.wait(box, timeout, until=until)
            clock = state.phase("run", clock)
            if state.outcome.running and gate_reached(staging):
                _checkpoint(state, way, box, staging, cspec, time.monotonic() - started)
                state.outcome = sandbox.wait(box, timeout)
                clock = state.phase("checkpoint", clock)
        elif spec.verify is None:
            state.outcome = sandbox.wait(box, timeout)
            clock = state.phase("run", clock)
        else:  # pvisor's phase ends with its marker; the verifier starts when the host says (see .verify)
            state.outcome = sandbox.wait(box, timeout, until=lambda: pvisor_done.stat().st_size > 0)
            clock = state.phase("run", clock)
        if cancel is not None and cancel.is_set():
            raise KeyboardInterrupt  # the batch stopped this sandbox: record it as interrupted, collect nothing
        verifying = state.outcome.running
        if verifying:  # pvisor has ended and the sandbox waits: its exit code is the marker's
            state.outcome = sandbox.WaitOutcome(exit_code=pvisor_exit_code(pvisor_done))
        state.self_deadline = self_deadline(staging.logs_dir / DEADLINE_FILE, prepared)
        state.logs_truncated, tail = collect_logs(staging.logs_dir, out / "logs")
        if not state.at_boundary:  # a prefix checkpointed at the boundary has no result: its forks have theirs
            _parse(state, tail)
        budget = Budget(spec.collect_limit)
        trees = {
            "output": staging.run_dir / "output" / state.attempt.pvisor_id,
            "state": staging.run_dir / "state" / state.attempt.pvisor_id,
        }
        state.collected = collect_trees(trees, out, budget)
        collect_workspace(
            state.collected, staging.workspace_dir, out, budget, mode=spec.collect_mode,
            before=staging.workspace_before, origin=staging.workspace_origin,
        )  # fmt: skip
        clock = state.phase("collect", clock)
        if spec.verify is not None and not state.at_boundary:
            verified = None
            if verifying:
                go_ahead(staging)
                verified = sandbox.wait(box, spec.verify_timeout)
                if cancel is not None and cancel.is_set():
                    raise KeyboardInterrupt
            seconds = time.monotonic() - clock
            state.verification = read_verification(spec.verify, staging, out, budget, verified, seconds)
            state.phase("verify", clock)
        warn_if_cut(budget, spec.collect_limit)


def _checkpoint(
    state: AttemptState, way: Way, box: Container, staging: Staging, cspec: sandbox.ContainerSpec, elapsed: float
) -> None:
    """The prefix at the boundary: checkpointed (``way.boundary``), its record to say so, or why it could not be."""
    assert way.boundary is not None and state.fork is not None
    try:
        state.fork = way.boundary(box, staging, cspec, state.model_token, elapsed)
    except (InfrastructureError, OSError) as exc:
        if isinstance(exc, DiskFull) or is_full(exc):
            raise  # the host's disk: DiskFull, as any write of ours that finds no space
        if isinstance(exc, InfrastructureError):
            why = exc.one_line()
        else:
            why = f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
        state.fork = state.fork.model_copy(update={"reached": True, "checkpoint_error": why})
        raise CheckpointFailed(why) from exc


def self_deadline(marker: Path, prepared: PreparedReplay) -> str | None:
    """What the sandbox's own deadline ended, in words (None: it did not end itself)."""
    handle, size = open_log(marker)
    with handle:
        raw = handle.read(256)
    if size == 0:
        return None
    try:
        what = json.loads(raw).get("what")
    except (ValueError, AttributeError):
        what = None
    if what == "verifier":
        bound = f"--verify-timeout {format_duration(prepared.spec.verify_timeout)}"
    else:
        bound = f"--timeout {format_duration(prepared.spec.timeout)}"
    return f"the {what or 'replay'} ran past {bound} and the {launch.SELF_GRACE}s grace with no host to end it"


def _parse(state: AttemptState, stdout_tail: bytes) -> None:
    try:
        raw, state.result = parse_result(stdout_tail)
    except Exception as exc:  # ResultProtocolError, or an unreadable log
        state.protocol_error = str(exc)
        return
    write_atomic(state.attempt.run_dir / "result.json", raw + b"\n")
