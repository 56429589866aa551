"""The worker's device-loop paths on a real device loop: the one transition path
(worker/state_machine.py), the swap pipeline's queue (worker/swaps.py), shared deadlines.

Through a real worker process these orders are hard to pin down (test_hardening.py covers the
cancellation of a queued Sleep that way); here the device loop is held by a job the test controls,
so a transition can be made to wait for exactly as long as a test needs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from memsvc.errors import Cancelled, Overloaded, TransitionInProgress
from memsvc.runtime.deadline import NO_DEADLINE, Deadline, SharedDeadline
from memsvc.vocabulary import CopyMethod, TransitionKind, WorkerState
from worker.device_loop import DeviceLoop
from worker.state_machine import WorkerStateMachine
from worker.status import Transition
from worker.swaps import SwapPipeline
from worker.telemetry import TelemetryHub

pytestmark = pytest.mark.asyncio


class Machine:
    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.device = DeviceLoop(loop)
        self.sm = WorkerStateMachine(TelemetryHub(loop), self.device)
        self.sm.state = WorkerState.AWAKE
        self.runs = 0

    def hold_device(self) -> threading.Event:
        """Occupy the device loop until the returned event is set (a long Generate, say)."""
        release = threading.Event()
        self.device.submit(release.wait)
        return release

    async def sleep(self, deadline: Deadline = NO_DEADLINE, request_id: str = "") -> Transition:
        def job() -> Transition:
            self.runs += 1
            return Transition(TransitionKind.SLEEP, 1, 0.0)

        return await self.sm.run("Sleep", request_id, lambda: None, lambda: job, deadline, lambda t: t)


@pytest_asyncio.fixture
async def machine() -> AsyncIterator[Machine]:
    m = Machine()
    yield m
    m.device.shutdown()


async def test_a_transition_runs_and_releases_the_lock(machine: Machine) -> None:
    t = await machine.sleep()
    assert t.kind == TransitionKind.SLEEP and machine.runs == 1
    assert not machine.sm.in_progress


async def test_a_second_transition_is_refused_while_one_waits(machine: Machine) -> None:
    release = machine.hold_device()
    first = asyncio.ensure_future(machine.sleep())
    await asyncio.sleep(0.05)
    assert machine.sm.in_progress
    with pytest.raises(TransitionInProgress):
        await machine.sleep()
    release.set()
    await first
    assert machine.runs == 1 and not machine.sm.in_progress


async def test_a_job_whose_deadline_passed_while_queued_never_starts(machine: Machine) -> None:
    """The caller still waits (its cancellation has not arrived), but its deadline has passed: the
    job must not run on a state the manager may already have given up on."""
    release = machine.hold_device()
    call = asyncio.ensure_future(machine.sleep(Deadline.after(0.05)))
    await asyncio.sleep(0.15)
    release.set()
    with pytest.raises(Cancelled, match="deadline passed before it could start"):
        await call
    assert machine.runs == 0 and not machine.sm.in_progress
    assert machine.sm.state == WorkerState.AWAKE


async def test_a_retry_with_time_left_keeps_a_shared_job_alive(machine: Machine) -> None:
    """A shared call works to its callers' latest deadline: the first caller's passing does not stop
    a job a retry (same request_id) still waits for."""
    release = machine.hold_device()
    first = asyncio.ensure_future(machine.sleep(Deadline.after(0.05), "r1"))
    await asyncio.sleep(0)
    retry = asyncio.ensure_future(machine.sleep(Deadline.after(30.0), "r1"))
    await asyncio.sleep(0.15)
    release.set()
    assert (await first) is (await retry)
    assert machine.runs == 1


async def test_a_caller_leaving_a_queued_job_frees_the_lock_at_once(machine: Machine) -> None:
    release = machine.hold_device()
    call = asyncio.ensure_future(machine.sleep())
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert not machine.sm.in_progress  # before the device loop is free again
    release.set()
    await machine.sleep()
    assert machine.runs == 1  # the abandoned job never ran; the new one did


class GatedWork:
    """What the device loop steps: ``steps`` engine steps, each waiting for the test's go-ahead, so a
    test knows exactly how many ran when it looks."""

    def __init__(self, steps: int) -> None:
        self.left = steps
        self.ran = 0
        self.go = threading.Semaphore(0)

    @property
    def has_work(self) -> bool:
        return self.left > 0

    def step(self) -> bool:
        assert self.go.acquire(timeout=30), "a step waited 30 s for the test"
        self.left -= 1
        self.ran += 1
        return self.has_work

    def land(self) -> None:
        """Nothing is queued on a device here: no step is ever in flight between two."""

    def finish(self) -> None:
        """No more work: the step waiting now ends and the loop idles."""
        self.left = 0
        self.go.release()


async def until(cond: Callable[[], bool], what: str) -> None:
    for _ in range(6000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"30 s without {what}")


async def test_a_transition_waits_for_the_engines_requests_and_commands_behind_it_wait_too(
    machine: Machine,
) -> None:
    """A Sleep queued while the engine has requests runs only once they end (the loop steps
    meanwhile); a command queued behind it runs after it, not between the steps."""
    work = GatedWork(3)
    machine.device.serve(work)
    order: list[str] = []
    call = asyncio.ensure_future(machine.sleep())
    await until(lambda: machine.sm.in_progress, "the Sleep queued")  # the lock is taken as it is queued
    behind = machine.device.submit(order.append, "behind")
    for _ in range(2):
        work.go.release()
    await until(lambda: work.ran >= 2, "two steps")
    assert machine.runs == 0 and not behind.done() and machine.sm.in_progress
    work.go.release()  # the last step: the engine is idle, the Sleep runs, then the command behind it
    await call
    await asyncio.wrap_future(behind)
    assert (work.ran, machine.runs, order) == (3, 1, ["behind"])


async def test_a_transition_whose_caller_left_while_the_steps_ran_never_runs(machine: Machine) -> None:
    """A caller that leaves while its Sleep waits for the engine's requests frees the lock at once;
    the Sleep never runs, and the commands behind it stop waiting for the steps."""
    work = GatedWork(1000)
    machine.device.serve(work)
    call = asyncio.ensure_future(machine.sleep())
    await until(lambda: machine.sm.in_progress, "the Sleep queued")
    behind = machine.device.submit(lambda: work.left)
    work.go.release()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert not machine.sm.in_progress
    work.go.release()  # one more step: the loop sees the caller gone and ends the command
    left = await asyncio.wait_for(asyncio.wrap_future(behind), 30)
    assert machine.runs == 0 and left > 900, "the abandoned Sleep ran, or waited for every step"
    work.finish()


async def test_a_shut_down_device_thread_does_not_leak_the_lock(machine: Machine) -> None:
    machine.device.shutdown()
    with pytest.raises(RuntimeError):
        await machine.sleep()
    assert not machine.sm.in_progress


async def test_telemetry_streams_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.telemetry as telemetry

    monkeypatch.setattr(telemetry, "MAX_TELEMETRY_SUBSCRIBERS", 1)
    hub = TelemetryHub(asyncio.get_running_loop())
    q = hub.subscribe()
    with pytest.raises(Overloaded):
        hub.subscribe()
    hub.unsubscribe(q)
    assert hub.subscribe() is not None


class _Copy:
    """What a begun swap hands back: its copy, already finished (the copies themselves are tested
    with real pools in test_model.py and test_copy_blocks.py)."""

    moved_bytes = 4096

    def wait(self) -> None:
        pass


async def test_a_swap_whose_caller_left_while_queued_never_begins(machine: Machine) -> None:
    begun: list[Any] = []

    def begin(direction: str, src: Any, dst: Any, method: CopyMethod) -> Any:
        begun.append(src)
        return _Copy()

    pipeline = SwapPipeline(machine.device, begin, lambda t: t)
    release = machine.hold_device()
    left = asyncio.ensure_future(pipeline.swap("out", [1], [2], CopyMethod.AUTO))
    await asyncio.sleep(0.05)
    left.cancel()
    with pytest.raises(asyncio.CancelledError):
        await left
    stays = asyncio.ensure_future(pipeline.swap("out", [3], [4], CopyMethod.AUTO))
    release.set()
    t = await stays
    assert begun == [[3]] and t.moved_bytes == 4096
    pipeline.shutdown()


async def test_a_shared_deadline_has_passed_once_every_caller_left() -> None:
    shared = SharedDeadline()
    assert shared.at() is None  # nobody joined yet: no deadline
    first, second = Deadline.after(30.0), NO_DEADLINE
    shared.join(first)
    assert shared.at() == first.at()
    shared.join(second)
    assert shared.at() is None  # one caller waits without a deadline
    shared.leave(second)
    shared.leave(first)
    left = shared.remaining()
    assert left is not None and left < 0
