"""Fan-out of manager events (snapshots, state changes, transitions) to WatchWorkers clients."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from memsvc.errors import Overloaded
from memsvc.runtime.limits import MAX_WATCHERS
from memsvc.v1 import memory_manager_service_pb2 as manager_pb


@dataclass(frozen=True)
class WatchEvent:
    worker_id: str
    message: manager_pb.WatchWorkersResponse


CLOSED = WatchEvent("", manager_pb.WatchWorkersResponse())
"""Sent to every watcher on shutdown: streams end before the server drains."""


class WatchHub:
    QUEUE_SIZE = 1024

    def close(self) -> None:
        self.publish(CLOSED)

    def __init__(self) -> None:
        self._queues: set[asyncio.Queue[WatchEvent]] = set()

    def subscribe(self) -> asyncio.Queue[WatchEvent]:
        """A queue of the events to come; Overloaded when MAX_WATCHERS streams are open."""
        if len(self._queues) >= MAX_WATCHERS:
            raise Overloaded(
                f"{len(self._queues)} WatchWorkers streams are open, the most this manager serves",
                metadata={"maxStreams": str(MAX_WATCHERS)},
            )
        q: asyncio.Queue[WatchEvent] = asyncio.Queue(self.QUEUE_SIZE)
        self._queues.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[WatchEvent]) -> None:
        self._queues.discard(q)

    def publish(self, event: WatchEvent) -> None:
        for q in self._queues:
            if q.full():  # a client that does not read loses its oldest events, never the manager's time
                q.get_nowait()
            q.put_nowait(event)

    @property
    def subscriber_count(self) -> int:
        return len(self._queues)
