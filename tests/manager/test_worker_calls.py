"""The manager's calls to its workers, decided in process against in-memory workers
(tests/manager/inmemory_env.py): a crashed, silent or unreachable worker, a retried request id,
deregistration, calls in doubt past their deadline, the bounds on records, waiting calls and watch
streams. Through real worker processes: tests/test_faults.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import pytest
from asyncwait import wait_until
from inmemory_env import (
    Env,
    GiB,
    inmemory_env,  # noqa: F401 - the env fixture
)

from memsvc.errors import NotFound, OutOfMemory, Overloaded, Unavailable
from memsvc.manager.controller import Manager
from memsvc.manager.inmemory import InMemoryLinks, InMemoryWorker
from memsvc.manager.settings import ManagerSettings
from memsvc.manager.store_sqlite import SqliteStore
from memsvc.runtime.deadline import NO_DEADLINE, Deadline
from memsvc.vocabulary import SleepLevel, WorkerState

pytestmark = pytest.mark.asyncio


async def test_a_crashed_worker_is_unavailable_and_calls_fail_fast(env: Env) -> None:
    a = await env.worker("a")
    await a.crash()
    await wait_until(lambda: env.rec("a").state == WorkerState.UNAVAILABLE, "UNAVAILABLE")
    with pytest.raises(Unavailable):
        await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE)
    with pytest.raises(Unavailable):
        await env.manager.transitions.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    assert env.rec("a").leases == {}
    await a.revive()
    env.manager.registry.register("a", a.address, "h1")  # its heartbeat reconnects the link
    await wait_until(lambda: env.rec("a").state == WorkerState.AWAKE, "back")


async def test_with_a_start_timeout_an_acquire_waits_for_an_unavailable_worker_counted_as_waiting(env: Env) -> None:
    """A worker whose process is started on demand (its policy's start_timeout): the acquire waits
    while it is unavailable, among its waiting acquires (what tells memsvc up to start it), and is
    granted once it registers again; one that does not come back in time is refused, naming the
    start_timeout, and leaves nothing behind. The gauge the alert reads says it is started on demand,
    and the timers do not forget it however long it is down."""
    a = await env.worker("a")
    env.manager.update_policy("a", {"start_timeout": 30.0})
    await a.crash()
    await wait_until(lambda: env.rec("a").state == WorkerState.UNAVAILABLE, "UNAVAILABLE")
    acquire = asyncio.ensure_future(env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE))
    await wait_until(lambda: env.rec("a").view().waiting_acquires == 1, "the acquire counted as waiting")
    assert not acquire.done()
    await a.revive()
    env.manager.registry.register("a", a.address, "h1")
    lease, rec = await asyncio.wait_for(acquire, 10)
    assert rec.state == WorkerState.AWAKE and lease.lease_id in rec.leases
    assert env.rec("a").view().waiting_acquires == 0
    env.manager.leases.release(lease.lease_id)

    env.manager.update_policy("a", {"start_timeout": 0.2})
    timers = env.manager.timers
    timers._settings = dataclasses.replace(timers._settings, forget_after=0.001)
    await a.crash()
    await wait_until(lambda: env.rec("a").state == WorkerState.UNAVAILABLE, "UNAVAILABLE again")
    with pytest.raises(Unavailable, match=r"start_timeout \(0.2 s\)"):
        await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE)
    assert env.rec("a").leases == {} and env.rec("a").view().waiting_acquires == 0
    env.rec("a").heard -= 10
    timers.tick()
    assert env.manager.metrics.start_timeout.labels("a")._value.get() == 0.2
    await asyncio.sleep(0)  # a forget the tick had spawned would have run now
    assert env.manager.registry.get("a").worker_id == "a", (
        "a worker started on demand is down on purpose: not forgotten"
    )
    env.manager.update_policy("a", {"start_timeout": 3600.0})
    with pytest.raises(Unavailable, match="start_timeout"):  # the caller's deadline, much sooner, ends it
        await asyncio.wait_for(env.manager.leases.acquire("a", 60, "t", "", "", Deadline.after(0.05)), 30)
    assert env.rec("a").leases == {}


async def test_a_silent_worker_is_marked_unavailable_and_its_link_restarted(env: Env) -> None:
    await env.worker("a")
    rec = env.rec("a")
    limit = env.manager.settings.silence_limit
    rec.heard -= limit + 1
    env.manager.timers._resumed -= limit + 1  # as if the manager had been running that long
    env.manager.timers.tick()
    await wait_until(lambda: rec.state == WorkerState.AWAKE, "the restarted link's snapshot")
    assert rec.last_seen > 0


async def test_a_retried_request_id_sleeps_once(env: Env) -> None:
    a = await env.worker("a")
    first, t1 = await env.manager.transitions.sleep_worker("a", SleepLevel.LEVEL_1, {}, "req-1", NO_DEADLINE)
    await env.manager.transitions.wake_worker("a", [], "", NO_DEADLINE)
    again, t2 = await env.manager.transitions.sleep_worker("a", SleepLevel.LEVEL_1, {}, "req-1", NO_DEADLINE)
    assert t1 == t2 and a.calls == ["Sleep", "WakeUp"]
    assert again == first and again.state == WorkerState.ASLEEP, (
        "a replay answers with the worker as the first call left it, not as it is now (awake)"
    )


async def test_a_worker_unreachable_past_forget_after_is_deregistered_unless_leased_or_configured(
    tmp_path: Path,
) -> None:
    links = InMemoryLinks()
    settings = ManagerSettings(tick_interval=3600.0, forget_after=60.0)
    manager = Manager(SqliteStore(tmp_path / "forget.db"), settings, links=links)
    await manager.start()
    try:
        env = Env(manager, links)
        a = await env.worker("a")
        b = await env.worker("b")
        lease, _ = await manager.leases.acquire("b", 600, "t", "", "", NO_DEADLINE)
        for wk in (a, b):
            await wk.crash()
        await wait_until(lambda: env.rec("a").state == WorkerState.UNAVAILABLE, "a unavailable")
        for wid in ("a", "b"):
            env.rec(wid).heard -= 61
        manager.timers.tick()
        await wait_until(lambda: "a" not in manager.registry.workers, "a forgotten")
        assert [sw.worker_id for sw in manager.store.workers()] == ["b"], "a's stored registration went too"
        assert "b" in manager.registry.workers, "a leased worker is never forgotten"
        manager.leases.release(lease.lease_id)
    finally:
        await manager.close()
        manager.store.close()


async def test_the_manager_keeps_at_most_max_workers_records(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    import memsvc.manager.registry as registry

    monkeypatch.setattr(registry, "MAX_WORKERS", 2)
    await env.worker("a")
    await env.worker("b")
    c_ = env.links.add(InMemoryWorker("c"))
    with pytest.raises(Overloaded):
        env.manager.registry.register("c", c_.address, "h1")
    assert sorted(env.manager.registry.workers) == ["a", "b"]
    env.manager.registry.register("a", env.rec("a").address, "h1")  # a known worker's heartbeat still counts
    await env.manager.registry.deregister("b")
    env.manager.registry.register("c", c_.address, "h1")
    assert sorted(env.manager.registry.workers) == ["a", "c"]


async def test_calls_queued_behind_a_deregistration_find_the_worker_gone(env: Env) -> None:
    x = await env.worker("x", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    n = await env.worker("n", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    await env.manager.transitions.sleep_worker("x", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    stale = env.rec("x")
    x.gate = asyncio.Event()  # a demotion holds x's lock while the others queue behind it
    demoting = asyncio.create_task(env.manager.transitions.sleep_worker("x", SleepLevel.LEVEL_2, {}, "", NO_DEADLINE))
    await wait_until(lambda: x.calls[-1:] == ["Sleep"] and stale.lock.locked(), "the demotion to hold the lock")
    first = asyncio.create_task(env.manager.registry.deregister("x"))
    second = asyncio.create_task(env.manager.registry.deregister("x"))
    waking = asyncio.create_task(env.manager.transitions.wake_worker("x", [], "", NO_DEADLINE))
    await asyncio.sleep(0.01)
    x.gate.set()
    await demoting
    results = await asyncio.gather(first, second, waking, return_exceptions=True)
    assert not isinstance(results[0], BaseException), results
    assert isinstance(results[1], NotFound) and isinstance(results[2], NotFound), results
    assert n.calls == [], "no neighbour is evicted to wake a worker that was forgotten"
    assert x.calls == ["Sleep", "Sleep"]
    with pytest.raises(NotFound):
        env.manager.registry.link(stale)  # a call that began before the deregistration
    env.manager.registry.register("x", x.address, "h1")  # registered again: a new record, not the old one
    with pytest.raises(NotFound):
        env.manager.registry.link(stale)
    await wait_until(lambda: env.rec("x").reachable, "x reachable again")
    assert env.manager.registry.link(env.rec("x")) is not None


async def test_deregistering_forgets_the_workers_policy_overrides(env: Env) -> None:
    await env.worker("a")
    env.manager.update_policy("a", {"idle_sleep_timeout": 7.0})
    assert env.manager.policies.effective("workers/a").idle_sleep_timeout == 7
    await env.manager.registry.deregister("a")
    assert env.manager.store.policy_fields("workers/a") is None
    await env.worker("a")
    assert env.manager.policies.effective("workers/a") == env.manager.policies.default


async def test_a_transition_in_progress_the_manager_did_not_start_counts_as_busy(env: Env) -> None:
    a = await env.worker("a", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    await env.worker("b", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    await env.policy(idle_sleep_timeout=60.0)
    await env.manager.transitions.sleep_worker("b", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    await a.hold_transition(True)  # a direct Sleep is queued on a, still AWAKE
    await wait_until(lambda: env.rec("a").in_transition, "the manager to see a's transition")
    env.idle_for("a", 100)
    env.manager.timers.tick()
    await asyncio.sleep(0.05)
    assert a.calls == [], "no idle sleep on a worker with a transition in progress"
    with pytest.raises(OutOfMemory):  # a is not a victim either: nothing else can make room for b
        await env.manager.leases.acquire("b", 60, "t", "", "", NO_DEADLINE)
    acquiring = asyncio.create_task(env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE))
    await asyncio.sleep(0.05)
    assert not acquiring.done(), "no lease on a state a queued transition is about to change"
    await a.hold_transition(False)
    lease, rec = await acquiring
    assert rec.state == WorkerState.AWAKE and a.calls == []
    env.manager.leases.release(lease.lease_id)


async def test_calls_waiting_for_one_workers_transitions_are_bounded(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    import memsvc.manager.records as records

    monkeypatch.setattr(records, "MAX_QUEUED_TRANSITIONS", 2)
    a = await env.worker("a")
    a.gate = asyncio.Event()
    first = asyncio.create_task(env.manager.transitions.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE))
    second = asyncio.create_task(env.manager.transitions.wake_worker("a", [], "", NO_DEADLINE))
    await wait_until(lambda: env.rec("a").queued == 2, "two calls queued")
    with pytest.raises(Overloaded):
        await env.manager.transitions.sleep_worker("a", SleepLevel.LEVEL_2, {}, "", NO_DEADLINE)
    a.gate.set()
    await first
    await second
    assert a.calls == ["Sleep", "WakeUp"] and env.rec("a").queued == 0


async def test_watch_streams_are_bounded(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    import memsvc.manager.watch as watch

    monkeypatch.setattr(watch, "MAX_WATCHERS", 1)
    q = env.manager.hub.subscribe()
    with pytest.raises(Overloaded):
        env.manager.hub.subscribe()
    env.manager.hub.unsubscribe(q)
    env.manager.hub.unsubscribe(env.manager.hub.subscribe())


async def test_closing_the_manager_does_not_wait_to_settle_a_call_in_doubt(tmp_path: Path) -> None:
    links = InMemoryLinks()
    manager = Manager(SqliteStore(tmp_path / "close.db"), ManagerSettings(tick_interval=3600.0), links=links)
    await manager.start()
    env = Env(manager, links)
    a = await env.worker("a")
    a.gate = asyncio.Event()  # the sleep never ends, and the worker reports it in progress
    sleeping = asyncio.create_task(manager.transitions.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE))
    await wait_until(lambda: a.calls == ["Sleep"], "the sleep to reach the worker")
    sleeping.cancel()  # in doubt: the manager starts asking the worker how it ended
    await asyncio.sleep(0.05)
    await asyncio.wait_for(manager.close(), timeout=5.0)
    manager.store.close()
    with pytest.raises(asyncio.CancelledError):  # its settling stopped too, not after rpc_timeout (600 s)
        await asyncio.wait_for(sleeping, timeout=5.0)
    a.gate.set()  # the worker's sleep, which began, runs to its end
    await asyncio.gather(*a.handlers)
    assert a.state == WorkerState.ASLEEP


async def test_a_call_past_its_deadline_waits_for_the_worker_to_say_how_it_ended(env: Env) -> None:
    a = await env.worker("a")
    a.gate = gate = asyncio.Event()

    async def finish_later() -> None:
        await asyncio.sleep(0.4)
        gate.set()  # the worker's sleep, begun before the deadline, ends after it

    opener = asyncio.create_task(finish_later())
    with pytest.raises(Unavailable, match="DEADLINE_EXCEEDED"):
        await env.manager.transitions.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", Deadline.after(0.1))
    assert gate.is_set(), "the manager held the worker until it reported no transition in progress"
    assert env.rec("a").state == WorkerState.ASLEEP and not env.rec("a").in_transition
    await opener


async def test_a_worker_that_ends_its_telemetry_stream_is_logged_as_stopping_not_warned(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """A draining worker closes its telemetry stream (STREAM_ENDED): the manager marks it unavailable
    at INFO; a broken stream (an error status) is still a WARNING."""
    from memsvc.manager.links import STREAM_ENDED
    from memsvc.manager.telemetry import TelemetryIngest

    await env.worker("a")
    await env.worker("b")
    ingest = TelemetryIngest(env.manager.metrics, env.manager.hub)
    with caplog.at_level(logging.INFO, logger="memsvc.manager"):
        await ingest.on_down(env.rec("a"), STREAM_ENDED)
        await ingest.on_down(env.rec("b"), "UNAVAILABLE: connection reset")
    levels = {r.getMessage(): r.levelno for r in caplog.records if "unavailable" in r.getMessage()}
    assert levels == {
        f"worker a unavailable: {STREAM_ENDED}": logging.INFO,
        "worker b unavailable: UNAVAILABLE: connection reset": logging.WARNING,
    }, levels
