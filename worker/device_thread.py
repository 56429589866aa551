"""The one thread that does the worker's device work.

Load, sleep, wake, reload, swap and generate all run here, one after another, so the event loop stays
free for status and telemetry, and device work is serialised without a lock around the model: a
step never reads memory a sleep is unmapping, because the sleep cannot start until the step is done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("memsvc.worker")


class DeviceThread:
    """A single-thread executor bound to the worker's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="memsvc-device")

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the device thread and return its result.

        Shielded: a caller that leaves (cancelled, deadline passed) cannot interrupt a thread, and the
        job settles its own bookkeeping; a caller that must keep a queued job from starting races it
        with a :class:`Ticket`.
        """
        return await asyncio.shield(self.queue(fn))

    def queue(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Queue ``fn`` on the device thread: the loop future of its result (await it shielded)."""
        return self.loop.run_in_executor(self._executor, fn)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Queue ``fn(*args)`` without waiting (the caller settles its own result future)."""
        return self._executor.submit(fn, *args)

    def shutdown(self) -> None:
        """Finish the jobs queued so far, then stop the thread."""
        self._executor.shutdown(wait=True)


class Ticket:
    """A queued job's start, raced against its caller leaving: exactly one of :meth:`start` (on the
    device thread) and :meth:`abandon` (on the loop, when the caller is cancelled) wins."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "queued"

    def start(self) -> bool:
        """True: run the job. False: its caller left while it was queued; do nothing."""
        with self._lock:
            if self._state == "abandoned":
                return False
            self._state = "started"
            return True

    def abandon(self) -> bool:
        """True: the job had not started and now never will. False: it is running or done."""
        with self._lock:
            if self._state != "queued":
                return False
            self._state = "abandoned"
            return True


class LoopPost:
    """Calls from the device thread to run on the event loop, many for one wake-up of the loop.

    A step of 64 streams makes 64 tokens; ``call_soon_threadsafe`` for each would wake the loop (a
    write to its self-pipe, a pass of the loop, the GIL handed over) 64 times per step. Posted calls
    queue here and the first one of a batch schedules a single flush, which runs every call queued
    by the time it runs: one wake-up per step, or fewer when the loop is slower than the steps."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._calls: list[tuple[Callable[[Any], object], Any]] = []

    def __call__(self, fn: Callable[[T], object], arg: T) -> None:
        """Run ``fn(arg)`` on the loop soon, after the calls posted before it (any thread)."""
        with self._lock:
            first = not self._calls
            self._calls.append((fn, arg))
        if first:
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, arg in calls:
            try:
                fn(arg)
            except Exception:  # one call's failure must not drop the others (another stream's end)
                log.exception("a call posted to the event loop failed")


def settle_future(fut: asyncio.Future[T], value: T | None, exc: BaseException | None) -> None:
    """Complete a loop future with another thread's result (call through ``call_soon_threadsafe``)."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)  # type: ignore[arg-type]


__all__ = ["DeviceThread", "LoopPost", "Ticket", "settle_future"]
