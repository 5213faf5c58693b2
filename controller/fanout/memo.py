"""Values computed once per key, safely across threads."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from ..errors import PvisorHostError

V = TypeVar("V")


class Memo(Generic[V]):
    """Values computed once per key (images, gateways, workspace digests). A :class:`PvisorHostError` is
    remembered too, and raised again for every later caller of that key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[Hashable, threading.Lock] = {}
        self._values: dict[Hashable, V | PvisorHostError] = {}

    def get(self, key: Hashable, compute: Callable[[], V]) -> V:
        """The value for ``key``, computed by ``compute`` for the first caller (others wait for it)."""
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._values:
                try:
                    self._values[key] = compute()
                except PvisorHostError as exc:
                    self._values[key] = exc
            value = self._values[key]
        if isinstance(value, PvisorHostError):
            raise value
        return value

    def values(self) -> list[V]:
        """Every value computed so far (not the errors)."""
        with self._lock:
            return [v for v in self._values.values() if not isinstance(v, PvisorHostError)]
