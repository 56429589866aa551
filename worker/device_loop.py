"""The device loop: the one thread that does the worker's device work, and decides what it does next.

Load, sleep, wake, reload, swap, free and the admission of each Generate arrive as commands, queued
from any thread and run here in the order they came; between them, while the engine has requests,
the loop runs its steps. So device work is serialised without a lock around the model (a step never
reads memory a sleep is unmapping: the sleep is a command, and commands run between steps), the
event loop stays free for status and telemetry, and the engine is touched by this thread alone.

The engine queues each step on the device before it reads the tokens of the one before; every
command but an admission first waits for the step in flight (:meth:`Engine.land`), so a command never
touches memory a queued step still reads or writes.

A command may ask for an idle engine (a transition: the Generate calls accepted before it end
first). It then waits at the head of the queue while the loop steps, and every command behind it
waits too; it gives up waiting as soon as its own ``until`` says so (its callers left) and then runs
at once, to end itself. Nothing else re-queues itself: the loop alone says when a step runs.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
log = logging.getLogger("memsvc.worker")

THREAD_NAME = "memsvc-device"


class Steps(Protocol):
    """What the loop steps between commands (worker/model/engine.py's Engine)."""

    @property
    def has_work(self) -> bool: ...

    def step(self) -> bool: ...

    def land(self) -> None: ...


@dataclass(eq=False)
class _Command:
    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any]
    idle: bool = False
    """Run only once the engine has no requests (or ``until`` says stop waiting)."""
    lands: bool = True
    """Wait for the engine's step in flight first (see :meth:`DeviceLoop.admit`)."""
    until: Callable[[], bool] = lambda: False


class DeviceLoop:
    """Commands in order, engine steps between them, on one thread bound to the worker's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._cv = threading.Condition()
        self._commands: collections.deque[_Command] = collections.deque()
        self._engine: Steps | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name=THREAD_NAME, daemon=True)
        self._thread.start()

    # ---- any thread ----
    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)``; its future is resolved when it has run. RuntimeError once shut down."""
        return self._put(_Command(lambda: fn(*args), concurrent.futures.Future()))

    def admit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queue ``fn``, which only hands the engine a request: unlike every other command it runs
        while the engine's last step is still in flight on the device (worker/model/engine.py), so
        requests arriving under load do not stall the pipeline of steps."""
        return self._put(_Command(fn, concurrent.futures.Future(), lands=False))

    def submit_when_idle(self, fn: Callable[[], T], until: Callable[[], bool]) -> concurrent.futures.Future[T]:
        """Queue ``fn`` to run once every Generate admitted before it has ended, or once ``until``
        says its callers stopped waiting (asked between steps; ``fn`` runs then too, to end itself)."""
        return self._put(_Command(fn, concurrent.futures.Future(), idle=True, until=until))

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the device loop and return its result.

        Shielded: a caller that leaves (cancelled, deadline passed) cannot interrupt a thread, and the
        command resolves its own bookkeeping; a caller that must keep a queued command from starting
        races it with a :class:`Ticket`.
        """
        return await asyncio.shield(asyncio.wrap_future(self.submit(fn), loop=self.loop))

    def serve(self, engine: Steps | None) -> None:
        """Step ``engine`` whenever it has requests (None: no engine, the model is gone)."""
        with self._cv:
            self._engine = engine
            self._cv.notify()

    def shutdown(self) -> None:
        """Run the commands queued so far, then stop the thread (later submits raise RuntimeError)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # ---- the loop ----
    def _put(self, cmd: _Command) -> concurrent.futures.Future[Any]:
        with self._cv:
            if self._stopping:
                raise RuntimeError("the device loop is shut down")
            self._commands.append(cmd)
            self._cv.notify()
        return cmd.future

    def _next(self) -> _Command | Steps | None:
        """What runs next: the head command unless it waits for an idle engine that still works,
        else a step; None when the loop is to end. Waits while there is nothing to do."""
        with self._cv:
            while True:
                engine = self._engine if self._engine is not None and self._engine.has_work else None
                if self._commands:
                    head = self._commands[0]
                    if not (head.idle and engine is not None) or head.until():
                        return self._commands.popleft()
                if engine is not None:
                    return engine
                if self._stopping:
                    return None
                self._cv.wait()

    def _main(self) -> None:
        while (item := self._next()) is not None:
            if isinstance(item, _Command):
                if item.lands and self._engine is not None:
                    try:
                        self._engine.land()  # a command may touch memory the step in flight uses
                    except Exception:  # the engine failed the step's requests itself
                        log.exception("engine step failed")
                if item.future.set_running_or_notify_cancel():
                    try:
                        item.future.set_result(item.fn())
                    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for it
                        item.future.set_exception(exc)
                continue
            try:
                item.step()
            except Exception:  # the engine fails the batch's requests itself; the loop serves on
                log.exception("engine step failed")


class Ticket:
    """A queued command's start, raced against its caller leaving: exactly one of :meth:`start` (on
    the device loop) and :meth:`abandon` (on the event loop, when the caller is cancelled) wins."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "queued"

    def start(self) -> bool:
        """True: run the command. False: its caller left while it was queued; do nothing."""
        with self._lock:
            if self._state == "abandoned":
                return False
            self._state = "started"
            return True

    def abandon(self) -> bool:
        """True: the command had not started and now never will. False: it is running or done."""
        with self._lock:
            if self._state != "queued":
                return False
            self._state = "abandoned"
            return True

    @property
    def abandoned(self) -> bool:
        return self._state == "abandoned"


class LoopPost:
    """Calls from the device loop to run on the event loop, many for one wake-up of the event loop.

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


def resolve_future(fut: asyncio.Future[T], value: T | None, exc: BaseException | None) -> None:
    """Complete a loop future with another thread's result (call through ``call_soon_threadsafe``)."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)  # type: ignore[arg-type]


__all__ = ["THREAD_NAME", "DeviceLoop", "LoopPost", "Steps", "Ticket", "resolve_future"]
