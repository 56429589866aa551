"""Turns: busy workers that share a device take turns on it instead of one starving the others.

Without turns a leased worker is never put to sleep, so a worker that is never idle keeps its device
for as long as its traffic lasts: a request for another model there waited out its whole queue
timeout. With them:

- A worker's turn runs from the wake the manager gave it (``WorkerRecord.turn_start``) for its
  policy's ``time_slice``; one awake since before anything waited has had its turn.
- A wake short of room that finds no idle neighbour to evict (memsvc/manager/budgets.py) takes the
  device from a busy neighbour whose turn is over, the longest awake first: a Sleep with
  ``pause_generations``, so its running requests pause between two steps with their KV cache in the
  worker's host block pool, their streams open and their leases held. While no busy neighbour's turn
  is over, the wake waits for the first to end, or for a lease to end (a neighbour may be idle then).
- A worker that gave up its turn with leases held, or that reports paused requests while asleep (a
  manager that restarted finds it so), is owed one: a task of the manager's wakes it again the way
  an AcquireWorker would (waiting for room the same way), so its paused requests go on without any
  client asking. New requests for it queue meanwhile at AcquireWorker.
- Wakes on one device run one at a time in the order they asked (Budgets' device lock is fair), so
  turns go round.

A policy's ``time_slice`` of 0 pins a worker: it keeps its device until its leases end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from memsvc.errors import MemsvcError
from memsvc.manager.background import Background
from memsvc.manager.policy import Policies
from memsvc.manager.records import WorkerRecord
from memsvc.manager.registry import Registry
from memsvc.runtime.deadline import Deadline
from memsvc.vocabulary import WorkerState

log = logging.getLogger("memsvc.manager")

OWED_WAKE_S = 120.0
"""How long one try to wake a worker owed a turn may wait for room (then it is tried again)."""
OWED_RETRY_S = (1.0, 30.0)
"""The pause before trying again after a wake for an owed turn failed: the first, doubling up to the
second (a wake that keeps failing must not take a busy neighbour's turn every second)."""

WakeOwed = Callable[[WorkerRecord, Deadline], Awaitable[None]]


class Turns:
    """Whose turn on a device is over, the wait for the next to end, and the wakes owed to workers
    that gave theirs up (see the module docstring)."""

    def __init__(self, registry: Registry, policies: Policies, background: Background) -> None:
        self._registry = registry
        self._policies = policies
        self._background = background
        self.wake_owed: WakeOwed | None = None
        """Wakes a worker for its leases (Leases' way of waking for an AcquireWorker); set by the
        manager once the leases exist."""
        self._owed: dict[str, asyncio.Task[None]] = {}
        self._yielded: set[str] = set()
        """Workers that gave up their turn and have not been woken since."""
        self._lease_ended = asyncio.Event()
        """Set (and replaced) when a lease ends: a busy neighbour may be idle now."""

    def time_slice(self, rec: WorkerRecord) -> float:
        return self._policies.effective(rec.name).time_slice

    def busy(self, group: list[WorkerRecord], passed_over: set[str]) -> list[WorkerRecord]:
        """Neighbours that could give up their turn: awake, leased, not pinned, holding memory. Not one
        whose lock is held: a partial wake holds it while it waits for the device (the caller holds
        that), and the others who hold it end by themselves."""
        return [
            r
            for r in group
            if r.worker_id not in passed_over
            and r.leases
            and r.state == WorkerState.AWAKE
            and not r.in_transition
            and not r.lock.locked()
            and r.mapped_bytes > 0
            and self.time_slice(r) > 0
        ]

    async def next_over(self, busy: list[WorkerRecord], deadline: Deadline) -> WorkerRecord | None:
        """The busy neighbour whose turn is over (the longest awake), waiting for the first turn to
        end if none is yet; None when a lease ended meanwhile (the caller looks at the device
        again: a neighbour may be idle) or the deadline came first."""
        now = time.time()
        ends = {r.worker_id: r.turn_start + self.time_slice(r) for r in busy}
        over = [r for r in busy if ends[r.worker_id] <= now]
        if over:
            return min(over, key=lambda r: r.turn_start)
        wait = min(ends.values()) - now
        left = deadline.remaining()
        if left is not None:
            wait = min(wait, left)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._lease_ended.wait(), max(wait, 0.0))
            return None
        now = time.time()
        over = [r for r in busy if ends[r.worker_id] <= now]
        return min(over, key=lambda r: r.turn_start) if over else None

    def lease_ended(self) -> None:
        """A lease ended: wakes waiting for a turn to end look at their device again."""
        self._lease_ended.set()
        self._lease_ended = asyncio.Event()

    def woke(self, rec: WorkerRecord) -> None:
        """The manager woke ``rec``: its turn starts now."""
        rec.turn_start = time.time()
        self._yielded.discard(rec.worker_id)

    def yielded(self, rec: WorkerRecord) -> None:
        """``rec`` gave up its turn (its requests paused, asleep): wake it again on its next turn."""
        rec.turns_yielded += 1
        self._yielded.add(rec.worker_id)
        self.owe(rec)

    def owe(self, rec: WorkerRecord) -> None:
        """If ``rec`` is owed a turn (see :meth:`_owed_one`), make sure a task wakes it (the manager's
        tick asks for every worker: paused requests outlive a manager restart)."""
        if rec.worker_id in self._owed or not self._owed_one(rec):
            return
        task = self._background.spawn(self._wake_owed(rec), f"owed turn of {rec.worker_id}")
        self._owed[rec.worker_id] = task
        task.add_done_callback(lambda _: self._owed.pop(rec.worker_id, None))

    def _owed_one(self, rec: WorkerRecord) -> bool:
        """Still registered, not awake, and either requests are paused on it, or it gave up its turn
        and leases hold it. (A leased worker put to sleep by someone else's direct Sleep is not owed
        one: the manager counts and logs that, and leaves it to whoever did it.)"""
        if self._registry.workers.get(rec.worker_id) is not rec or rec.state == WorkerState.AWAKE:
            return False
        paused = rec.status is not None and rec.status.paused_generations > 0
        return paused or (rec.worker_id in self._yielded and bool(rec.leases))

    async def _wake_owed(self, rec: WorkerRecord) -> None:
        """Wake ``rec`` while it is owed a turn; done once it is awake, or owed none."""
        assert self.wake_owed is not None, "the manager sets wake_owed"
        pause = OWED_RETRY_S[0]
        while self._owed_one(rec):
            try:
                await self.wake_owed(rec, Deadline.after(OWED_WAKE_S))
                return
            except MemsvcError as exc:
                log.warning("the turn owed to %s did not start: %s; trying again in %.0f s", rec.worker_id, exc, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, OWED_RETRY_S[1])


__all__ = ["OWED_RETRY_S", "OWED_WAKE_S", "Turns"]
