"""The worker's transition state machine: its state, sleep level and last transition, the lock that
lets one transition run at a time, and the one path every transition RPC takes.

A transition's bookkeeping (state, lock, events) happens on the device loop inside the job itself:
a client that cancels mid-Sleep leaves the job to finish, and the worker ends in a consistent state
rather than in the one the cancelled coroutine last saw. A job whose callers all left *before it
started* (it waited behind a long Generate, say), or whose callers' deadline passed by then, never
starts: the manager that gave up on it may already have granted a lease on the worker's current state.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Collection
from typing import TypeVar

from memsvc.errors import Cancelled, TransitionInProgress, WrongState
from memsvc.runtime.deadline import Deadline
from memsvc.runtime.replay import ReplayCache
from memsvc.vocabulary import TagState, WorkerState
from worker.device_loop import DeviceLoop, Ticket
from worker.status import Transition
from worker.telemetry import Event, EventKind, StateChange, TelemetryHub

Job = Callable[[], Transition]


T = TypeVar("T")


class WorkerStateMachine:
    REQUEST_CACHE = 512
    """Transition results kept for retries with the same request_id."""

    def __init__(self, telemetry: TelemetryHub, device: DeviceLoop) -> None:
        self.state = WorkerState.LOADING
        self.sleep_level = 0
        """Level of the last Sleep while not AWAKE (0 after an explicit tag map, or awake)."""
        self.last: Transition | None = None
        self._telemetry = telemetry
        self._device = device
        self._busy = threading.Lock()
        self.replay = ReplayCache(self.REQUEST_CACHE)

    # ---- the transition lock ----
    def begin(self) -> None:
        """Take the transition lock, or fail fast with ABORTED: a second transition never queues."""
        if not self._busy.acquire(blocking=False):
            raise TransitionInProgress(
                f"worker is {self.state.label}: another transition is running", metadata={"state": self.state.name}
            )

    def begin_blocking(self) -> None:
        """Take the lock, waiting (the load, before any RPC can race it)."""
        self._busy.acquire()

    def release(self) -> None:
        self._busy.release()

    @property
    def in_progress(self) -> bool:
        """A transition holds the lock: accepted, maybe still queued behind other device work."""
        return self._busy.locked()

    async def run(
        self,
        method: str,
        request_id: str,
        validate: Callable[[], None],
        plan: Callable[[], Job],
        deadline: Deadline,
        answer: Callable[[Transition], T],
        idle: bool = True,
    ) -> T:
        """The path of every transition RPC; its result is ``answer(transition)``, taken on the event
        loop as soon as the job ends (the worker's status then), so that a retry gets the first call's
        answer whole, not a new status beside the old transition.

        A retried ``request_id`` shares the first call's result (memsvc/runtime/replay.py); ``validate``
        checks the request's input (INVALID_ARGUMENT whatever the state); the lock is taken (from
        then on no Generate is accepted); ``plan`` checks the state and returns the job, a command of
        the device loop that runs once the Generate calls admitted before it have ended (without
        ``idle``: at the next step boundary, for a Sleep that pauses them). The lock is
        released when the job ends, at once if ``plan`` refuses, and at once if every caller leaves
        while the job still waits for the device loop (then it never runs). A job whose callers' deadline
        (``deadline``, or a retry's later one) passed while it waited does not start either (CANCELLED,
        nothing changed): the cancellation of a caller that timed out may not have arrived yet. A job
        that had started when its callers left still finishes, and its result is kept for a retry.
        """

        async def transition(shared: Deadline) -> T:
            validate()
            self.begin()
            try:
                job = plan()
            except BaseException:
                self.release()
                raise
            ticket = Ticket()

            def locked() -> Transition | None:
                if not ticket.start():
                    return None  # abandoned while queued: the lock went with it
                try:
                    if shared.passed():
                        raise Cancelled(
                            f"{method}: its callers' deadline passed before it could start; nothing changed",
                            metadata={"state": self.state.name},
                        )
                    return job()
                finally:
                    self.release()

            try:  # no Generate is admitted while the lock is held, so the wait for an idle engine ends
                until = lambda: ticket.abandoned or shared.passed()  # noqa: E731
                queued = self._device.submit_when_idle(locked, until) if idle else self._device.submit(locked)
                job_done = asyncio.wrap_future(queued, loop=self._device.loop)
            except BaseException:
                self.release()  # the device loop is shut down: the job never runs
                raise
            try:
                result = await asyncio.shield(job_done)
            except asyncio.CancelledError:
                if ticket.abandon():
                    self.release()
                    raise
                # Every caller left, but the job had started and runs to its end: keep its result, so a
                # retry with this request_id (the manager's, after it asked how the call ended) gets it.
                result = await job_done
            assert result is not None, "a started job returns its transition"
            return answer(result)

        return await self.replay.run(request_id, method, transition, deadline=deadline)

    # ---- state ----
    def require(self, *states: WorkerState) -> None:
        if self.state not in states:
            raise WrongState(
                f"worker is {self.state.label}; this needs it {' or '.join(s.label for s in states)}",
                metadata={"state": self.state.name},
            )

    def set_state(self, new: WorkerState, reason: str) -> None:
        old, self.state = self.state, new
        if old != new:
            self._telemetry.publish(Event(EventKind.STATE_CHANGE, StateChange(old, new, reason)))

    def finish(self, t: Transition) -> Transition:
        """Record a finished transition and tell telemetry subscribers."""
        self.last = t
        self._telemetry.publish(Event(EventKind.TRANSITION, t))
        return t

    def settle(self, tag_states: Collection[TagState], reason: str) -> None:
        """After a failed transition, the state is whatever the pools say, not what it was before."""
        states = set(tag_states)
        if states <= {TagState.AWAKE}:
            self.sleep_level = 0
            new = WorkerState.AWAKE
        elif TagState.AWAKE in states:
            new = WorkerState.PARTIALLY_AWAKE
        else:
            new = WorkerState.ASLEEP
        self.set_state(new, reason)


__all__ = ["Job", "WorkerStateMachine"]
