"""The retry rules of memsvc/runtime/replay.py, on a real event loop, one rule per test.

The same cache answers retried Sleep/WakeUp/ReloadWeights on the worker and SleepWorker/WakeWorker/
AcquireWorker on the manager; those paths are tested through real servers in test_hardening.py and
test_stateful.py. Here the edges that are hard to hit through a server get their own test: a retry
arriving while an abandoned call is still unwinding, and a call that finished just before the
cancellation meant for it.
"""

from __future__ import annotations

import asyncio

import pytest

from memsvc.errors import InvalidArgument
from memsvc.runtime.deadline import Deadline
from memsvc.runtime.replay import ReplayCache

pytestmark = pytest.mark.asyncio


class Operation:
    """An operation that counts its runs and finishes when told to."""

    def __init__(self) -> None:
        self.runs = 0
        self.release = asyncio.Event()
        self.started = asyncio.Event()
        self.cancelled = 0

    async def __call__(self, deadline: Deadline) -> str:
        self.runs += 1
        run = self.runs
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return f"result {run}"


async def test_retry_while_running_shares_the_call() -> None:
    cache, op = ReplayCache(8), Operation()
    first = asyncio.ensure_future(cache.run("r1", "Sleep", op))
    await op.started.wait()
    second = asyncio.ensure_future(cache.run("r1", "Sleep", op))
    await asyncio.sleep(0)
    op.release.set()
    assert await first == await second == "result 1"
    assert op.runs == 1


async def test_a_kept_result_answers_a_later_retry() -> None:
    cache, op = ReplayCache(8), Operation()
    op.release.set()
    assert await cache.run("r1", "Sleep", op) == "result 1"
    assert await cache.run("r1", "Sleep", op) == "result 1"
    assert op.runs == 1


async def test_same_id_for_another_method_is_refused() -> None:
    cache, op = ReplayCache(8), Operation()
    op.release.set()
    await cache.run("r1", "Sleep", op)
    with pytest.raises(InvalidArgument, match="already used for Sleep"):
        await cache.run("r1", "WakeUp", op)


async def test_a_failure_is_not_kept() -> None:
    cache = ReplayCache(8)
    calls = 0

    async def failing(deadline: Deadline) -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("first try fails")
        return "second try"

    with pytest.raises(RuntimeError):
        await cache.run("r1", "Sleep", failing)
    assert await cache.run("r1", "Sleep", failing) == "second try"


async def test_the_call_stops_when_every_caller_left() -> None:
    cache, op = ReplayCache(8), Operation()
    caller = asyncio.ensure_future(cache.run("r1", "Sleep", op))
    await op.started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    for _ in range(3):
        await asyncio.sleep(0)
    assert op.cancelled == 1
    assert len(cache) == 0


async def test_a_retry_does_not_join_an_abandoned_call() -> None:
    """The retry arrives after the last caller left but before the cancelled call unwound: it must
    run the operation afresh, not inherit the cancellation meant for nobody."""
    cache, op = ReplayCache(8), Operation()
    caller = asyncio.ensure_future(cache.run("r1", "Sleep", op))
    await op.started.wait()
    caller.cancel()
    retry = asyncio.ensure_future(cache.run("r1", "Sleep", op))  # queued before the unwinding
    with pytest.raises(asyncio.CancelledError):
        await caller
    op.release.set()
    assert await retry == "result 2"
    assert op.runs == 2 and op.cancelled == 1


async def test_a_call_that_finished_before_its_cancellation_keeps_its_result() -> None:
    cache = ReplayCache(8)
    runs = 0

    async def uncancellable(deadline: Deadline) -> str:
        nonlocal runs
        runs += 1
        await asyncio.shield(asyncio.sleep(0.01))  # the device work finishes regardless
        return "done"

    async def finish_anyway(deadline: Deadline) -> str:
        try:
            return await uncancellable(deadline)
        except asyncio.CancelledError:
            return "done"  # the work had completed: the result stands

    caller = asyncio.ensure_future(cache.run("r1", "Sleep", finish_anyway))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert await cache.run("r1", "Sleep", finish_anyway) == "done"
    assert runs == 1


async def test_a_shared_call_works_to_the_latest_deadline() -> None:
    cache = ReplayCache(8)
    seen: list[float | None] = []
    release = asyncio.Event()

    async def op(deadline: Deadline) -> str:
        await release.wait()
        seen.append(deadline.at())
        return "ok"

    early, late = Deadline.after(5.0), Deadline.after(50.0)
    first = asyncio.ensure_future(cache.run("r1", "Sleep", op, deadline=early))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(cache.run("r1", "Sleep", op, deadline=late))
    await asyncio.sleep(0)
    release.set()
    await asyncio.gather(first, second)
    assert seen == [late.at()]


async def test_capacity_bounds_kept_results_oldest_first() -> None:
    cache, op = ReplayCache(2), Operation()
    op.release.set()
    for rid in ("a", "b", "c"):
        await cache.run(rid, "Sleep", op)
    assert len(cache) == 2
    assert await cache.run("a", "Sleep", op) == "result 4"  # "a" was dropped: it ran again
    assert await cache.run("c", "Sleep", op) == "result 3"  # "c" was kept


async def test_an_overlong_request_id_is_refused() -> None:
    cache, op = ReplayCache(8), Operation()
    with pytest.raises(InvalidArgument):
        await cache.run("x" * 10_000, "Sleep", op)
    assert op.runs == 0
