"""Waiting, inside an event loop, for the in-process manager's tasks to reach a state."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def wait_until(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Let the manager's tasks run until ``cond()`` holds; AssertionError naming ``what`` after ``timeout`` s."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


__all__ = ["wait_until"]
