"""Fan-out of worker events to StreamTelemetry subscribers.

Transitions run on the device loop; subscribers live on the event loop. ``publish`` may be called
from any thread and hands the event to each subscriber's bounded queue on the loop, dropping the
oldest event for a subscriber that does not keep up (a slow client must not stall a transition).
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memsvc.errors import Overloaded
from memsvc.runtime.limits import MAX_TELEMETRY_SUBSCRIBERS
from memsvc.vocabulary import WorkerState

if TYPE_CHECKING:
    from worker.status import Transition


class EventKind(enum.StrEnum):
    """What a telemetry event says."""

    STATE_CHANGE = "state_change"
    """``data``: a :class:`StateChange`."""
    TRANSITION = "transition"
    """``data``: the finished :class:`~worker.status.Transition`."""
    ACTIVITY = "activity"
    """Traffic (Generate, SwapBlocks, FreeSequence): streams send a fresh snapshot, whose
    ``last_activity_time`` resets the manager's idle clock. No data."""
    CLOSED = "closed"
    """The worker shuts down: streams end before the drain. No data."""


@dataclass(frozen=True)
class StateChange:
    """The worker's state changed from ``old`` to ``new``, for ``reason``."""

    old: WorkerState
    new: WorkerState
    reason: str


@dataclass(frozen=True)
class Event:
    """One telemetry event of ``kind``, with its ``data`` (see :class:`EventKind`).

    ``time`` is when it happened (not when a stream sent it): the manager orders telemetry against
    RPC responses by it, so a late event never moves a worker's state backwards.
    """

    kind: EventKind
    data: StateChange | Transition | None = None
    time: float = field(default_factory=time.time)


CLOSED = Event(EventKind.CLOSED)
"""Delivered to every subscriber when the worker shuts down: streams end before the drain."""


class TelemetryHub:
    QUEUE_SIZE = 256

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queues: set[asyncio.Queue[Event]] = set()
        self._lock = threading.Lock()

    def close(self) -> None:
        self.publish(CLOSED)

    def subscribe(self) -> asyncio.Queue[Event]:
        """A queue of the events to come; Overloaded when MAX_TELEMETRY_SUBSCRIBERS streams are open."""
        q: asyncio.Queue[Event] = asyncio.Queue(self.QUEUE_SIZE)
        with self._lock:
            if len(self._queues) >= MAX_TELEMETRY_SUBSCRIBERS:
                raise Overloaded(
                    f"{len(self._queues)} telemetry streams are open, the most this worker serves",
                    metadata={"maxStreams": str(MAX_TELEMETRY_SUBSCRIBERS)},
                )
            self._queues.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[Event]) -> None:
        with self._lock:
            self._queues.discard(q)

    def publish(self, event: Event) -> None:
        with self._lock:
            queues = list(self._queues)
        for q in queues:
            self._loop.call_soon_threadsafe(self._put, q, event)

    @staticmethod
    def _put(q: asyncio.Queue[Event], event: Event) -> None:
        if q.full():
            q.get_nowait()
        q.put_nowait(event)

    @property
    def subscriber_count(self) -> int:
        with self._lock:
            return len(self._queues)


__all__ = ["CLOSED", "Event", "EventKind", "StateChange", "TelemetryHub"]
