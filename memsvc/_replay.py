"""Retry safety for transition RPCs: a repeated ``request_id`` returns the first call's result.

One cache serves the worker (Sleep, WakeUp, ReloadWeights) and the manager (SleepWorker,
WakeWorker, AcquireWorker). A request_id names one call of one method: reusing it for another
method in the same scope is the client's mistake and is refused, not answered with an unrelated
result. The cache is bounded (oldest entries go first) and thread-safe: the worker records results
on its device thread while its event loop looks them up.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from memsvc.errors import InvalidArgument


class ReplayCache:
    """The last ``capacity`` results by (scope, request_id)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: collections.OrderedDict[tuple[str, str], tuple[str, Any]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, request_id: str, method: str, scope: str = "") -> Any:
        """The result recorded for ``request_id``, or None (no id, or not seen).

        InvalidArgument when the id was used for another method in ``scope``.
        """
        if not request_id:
            return None
        with self._lock:
            hit = self._entries.get((scope, request_id))
        if hit is None:
            return None
        if hit[0] != method:
            raise InvalidArgument(
                f"request_id {request_id!r} was already used for {hit[0]}", metadata={"requestId": request_id}
            )
        return hit[1]

    def put(self, request_id: str, method: str, result: Any, scope: str = "") -> None:
        """Record the result of ``method`` for ``request_id`` (nothing without an id)."""
        if not request_id:
            return
        with self._lock:
            self._entries[(scope, request_id)] = (method, result)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


__all__ = ["ReplayCache"]
