"""Retry safety for transition RPCs: a repeated ``request_id`` gets the first call's result.

One cache serves the worker (Sleep, WakeUp, ReloadWeights) and the manager (SleepWorker,
WakeWorker, AcquireWorker). The rules, which docs/operations.md states for clients:

- a request_id names one call of one method in one scope (a worker, for the manager): reusing it
  for another method is the client's mistake and is refused, not answered with an unrelated result;
- retries that arrive while the first call still runs *share* it: they wait for its result, they
  do not run the operation again (nor fail with ABORTED because it is running);
- the operation runs for as long as at least one of its callers waits; when every caller has left
  (cancelled, deadline passed) it is cancelled, so nothing keeps running for nobody, and a retry that
  arrives while it unwinds waits for it, then takes its result if it finished anyway, or runs anew;
- a result is kept for later retries; a failure is not: a retry may run it again (what the failure
  left is the operation's to say: most change nothing);
- the cache holds at most ``capacity`` results, oldest first out, and request_ids are at most
  ``MAX_ID_BYTES`` long (memsvc/runtime/limits.py): what a client can make the server keep is bounded.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from memsvc.errors import InvalidArgument
from memsvc.runtime.deadline import NO_DEADLINE, Deadline, SharedDeadline
from memsvc.runtime.limits import MAX_ID_BYTES, check_length

T = TypeVar("T")


@dataclass
class _Entry:
    method: str
    task: asyncio.Future[Any]
    """The call in flight or its result: a task, or a done future (:meth:`ReplayCache.remember`)."""
    deadline: SharedDeadline
    """The latest deadline of the callers waiting: the operation's."""
    waiters: int = field(default=0)
    abandoned: bool = field(default=False)
    """Every caller left and the task was cancelled: a new caller must not join it."""


class ReplayCache:
    """Results and calls in flight by (scope, request_id), on one event loop."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: collections.OrderedDict[tuple[str, str], _Entry] = collections.OrderedDict()

    async def run(
        self,
        request_id: str,
        method: str,
        operation: Callable[[Deadline], Awaitable[T]],
        scope: str = "",
        deadline: Deadline = NO_DEADLINE,
    ) -> T:
        """``operation(deadline)``'s result, run at most once per request_id (see the module's rules).

        The operation is given the deadline to work to: this caller's, or for a shared call the latest
        of its waiting callers' (memsvc/runtime/deadline.py)."""
        if not request_id:
            return await operation(deadline)
        check_length(request_id, MAX_ID_BYTES, "request_id")
        key = (scope, request_id)
        entry = self._entries.get(key)
        while entry is not None and entry.abandoned:
            # The cancelled call may still be unwinding (or may have finished before the
            # cancellation landed): wait for it, then use what it left behind.
            await asyncio.wait([entry.task])
            entry = self._entries.get(key)
        if entry is None:
            shared = SharedDeadline()
            entry = _Entry(method, asyncio.get_running_loop().create_task(_call(operation, shared)), shared)
            self._entries[key] = entry
            entry.task.add_done_callback(functools.partial(self._finished, key))
            self._evict()
        elif entry.method != method:
            raise InvalidArgument(
                f"request_id {request_id!r} was already used for {entry.method}", metadata={"requestId": request_id}
            )
        entry.waiters += 1
        entry.deadline.join(deadline)
        try:
            result: T = await asyncio.shield(entry.task)
            return result
        finally:
            entry.deadline.leave(deadline)
            entry.waiters -= 1
            if not entry.waiters and not entry.task.done():
                entry.abandoned = True
                entry.task.cancel()  # every caller left: the operation stops too

    def remember(self, request_id: str, method: str, result: object, scope: str = "") -> None:
        """Keep ``result`` as the answer to a call made before this cache existed (the manager's
        stored leases, restored after a restart or a failover), so its retry gets it too."""
        if not request_id:
            return
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(result)
        self._entries[(scope, request_id)] = _Entry(method, done, SharedDeadline())
        self._evict()

    def forget(self, request_id: str, scope: str = "") -> None:
        """Drop a kept result (the caller found it stale: a lease since released, say)."""
        entry = self._entries.get((scope, request_id))
        if entry is not None and entry.task.done():
            del self._entries[(scope, request_id)]

    def _finished(self, key: tuple[str, str], task: asyncio.Future[Any]) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.task is not task:
            return
        if task.cancelled() or task.exception() is not None:
            del self._entries[key]  # a failure is not kept: the retry may run it again
        else:
            entry.abandoned = False  # it finished before the cancellation landed: the result stands

    def _evict(self) -> None:
        while len(self._entries) > self.capacity:
            for key, entry in self._entries.items():  # the oldest finished result goes first
                if entry.task.done():
                    del self._entries[key]
                    break
            else:
                return  # every entry is in flight: keep them until they finish

    def __len__(self) -> int:
        return len(self._entries)


async def _call(operation: Callable[[Deadline], Awaitable[T]], deadline: Deadline) -> T:
    return await operation(deadline)


__all__ = ["ReplayCache"]
