"""Device and host budgets: room is made before it is needed.

- device: before a worker wakes, the least recently used idle worker on the same device is put to
  sleep until the waking one fits, and a neighbour's sleep already running is waited for;
  RESOURCE_EXHAUSTED only when nothing can be freed. With the policy's
  ``device_swap_headroom_bytes``, the wake starts while that sleep is still running when
  both fit in the budget plus the headroom and in the device's free memory: the neighbour's
  device-to-host copy and the wake's host-to-device copy then run at once (PCIe is full duplex), and
  a swap costs about one copy instead of two.
- host: before a sleep offloads, the coldest sleeper on the host is demoted to level 2; a tier-1
  sleep that still does not fit sleeps at level 2 itself.

A victim whose own sleep fails (it went down, or refused) is passed over for the next one: one bad
neighbour does not fail the wake it was making room for.

Where no neighbour is idle, a busy one whose turn is over gives the device up, its requests paused
(memsvc/manager/turns.py); RESOURCE_EXHAUSTED then only when no busy neighbour can (every one pinned,
or in a transition of its own).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import TypeVar

from memsvc.errors import MemsvcError, OutOfMemory, Unavailable
from memsvc.manager.background import Background
from memsvc.manager.calls import WorkerCalls
from memsvc.manager.metrics import ManagerMetrics
from memsvc.manager.policy import Policies
from memsvc.manager.records import WorkerRecord
from memsvc.manager.registry import Registry
from memsvc.manager.reports import Transition
from memsvc.manager.turns import Turns
from memsvc.runtime.deadline import Deadline
from memsvc.vocabulary import AWAKE_STATES, Action, SleepLevel, WorkerState, policy_actions

log = logging.getLogger("memsvc.manager")
T = TypeVar("T")


def _unlock(rec: WorkerRecord, _task: object) -> None:
    rec.lock.release()


class Budgets:
    def __init__(
        self,
        registry: Registry,
        policies: Policies,
        calls: WorkerCalls,
        metrics: ManagerMetrics,
        background: Background,
        turns: Turns,
    ) -> None:
        self._registry = registry
        self._turns = turns
        self._policies = policies
        self._calls = calls
        self._metrics = metrics
        self._background = background
        """Runs the evictions beside a wake (kept, logged if they fail, cancelled at close)."""
        self._devices: weakref.WeakValueDictionary[tuple[str, str, str], asyncio.Lock] = weakref.WeakValueDictionary()
        """One per device: its wakes, with the room each makes, run one at a time. Weak: a lock lives
        while a wake holds or waits for it, so device keys that come and go (a host name is the
        registering client's) leave nothing behind."""

    def _device_group(self, rec: WorkerRecord) -> list[WorkerRecord]:
        return [r for r in self._registry if r is not rec and r.reachable and r.device_key == rec.device_key]

    async def wake_with_room(
        self, rec: WorkerRecord, tags: list[str] | None, deadline: Deadline, wake: Callable[[], Awaitable[T]]
    ) -> T:
        """``wake()`` once ``rec`` waking ``tags`` fits its device budget (see :meth:`make_device_room`).
        A wake that runs beside evictions and finds the device full after all (its free memory was
        reported before someone else took it) waits for them and is tried once more: a failed wake
        leaves the worker asleep with its backups, so the second try starts clean."""
        device = self._devices.get(rec.device_key)
        if device is None:
            device = self._devices[rec.device_key] = asyncio.Lock()
        # One wake at a time per device: the budget counts what the workers there have mapped, and a
        # neighbour's wake still in flight has mapped nothing yet as far as the manager knows, so two
        # wakes checked at once could both fit and together exceed it.
        left = deadline.remaining()
        try:
            await asyncio.wait_for(device.acquire(), timeout=left)
        except TimeoutError:
            raise Unavailable(
                f"worker {rec.worker_id}: another wake on its device did not end before the deadline"
            ) from None
        try:
            evicting = await self.make_device_room(rec, tags, deadline)
            try:
                woke = await wake()
            except OutOfMemory:
                if not evicting:
                    raise
                log.info("waking %s beside its evictions found the device full: waiting for them", rec.worker_id)
                await asyncio.wait(evicting)
                woke = await wake()
            finally:
                if evicting:  # each ends by itself; an eviction that failed leaves the budget exceeded:
                    await asyncio.wait(evicting)  # then idle neighbours go the usual way, now
                    await self._back_within_budget(rec, deadline)
            self._turns.woke(rec)
            return woke
        finally:
            device.release()

    async def _back_within_budget(self, rec: WorkerRecord, deadline: Deadline) -> None:
        """After overlapped evictions: if one of them did not sleep, the awake workers exceed the budget
        beyond the swap; put idle neighbours to sleep until they fit (or say why not, in the log)."""
        try:
            await self.make_device_room(rec, None, deadline, overlap=False, need=0, turns=False)
        except MemsvcError as exc:
            log.warning("device of %s stays over its budget after an eviction failed: %s", rec.worker_id, exc)

    async def make_device_room(
        self,
        rec: WorkerRecord,
        tags: list[str] | None,
        deadline: Deadline,
        overlap: bool = True,
        need: int | None = None,
        turns: bool = True,
    ) -> list[asyncio.Task[None]]:
        """Put LRU idle neighbours to sleep until ``rec`` waking ``tags`` fits its device budget (or,
        with ``need``, until that many more bytes fit: 0, until what is awake fits); with ``turns``,
        where none is idle, busy ones whose turn is over (:meth:`_take_turn`). The sleeps that may
        overlap the wake (``device_swap_headroom_bytes``, with ``overlap``) are left running, and
        returned; the others have ended."""
        group = self._device_group(rec)
        policy = self._policies.effective(rec.name)
        budget = policy.device_budget_bytes or min(
            [r.device_total_bytes for r in [rec, *group] if r.device_total_bytes] or [0]
        )
        evicting: list[asyncio.Task[None]] = []
        if not budget:
            return evicting
        if need is None:
            need = rec.wake_need_bytes(tags)
            if not need:
                return evicting  # nothing to map (the worker will say why the wake does not apply)
        passed_over: set[str] = set()
        going = 0  # bytes of the evictions left running: counted as free for the budget
        while True:
            now = rec.mapped_bytes + sum(r.mapped_bytes for r in group)
            used = now - going
            if used + need <= budget:
                return evicting
            idle = [
                r
                for r in group
                if r.worker_id not in passed_over
                and not r.leases
                and r.state in AWAKE_STATES
                and not r.in_transition
                and r.mapped_bytes > 0
                and not r.lock.locked()
            ]
            freeing = [
                r
                for r in group
                if r.worker_id not in passed_over  # not an eviction of this wake's own: `going` counts those
                and r.sleeping  # sent by this manager: its RPC timeout bounds the wait
                and r.mapped_bytes > 0
            ]
            if not idle and freeing and not deadline.passed():
                # A sleep already running there (an idle timer's, an operator's) frees room: wait for it
                # rather than refuse a wake that will fit once it ends. It needs no device lock, so it
                # ends while this wake holds one.
                await freeing[0].wait_changed(deadline)
                continue
            busy = self._turns.busy(group, passed_over) if turns and not idle and not evicting else []
            if busy:
                victim = await self._turns.next_over(busy, deadline)
                if victim is None:
                    if deadline.passed():
                        raise Unavailable(f"worker {rec.worker_id}: no turn on its device ended before the deadline")
                    continue  # a lease ended: look again
                if not self._turns.busy([victim], passed_over):
                    # It changed while this wake waited: idle now (evicted the usual way), asleep, or
                    # locked (a transition runs on it, or a wake of it waits for this device: taking
                    # its lock now could wait for ever). Look at the device again.
                    continue
                passed_over.add(victim.worker_id)  # one try, whichever way it goes
                await self._take_turn(victim, rec, deadline)
                continue
            if not idle:
                raise OutOfMemory(
                    f"device budget of {budget} bytes: {rec.worker_id} needs {need} more, {used} in use, "
                    "and no idle worker on the device can be put to sleep",
                    metadata={"budgetBytes": str(budget), "neededBytes": str(need), "usedBytes": str(used)},
                )
            victim = min(idle, key=lambda r: r.idle_start)
            passed_over.add(victim.worker_id)  # one try per victim, whichever way it goes
            free = rec.device.free_bytes
            headroom = policy.device_swap_headroom_bytes
            if overlap and headroom and need and now + need <= budget + headroom and free >= need:
                await victim.lock.acquire()  # now, so that no lease or other sleep slips in before the task
                if victim.leases or victim.state not in AWAKE_STATES or victim.in_transition:
                    victim.lock.release()
                    continue
                log.info("making room for %s: putting %s to sleep beside the wake", rec.worker_id, victim.worker_id)
                going += victim.unmap_bytes(self.tier1_actions(victim))  # what its sleep frees (KEEP stays)
                task = self._background.spawn(self._evict_locked(victim, deadline), f"evict {victim.worker_id}")
                task.add_done_callback(functools.partial(_unlock, victim))  # also if cancelled unstarted
                evicting.append(task)
                continue
            log.info("making room for %s: putting %s to sleep", rec.worker_id, victim.worker_id)
            async with victim.lock:
                if victim.leases or victim.state not in AWAKE_STATES:
                    continue
                try:
                    await self.sleep_tier1(victim, deadline, "device budget")
                except MemsvcError as exc:
                    if deadline.passed():  # the caller's deadline, not the victim, is the answer
                        raise
                    log.warning("making room for %s: %s did not sleep: %s", rec.worker_id, victim.worker_id, exc)
                    continue
                self._metrics.evictions.inc()

    async def _take_turn(self, victim: WorkerRecord, rec: WorkerRecord, deadline: Deadline) -> None:
        """``victim``'s turn is over and ``rec`` waits for its device: pause its requests and put it to
        sleep (the policy's tier-1 actions); its leases stay, and it is owed the next turn. A refusal is
        logged and the victim passed over. The caller checked, with no wait since, that its lock is free."""
        async with victim.lock:
            log.info(
                "turns: %s (awake %.1f s, %d leases) pauses and sleeps so %s can wake",
                victim.worker_id,
                time.time() - victim.turn_start if victim.turn_start else float("inf"),
                len(victim.leases),
                rec.worker_id,
            )
            try:
                await self.sleep_tier1(victim, deadline, f"turn (for {rec.worker_id})", pause=True)
            except MemsvcError as exc:
                if deadline.passed():
                    raise
                log.warning("turns: %s did not give up its turn: %s", victim.worker_id, exc)
                return
            self._metrics.turns.labels(victim.worker_id).inc()
            self._turns.yielded(victim)

    async def _evict_locked(self, victim: WorkerRecord, deadline: Deadline) -> None:
        """An eviction beside a wake; the caller took ``victim.lock`` (the task's done-callback releases
        it). A refusal is logged, not raised: the wake it made room for goes on, and
        :meth:`wake_with_room` puts the budget right afterwards."""
        try:
            await self.sleep_tier1(victim, deadline, "device budget (beside a wake)")
            self._metrics.evictions.inc()
        except MemsvcError as exc:
            log.warning("an eviction beside a wake: %s did not sleep: %s", victim.worker_id, exc)

    async def make_host_room(self, rec: WorkerRecord, need: int, deadline: Deadline) -> bool:
        """Demote the coldest sleepers on ``rec``'s host until ``need`` more bytes fit (see
        :meth:`_demote`: to a disk tier, keeping the bytes, where the sleeper has one)."""
        budget = self._policies.effective(rec.name).host_budget_bytes
        if not budget or not need:
            return True
        passed_over: set[str] = set()
        while True:
            used = sum(r.offloaded_bytes for r in self._registry if r.host == rec.host and r.reachable)
            if used + need <= budget:
                return True
            cold = [
                r
                for r in self._registry
                if r is not rec
                and r.worker_id not in passed_over
                and r.host == rec.host
                and r.reachable
                and not r.leases
                and r.state == WorkerState.ASLEEP
                and not r.in_transition
                and r.offloaded_bytes > 0
                and not r.lock.locked()
            ]
            if not cold:
                return False
            victim = min(cold, key=lambda r: r.idle_start)
            async with victim.lock:
                if victim.state == WorkerState.ASLEEP and not victim.leases:
                    try:
                        await self._demote(victim, deadline)
                    except MemsvcError as exc:
                        if deadline.passed():
                            raise
                        log.warning("host budget: %s was not demoted: %s", victim.worker_id, exc)
                        passed_over.add(victim.worker_id)
                        continue
                    self._metrics.demotions.inc()

    async def _demote(self, victim: WorkerRecord, deadline: Deadline) -> None:
        """Free a sleeper's host RAM. The caller holds ``victim.lock``."""
        to_disk = victim.to_disk_actions() if victim.disk_tier else {}
        await self._disk_else_level2(victim, to_disk, "", deadline, "host budget", "host budget")

    async def _disk_else_level2(
        self,
        rec: WorkerRecord,
        to_disk: dict[str, Action],
        request_id: str,
        deadline: Deadline,
        why_disk: str,
        why_level2: str,
        pause: bool = False,
    ) -> Transition:
        """Sleep with ``to_disk`` (tag actions onto the worker's disk tier: the bytes are kept), or
        where there are none or the disk refuses (full, failing: the worker is as it was) at level 2.
        The host budget's way to free host RAM; the caller holds ``rec.lock``."""
        if to_disk:
            log.info("host budget: %s sleeps to its disk tier", rec.worker_id)
            try:
                return await self._calls.sleep(rec, None, to_disk, request_id, deadline, why_disk, pause)
            except MemsvcError as exc:
                if deadline.passed():
                    raise
                log.warning("host budget: %s could not sleep to disk (%s); level 2 instead", rec.worker_id, exc)
        log.info("host budget: %s sleeps at level 2", rec.worker_id)
        return await self._calls.sleep(rec, SleepLevel.LEVEL_2, {}, request_id, deadline, why_level2, pause)

    def tier1_actions(self, rec: WorkerRecord) -> dict[str, Action]:
        """The policy's tier-1 actions for every tag ``rec`` has (vocabulary.policy_actions); before
        its first status, the policy's own."""
        named = self._policies.effective(rec.name).tag_actions
        tags = rec.tag_names()
        return policy_actions(sorted(tags), named) if tags else dict(named)

    async def sleep_tier1(
        self, rec: WorkerRecord, deadline: Deadline, why: str, request_id: str = "", pause: bool = False
    ) -> Transition:
        """Sleep with the policy's tag actions; when host RAM is short, offload to the worker's disk
        tier instead, or without one fall back to level 2. ``pause``: its running requests pause
        instead of being waited for. The caller holds ``rec.lock``."""
        actions = self.tier1_actions(rec)
        if await self.make_host_room(rec, rec.offload_need_bytes(actions), deadline):
            return await self._calls.sleep(rec, None, actions, request_id, deadline, why, pause)
        log.info("host budget: no host room for %s's offload", rec.worker_id)
        to_disk: dict[str, Action] = {}
        if rec.disk_tier:
            to_disk = {t: Action.OFFLOAD_DISK if a == Action.OFFLOAD else a for t, a in actions.items()}
        return await self._disk_else_level2(
            rec,
            to_disk,
            request_id,
            deadline,
            why + " (disk: host budget)",
            why + " (level 2: host budget)",
            pause,
        )


__all__ = ["Budgets"]
