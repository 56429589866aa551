"""Fan-out of manager events (snapshots, state changes, transitions) to WatchWorkers clients.

Events are the manager's own values (:class:`WatchEvent`). A WatchWorkers stream turns the ones it
shows into messages (memsvc/manager/wire.py's ``watch_pb``): the first stream to show an event builds
its message, and the others send that one (a message per watcher was Python work on the event loop
per event times up to MAX_WATCHERS)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from memsvc.errors import Overloaded
from memsvc.manager.records import WorkerView
from memsvc.manager.reports import StateChange, Transition
from memsvc.runtime.limits import MAX_WATCHERS


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """Something a watcher of one worker sees: the worker as it stood then, and what happened."""

    worker: WorkerView
    """Frozen when the event happened: a watcher that reads it later still sees that moment."""
    change: StateChange | Transition | None = None
    """A state change, a finished transition, or None: a snapshot (the worker as it is, sent first
    for each watched worker and when a worker becomes known)."""
    time_ns: int = field(default_factory=time.time_ns)
    """When the manager published it."""
    encoded: dict[str, object] = field(default_factory=dict, compare=False, repr=False)
    """Its message, once a stream built it (memsvc/manager/wire.py's ``watch_pb``), for the next."""

    @property
    def worker_id(self) -> str:
        return self.worker.worker_id


class _Closed:
    """The type of :data:`CLOSED`."""


CLOSED = _Closed()
"""Sent to every watcher on shutdown: streams end before the server drains."""


class WatchHub:
    QUEUE_SIZE = 1024

    def close(self) -> None:
        self.publish(CLOSED)

    def __init__(self) -> None:
        self._queues: set[asyncio.Queue[WatchEvent | _Closed]] = set()

    def subscribe(self) -> asyncio.Queue[WatchEvent | _Closed]:
        """A queue of the events to come; Overloaded when MAX_WATCHERS streams are open."""
        if len(self._queues) >= MAX_WATCHERS:
            raise Overloaded(
                f"{len(self._queues)} WatchWorkers streams are open, the most this manager serves",
                metadata={"maxStreams": str(MAX_WATCHERS)},
            )
        q: asyncio.Queue[WatchEvent | _Closed] = asyncio.Queue(self.QUEUE_SIZE)
        self._queues.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[WatchEvent | _Closed]) -> None:
        self._queues.discard(q)

    def publish(self, event: WatchEvent | _Closed) -> None:
        for q in self._queues:
            if q.full():  # a client that does not read loses its oldest events, never the manager's time
                q.get_nowait()
            q.put_nowait(event)

    @property
    def subscriber_count(self) -> int:
        return len(self._queues)


__all__ = ["CLOSED", "WatchEvent", "WatchHub"]
