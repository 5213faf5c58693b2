"""A whole replay: the model gateway around it, and retries of what pvisor marks retryable.

pvisor marks model rate limits, 5xx answers and connection errors ``retryable``. Such an attempt is retried
with exponential backoff in a fresh sandbox with a new run id (pvisor refuses to reuse state), up to
``--attempts``. Attempts run in ``<out>/attempts/<n>/``; the last one is moved up to ``<out>/`` and its
record lists every attempt, while earlier ones keep their own files and records under ``attempts/``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import docker
from loguru import logger

from .errors import Interrupted
from .gateway import Gateway, GatewayConfig
from .launch import Attempt
from .preflight import PreparedReplay, release_out_dir
from .record import AttemptSummary, ReplayRecord, load_record, save_record
from .replay import MODEL_JOURNAL, run_attempt
from .stage import parse_user
from .units import format_duration


def gateway_config(prepared: PreparedReplay) -> GatewayConfig | None:
    """The gateway a replay needs (a live continuation with ``--model-base-url``), or None."""
    spec = prepared.spec
    if not spec.uses_gateway:
        return None
    assert spec.model_base_url is not None
    assert spec.model is not None
    assert spec.model_api_key_env is not None
    return GatewayConfig(
        upstream=spec.model_base_url,
        model=spec.model,
        api_key_env=spec.model_api_key_env,
        network=spec.model_network,
        body_limit=0 if spec.no_model_bodies else spec.model_body_limit,
        upstream_timeout=spec.model_timeout,
    )


@contextlib.contextmanager
def model_gateway(prepared: PreparedReplay, client: docker.DockerClient) -> Iterator[Gateway | None]:
    """The running gateway for ``prepared`` (stopped, and its socket or network removed, on every path)."""
    config = gateway_config(prepared)
    if config is None:
        yield None
        return
    uid, _ = parse_user(prepared.user)
    with Gateway(config, os.environ[config.api_key_env], client=client, sandbox_uid=uid) as gateway:
        yield gateway


def run_replay(prepared: PreparedReplay, client: docker.DockerClient) -> ReplayRecord:
    """Run ``prepared`` to its final record: gateway, attempts, retries (see the module docstring)."""
    with model_gateway(prepared, client) as gateway:
        return _attempts(prepared, client, gateway)


def _attempts(prepared: PreparedReplay, client: docker.DockerClient, gateway: Gateway | None) -> ReplayRecord:
    out = prepared.out_dir
    spec = prepared.spec
    records: list[ReplayRecord] = []
    try:
        for number in range(1, spec.attempts + 1):
            if number > 1:
                _back_off(number - 1, records[-1], spec.retry_backoff)
            records.append(_one(prepared, client, gateway, number))
            failure = records[-1].failure
            if failure is None or not failure.retryable:
                break
    except Interrupted:
        attempted = out / "attempts" / str(len(records) + 1) / "record.json"
        if attempted.exists():  # the interrupted attempt ran: its record says so
            records.append(load_record(attempted))
        if records:
            _finish(out, records)
        else:
            shutil.rmtree(out / "attempts", ignore_errors=True)
            release_out_dir(out)
        raise
    return _finish(out, records)


def _one(prepared: PreparedReplay, client: docker.DockerClient, gateway: Gateway | None, number: int) -> ReplayRecord:
    run_id = prepared.run_id if number == 1 else f"{prepared.run_id}-a{number}"
    run_dir = prepared.out_dir / "attempts" / str(number)
    access = gateway.access(run_id, run_dir / MODEL_JOURNAL) if gateway is not None else None
    try:
        return run_attempt(prepared, client, Attempt(number=number, run_id=run_id, run_dir=run_dir, model=access))
    finally:
        if gateway is not None and access is not None:
            gateway.release(access.token)


def _back_off(done: int, last: ReplayRecord, base: float) -> None:
    delay = base * 2 ** (done - 1)
    category = last.failure.category if last.failure else "?"
    logger.warning(
        "attempt {} failed with {} (retryable); retrying in a fresh sandbox in {}",
        done,
        category,
        format_duration(delay),
    )
    try:
        time.sleep(delay)
    except KeyboardInterrupt:
        raise Interrupted("interrupted between attempts; the records of finished attempts are kept") from None


def _finish(out: Path, records: list[ReplayRecord]) -> ReplayRecord:
    """Move the last attempt up to ``out`` and write the top-level record listing every attempt."""
    last = records[-1]
    last_dir = out / "attempts" / str(last.attempt)
    for entry in last_dir.iterdir():
        entry.rename(out / entry.name)
    last_dir.rmdir()
    attempts_dir = out / "attempts"
    if not any(attempts_dir.iterdir()):
        attempts_dir.rmdir()
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
    final = last.model_copy(update={"attempts": summaries if len(records) > 1 else []})
    save_record(final, out)
    return final
