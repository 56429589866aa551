"""The manager's decisions in process, against in-memory workers (memsvc.manager.inmemory).

The same decisions are tested through real worker processes in test_manager_budgets.py,
test_manager_idle.py and test_faults.py; here each runs in milliseconds, so the edge cases get their
own test: LRU eviction order, leases that block every kind of sleep, tier-2 demotion, the host
budget's fallback to level 2, silence, expiry. The store is a real SQLite file; timers are driven by
calling ``tick()`` with idle clocks moved back, not by sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypedDict, Unpack

import pytest
import pytest_asyncio
from asyncwait import wait_until
from google.protobuf.duration_pb2 import Duration
from stores import STORE_KINDS, store_for

from memsvc.errors import InvalidArgument, MemsvcError, NotFound, OutOfMemory, Overloaded, Unavailable, WrongState
from memsvc.manager.controller import Manager
from memsvc.manager.inmemory import InMemoryLinks, InMemoryWorker
from memsvc.manager.records import WorkerRecord
from memsvc.manager.settings import ManagerSettings
from memsvc.manager.store_sqlite import SqliteStore
from memsvc.runtime.deadline import Deadline
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.vocabulary import KV_CACHE, WEIGHTS, Action, SleepLevel, TagState, WorkerState

GiB = 1 << 30
pytestmark = pytest.mark.asyncio


class _Sizes(TypedDict, total=False):
    weights_bytes: int
    kv_bytes: int
    device_total_bytes: int
    offload_dir: str


class _PolicyFields(TypedDict, total=False):
    device_budget_bytes: int
    host_budget_bytes: int
    device_swap_headroom_bytes: int
    idle_sleep_timeout: Duration
    idle_deep_sleep_timeout: Duration
    time_slice: Duration
    start_timeout: Duration


class Env:
    def __init__(self, manager: Manager, links: InMemoryLinks) -> None:
        self.manager = manager
        self.links = links

    async def worker(self, wid: str, host: str = "h1", **sizes: Unpack[_Sizes]) -> InMemoryWorker:
        wk = self.links.add(InMemoryWorker(wid, **sizes))
        await self.manager.register(wid, wk.address, host)
        await wait_until(lambda: self.rec(wid).state == WorkerState.AWAKE, f"{wid} awake at the manager")
        return wk

    def rec(self, wid: str) -> WorkerRecord:
        return self.manager.get(wid)

    def idle_for(self, wid: str, seconds: float) -> None:
        """Move the worker's idle clock back, as if it had been idle that long."""
        rec = self.rec(wid)
        rec.idle_since -= seconds
        if rec.status is not None:
            t = rec.status.last_activity_time
            t.FromNanoseconds(t.ToNanoseconds() - int(seconds * 1e9))

    async def policy(self, **fields: Unpack[_PolicyFields]) -> None:
        p = manager_pb.Policy(**fields)
        self.manager.update_policy("", p, list(fields))


@pytest_asyncio.fixture(params=STORE_KINDS)
async def env(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Env]:
    """Every test here on each store: the manager's decisions must not depend on where it keeps them."""
    links = InMemoryLinks()
    # a tick interval of an hour: the tests call tick() themselves
    manager = Manager(store_for(request, tmp_path), ManagerSettings(tick_interval=3600.0), links=links)
    await manager.start()
    yield Env(manager, links)
    await manager.close()
    manager.store.close()


async def test_device_budget_evicts_the_least_recently_used_idle_worker(env: Env) -> None:
    a = await env.worker("a", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    b = await env.worker("b", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    c_ = await env.worker("c", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    await env.manager.sleep_worker("c", SleepLevel.LEVEL_1, {}, "", None)
    env.idle_for("a", 100)  # a has been idle longer than b
    env.idle_for("b", 10)
    lease, _ = await env.manager.acquire("c", 60, "t", "", "", None)
    assert c_.state == WorkerState.AWAKE
    assert a.state == WorkerState.ASLEEP and b.state == WorkerState.AWAKE  # the LRU one went, only it
    assert a.calls == ["Sleep"] and b.calls == []
    assert env.manager.metrics.evictions._value.get() == 1
    env.manager.release(lease.lease_id)


async def test_device_budget_refuses_when_every_neighbour_is_leased_and_pinned_and_keeps_the_sleeper_asleep(
    env: Env,
) -> None:
    """A leased neighbour whose time_slice is 0 never gives up its turn: the wake is refused."""
    await env.worker("a", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    b = await env.worker("b", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    env.manager.update_policy("a", manager_pb.Policy(), ["time_slice"])
    await env.manager.sleep_worker("b", SleepLevel.LEVEL_1, {}, "", None)
    held, _ = await env.manager.acquire("a", 60, "holder", "", "", None)
    with pytest.raises(OutOfMemory):
        await env.manager.acquire("b", 60, "t", "", "", None)
    assert b.state == WorkerState.ASLEEP and b.tags[WEIGHTS].state == TagState.OFFLOADED
    assert env.rec("b").leases == {}, "a refused acquire leaves no lease behind"
    env.manager.release(held.lease_id)
    lease, _ = await env.manager.acquire("b", 60, "t", "", "", None)  # now a can be evicted
    # mypy keeps b.state narrowed to ASLEEP by the assert above, across the await that wakes b
    assert b.state == WorkerState.AWAKE  # type: ignore[comparison-overlap]
    env.manager.release(lease.lease_id)


async def test_busy_workers_on_a_full_device_take_turns_and_keep_their_leases(env: Env) -> None:
    """a is leased (busy) and awake since before b was wanted: a lease on b pauses a at once (a Sleep
    that pauses its generations; a keeps its lease, asleep) and wakes b. a is then owed a turn: once
    b's slice is over, the manager itself wakes a again, pausing b (whose lease stays too). Each
    gave up one turn, and nothing was refused."""
    a = await env.worker("a", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    b = await env.worker("b", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    await env.policy(time_slice=Duration(nanos=200_000_000))
    await env.manager.sleep_worker("b", SleepLevel.LEVEL_1, {}, "", None)
    held_a, _ = await env.manager.acquire("a", 60, "holder", "", "", None)
    held_b, _ = await env.manager.acquire("b", 60, "t", "", "", None)
    assert (env.rec("a").state, env.rec("b").state) == (WorkerState.ASLEEP, WorkerState.AWAKE)
    assert a.pausing_sleeps == 1 and env.rec("a").leases.keys() == {held_a.lease_id}
    await wait_until(lambda: a.state == WorkerState.AWAKE, "a woken again for its lease, on its next turn")
    assert b.pausing_sleeps == 1 and b.state == WorkerState.ASLEEP
    assert env.rec("b").leases.keys() == {held_b.lease_id}
    assert (env.rec("a").turns_yielded, env.rec("b").turns_yielded) == (1, 1)
    env.manager.release(held_a.lease_id)
    await wait_until(lambda: b.state == WorkerState.AWAKE, "b woken for its lease once a went idle")
    assert a.state == WorkerState.ASLEEP and a.pausing_sleeps == 1, "an idle neighbour is evicted, not paused"
    env.manager.release(held_b.lease_id)


async def test_a_wake_waiting_for_a_turn_does_not_deadlock_with_an_operators_wake_of_the_busy_worker(
    env: Env,
) -> None:
    """b's lease waits for a's turn (a leased, just woken) while holding the device's wake lock; an
    operator's WakeWorker of a takes a's lock and waits for that device lock. When a's turn ends, b's
    wake must not wait for a's lock (it would for ever): it looks again instead, and both calls end."""
    await env.worker("a", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    await env.worker("b", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    await env.policy(time_slice=Duration(nanos=200_000_000))
    await env.manager.sleep_worker("b", SleepLevel.LEVEL_1, {}, "", None)
    held, _ = await env.manager.acquire("a", 60, "holder", "", "", None)
    env.rec("a").turn_start = time.time()  # a's turn has just begun
    waking_b = asyncio.create_task(env.manager.acquire("b", 60, "t", "", "", None))
    await wait_until(lambda: len(env.rec("b").waiting) == 1, "b's lease to wait for a's turn")
    operator = asyncio.create_task(env.manager.wake_worker("a", [], "", None))
    done, _ = await asyncio.wait({waking_b, operator}, timeout=30)
    assert done == {waking_b, operator}, "a wake waiting for a turn and an operator's wake deadlocked"
    with contextlib.suppress(MemsvcError):  # refused (a is awake) or answered: either way it ended
        operator.result()
    if waking_b.exception() is None:
        lease, _ = waking_b.result()
        env.manager.release(lease.lease_id)
    else:  # a's lock was taken when its turn ended: b's wake was refused, not stuck
        assert isinstance(waking_b.exception(), OutOfMemory), waking_b.exception()
    env.manager.release(held.lease_id)


async def test_a_wake_short_of_room_waits_for_a_neighbours_sleep_already_running(env: Env) -> None:
    """The only neighbour that could make room is already going to sleep (its idle timer's sleep holds
    it): the wake waits for that sleep and runs, instead of RESOURCE_EXHAUSTED for a room being made."""
    a = await env.worker("a", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    b = await env.worker("b", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    await env.manager.sleep_worker("b", SleepLevel.LEVEL_1, {}, "", None)
    await env.policy(idle_sleep_timeout=Duration(seconds=60))
    a.gate = asyncio.Event()
    env.idle_for("a", 120)
    env.manager.tick()
    await wait_until(lambda: a.calls == ["Sleep"], "a's idle sleep to reach the worker")
    acquiring = asyncio.create_task(env.manager.acquire("b", 60, "t", "", "", Deadline.after(10.0)))
    await asyncio.sleep(0.1)
    assert not acquiring.done(), "the acquire did not wait for the sleep that makes its room"
    a.gate.set()
    lease, _ = await acquiring
    assert a.state == WorkerState.ASLEEP and b.state == WorkerState.AWAKE
    assert a.calls == ["Sleep"] and b.calls == ["Sleep", "WakeUp"]
    env.manager.release(lease.lease_id)


async def _swap_pair(env: Env, headroom: int, device_total: int = 80 * GiB) -> tuple[InMemoryWorker, InMemoryWorker]:
    """a asleep, b awake, a 4 GiB budget that fits one of them (2+1 GiB each), ``headroom`` over it;
    b's next sleep held at its gate."""
    a = await env.worker("a", weights_bytes=2 * GiB, kv_bytes=GiB, device_total_bytes=device_total)
    b = await env.worker("b", weights_bytes=2 * GiB, kv_bytes=GiB, device_total_bytes=device_total)
    await env.manager.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", None)
    await env.policy(device_budget_bytes=4 * GiB, device_swap_headroom_bytes=headroom)
    b.gate = asyncio.Event()
    return a, b


async def test_with_swap_headroom_the_wake_runs_while_its_eviction_is_still_sleeping(env: Env) -> None:
    a, b = await _swap_pair(env, headroom=3 * GiB)
    acquiring = asyncio.create_task(env.manager.acquire("a", 60, "t", "", "", None))
    await wait_until(lambda: a.state == WorkerState.AWAKE, "a's wake, beside b's sleep")
    assert a.calls == ["Sleep", "WakeUp"]
    assert b.calls == ["Sleep"] and b.state == WorkerState.AWAKE, "b's sleep is still held, yet a is awake"
    assert env.rec("b").lock.locked(), "the eviction holds b: no lease or timer acts on it meanwhile"
    assert b.gate is not None
    b.gate.set()  # the lease comes once the eviction it overlapped has ended (the budget holds again)
    lease, _ = await asyncio.wait_for(acquiring, timeout=5)
    assert env.rec("b").state == WorkerState.ASLEEP and not env.rec("b").lock.locked()
    assert env.manager.metrics.evictions._value.get() == 1
    env.manager.release(lease.lease_id)


async def test_an_overlapped_eviction_that_fails_is_followed_by_one_that_restores_the_budget(env: Env) -> None:
    """b refuses its overlapped sleep: a still wakes, then the manager evicts the next idle neighbour
    (c) so that the awake workers fit the budget again, instead of staying over it."""
    a, b = await _swap_pair(env, headroom=3 * GiB)
    b.gate = None
    c_ = await env.worker("c", weights_bytes=GiB // 2, kv_bytes=GiB // 2, device_total_bytes=80 * GiB)
    env.idle_for("b", 100)  # b is the least recently used: the overlapped victim
    b.refuse = WrongState("b will not sleep now")
    await env.policy(device_budget_bytes=5 * GiB, device_swap_headroom_bytes=3 * GiB)
    lease, _ = await asyncio.wait_for(env.manager.acquire("a", 60, "t", "", "", None), timeout=5)
    assert a.state == WorkerState.AWAKE and b.state == WorkerState.AWAKE and set(b.calls) == {"Sleep"}
    assert c_.state == WorkerState.ASLEEP, "the budget is restored by the next idle neighbour"
    assert sum(env.rec(x).mapped_bytes for x in "abc") <= 5 * GiB + 2 * GiB  # b's 3 GiB + a's 3 GiB, c's gone
    env.manager.release(lease.lease_id)


async def test_the_overlap_counts_only_what_the_eviction_frees(env: Env) -> None:
    """With kv_cache KEPT by the tier-1 actions, b's sleep frees 2 of its 3 GiB: b's 1 GiB and a's
    3 GiB do not fit a 3.5 GiB budget, so the wake is refused, as when evicting first; counting all
    of b's bytes as freed would have woken a over the budget."""
    a, b = await _swap_pair(env, headroom=4 * GiB)
    b.gate = None
    keep_kv = manager_pb.Policy(device_budget_bytes=int(3.5 * GiB))
    keep_kv.tag_actions.update({WEIGHTS: Action.OFFLOAD.proto, KV_CACHE: Action.KEEP.proto})
    env.manager.update_policy("", keep_kv, ["tag_actions", "device_budget_bytes"])
    with pytest.raises(OutOfMemory):
        await env.manager.acquire("a", 60, "t", "", "", None)
    assert a.state == WorkerState.ASLEEP, "a was not woken over the budget"
    await wait_until(lambda: not env.rec("b").lock.locked(), "b's eviction to end")
    assert sum(env.rec(x).mapped_bytes for x in "ab") <= int(3.5 * GiB)


@pytest.mark.parametrize(
    ("headroom", "device_total", "why"),
    [
        (0, 80 * GiB, "no headroom"),
        (2 * GiB - 1, 80 * GiB, "the headroom is short of the overlap"),
        (3 * GiB, 2 * GiB, "the device's free memory does not hold both"),
    ],
)
async def test_without_room_for_both_the_eviction_ends_before_the_wake(
    env: Env, headroom: int, device_total: int, why: str
) -> None:
    a, b = await _swap_pair(env, headroom, device_total)
    acquiring = asyncio.create_task(env.manager.acquire("a", 60, "t", "", "", None))
    await wait_until(lambda: b.calls == ["Sleep"], "the eviction to start")
    await asyncio.sleep(0.05)
    assert not acquiring.done() and a.calls == ["Sleep"], f"{why}: the wake must wait for the eviction"
    assert b.gate is not None
    b.gate.set()
    lease, _ = await asyncio.wait_for(acquiring, timeout=5)
    assert a.state == WorkerState.AWAKE and b.state == WorkerState.ASLEEP
    env.manager.release(lease.lease_id)


async def test_an_overlapped_wake_that_finds_the_device_full_waits_for_its_eviction_and_tries_again(env: Env) -> None:
    a, b = await _swap_pair(env, headroom=3 * GiB)
    a.refuse = OutOfMemory("cuMemCreate failed: out of memory")  # the device was fuller than reported
    acquiring = asyncio.create_task(env.manager.acquire("a", 60, "t", "", "", None))
    await wait_until(lambda: a.calls == ["Sleep", "WakeUp"], "the overlapped wake to be refused")
    await asyncio.sleep(0.05)
    assert not acquiring.done(), "it waits for the eviction instead of failing"
    a.refuse = None
    assert b.gate is not None
    b.gate.set()
    lease, _ = await asyncio.wait_for(acquiring, timeout=5)
    assert a.calls == ["Sleep", "WakeUp", "WakeUp"] and a.state == WorkerState.AWAKE
    assert b.state == WorkerState.ASLEEP
    env.manager.release(lease.lease_id)


async def test_device_budget_policy_is_smaller_than_the_device(env: Env) -> None:
    a = await env.worker("a", weights_bytes=2 * GiB, kv_bytes=GiB, device_total_bytes=80 * GiB)
    b = await env.worker("b", weights_bytes=2 * GiB, kv_bytes=GiB, device_total_bytes=80 * GiB)
    await env.manager.sleep_worker("b", SleepLevel.LEVEL_1, {}, "", None)
    await env.policy(device_budget_bytes=4 * GiB)
    await env.manager.wake_worker("b", [], "", None)
    assert a.state == WorkerState.ASLEEP and b.state == WorkerState.AWAKE


async def test_a_lease_blocks_idle_sleep_and_the_idle_clock_starts_at_release(env: Env) -> None:
    a = await env.worker("a")
    await env.policy(idle_sleep_timeout=Duration(seconds=60))
    lease, _ = await env.manager.acquire("a", 600, "t", "", "", None)
    env.idle_for("a", 3600)
    env.manager.tick()
    await asyncio.sleep(0.05)
    assert a.calls == [], "a leased worker is never put to sleep"
    env.manager.release(lease.lease_id)
    env.manager.tick()  # just released: idle for 0 s
    await asyncio.sleep(0.05)
    assert a.calls == []
    env.idle_for("a", 61)
    env.manager.tick()
    await wait_until(lambda: a.state == WorkerState.ASLEEP, "the tier-1 idle sleep")
    assert a.tags[WEIGHTS].state == TagState.OFFLOADED and a.tags[KV_CACHE].state == TagState.DISCARDED


async def test_tier_two_demotes_an_idle_sleeper_to_level_two(env: Env) -> None:
    a = await env.worker("a")
    await env.policy(idle_sleep_timeout=Duration(seconds=60), idle_deep_sleep_timeout=Duration(seconds=600))
    env.idle_for("a", 61)
    env.manager.tick()
    await wait_until(lambda: a.state == WorkerState.ASLEEP, "tier 1")
    assert a.sleep_level == 0 and a.tags[WEIGHTS].state == TagState.OFFLOADED
    env.idle_for("a", 600)
    env.manager.tick()
    idle_sleeps = env.manager.metrics.idle_sleeps.labels("2")._value
    # the worker's state changes inside its Sleep; the manager counts the sleep once the call returns
    await wait_until(lambda: a.tags[WEIGHTS].state == TagState.DISCARDED and idle_sleeps.get() == 1, "tier 2")
    assert a.sleep_level == SleepLevel.LEVEL_2 and a.calls == ["Sleep", "Sleep"]


async def test_host_budget_demotes_the_coldest_sleeper_before_another_offloads(env: Env) -> None:
    a = await env.worker("a", weights_bytes=3 * GiB)
    b = await env.worker("b", weights_bytes=3 * GiB)
    cold = await env.worker("cold", weights_bytes=3 * GiB)
    await env.policy(host_budget_bytes=7 * GiB)
    await env.manager.sleep_worker("cold", None, {}, "", None)
    await env.manager.sleep_worker("a", None, {}, "", None)
    env.idle_for("cold", 1000)
    await env.manager.sleep_worker("b", None, {}, "", None)  # 9 GiB would not fit: the coldest goes to level 2
    assert cold.tags[WEIGHTS].state == TagState.DISCARDED
    assert a.tags[WEIGHTS].state == TagState.OFFLOADED and b.tags[WEIGHTS].state == TagState.OFFLOADED
    assert env.manager.metrics.demotions._value.get() == 1


async def test_host_budget_with_no_one_to_demote_puts_a_tier_one_sleep_at_level_two(env: Env) -> None:
    a = await env.worker("a", weights_bytes=3 * GiB)
    await env.policy(host_budget_bytes=2 * GiB)
    await env.manager.sleep_worker("a", None, {}, "", None)
    assert a.tags[WEIGHTS].state == TagState.DISCARDED and a.sleep_level == SleepLevel.LEVEL_2
    b = await env.worker("b", weights_bytes=3 * GiB)
    with pytest.raises(OutOfMemory):  # an explicit offload is refused instead, nothing changed
        await env.manager.sleep_worker("b", None, {WEIGHTS: Action.OFFLOAD}, "", None)
    assert b.state == WorkerState.AWAKE and b.calls == []


async def test_host_budget_moves_a_sleeper_with_a_disk_tier_to_disk_and_keeps_its_bytes(env: Env) -> None:
    cold = await env.worker("cold", weights_bytes=3 * GiB, offload_dir="/srv/offload")
    plain = await env.worker("plain", weights_bytes=3 * GiB)
    b = await env.worker("b", weights_bytes=3 * GiB)
    await env.policy(host_budget_bytes=7 * GiB)
    await env.manager.sleep_worker("cold", None, {}, "", None)
    await env.manager.sleep_worker("plain", None, {}, "", None)
    env.idle_for("cold", 1000)
    await env.manager.sleep_worker("b", None, {}, "", None)  # 9 GiB would not fit: the coldest moves to disk
    assert cold.tags[WEIGHTS].state == TagState.ON_DISK and cold.tags[KV_CACHE].state == TagState.DISCARDED
    assert cold.sleep_level != SleepLevel.LEVEL_2 and cold.calls == ["Sleep", "Sleep"]
    assert env.rec("cold").offloaded_bytes == 0  # the host budget counts host RAM, not the disk tier
    assert plain.tags[WEIGHTS].state == TagState.OFFLOADED and b.tags[WEIGHTS].state == TagState.OFFLOADED
    assert env.manager.metrics.demotions._value.get() == 1
    await env.manager.wake_worker("cold", [], "", None)
    assert cold.state == WorkerState.AWAKE


async def test_a_tier_one_sleep_with_no_host_room_goes_to_the_disk_tier_instead_of_level_two(env: Env) -> None:
    a = await env.worker("a", weights_bytes=3 * GiB, offload_dir="/srv/offload")
    await env.policy(host_budget_bytes=2 * GiB)
    await env.manager.sleep_worker("a", None, {}, "", None)
    assert a.tags[WEIGHTS].state == TagState.ON_DISK and a.tags[KV_CACHE].state == TagState.DISCARDED
    plain = await env.worker("plain", weights_bytes=3 * GiB)
    with pytest.raises(WrongState, match="no disk tier"):  # asked for by name, without a disk tier
        await env.manager.sleep_worker("plain", None, {WEIGHTS: Action.OFFLOAD_DISK}, "", None)
    assert plain.state == WorkerState.AWAKE


async def test_a_full_disk_falls_back_to_level_two_for_the_demotion_and_for_a_tier_one_sleep(env: Env) -> None:
    cold = await env.worker("cold", weights_bytes=3 * GiB, offload_dir="/srv/offload")
    b = await env.worker("b", weights_bytes=3 * GiB, offload_dir="/srv/offload")
    await env.policy(host_budget_bytes=5 * GiB)
    await env.manager.sleep_worker("cold", None, {}, "", None)
    cold.disk_full = b.disk_full = True
    await env.manager.sleep_worker("b", None, {}, "", None)  # no room: cold's move to disk fails, level 2
    assert cold.tags[WEIGHTS].state == TagState.DISCARDED and cold.sleep_level == SleepLevel.LEVEL_2
    assert cold.calls == ["Sleep", "Sleep", "Sleep"]  # tier 1, the refused move to disk, level 2
    assert b.tags[WEIGHTS].state == TagState.OFFLOADED
    assert env.manager.metrics.demotions._value.get() == 1
    await env.policy(host_budget_bytes=2 * GiB)  # b demoted (level 2 again) and still no room for d's 3 GiB
    d = await env.worker("d", weights_bytes=3 * GiB, offload_dir="/srv/offload")
    d.disk_full = True
    await env.manager.sleep_worker("d", None, {}, "", None)  # to its disk: refused; level 2
    assert b.tags[WEIGHTS].state == TagState.DISCARDED and env.manager.metrics.demotions._value.get() == 2
    assert d.tags[WEIGHTS].state == TagState.DISCARDED and d.sleep_level == SleepLevel.LEVEL_2
    assert d.calls == ["Sleep", "Sleep"]


async def test_sleep_worker_is_refused_while_leased_and_acquire_waits_for_a_sleep_in_flight(env: Env) -> None:
    a = await env.worker("a")
    lease, _ = await env.manager.acquire("a", 60, "t", "", "", None)
    with pytest.raises(WrongState):
        await env.manager.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", None)
    env.manager.release(lease.lease_id)
    a.gate = asyncio.Event()  # the next sleep holds until the gate opens
    sleeping = asyncio.create_task(env.manager.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", None))
    await wait_until(lambda: a.calls == ["Sleep"], "the sleep to reach the worker")
    acquiring = asyncio.create_task(env.manager.acquire("a", 60, "t2", "", "", None))
    await asyncio.sleep(0.05)
    assert not acquiring.done(), "acquire waits for the sleep in flight, then wakes the worker"
    a.gate.set()
    await sleeping
    lease2, rec = await acquiring
    assert a.state == WorkerState.AWAKE and a.calls == ["Sleep", "WakeUp"]
    assert rec.state == WorkerState.AWAKE and list(rec.leases) == [lease2.lease_id]


async def test_a_lease_expires_after_its_ttl_and_frees_the_worker_for_idle_sleep(env: Env) -> None:
    a = await env.worker("a")
    await env.policy(idle_sleep_timeout=Duration(seconds=60))
    lease, _ = await env.manager.acquire("a", 30, "vanished", "", "", None)
    env.manager.leases.leases[lease.lease_id].expire_time -= 31
    env.manager.tick()
    assert env.rec("a").leases == {}
    assert env.manager.metrics.leases_expired._value.get() == 1
    env.idle_for("a", 61)
    env.manager.tick()
    await wait_until(lambda: a.state == WorkerState.ASLEEP, "idle sleep after expiry")


async def test_the_last_lease_to_end_sets_the_idle_timeout_by_its_keep_alive(env: Env) -> None:
    """keep_alive (Ollama's): 0 sleeps at the next tick, negative never idle-sleeps, positive replaces
    the policy's timeout; the last lease to end decides and a lease without one restores the policy."""
    a = await env.worker("a")
    await env.policy(idle_sleep_timeout=Duration(seconds=60))
    forever, _ = await env.manager.acquire("a", 60, "t", "", "", None, keep_alive=-1)
    plain, _ = await env.manager.acquire("a", 60, "t", "", "", None)
    env.manager.release(plain.lease_id)
    assert env.rec("a").keep_alive is None, "a lease that is not the last to end decides nothing"
    env.manager.release(forever.lease_id)
    assert env.rec("a").keep_alive == -1 and env.rec("a").to_proto().keep_alive.ToSeconds() == -1
    env.idle_for("a", 10 * 86400)
    env.manager.tick()
    await asyncio.sleep(0.05)
    assert a.state == WorkerState.AWAKE and a.calls == [], "keep_alive -1 let the idle timer sleep it"

    longer, _ = await env.manager.acquire("a", 60, "t", "", "", None, keep_alive=600)
    env.manager.release(longer.lease_id)
    env.idle_for("a", 120)  # past the policy's 60 s, short of the lease's 600 s
    env.manager.tick()
    await asyncio.sleep(0.05)
    assert a.state == WorkerState.AWAKE
    env.idle_for("a", 500)
    env.manager.tick()
    await wait_until(lambda: a.state == WorkerState.ASLEEP, "the sleep after keep_alive 600 s")

    now, _ = await env.manager.acquire("a", 60, "t", "", "", None, keep_alive=0)  # wakes it
    renewed, _ = await env.manager.acquire("a", 60, "t", now.lease_id, "", None, keep_alive=-1)
    assert renewed.keep_alive == -1, "a renewal's keep_alive replaces the lease's"
    renewed, _ = await env.manager.acquire("a", 60, "t", now.lease_id, "", None)
    assert renewed.keep_alive == -1, "a renewal without keep_alive keeps it"
    await env.manager.acquire("a", 60, "t", now.lease_id, "", None, keep_alive=0)  # renewed to "at once"
    env.manager.release(now.lease_id)
    env.manager.tick()  # no idle time at all
    await wait_until(lambda: a.state == WorkerState.ASLEEP, "the sleep right after keep_alive 0")

    assert env.rec("a").keep_alive is None, "the idle sleep it decided ended its idle period"
    await env.manager.wake_worker("a", [], "", None)
    once, _ = await env.manager.acquire("a", 60, "t", "", "", None, keep_alive=0)
    env.manager.release(once.lease_id)
    await env.manager.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", None)
    await env.manager.wake_worker("a", [], "", None)  # an operator's wake: the policy's idle period
    assert env.rec("a").keep_alive is None
    env.manager.tick()
    await asyncio.sleep(0.05)
    assert a.state == WorkerState.AWAKE, "a keep_alive 0 of an earlier lease put an operator's wake to sleep"

    never, _ = await env.manager.acquire("a", 60, "t", "", "", None, keep_alive=-1e15)
    env.manager.release(never.lease_id)
    assert env.rec("a").keep_alive == -1, "any negative keep_alive is 'never', inside Duration's range"
    policy, _ = await env.manager.acquire("a", 60, "t", "", "", None)
    env.manager.release(policy.lease_id)
    assert env.rec("a").keep_alive is None and not env.rec("a").to_proto().HasField("keep_alive")
    with pytest.raises(InvalidArgument, match="keep_alive"):
        await env.manager.acquire("a", 60, "t", "", "", None, keep_alive=31 * 86400)
    assert env.rec("a").leases == {}


async def test_a_crashed_worker_is_unavailable_and_calls_fail_fast(env: Env) -> None:
    a = await env.worker("a")
    await a.crash()
    await wait_until(lambda: env.rec("a").state == WorkerState.UNAVAILABLE, "UNAVAILABLE")
    with pytest.raises(Unavailable):
        await env.manager.acquire("a", 60, "t", "", "", None)
    with pytest.raises(Unavailable):
        await env.manager.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", None)
    assert env.rec("a").leases == {}
    await a.revive()
    await env.manager.register("a", a.address, "h1")  # its heartbeat reconnects the link
    await wait_until(lambda: env.rec("a").state == WorkerState.AWAKE, "back")


async def test_with_a_start_timeout_an_acquire_waits_for_an_unavailable_worker_counted_as_waiting(env: Env) -> None:
    """A worker whose process is started on demand (its policy's start_timeout): the acquire waits
    while it is unavailable, among its waiting acquires (what tells memsvc up to start it), and is
    granted once it registers again; one that does not come back in time is refused, naming the
    start_timeout, and leaves nothing behind. The gauge the alert reads says it is started on demand,
    and the timers do not forget it however long it is down."""
    a = await env.worker("a")
    env.manager.update_policy("a", manager_pb.Policy(start_timeout=Duration(seconds=30)), ["start_timeout"])
    await a.crash()
    await wait_until(lambda: env.rec("a").state == WorkerState.UNAVAILABLE, "UNAVAILABLE")
    acquire = asyncio.ensure_future(env.manager.acquire("a", 60, "t", "", "", None))
    await wait_until(lambda: env.rec("a").to_proto().waiting_acquires == 1, "the acquire counted as waiting")
    assert not acquire.done()
    await a.revive()
    await env.manager.register("a", a.address, "h1")
    lease, rec = await asyncio.wait_for(acquire, 10)
    assert rec.state == WorkerState.AWAKE and lease.lease_id in rec.leases
    assert env.rec("a").to_proto().waiting_acquires == 0
    env.manager.release(lease.lease_id)

    env.manager.update_policy("a", manager_pb.Policy(start_timeout=Duration(nanos=200_000_000)), ["start_timeout"])
    timers = env.manager.timers
    timers._settings = dataclasses.replace(timers._settings, forget_after=0.001)
    await a.crash()
    await wait_until(lambda: env.rec("a").state == WorkerState.UNAVAILABLE, "UNAVAILABLE again")
    with pytest.raises(Unavailable, match=r"start_timeout \(0.2 s\)"):
        await env.manager.acquire("a", 60, "t", "", "", None)
    assert env.rec("a").leases == {} and env.rec("a").to_proto().waiting_acquires == 0
    env.rec("a").heard -= 10
    timers.tick()
    assert env.manager.metrics.start_timeout.labels("a")._value.get() == 0.2
    await asyncio.sleep(0)  # a forget the tick had spawned would have run now
    assert env.manager.get("a").worker_id == "a", "a worker started on demand is down on purpose: not forgotten"
    env.manager.update_policy("a", manager_pb.Policy(start_timeout=Duration(seconds=3600)), ["start_timeout"])
    with pytest.raises(Unavailable, match="start_timeout"):  # the caller's deadline, much sooner, ends it
        await asyncio.wait_for(env.manager.acquire("a", 60, "t", "", "", Deadline.after(0.05)), 30)
    assert env.rec("a").leases == {}


async def test_a_silent_worker_is_marked_unavailable_and_its_link_restarted(env: Env) -> None:
    await env.worker("a")
    rec = env.rec("a")
    limit = env.manager.settings.silence_limit
    rec.heard -= limit + 1
    env.manager.timers._resumed -= limit + 1  # as if the manager had been running that long
    env.manager.tick()
    await wait_until(lambda: rec.state == WorkerState.AWAKE, "the restarted link's snapshot")
    assert rec.last_seen > 0


async def test_a_retried_request_id_sleeps_once(env: Env) -> None:
    a = await env.worker("a")
    first, t1 = await env.manager.sleep_worker("a", SleepLevel.LEVEL_1, {}, "req-1", None)
    await env.manager.wake_worker("a", [], "", None)
    again, t2 = await env.manager.sleep_worker("a", SleepLevel.LEVEL_1, {}, "req-1", None)
    assert t1 == t2 and a.calls == ["Sleep", "WakeUp"]
    assert again == first and again.state == WorkerState.ASLEEP.proto, (
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
        lease, _ = await manager.acquire("b", 600, "t", "", "", None)
        for wk in (a, b):
            await wk.crash()
        await wait_until(lambda: env.rec("a").state == WorkerState.UNAVAILABLE, "a unavailable")
        for wid in ("a", "b"):
            env.rec(wid).heard -= 61
        manager.tick()
        await wait_until(lambda: "a" not in manager.workers, "a forgotten")
        assert [sw.worker_id for sw in manager.store.workers()] == ["b"], "a's stored registration went too"
        assert "b" in manager.workers, "a leased worker is never forgotten"
        manager.release(lease.lease_id)
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
        await env.manager.register("c", c_.address, "h1")
    assert sorted(env.manager.workers) == ["a", "b"]
    await env.manager.register("a", env.rec("a").address, "h1")  # a known worker's heartbeat still counts
    await env.manager.deregister("b")
    await env.manager.register("c", c_.address, "h1")
    assert sorted(env.manager.workers) == ["a", "c"]


async def test_calls_queued_behind_a_deregistration_find_the_worker_gone(env: Env) -> None:
    x = await env.worker("x", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    n = await env.worker("n", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    await env.manager.sleep_worker("x", SleepLevel.LEVEL_1, {}, "", None)
    stale = env.rec("x")
    x.gate = asyncio.Event()  # a demotion holds x's lock while the others queue behind it
    demoting = asyncio.create_task(env.manager.sleep_worker("x", SleepLevel.LEVEL_2, {}, "", None))
    await wait_until(lambda: x.calls[-1:] == ["Sleep"] and stale.lock.locked(), "the demotion to hold the lock")
    first = asyncio.create_task(env.manager.deregister("x"))
    second = asyncio.create_task(env.manager.deregister("x"))
    waking = asyncio.create_task(env.manager.wake_worker("x", [], "", None))
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
    await env.manager.register("x", x.address, "h1")  # registered again: a new record, not the old one
    with pytest.raises(NotFound):
        env.manager.registry.link(stale)
    await wait_until(lambda: env.rec("x").reachable, "x reachable again")
    assert env.manager.registry.link(env.rec("x")) is not None


async def test_deregistering_forgets_the_workers_policy_overrides(env: Env) -> None:
    await env.worker("a")
    env.manager.update_policy("a", manager_pb.Policy(idle_sleep_timeout=Duration(seconds=7)), ["idle_sleep_timeout"])
    assert env.manager.policies.effective("workers/a").idle_sleep_timeout == 7
    await env.manager.deregister("a")
    assert env.manager.store.policy_fields("workers/a") is None
    await env.worker("a")
    assert env.manager.policies.effective("workers/a") == env.manager.policies.default


async def test_a_transition_in_progress_the_manager_did_not_start_counts_as_busy(env: Env) -> None:
    a = await env.worker("a", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    await env.worker("b", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    await env.policy(idle_sleep_timeout=Duration(seconds=60))
    await env.manager.sleep_worker("b", SleepLevel.LEVEL_1, {}, "", None)
    await a.hold_transition(True)  # a direct Sleep is queued on a, still AWAKE
    await wait_until(lambda: env.rec("a").in_transition, "the manager to see a's transition")
    env.idle_for("a", 100)
    env.manager.tick()
    await asyncio.sleep(0.05)
    assert a.calls == [], "no idle sleep on a worker with a transition in progress"
    with pytest.raises(OutOfMemory):  # a is not a victim either: nothing else can make room for b
        await env.manager.acquire("b", 60, "t", "", "", None)
    acquiring = asyncio.create_task(env.manager.acquire("a", 60, "t", "", "", None))
    await asyncio.sleep(0.05)
    assert not acquiring.done(), "no lease on a state a queued transition is about to change"
    await a.hold_transition(False)
    lease, rec = await acquiring
    assert rec.state == WorkerState.AWAKE and a.calls == []
    env.manager.release(lease.lease_id)


async def test_the_device_budget_passes_over_a_victim_that_refuses(env: Env) -> None:
    a = await env.worker("a", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    b = await env.worker("b", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    c_ = await env.worker("c", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    await env.manager.sleep_worker("c", SleepLevel.LEVEL_1, {}, "", None)
    env.idle_for("a", 100)  # a is the LRU one, but refuses
    env.idle_for("b", 10)
    a.refuse = WrongState("worker a: not now")
    lease, _ = await env.manager.acquire("c", 60, "t", "", "", None)
    assert a.state == WorkerState.AWAKE and b.state == WorkerState.ASLEEP and c_.state == WorkerState.AWAKE
    env.manager.release(lease.lease_id)
    await env.manager.sleep_worker("c", SleepLevel.LEVEL_1, {}, "", None)
    await env.manager.wake_worker("b", [], "", None)  # b awake again; now both neighbours refuse
    b.refuse = WrongState("worker b: not now")
    with pytest.raises(OutOfMemory):  # every victim refused: the budget's own answer
        await env.manager.acquire("c", 60, "t", "", "", None)
    assert env.rec("c").state == WorkerState.ASLEEP and env.rec("c").leases == {}


async def test_a_wake_naming_an_unknown_tag_or_mapping_nothing_evicts_no_one(env: Env) -> None:
    a = await env.worker("a", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    b = await env.worker("b", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    c_ = await env.worker("c", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    await env.manager.sleep_worker("c", SleepLevel.LEVEL_1, {}, "", None)
    await env.policy(device_budget_bytes=10 * GiB)  # a and b map 14 GiB: any wake would evict one
    env.idle_for("b", 100)
    with pytest.raises(InvalidArgument, match="unknown tag"):
        await env.manager.wake_worker("c", [WEIGHTS, "lora"], "", None)
    with pytest.raises(InvalidArgument, match="named twice"):
        await env.manager.wake_worker("c", [KV_CACHE, KV_CACHE], "", None)
    with pytest.raises(WrongState):  # a is awake: nothing to map, so nothing is evicted for it
        await env.manager.wake_worker("a", [], "", None)
    assert a.calls == ["WakeUp"] and b.calls == [] and c_.calls == ["Sleep"]
    assert a.state == b.state == WorkerState.AWAKE


async def test_a_refused_acquire_leaves_the_idle_clock_where_it_was(env: Env) -> None:
    a = await env.worker("a")
    await env.manager.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", None)
    env.idle_for("a", 100)
    before = env.rec("a").idle_since
    a.refuse = OutOfMemory("worker a: the device is full")
    with pytest.raises(OutOfMemory):
        await env.manager.acquire("a", 60, "t", "", "", None)
    assert env.rec("a").idle_since == before and env.rec("a").leases == {}


async def test_leases_per_worker_are_bounded_and_a_renewal_always_succeeds(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    import memsvc.manager.leases as leases

    monkeypatch.setattr(leases, "MAX_LEASES_PER_WORKER", 2)
    await env.worker("a")
    first, _ = await env.manager.acquire("a", 60, "t", "", "", None)
    await env.manager.acquire("a", 60, "t", "", "", None)
    with pytest.raises(Overloaded):
        await env.manager.acquire("a", 60, "t", "", "", None)
    assert len(env.rec("a").leases) == 2
    renewed, _ = await env.manager.acquire("a", 120, "t", first.lease_id, "", None)
    assert renewed.lease_id == first.lease_id


async def test_calls_waiting_for_one_workers_transitions_are_bounded(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    import memsvc.manager.records as records

    monkeypatch.setattr(records, "MAX_QUEUED_TRANSITIONS", 2)
    a = await env.worker("a")
    a.gate = asyncio.Event()
    first = asyncio.create_task(env.manager.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", None))
    second = asyncio.create_task(env.manager.wake_worker("a", [], "", None))
    await wait_until(lambda: env.rec("a").queued == 2, "two calls queued")
    with pytest.raises(Overloaded):
        await env.manager.sleep_worker("a", SleepLevel.LEVEL_2, {}, "", None)
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
    sleeping = asyncio.create_task(manager.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", None))
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
        await env.manager.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", Deadline.after(0.1))
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


async def test_list_leases_leaves_out_a_lease_still_being_granted(env: Env) -> None:
    """A lease whose wake still runs has no TTL yet (and no holder has it): ListLeases skips it
    instead of failing on it."""
    a = await env.worker("a")
    held, _ = await env.manager.acquire("a", 60, "held", "", "", None)
    b = await env.worker("b")
    await env.manager.sleep_worker("b", SleepLevel.LEVEL_1, {}, "", None)
    b.gate = asyncio.Event()
    waking = asyncio.create_task(env.manager.acquire("b", 60, "pending", "", "", None))
    await wait_until(lambda: b.calls == ["Sleep", "WakeUp"], "b's wake to start")
    listed, token = env.manager.leases.page("", 0, "")
    assert [x.lease_id for x in listed] == [held.lease_id] and token == ""
    assert [x.to_proto().lease_id for x in listed] == [held.lease_id]
    b.gate.set()
    granted, _ = await waking
    assert {x.lease_id for x in env.manager.leases.page("", 0, "")[0]} == {held.lease_id, granted.lease_id}
    assert a.state == WorkerState.AWAKE


async def test_two_wakes_on_one_device_are_checked_one_at_a_time(env: Env) -> None:
    """b's wake (evicting a) is still in flight, so the manager's records show nothing mapped for b yet:
    c's acquire must wait for it rather than find room that b is about to take (both would end awake,
    over a budget that fits one)."""
    a = await env.worker("a", weights_bytes=2 * GiB, kv_bytes=GiB, device_total_bytes=80 * GiB)
    b = await env.worker("b", weights_bytes=2 * GiB, kv_bytes=GiB, device_total_bytes=80 * GiB)
    c_ = await env.worker("c", weights_bytes=2 * GiB, kv_bytes=GiB, device_total_bytes=80 * GiB)
    for name in ("b", "c"):
        await env.manager.sleep_worker(name, SleepLevel.LEVEL_1, {}, "", None)
    await env.policy(device_budget_bytes=4 * GiB)
    env.manager.update_policy("b", manager_pb.Policy(), ["time_slice"])  # pinned: leased, it keeps its turn
    b.gate = asyncio.Event()
    waking_b = asyncio.create_task(env.manager.acquire("b", 60, "t", "", "", None))
    await wait_until(lambda: b.calls[-1:] == ["WakeUp"], "b's wake to start (a evicted)")
    waking_c = asyncio.create_task(env.manager.acquire("c", 60, "t", "", "", None))
    await asyncio.sleep(0.05)
    assert not waking_c.done() and c_.calls == ["Sleep"], "c's wake did not wait for b's"
    b.gate.set()
    lease, _ = await waking_b
    with pytest.raises(OutOfMemory):  # b is leased now: nothing on the device can make room for c
        await waking_c
    assert (a.state, b.state, c_.state) == (WorkerState.ASLEEP, WorkerState.AWAKE, WorkerState.ASLEEP)
    env.manager.release(lease.lease_id)
    import gc

    del waking_b, waking_c  # the finished tasks (and the refusal's traceback) are the test's, not the manager's
    gc.collect()
    assert len(env.manager.transitions._budgets._devices) == 0, "a device's lock outlived its wakes"
