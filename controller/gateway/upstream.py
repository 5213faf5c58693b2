"""One model call to the upstream: a slot in the batch's limits, then the request, retried while nothing has
reached the agent yet.

What the upstream means as passing is retried with tenacity, within the call's budget (``--model-retry-budget``):
429 and 529 (honouring ``Retry-After``), 5xx, a refused, reset or timed-out connection. Everything else, and
whatever outlasts the budget, goes to the agent as it came. Once an answer's headers are in, the call is the
agent's: a stream that breaks off later is ended cleanly for it, never retried behind its back. Each retry
gives its slot back while it waits (the load is what is in flight upstream), and is journaled.
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt
from tenacity.wait import wait_exponential_jitter

from ..units import parse_retry_after
from .limits import Limits, Slot

#: Answers that mean "not now": retried within the budget.
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504, 529})
#: Connection failures before an answer: refused, reset, or a connect that timed out. (A read that timed out
#: waiting for the first byte is not among them: the upstream may still be working on it; nor is a TLS
#: failure, which another try would meet again.)
RETRYABLE_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                    aiohttp.ConnectionTimeoutError)  # fmt: skip
PERMANENT_ERRORS = (aiohttp.ClientSSLError, aiohttp.ClientConnectorCertificateError)
#: Backoff without Retry-After: exponential from half a second, capped, with jitter.
BACKOFF = wait_exponential_jitter(multiplier=0.5, max=20, jitter=1)


class Refused(Exception):
    """The upstream said "not now" (or the connection failed) on one try."""

    def __init__(self, *, status: int | None, body: bytes = b"", retry_after: float | None = None,
                 error: BaseException | None = None) -> None:  # fmt: skip
        super().__init__(status or error)
        self.status = status
        self.body = body
        self.retry_after = retry_after
        self.error = error


class Call:
    """A call whose answer's headers are in: :attr:`response` to read, its slot held until :meth:`close`."""

    def __init__(self, response: aiohttp.ClientResponse, slot: Slot, exit_stack: contextlib.AsyncExitStack) -> None:
        self.response = response
        self.slot = slot
        self._stack = exit_stack

    async def close(self, tokens: int) -> None:
        """The answer is done: give the slot back with the tokens it used."""
        self.slot.tokens = tokens
        self.response.release()
        await self._stack.aclose()


class Tries:
    """What a call's tries came to: every retry (for the journal) and the time spent waiting for slots."""

    def __init__(self) -> None:
        self.retries: list[dict[str, Any]] = []
        self.waited = 0.0
        self._started = time.monotonic()

    def note(self, state: RetryCallState) -> None:
        """tenacity's ``before_sleep``: one try was refused and another follows after the sleep."""
        refused = state.outcome.exception() if state.outcome is not None else None
        entry: dict[str, Any] = {"after_ms": round((time.monotonic() - self._started) * 1000, 1)}
        if isinstance(refused, Refused):
            if refused.status is not None:
                entry["status"] = refused.status
            if refused.error is not None:
                entry["error"] = reason(refused.error)
            if refused.retry_after is not None:
                entry["retry_after"] = refused.retry_after
        entry["wait_ms"] = round((state.upcoming_sleep or 0) * 1000, 1)
        self.retries.append(entry)


async def call(send: Callable[[], Awaitable[aiohttp.ClientResponse]], limits: Limits, budget: float,
               tries: Tries) -> Call:  # fmt: skip
    """Send (``send`` makes one request) until an answer comes that is not a refusal, or the budget is spent.

    Raises:
        Refused: the last try's refusal, once retrying is over (its status and body go to the agent).
    """
    retrying = AsyncRetrying(
        stop=_within(budget, tries) if budget > 0 else stop_after_attempt(1),
        wait=_wait,
        retry=retry_if_exception_type(Refused),
        before_sleep=tries.note,
        reraise=True,
    )
    async for attempt in retrying:
        with attempt:
            return await _try(send, limits, tries)
    raise AssertionError("unreachable: tenacity returns or reraises")  # pragma: no cover


async def _try(send: Callable[[], Awaitable[aiohttp.ClientResponse]], limits: Limits, tries: Tries) -> Call:
    stack = contextlib.AsyncExitStack()
    slot = await stack.enter_async_context(limits.slot())
    tries.waited += slot.waited
    try:  # from here on, whatever ends this try (a refusal, a cancel) gives the slot back
        try:
            response = await send()
        except PERMANENT_ERRORS:
            raise
        except RETRYABLE_ERRORS as exc:
            raise Refused(status=None, error=exc) from exc
        if response.status in RETRYABLE_STATUS:
            try:
                body = await response.read()
            except (aiohttp.ClientError, TimeoutError):
                body = b""
            response.release()
            raise Refused(status=response.status, body=body, retry_after=retry_after(response.headers))
    except BaseException:
        await stack.aclose()
        raise
    return Call(response, slot, stack)


def _within(budget: float, tries: Tries) -> Callable[[RetryCallState], bool]:
    """tenacity's stop: no sleep begins that would end past ``budget`` seconds of trying, the time spent
    waiting for slots in the batch's limits not counted (a call that queued has not been refused for it)."""

    def stop(state: RetryCallState) -> bool:
        trying = (state.seconds_since_start or 0.0) - tries.waited
        return trying + state.upcoming_sleep >= budget

    return stop


def _wait(state: RetryCallState) -> float:
    """The upstream's Retry-After when it gave one (never less than the backoff: a Retry-After of 0 must not
    make a tight loop), else exponential backoff with jitter."""
    refused = state.outcome.exception() if state.outcome is not None else None
    backoff = float(BACKOFF(state))
    if isinstance(refused, Refused) and refused.retry_after is not None:
        return max(refused.retry_after, backoff)
    return backoff


def retry_after(headers: Any) -> float | None:
    """``Retry-After`` (or OpenAI's ``retry-after-ms``) in seconds."""
    with contextlib.suppress(TypeError, ValueError):
        if headers.get("retry-after-ms") is not None:
            return max(0.0, float(headers["retry-after-ms"]) / 1000)
    return parse_retry_after(headers.get("Retry-After"))


_ERRNO_WORDS = {
    errno.ECONNREFUSED: "connection refused",
    errno.EHOSTUNREACH: "no route to host",
    errno.ENETUNREACH: "network is unreachable",
    errno.ECONNRESET: "connection reset",
}


def reason(exc: BaseException) -> str:
    """A short reason in words (pvisor and people both read it)."""
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return f"name or service not known ({exc.host})"
    if isinstance(exc, aiohttp.ClientConnectorError) and exc.os_error.errno in _ERRNO_WORDS:
        return _ERRNO_WORDS[exc.os_error.errno]
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return text.split("\n")[0][:200]
