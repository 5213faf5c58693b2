"""A whole replay: the model gateway around it, and retries of what is worth retrying.

pvisor marks model rate limits, 5xx answers and connection errors ``retryable``. Such an attempt is retried
(tenacity, exponential backoff) in a fresh sandbox with a new run id (pvisor refuses to reuse state), up to
``--attempts``; batches also retry infrastructure errors (:class:`RetryPolicy`). Attempts run in
``<out>/attempts/<n>/``; the last one is moved up to ``<out>/`` and its record lists every attempt, while
earlier ones keep their own files and records under ``attempts/``.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Iterator
from typing import Literal

from pydantic import BaseModel
from tenacity import RetryCallState, Retrying, retry_if_result, stop_after_attempt, wait_exponential

from ._log import logger
from .backend.base import AnyBackend, ModelGateway
from .errors import Interrupted
from .files.atomic import write_atomic
from .files.space import disk_full, is_full
from .files.trees import remove_if_empty
from .models.batch import fork_row_id
from .models.gateway import MODEL_CASSETTE
from .models.observations import observations_of
from .models.record import (
    START_TIMEOUT,
    AttemptSummary,
    BatchInfo,
    ReplayRecord,
    add_totals,
    load_record,
    save_record,
)
from .models.replay import Attempt, PreparedReplay
from .models.spec import ReplaySpec
from .signals import pause
from .units import format_duration


@contextlib.contextmanager
def model_gateway(prepared: PreparedReplay, backend: AnyBackend) -> Iterator[ModelGateway | None]:
    """The running gateway of a live continuation (None otherwise), closed on every path."""
    upstream = prepared.spec.continuation
    if upstream is None:
        yield None
        return
    gateway = backend.open_gateway(upstream, user=prepared.user)
    try:
        yield gateway
    finally:
        gateway.close()


class RetryPolicy(BaseModel):
    """Which failed attempts are worth another attempt in a fresh sandbox."""

    attempts: int = 3
    backoff: float = 5.0
    """Seconds before the first retry; doubled for each further one."""
    infra: bool = False
    """Also retry ``infra_error`` (engine errors, failed container starts) — batches do."""
    oom: bool = False
    """Also retry ``oom``."""

    def wants(self, record: ReplayRecord) -> bool:
        """Whether ``record``'s outcome should be retried. Never a trajectory, configuration or version error,
        nor a full disk (another attempt would find it as full)."""
        if record.failure is not None and record.failure.disk_full:
            return False
        if record.failure is not None and record.failure.category == START_TIMEOUT:
            return record.attempt == 1  # a runtime that hung once: once more in a fresh sandbox, not again
        if record.failure is not None and record.failure.retryable:
            return True
        return (self.infra and record.status == "infra_error") or (self.oom and record.status == "oom")

    @classmethod
    def for_spec(cls, spec: ReplaySpec, **extra: bool) -> RetryPolicy:
        """The policy of ``spec``'s ``--attempts`` and ``--retry-backoff``, with ``extra`` switches."""
        return cls(attempts=spec.attempts, backoff=spec.retry_backoff, **extra)


def run_replay(prepared: PreparedReplay, backend: AnyBackend) -> ReplayRecord:
    """Run ``prepared`` to its final record: gateway, attempts, retries (see the module docstring)."""
    policy = RetryPolicy.for_spec(prepared.spec)
    if prepared.runtime_warning is not None:
        logger.warning(prepared.runtime_warning)
    with model_gateway(prepared, backend) as gateway:
        return run_attempts(prepared, backend, gateway=gateway, policy=policy)


def run_forked(
    prepared: PreparedReplay,
    backend: AnyBackend,
    *,
    gateway: ModelGateway | None | Literal["own"] = "own",
    cancel: threading.Event | None = None,
    batch: BatchInfo | None = None,
) -> list[ReplayRecord]:
    """Run ``prepared`` with ``--fork K`` (:meth:`~pvisor_host.backend.base.Backend.run_forks`) through ``gateway``
    (``"own"``: one of its own, for a live continuation): the prefix's record, then each fork's, each fork's with
    how its replayed calls' observations matched the trajectory's, and with ``batch`` the item each belongs to
    (a fork's row is ``<item>.f<k>``). The forks are not retried: each is one continuation from the one prefix
    (docs/fork.md)."""
    if gateway == "own":
        if prepared.runtime_warning is not None:
            logger.warning(prepared.runtime_warning)
        with model_gateway(prepared, backend) as own:
            return run_forked(prepared, backend, gateway=own, cancel=cancel, batch=batch)
    records = backend.run_forks(prepared, gateway=gateway, cancel=cancel)
    return [_finished_fork(prepared, record, batch) for record in records]


def _finished_fork(prepared: PreparedReplay, record: ReplayRecord, batch: BatchInfo | None) -> ReplayRecord:
    """A fork's (or the prefix's) record with its observations matched against the trajectory's and its batch
    item, saved again in its run directory."""
    fork = record.fork
    assert fork is not None  # run_forks gives every record its place
    run_dir = prepared.out_dir / fork.dir_name
    update: dict[str, object] = {"observations": observations_of(record, run_dir, prepared.trajectory.path)}
    if batch is not None:  # a fork's row is an item of its own
        update["batch"] = batch.model_copy(update={"item_id": fork_row_id(batch.item_id, fork.index)})
    record = record.model_copy(update=update)
    save_record(record, run_dir)
    return record


def run_attempts(
    prepared: PreparedReplay,
    backend: AnyBackend,
    *,
    gateway: ModelGateway | None,
    policy: RetryPolicy,
    cancel: threading.Event | None = None,
    batch: BatchInfo | None = None,
) -> ReplayRecord:
    """Attempt ``prepared`` until it succeeds or ``policy`` gives up; return the top-level record.

    ``cancel`` (batches) stops a running attempt (its sandbox is stopped by the batch) and any retry.
    """
    out = prepared.out_dir
    records: list[ReplayRecord] = []

    def attempt() -> ReplayRecord:
        number = len(records) + 1
        run_id = prepared.run_id if number == 1 else f"{prepared.run_id}-a{number}"
        this = Attempt(number=number, run_id=run_id, run_dir=out / "attempts" / str(number))
        records.append(backend.run_attempt(prepared, this, gateway=gateway, cancel=cancel))
        return records[-1]

    def between(seconds: float) -> None:
        try:
            pause(seconds, cancel, "waiting for the next attempt; the records of finished attempts are kept")
        except KeyboardInterrupt:
            raise Interrupted("interrupted between attempts; the records of finished attempts are kept") from None

    retrying = Retrying(
        stop=stop_after_attempt(policy.attempts),
        wait=wait_exponential(multiplier=policy.backoff, max=600),
        retry=retry_if_result(policy.wants),
        before_sleep=_log_retry,
        sleep=between,
        retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
    )
    stopped: Interrupted | None = None
    try:
        retrying(attempt)
    except Interrupted as exc:
        stopped = exc
        attempted = out / "attempts" / str(len(records) + 1) / "record.json"
        if attempted.exists():  # the interrupted attempt ran: its record says so
            records.append(load_record(attempted))
    try:
        final = _finish(prepared, records, batch, keep_tape=stopped is None)
    except OSError as exc:
        if stopped is not None:  # Ctrl-C stays the outcome; what failed while keeping its attempt is its cause
            raise stopped from exc
        if not is_full(exc):
            raise
        raise disk_full(out) from exc
    if stopped is not None:
        raise stopped
    assert final is not None  # an attempt that was not interrupted left its record
    return final


def _log_retry(state: RetryCallState) -> None:
    record = state.outcome.result() if state.outcome and not state.outcome.failed else None
    what = record.failure.category if record is not None and record.failure else "a retryable failure"
    delay = state.next_action.sleep if state.next_action else 0.0
    logger.warning(
        "attempt {} ended with {}; retrying in a fresh sandbox in {}",
        state.attempt_number,
        what,
        format_duration(delay),
    )


def _finish(
    prepared: PreparedReplay, records: list[ReplayRecord], batch: BatchInfo | None, *, keep_tape: bool
) -> ReplayRecord | None:
    """The run directory once the attempts have ended: the last one's record and files (:func:`_keep`), or, when
    Ctrl-C came before the first attempt ran, nothing (None)."""
    if records:
        return _keep(prepared, records, batch, keep_tape=keep_tape)
    shutil.rmtree(prepared.out_dir / "attempts", ignore_errors=True)
    remove_if_empty(prepared.out_dir)
    return None


def _keep(
    prepared: PreparedReplay, records: list[ReplayRecord], batch: BatchInfo | None, *, keep_tape: bool
) -> ReplayRecord:
    """Move the last attempt up to the run directory and write the top-level record listing every attempt, with
    how its replayed calls' observations matched the trajectory's. With ``keep_tape`` (the replay was not
    interrupted) and ``--model-cassette record DIR``, the final attempt's tape then goes to DIR, named after the
    run."""
    out = prepared.out_dir
    last = records[-1]
    last_dir = out / "attempts" / str(last.attempt)
    for entry in last_dir.iterdir():
        entry.rename(out / entry.name)
    last_dir.rmdir()
    remove_if_empty(out / "attempts")
    summaries = [
        AttemptSummary(
            attempt=r.attempt,
            run_id=r.run_id,
            status=r.status,
            failure=r.failure,
            started_at=r.started_at,
            finished_at=r.finished_at,
            container_id=r.container.id,
            path="." if r is last else f"attempts/{r.attempt}",
        )
        for r in records
    ]
    observations = observations_of(last, out, prepared.trajectory.path)
    failure = last.failure
    if failure is not None and str(last_dir) in failure.message:  # the files it names moved up with it
        failure = failure.model_copy(update={"message": failure.message.replace(str(last_dir), str(out))})
    final = last.model_copy(
        update={
            "attempts": summaries if len(records) > 1 else [],
            "batch": batch,
            "observations": observations,
            "failure": failure,
        }
    )
    if len(records) > 1 and final.model is not None:  # what every attempt's model calls came to
        every = add_totals([r.model.totals for r in records if r.model is not None and r.model.totals is not None])
        final = final.model_copy(update={"model": final.model.model_copy(update={"totals": every})})
    save_record(final, out)
    upstream = prepared.spec.continuation
    cassette = upstream.cassette if upstream is not None else None
    tape = out / MODEL_CASSETTE
    if keep_tape and cassette is not None and not cassette.replaying and tape.is_file():
        try:
            cassette.dir.mkdir(parents=True, exist_ok=True)  # checked at pre-flight, made now: a refusal makes none
            write_atomic(cassette.tape(prepared.name), tape.read_bytes())
        except OSError as exc:
            if is_full(exc):
                raise
            logger.warning("could not write the tape into {} ({}); it stays in {}", cassette.dir, exc.strerror, tape)
    return final
