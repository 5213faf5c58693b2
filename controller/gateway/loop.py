"""An asyncio event loop on a thread of its own, for the host's servers (the model proxy, the egress proxy) that
blocking callers drive: :meth:`LoopThread.call` runs a coroutine there and waits for its result."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """The loop starts with the first :meth:`call` and ends with :meth:`close` (idempotent). Thread-safe."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name=self._name, daemon=True)
                self._thread.start()
            return self._loop

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run ``coroutine`` on the loop; its result (or its exception), within ``timeout`` seconds."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._started()).result(timeout=timeout)

    def close(self, teardown: Callable[[], Coroutine[Any, Any, None]] | None = None, timeout: float = 30) -> None:
        """Run ``teardown()`` on the loop (when it ran at all), then stop it and its thread."""
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None:
            return
        try:
            if teardown is not None:
                asyncio.run_coroutine_threadsafe(teardown(), loop).result(timeout=timeout)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            if thread is not None:
                thread.join(timeout=timeout)
            loop.close()
