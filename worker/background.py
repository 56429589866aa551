"""Work the RPC front does while the device process starts (the model's text, its decoding), at a
lower CPU priority than the start.

Why: the front reads the model's text from the moment the load knows where it is, which for a
checkpoint directory is at once (worker/core.py): on a GPU host, while the device process imports
torch and stages the checkpoint, the start's critical path. Read then at the same priority, in an
earlier form of the front, the import took 0.2 s longer on an H100 host (docs/benchmarks.md, "the
model's text in the RPC front's process"; why was not measured). At :data:`BACKGROUND_NICE` the
read takes a tenth of a core's time where it and a thread of the start wait for the same core, and
all of any core the start leaves idle: side by side, the import ended no later with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

BACKGROUND_NICE = 10
"""How much lower (in nice steps) the front's start-up work runs than the rest: at +10 a thread
gets about a tenth of a default thread's share of a core both wait for."""


def _lower_priority() -> None:
    """Lower the calling thread's CPU priority by :data:`BACKGROUND_NICE`, for good (an unprivileged
    process cannot raise it again): on Linux, where nice values are per thread, the caller's thread
    alone and the threads and processes it starts from then on. Where the platform has no such call,
    nothing."""
    with contextlib.suppress(OSError, AttributeError):  # no getpriority (not POSIX), or not permitted
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + BACKGROUND_NICE)


async def in_background(fn: Callable[[], T], name: str) -> T:
    """``fn()`` on a thread of its own (named ``name``) at the lower priority: its result, or what it
    raised. A thread of its own, not the loop's executor, whose threads serve other work after and
    would keep the priority. A caller that stops waiting before ``fn`` began has it not run at all;
    after, leaves it to finish (a daemon thread), its result going nowhere."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not done.set_running_or_notify_cancel():  # the caller stopped waiting first
            return
        _lower_priority()
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
            done.set_exception(exc)
        else:
            done.set_result(result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await asyncio.wrap_future(done)


__all__ = ["BACKGROUND_NICE", "in_background"]
