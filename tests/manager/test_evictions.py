"""Who sleeps so that a wake fits, decided in process against in-memory workers (tests/manager/inmemory_env.py):
LRU eviction by the device budget, turns between busy workers, a wake overlapped with its eviction
(swap headroom), tier-2 demotion, the host budget's fallback to level 2 or the disk tier. Through real
worker processes: tests/manager/test_manager_budgets.py and test_turns.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from asyncwait import wait_until
from inmemory_env import (
    Env,
    GiB,
    inmemory_env,  # noqa: F401 - the env fixture
)

from memsvc.errors import InvalidArgument, MemsvcError, OutOfMemory, WrongState
from memsvc.manager.inmemory import InMemoryWorker
from memsvc.runtime.deadline import NO_DEADLINE, Deadline
from memsvc.vocabulary import KV_CACHE, WEIGHTS, Action, SleepLevel, TagState, WorkerState

pytestmark = pytest.mark.asyncio


async def test_device_budget_evicts_the_least_recently_used_idle_worker(env: Env) -> None:
    a = await env.worker("a", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    b = await env.worker("b", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    c_ = await env.worker("c", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    await env.manager.transitions.sleep_worker("c", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    env.idle_for("a", 100)  # a has been idle longer than b
    env.idle_for("b", 10)
    lease, _ = await env.manager.leases.acquire("c", 60, "t", "", "", NO_DEADLINE)
    assert c_.state == WorkerState.AWAKE
    assert a.state == WorkerState.ASLEEP and b.state == WorkerState.AWAKE  # the LRU one went, only it
    assert a.calls == ["Sleep"] and b.calls == []
    assert env.manager.metrics.evictions._value.get() == 1
    env.manager.leases.release(lease.lease_id)


async def test_device_budget_refuses_when_every_neighbour_is_leased_and_pinned_and_keeps_the_sleeper_asleep(
    env: Env,
) -> None:
    """A leased neighbour whose time_slice is 0 never gives up its turn: the wake is refused."""
    await env.worker("a", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    b = await env.worker("b", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    env.manager.update_policy("a", {"time_slice": 0.0})
    await env.manager.transitions.sleep_worker("b", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    held, _ = await env.manager.leases.acquire("a", 60, "holder", "", "", NO_DEADLINE)
    with pytest.raises(OutOfMemory):
        await env.manager.leases.acquire("b", 60, "t", "", "", NO_DEADLINE)
    assert b.state == WorkerState.ASLEEP and b.tags[WEIGHTS].state == TagState.OFFLOADED
    assert env.rec("b").leases == {}, "a refused acquire leaves no lease behind"
    env.manager.leases.release(held.lease_id)
    lease, _ = await env.manager.leases.acquire("b", 60, "t", "", "", NO_DEADLINE)  # now a can be evicted
    # mypy keeps b.state narrowed to ASLEEP by the assert above, across the await that wakes b
    assert b.state == WorkerState.AWAKE  # type: ignore[comparison-overlap]
    env.manager.leases.release(lease.lease_id)


async def test_busy_workers_on_a_full_device_take_turns_and_keep_their_leases(env: Env) -> None:
    """a is leased (busy) and awake since before b was wanted: a lease on b pauses a at once (a Sleep
    that pauses its generations; a keeps its lease, asleep) and wakes b. a is then owed a turn: once
    b's slice is over, the manager itself wakes a again, pausing b (whose lease stays too). Each
    gave up one turn, and nothing was refused."""
    a = await env.worker("a", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    b = await env.worker("b", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    await env.policy(time_slice=0.2)
    await env.manager.transitions.sleep_worker("b", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    held_a, _ = await env.manager.leases.acquire("a", 60, "holder", "", "", NO_DEADLINE)
    held_b, _ = await env.manager.leases.acquire("b", 60, "t", "", "", NO_DEADLINE)
    assert (env.rec("a").state, env.rec("b").state) == (WorkerState.ASLEEP, WorkerState.AWAKE)
    assert a.pausing_sleeps == 1 and env.rec("a").leases.keys() == {held_a.lease_id}
    await wait_until(lambda: a.state == WorkerState.AWAKE, "a woken again for its lease, on its next turn")
    assert b.pausing_sleeps == 1 and b.state == WorkerState.ASLEEP
    assert env.rec("b").leases.keys() == {held_b.lease_id}
    assert (env.rec("a").turns_yielded, env.rec("b").turns_yielded) == (1, 1)
    env.manager.leases.release(held_a.lease_id)
    await wait_until(lambda: b.state == WorkerState.AWAKE, "b woken for its lease once a went idle")
    assert a.state == WorkerState.ASLEEP and a.pausing_sleeps == 1, "an idle neighbour is evicted, not paused"
    env.manager.leases.release(held_b.lease_id)


async def test_a_wake_waiting_for_a_turn_does_not_deadlock_with_an_operators_wake_of_the_busy_worker(
    env: Env,
) -> None:
    """b's lease waits for a's turn (a leased, just woken) while holding the device's wake lock; an
    operator's WakeWorker of a takes a's lock and waits for that device lock. When a's turn ends, b's
    wake must not wait for a's lock (it would for ever): it looks again instead, and both calls end."""
    await env.worker("a", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    await env.worker("b", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    await env.policy(time_slice=0.2)
    await env.manager.transitions.sleep_worker("b", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    held, _ = await env.manager.leases.acquire("a", 60, "holder", "", "", NO_DEADLINE)
    env.rec("a").turn_start = time.time()  # a's turn has just begun
    waking_b = asyncio.create_task(env.manager.leases.acquire("b", 60, "t", "", "", NO_DEADLINE))
    await wait_until(lambda: len(env.rec("b").waiting) == 1, "b's lease to wait for a's turn")
    operator = asyncio.create_task(env.manager.transitions.wake_worker("a", [], "", NO_DEADLINE))
    done, _ = await asyncio.wait({waking_b, operator}, timeout=30)
    assert done == {waking_b, operator}, "a wake waiting for a turn and an operator's wake deadlocked"
    with contextlib.suppress(MemsvcError):  # refused (a is awake) or answered: either way it ended
        operator.result()
    if waking_b.exception() is None:
        lease, _ = waking_b.result()
        env.manager.leases.release(lease.lease_id)
    else:  # a's lock was taken when its turn ended: b's wake was refused, not stuck
        assert isinstance(waking_b.exception(), OutOfMemory), waking_b.exception()
    env.manager.leases.release(held.lease_id)


async def test_a_wake_short_of_room_waits_for_a_neighbours_sleep_already_running(env: Env) -> None:
    """The only neighbour that could make room is already going to sleep (its idle timer's sleep holds
    it): the wake waits for that sleep and runs, instead of RESOURCE_EXHAUSTED for a room being made."""
    a = await env.worker("a", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    b = await env.worker("b", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=10 * GiB)
    await env.manager.transitions.sleep_worker("b", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    await env.policy(idle_sleep_timeout=60.0)
    a.gate = asyncio.Event()
    env.idle_for("a", 120)
    env.manager.timers.tick()
    await wait_until(lambda: a.calls == ["Sleep"], "a's idle sleep to reach the worker")
    acquiring = asyncio.create_task(env.manager.leases.acquire("b", 60, "t", "", "", Deadline.after(10.0)))
    await asyncio.sleep(0.1)
    assert not acquiring.done(), "the acquire did not wait for the sleep that makes its room"
    a.gate.set()
    lease, _ = await acquiring
    assert a.state == WorkerState.ASLEEP and b.state == WorkerState.AWAKE
    assert a.calls == ["Sleep"] and b.calls == ["Sleep", "WakeUp"]
    env.manager.leases.release(lease.lease_id)


async def _swap_pair(env: Env, headroom: int, device_total: int = 80 * GiB) -> tuple[InMemoryWorker, InMemoryWorker]:
    """a asleep, b awake, a 4 GiB budget that fits one of them (2+1 GiB each), ``headroom`` over it;
    b's next sleep held at its gate."""
    a = await env.worker("a", weights_bytes=2 * GiB, kv_bytes=GiB, device_total_bytes=device_total)
    b = await env.worker("b", weights_bytes=2 * GiB, kv_bytes=GiB, device_total_bytes=device_total)
    await env.manager.transitions.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    await env.policy(device_budget_bytes=4 * GiB, device_swap_headroom_bytes=headroom)
    b.gate = asyncio.Event()
    return a, b


async def test_with_swap_headroom_the_wake_runs_while_its_eviction_is_still_sleeping(env: Env) -> None:
    a, b = await _swap_pair(env, headroom=3 * GiB)
    acquiring = asyncio.create_task(env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE))
    await wait_until(lambda: a.state == WorkerState.AWAKE, "a's wake, beside b's sleep")
    assert a.calls == ["Sleep", "WakeUp"]
    assert b.calls == ["Sleep"] and b.state == WorkerState.AWAKE, "b's sleep is still held, yet a is awake"
    assert env.rec("b").lock.locked(), "the eviction holds b: no lease or timer acts on it meanwhile"
    assert b.gate is not None
    b.gate.set()  # the lease comes once the eviction it overlapped has ended (the budget holds again)
    lease, _ = await asyncio.wait_for(acquiring, timeout=5)
    assert env.rec("b").state == WorkerState.ASLEEP and not env.rec("b").lock.locked()
    assert env.manager.metrics.evictions._value.get() == 1
    env.manager.leases.release(lease.lease_id)


async def test_an_overlapped_eviction_that_fails_is_followed_by_one_that_restores_the_budget(env: Env) -> None:
    """b refuses its overlapped sleep: a still wakes, then the manager evicts the next idle neighbour
    (c) so that the awake workers fit the budget again, instead of staying over it."""
    a, b = await _swap_pair(env, headroom=3 * GiB)
    b.gate = None
    c_ = await env.worker("c", weights_bytes=GiB // 2, kv_bytes=GiB // 2, device_total_bytes=80 * GiB)
    env.idle_for("b", 100)  # b is the least recently used: the overlapped victim
    b.refuse = WrongState("b will not sleep now")
    await env.policy(device_budget_bytes=5 * GiB, device_swap_headroom_bytes=3 * GiB)
    lease, _ = await asyncio.wait_for(env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE), timeout=5)
    assert a.state == WorkerState.AWAKE and b.state == WorkerState.AWAKE and set(b.calls) == {"Sleep"}
    assert c_.state == WorkerState.ASLEEP, "the budget is restored by the next idle neighbour"
    assert sum(env.rec(x).mapped_bytes for x in "abc") <= 5 * GiB + 2 * GiB  # b's 3 GiB + a's 3 GiB, c's gone
    env.manager.leases.release(lease.lease_id)


async def test_the_overlap_counts_only_what_the_eviction_frees(env: Env) -> None:
    """With kv_cache KEPT by the tier-1 actions, b's sleep frees 2 of its 3 GiB: b's 1 GiB and a's
    3 GiB do not fit a 3.5 GiB budget, so the wake is refused, as when evicting first; counting all
    of b's bytes as freed would have woken a over the budget."""
    a, b = await _swap_pair(env, headroom=4 * GiB)
    b.gate = None
    keep_kv = {"tag_actions": {WEIGHTS: Action.OFFLOAD, KV_CACHE: Action.KEEP}, "device_budget_bytes": int(3.5 * GiB)}
    env.manager.update_policy("", keep_kv)
    with pytest.raises(OutOfMemory):
        await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE)
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
    acquiring = asyncio.create_task(env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE))
    await wait_until(lambda: b.calls == ["Sleep"], "the eviction to start")
    await asyncio.sleep(0.05)
    assert not acquiring.done() and a.calls == ["Sleep"], f"{why}: the wake must wait for the eviction"
    assert b.gate is not None
    b.gate.set()
    lease, _ = await asyncio.wait_for(acquiring, timeout=5)
    assert a.state == WorkerState.AWAKE and b.state == WorkerState.ASLEEP
    env.manager.leases.release(lease.lease_id)


async def test_an_overlapped_wake_that_finds_the_device_full_waits_for_its_eviction_and_tries_again(env: Env) -> None:
    a, b = await _swap_pair(env, headroom=3 * GiB)
    a.refuse = OutOfMemory("cuMemCreate failed: out of memory")  # the device was fuller than reported
    acquiring = asyncio.create_task(env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE))
    await wait_until(lambda: a.calls == ["Sleep", "WakeUp"], "the overlapped wake to be refused")
    await asyncio.sleep(0.05)
    assert not acquiring.done(), "it waits for the eviction instead of failing"
    a.refuse = None
    assert b.gate is not None
    b.gate.set()
    lease, _ = await asyncio.wait_for(acquiring, timeout=5)
    assert a.calls == ["Sleep", "WakeUp", "WakeUp"] and a.state == WorkerState.AWAKE
    assert b.state == WorkerState.ASLEEP
    env.manager.leases.release(lease.lease_id)


async def test_device_budget_policy_is_smaller_than_the_device(env: Env) -> None:
    a = await env.worker("a", weights_bytes=2 * GiB, kv_bytes=GiB, device_total_bytes=80 * GiB)
    b = await env.worker("b", weights_bytes=2 * GiB, kv_bytes=GiB, device_total_bytes=80 * GiB)
    await env.manager.transitions.sleep_worker("b", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    await env.policy(device_budget_bytes=4 * GiB)
    await env.manager.transitions.wake_worker("b", [], "", NO_DEADLINE)
    assert a.state == WorkerState.ASLEEP and b.state == WorkerState.AWAKE


async def test_tier_two_demotes_an_idle_sleeper_to_level_two(env: Env) -> None:
    a = await env.worker("a")
    await env.policy(idle_sleep_timeout=60.0, idle_deep_sleep_timeout=600.0)
    env.idle_for("a", 61)
    env.manager.timers.tick()
    await wait_until(lambda: a.state == WorkerState.ASLEEP, "tier 1")
    assert a.sleep_level == 0 and a.tags[WEIGHTS].state == TagState.OFFLOADED
    env.idle_for("a", 600)
    env.manager.timers.tick()
    idle_sleeps = env.manager.metrics.idle_sleeps.labels("2")._value
    # the worker's state changes inside its Sleep; the manager counts the sleep once the call returns
    await wait_until(lambda: a.tags[WEIGHTS].state == TagState.DISCARDED and idle_sleeps.get() == 1, "tier 2")
    assert a.sleep_level == SleepLevel.LEVEL_2 and a.calls == ["Sleep", "Sleep"]


async def test_host_budget_demotes_the_coldest_sleeper_before_another_offloads(env: Env) -> None:
    a = await env.worker("a", weights_bytes=3 * GiB)
    b = await env.worker("b", weights_bytes=3 * GiB)
    cold = await env.worker("cold", weights_bytes=3 * GiB)
    await env.policy(host_budget_bytes=7 * GiB)
    await env.manager.transitions.sleep_worker("cold", None, {}, "", NO_DEADLINE)
    await env.manager.transitions.sleep_worker("a", None, {}, "", NO_DEADLINE)
    env.idle_for("cold", 1000)
    await env.manager.transitions.sleep_worker(
        "b", None, {}, "", NO_DEADLINE
    )  # 9 GiB would not fit: the coldest goes to level 2
    assert cold.tags[WEIGHTS].state == TagState.DISCARDED
    assert a.tags[WEIGHTS].state == TagState.OFFLOADED and b.tags[WEIGHTS].state == TagState.OFFLOADED
    assert env.manager.metrics.demotions._value.get() == 1


async def test_host_budget_with_no_one_to_demote_puts_a_tier_one_sleep_at_level_two(env: Env) -> None:
    a = await env.worker("a", weights_bytes=3 * GiB)
    await env.policy(host_budget_bytes=2 * GiB)
    await env.manager.transitions.sleep_worker("a", None, {}, "", NO_DEADLINE)
    assert a.tags[WEIGHTS].state == TagState.DISCARDED and a.sleep_level == SleepLevel.LEVEL_2
    b = await env.worker("b", weights_bytes=3 * GiB)
    with pytest.raises(OutOfMemory):  # an explicit offload is refused instead, nothing changed
        await env.manager.transitions.sleep_worker("b", None, {WEIGHTS: Action.OFFLOAD}, "", NO_DEADLINE)
    assert b.state == WorkerState.AWAKE and b.calls == []


async def test_host_budget_moves_a_sleeper_with_a_disk_tier_to_disk_and_keeps_its_bytes(env: Env) -> None:
    cold = await env.worker("cold", weights_bytes=3 * GiB, offload_dir="/srv/offload")
    plain = await env.worker("plain", weights_bytes=3 * GiB)
    b = await env.worker("b", weights_bytes=3 * GiB)
    await env.policy(host_budget_bytes=7 * GiB)
    await env.manager.transitions.sleep_worker("cold", None, {}, "", NO_DEADLINE)
    await env.manager.transitions.sleep_worker("plain", None, {}, "", NO_DEADLINE)
    env.idle_for("cold", 1000)
    await env.manager.transitions.sleep_worker(
        "b", None, {}, "", NO_DEADLINE
    )  # 9 GiB would not fit: the coldest moves to disk
    assert cold.tags[WEIGHTS].state == TagState.ON_DISK and cold.tags[KV_CACHE].state == TagState.DISCARDED
    assert cold.sleep_level != SleepLevel.LEVEL_2 and cold.calls == ["Sleep", "Sleep"]
    assert env.rec("cold").offloaded_bytes == 0  # the host budget counts host RAM, not the disk tier
    assert plain.tags[WEIGHTS].state == TagState.OFFLOADED and b.tags[WEIGHTS].state == TagState.OFFLOADED
    assert env.manager.metrics.demotions._value.get() == 1
    await env.manager.transitions.wake_worker("cold", [], "", NO_DEADLINE)
    assert cold.state == WorkerState.AWAKE


async def test_a_tier_one_sleep_with_no_host_room_goes_to_the_disk_tier_instead_of_level_two(env: Env) -> None:
    a = await env.worker("a", weights_bytes=3 * GiB, offload_dir="/srv/offload")
    await env.policy(host_budget_bytes=2 * GiB)
    await env.manager.transitions.sleep_worker("a", None, {}, "", NO_DEADLINE)
    assert a.tags[WEIGHTS].state == TagState.ON_DISK and a.tags[KV_CACHE].state == TagState.DISCARDED
    plain = await env.worker("plain", weights_bytes=3 * GiB)
    with pytest.raises(WrongState, match="no disk tier"):  # asked for by name, without a disk tier
        await env.manager.transitions.sleep_worker("plain", None, {WEIGHTS: Action.OFFLOAD_DISK}, "", NO_DEADLINE)
    assert plain.state == WorkerState.AWAKE


async def test_a_full_disk_falls_back_to_level_two_for_the_demotion_and_for_a_tier_one_sleep(env: Env) -> None:
    cold = await env.worker("cold", weights_bytes=3 * GiB, offload_dir="/srv/offload")
    b = await env.worker("b", weights_bytes=3 * GiB, offload_dir="/srv/offload")
    await env.policy(host_budget_bytes=5 * GiB)
    await env.manager.transitions.sleep_worker("cold", None, {}, "", NO_DEADLINE)
    cold.disk_full = b.disk_full = True
    await env.manager.transitions.sleep_worker(
        "b", None, {}, "", NO_DEADLINE
    )  # no room: cold's move to disk fails, level 2
    assert cold.tags[WEIGHTS].state == TagState.DISCARDED and cold.sleep_level == SleepLevel.LEVEL_2
    assert cold.calls == ["Sleep", "Sleep", "Sleep"]  # tier 1, the refused move to disk, level 2
    assert b.tags[WEIGHTS].state == TagState.OFFLOADED
    assert env.manager.metrics.demotions._value.get() == 1
    await env.policy(host_budget_bytes=2 * GiB)  # b demoted (level 2 again) and still no room for d's 3 GiB
    d = await env.worker("d", weights_bytes=3 * GiB, offload_dir="/srv/offload")
    d.disk_full = True
    await env.manager.transitions.sleep_worker("d", None, {}, "", NO_DEADLINE)  # to its disk: refused; level 2
    assert b.tags[WEIGHTS].state == TagState.DISCARDED and env.manager.metrics.demotions._value.get() == 2
    assert d.tags[WEIGHTS].state == TagState.DISCARDED and d.sleep_level == SleepLevel.LEVEL_2
    assert d.calls == ["Sleep", "Sleep"]


async def test_the_device_budget_passes_over_a_victim_that_refuses(env: Env) -> None:
    a = await env.worker("a", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    b = await env.worker("b", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    c_ = await env.worker("c", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    await env.manager.transitions.sleep_worker("c", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    env.idle_for("a", 100)  # a is the LRU one, but refuses
    env.idle_for("b", 10)
    a.refuse = WrongState("worker a: not now")
    lease, _ = await env.manager.leases.acquire("c", 60, "t", "", "", NO_DEADLINE)
    assert a.state == WorkerState.AWAKE and b.state == WorkerState.ASLEEP and c_.state == WorkerState.AWAKE
    env.manager.leases.release(lease.lease_id)
    await env.manager.transitions.sleep_worker("c", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    await env.manager.transitions.wake_worker("b", [], "", NO_DEADLINE)  # b awake again; now both neighbours refuse
    b.refuse = WrongState("worker b: not now")
    with pytest.raises(OutOfMemory):  # every victim refused: the budget's own answer
        await env.manager.leases.acquire("c", 60, "t", "", "", NO_DEADLINE)
    assert env.rec("c").state == WorkerState.ASLEEP and env.rec("c").leases == {}


async def test_a_wake_naming_an_unknown_tag_or_mapping_nothing_evicts_no_one(env: Env) -> None:
    a = await env.worker("a", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    b = await env.worker("b", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    c_ = await env.worker("c", weights_bytes=6 * GiB, kv_bytes=GiB, device_total_bytes=16 * GiB)
    await env.manager.transitions.sleep_worker("c", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    await env.policy(device_budget_bytes=10 * GiB)  # a and b map 14 GiB: any wake would evict one
    env.idle_for("b", 100)
    with pytest.raises(InvalidArgument, match="unknown tag"):
        await env.manager.transitions.wake_worker("c", [WEIGHTS, "lora"], "", NO_DEADLINE)
    with pytest.raises(InvalidArgument, match="named twice"):
        await env.manager.transitions.wake_worker("c", [KV_CACHE, KV_CACHE], "", NO_DEADLINE)
    with pytest.raises(WrongState):  # a is awake: nothing to map, so nothing is evicted for it
        await env.manager.transitions.wake_worker("a", [], "", NO_DEADLINE)
    assert a.calls == ["WakeUp"] and b.calls == [] and c_.calls == ["Sleep"]
    assert a.state == b.state == WorkerState.AWAKE


async def test_two_wakes_on_one_device_are_checked_one_at_a_time(env: Env) -> None:
    """b's wake (evicting a) is still in flight, so the manager's records show nothing mapped for b yet:
    c's acquire must wait for it rather than find room that b is about to take (both would end awake,
    over a budget that fits one)."""
    a = await env.worker("a", weights_bytes=2 * GiB, kv_bytes=GiB, device_total_bytes=80 * GiB)
    b = await env.worker("b", weights_bytes=2 * GiB, kv_bytes=GiB, device_total_bytes=80 * GiB)
    c_ = await env.worker("c", weights_bytes=2 * GiB, kv_bytes=GiB, device_total_bytes=80 * GiB)
    for name in ("b", "c"):
        await env.manager.transitions.sleep_worker(name, SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    await env.policy(device_budget_bytes=4 * GiB)
    env.manager.update_policy("b", {"time_slice": 0.0})  # pinned: leased, it keeps its turn
    b.gate = asyncio.Event()
    waking_b = asyncio.create_task(env.manager.leases.acquire("b", 60, "t", "", "", NO_DEADLINE))
    await wait_until(lambda: b.calls[-1:] == ["WakeUp"], "b's wake to start (a evicted)")
    waking_c = asyncio.create_task(env.manager.leases.acquire("c", 60, "t", "", "", NO_DEADLINE))
    await asyncio.sleep(0.05)
    assert not waking_c.done() and c_.calls == ["Sleep"], "c's wake did not wait for b's"
    b.gate.set()
    lease, _ = await waking_b
    with pytest.raises(OutOfMemory):  # b is leased now: nothing on the device can make room for c
        await waking_c
    assert (a.state, b.state, c_.state) == (WorkerState.ASLEEP, WorkerState.AWAKE, WorkerState.ASLEEP)
    env.manager.leases.release(lease.lease_id)
    import gc

    del waking_b, waking_c  # the finished tasks (and the refusal's traceback) are the test's, not the manager's
    gc.collect()
    assert len(env.manager.transitions._budgets._devices) == 0, "a device's lock outlived its wakes"
