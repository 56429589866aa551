"""The RPC front's start-up work below the start's CPU priority (worker/background.py): its thread,
and a process it starts, run BACKGROUND_NICE steps lower; the caller's own priority is unchanged."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest

from worker.background import BACKGROUND_NICE, in_background

pytestmark = pytest.mark.asyncio


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)  # on Linux: the calling thread's


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values are per thread on Linux")
async def test_the_work_and_what_it_starts_run_lower_and_the_caller_stays_as_it_was() -> None:
    before = _nice()

    def work() -> tuple[int, int, str]:
        child = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
            capture_output=True,
            text=True,
            check=True,
        )
        return _nice(), int(child.stdout), threading.current_thread().name

    mine, child, name = await in_background(work, "memsvc-test-background")
    assert (mine, child, name) == (before + BACKGROUND_NICE, before + BACKGROUND_NICE, "memsvc-test-background")
    assert _nice() == before
    again, _, _ = await in_background(work, "memsvc-test-background")  # a thread of its own each time
    assert again == before + BACKGROUND_NICE


async def test_what_the_work_raises_reaches_the_caller() -> None:
    def fails() -> None:
        raise ValueError("no such tokenizer")

    with pytest.raises(ValueError, match="no such tokenizer"):
        await in_background(fails, "memsvc-test-background")


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_caller_that_stops_waiting_leaves_the_work_to_finish_quietly() -> None:
    """Its result goes nowhere, and the thread ends without a traceback (setting the result of a
    future its caller had cancelled raised in the thread)."""
    began = threading.Event()
    release = threading.Event()
    finished = threading.Event()

    def work() -> int:
        began.set()
        release.wait(60)
        finished.set()
        return 1

    waiting = asyncio.ensure_future(in_background(work, "memsvc-test-background"))
    assert await asyncio.to_thread(began.wait, 60)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    release.set()
    assert await asyncio.to_thread(finished.wait, 60)
    for thread in threading.enumerate():  # its end, and any traceback it printed, before the test ends
        if thread.name == "memsvc-test-background":
            await asyncio.to_thread(thread.join, 60)
