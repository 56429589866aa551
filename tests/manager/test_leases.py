"""Leases, decided in process against in-memory workers (tests/manager/inmemory_env.py): a lease blocks
every kind of sleep, its expiry, the idle clock it leaves behind, their bound per worker, ListLeases.
"""

from __future__ import annotations

import asyncio

import pytest
from asyncwait import wait_until
from inmemory_env import (
    Env,
    inmemory_env,  # noqa: F401 - the env fixture
)

from memsvc.errors import InvalidArgument, OutOfMemory, Overloaded, WrongState
from memsvc.manager.wire import lease_pb, view_pb
from memsvc.runtime.deadline import NO_DEADLINE
from memsvc.vocabulary import KV_CACHE, WEIGHTS, SleepLevel, TagState, WorkerState

pytestmark = pytest.mark.asyncio


async def test_a_lease_blocks_idle_sleep_and_the_idle_clock_starts_at_release(env: Env) -> None:
    a = await env.worker("a")
    await env.policy(idle_sleep_timeout=60.0)
    lease, _ = await env.manager.leases.acquire("a", 600, "t", "", "", NO_DEADLINE)
    env.idle_for("a", 3600)
    env.manager.timers.tick()
    await asyncio.sleep(0.05)
    assert a.calls == [], "a leased worker is never put to sleep"
    env.manager.leases.release(lease.lease_id)
    env.manager.timers.tick()  # just released: idle for 0 s
    await asyncio.sleep(0.05)
    assert a.calls == []
    env.idle_for("a", 61)
    env.manager.timers.tick()
    await wait_until(lambda: a.state == WorkerState.ASLEEP, "the tier-1 idle sleep")
    assert a.tags[WEIGHTS].state == TagState.OFFLOADED and a.tags[KV_CACHE].state == TagState.DISCARDED


async def test_sleep_worker_is_refused_while_leased_and_acquire_waits_for_a_sleep_in_flight(env: Env) -> None:
    a = await env.worker("a")
    lease, _ = await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE)
    with pytest.raises(WrongState):
        await env.manager.transitions.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    env.manager.leases.release(lease.lease_id)
    a.gate = asyncio.Event()  # the next sleep holds until the gate opens
    sleeping = asyncio.create_task(env.manager.transitions.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE))
    await wait_until(lambda: a.calls == ["Sleep"], "the sleep to reach the worker")
    acquiring = asyncio.create_task(env.manager.leases.acquire("a", 60, "t2", "", "", NO_DEADLINE))
    await asyncio.sleep(0.05)
    assert not acquiring.done(), "acquire waits for the sleep in flight, then wakes the worker"
    a.gate.set()
    await sleeping
    lease2, rec = await acquiring
    assert a.state == WorkerState.AWAKE and a.calls == ["Sleep", "WakeUp"]
    assert rec.state == WorkerState.AWAKE and list(rec.leases) == [lease2.lease_id]


async def test_a_lease_expires_after_its_ttl_and_frees_the_worker_for_idle_sleep(env: Env) -> None:
    a = await env.worker("a")
    await env.policy(idle_sleep_timeout=60.0)
    lease, _ = await env.manager.leases.acquire("a", 30, "vanished", "", "", NO_DEADLINE)
    env.manager.leases.leases[lease.lease_id].expire_time -= 31
    env.manager.timers.tick()
    assert env.rec("a").leases == {}
    assert env.manager.metrics.leases_expired._value.get() == 1
    env.idle_for("a", 61)
    env.manager.timers.tick()
    await wait_until(lambda: a.state == WorkerState.ASLEEP, "idle sleep after expiry")


async def test_the_last_lease_to_end_sets_the_idle_timeout_by_its_keep_alive(env: Env) -> None:
    """keep_alive (Ollama's): 0 sleeps at the next tick, negative never idle-sleeps, positive replaces
    the policy's timeout; the last lease to end decides and a lease without one restores the policy."""
    a = await env.worker("a")
    await env.policy(idle_sleep_timeout=60.0)
    forever, _ = await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE, keep_alive=-1)
    plain, _ = await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE)
    env.manager.leases.release(plain.lease_id)
    assert env.rec("a").keep_alive is None, "a lease that is not the last to end decides nothing"
    env.manager.leases.release(forever.lease_id)
    assert env.rec("a").keep_alive == -1 and view_pb(env.rec("a").view()).keep_alive.ToSeconds() == -1
    env.idle_for("a", 10 * 86400)
    env.manager.timers.tick()
    await asyncio.sleep(0.05)
    assert a.state == WorkerState.AWAKE and a.calls == [], "keep_alive -1 let the idle timer sleep it"

    longer, _ = await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE, keep_alive=600)
    env.manager.leases.release(longer.lease_id)
    env.idle_for("a", 120)  # past the policy's 60 s, short of the lease's 600 s
    env.manager.timers.tick()
    await asyncio.sleep(0.05)
    assert a.state == WorkerState.AWAKE
    env.idle_for("a", 500)
    env.manager.timers.tick()
    await wait_until(lambda: a.state == WorkerState.ASLEEP, "the sleep after keep_alive 600 s")

    now, _ = await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE, keep_alive=0)  # wakes it
    renewed, _ = await env.manager.leases.acquire("a", 60, "t", now.lease_id, "", NO_DEADLINE, keep_alive=-1)
    assert renewed.keep_alive == -1, "a renewal's keep_alive replaces the lease's"
    renewed, _ = await env.manager.leases.acquire("a", 60, "t", now.lease_id, "", NO_DEADLINE)
    assert renewed.keep_alive == -1, "a renewal without keep_alive keeps it"
    await env.manager.leases.acquire("a", 60, "t", now.lease_id, "", NO_DEADLINE, keep_alive=0)  # renewed to "at once"
    env.manager.leases.release(now.lease_id)
    env.manager.timers.tick()  # no idle time at all
    await wait_until(lambda: a.state == WorkerState.ASLEEP, "the sleep right after keep_alive 0")

    assert env.rec("a").keep_alive is None, "the idle sleep it decided ended its idle period"
    await env.manager.transitions.wake_worker("a", [], "", NO_DEADLINE)
    once, _ = await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE, keep_alive=0)
    env.manager.leases.release(once.lease_id)
    await env.manager.transitions.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    await env.manager.transitions.wake_worker("a", [], "", NO_DEADLINE)  # an operator's wake: the policy's idle period
    assert env.rec("a").keep_alive is None
    env.manager.timers.tick()
    await asyncio.sleep(0.05)
    assert a.state == WorkerState.AWAKE, "a keep_alive 0 of an earlier lease put an operator's wake to sleep"

    never, _ = await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE, keep_alive=-1e15)
    env.manager.leases.release(never.lease_id)
    assert env.rec("a").keep_alive == -1, "any negative keep_alive is 'never', inside Duration's range"
    policy, _ = await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE)
    env.manager.leases.release(policy.lease_id)
    assert env.rec("a").keep_alive is None and not view_pb(env.rec("a").view()).HasField("keep_alive")
    with pytest.raises(InvalidArgument, match="keep_alive"):
        await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE, keep_alive=31 * 86400)
    assert env.rec("a").leases == {}


async def test_a_refused_acquire_leaves_the_idle_clock_where_it_was(env: Env) -> None:
    a = await env.worker("a")
    await env.manager.transitions.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    env.idle_for("a", 100)
    before = env.rec("a").idle_since
    a.refuse = OutOfMemory("worker a: the device is full")
    with pytest.raises(OutOfMemory):
        await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE)
    assert env.rec("a").idle_since == before and env.rec("a").leases == {}


async def test_leases_per_worker_are_bounded_and_a_renewal_always_succeeds(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    import memsvc.manager.leases as leases

    monkeypatch.setattr(leases, "MAX_LEASES_PER_WORKER", 2)
    await env.worker("a")
    first, _ = await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE)
    await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE)
    with pytest.raises(Overloaded):
        await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE)
    assert len(env.rec("a").leases) == 2
    renewed, _ = await env.manager.leases.acquire("a", 120, "t", first.lease_id, "", NO_DEADLINE)
    assert renewed.lease_id == first.lease_id


async def test_list_leases_leaves_out_a_lease_still_being_granted(env: Env) -> None:
    """A lease whose wake still runs has no TTL yet (and no holder has it): ListLeases skips it
    instead of failing on it."""
    a = await env.worker("a")
    held, _ = await env.manager.leases.acquire("a", 60, "held", "", "", NO_DEADLINE)
    b = await env.worker("b")
    await env.manager.transitions.sleep_worker("b", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    b.gate = asyncio.Event()
    waking = asyncio.create_task(env.manager.leases.acquire("b", 60, "pending", "", "", NO_DEADLINE))
    await wait_until(lambda: b.calls == ["Sleep", "WakeUp"], "b's wake to start")
    listed, token = env.manager.leases.page("", 0, "")
    assert [x.lease_id for x in listed] == [held.lease_id] and token == ""
    assert [lease_pb(x).lease_id for x in listed] == [held.lease_id]
    b.gate.set()
    granted, _ = await waking
    assert {x.lease_id for x in env.manager.leases.page("", 0, "")[0]} == {held.lease_id, granted.lease_id}
    assert a.state == WorkerState.AWAKE
