"""Leases: AcquireWorker wakes on demand and waits until the worker is ready; a leased worker is not
put to sleep (except for another worker's turn on its device: memsvc/manager/turns.py, which pauses
its requests and wakes it again); its idle clock starts at the last release (a drain, not a refusal).
An acquire for an unavailable worker is refused at once, or waits for it for its policy's
``start_timeout`` (a process started on demand: memsvc up's ``[workers] stop_after``).

A lease is recorded on the worker *before* the wake starts, so no timer or budget eviction can put
it to sleep between the wake and the grant; its TTL starts at the grant.

Every change to a granted lease is written to the store before it is made in memory: a write that
fails (memsvc/manager/store.py) changes nothing, so the lease the client holds is still the one
the manager holds, and a release or an expiry can be tried again.
"""

from __future__ import annotations

import logging
import math
import time
import uuid

from memsvc.errors import InvalidArgument, MemsvcError, NotFound, Overloaded, Unavailable
from memsvc.manager.budgets import Budgets
from memsvc.manager.calls import WorkerCalls
from memsvc.manager.metrics import ManagerMetrics
from memsvc.manager.paging import page_of
from memsvc.manager.policy import Policies
from memsvc.manager.records import Lease, WorkerRecord
from memsvc.manager.registry import Registry
from memsvc.manager.settings import ManagerSettings
from memsvc.manager.store import Store, StoredLease
from memsvc.manager.telemetry import TelemetryIngest
from memsvc.manager.turns import Turns
from memsvc.runtime.deadline import Deadline
from memsvc.runtime.limits import MAX_HOLDER_BYTES, MAX_KEEP_ALIVE_S, MAX_LEASES, MAX_LEASES_PER_WORKER, check_length
from memsvc.runtime.replay import ReplayCache
from memsvc.vocabulary import WorkerState

log = logging.getLogger("memsvc.manager")


def _sooner(a: Deadline, b: Deadline) -> Deadline:
    """The earlier of two deadlines (one without a time is no bound)."""
    ats = [x for x in (a.at(), b.at()) if x is not None]
    return Deadline(min(ats) if ats else None)


class Leases:
    def __init__(
        self,
        registry: Registry,
        store: Store,
        settings: ManagerSettings,
        calls: WorkerCalls,
        budgets: Budgets,
        ingest: TelemetryIngest,
        metrics: ManagerMetrics,
        replay: ReplayCache,
        turns: Turns,
        policies: Policies,
    ) -> None:
        self._registry = registry
        self._policies = policies
        self._turns = turns
        turns.wake_owed = self._ensure_awake
        self._store = store
        self._settings = settings
        self._calls = calls
        self._budgets = budgets
        self._ingest = ingest
        self._metrics = metrics
        self._replay = replay
        self.leases: dict[str, Lease] = {}
        self._expiry_refused = ""
        """The store's last refusal of an expiry, logged once until an expiry is written again."""

    def restore(self) -> None:
        """Take back the stored leases of known workers that have not expired; drop the rest. A
        lease's AcquireWorker request_id is remembered, so that the client's retry of a grant whose
        answer it lost (the manager restarted, or a replica took over) gets the same lease."""
        now = time.time()
        for sl in self._store.leases():
            rec = self._registry.workers.get(sl.worker_id)
            if rec is None or sl.expire_time <= now:
                self._store.delete_lease(sl.lease_id)
                continue
            lease = Lease(sl.lease_id, sl.worker_id, sl.expire_time, sl.holder, sl.keep_alive, sl.request_id)
            self.leases[lease.lease_id] = lease
            rec.leases[lease.lease_id] = lease
            self._replay.remember(sl.request_id, "AcquireWorker", lease.lease_id, rec.worker_id)

    def _ttl(self, seconds: float) -> float:
        if seconds < 0:
            raise InvalidArgument("ttl must not be negative")
        if seconds > self._settings.max_lease_ttl:
            raise InvalidArgument(f"ttl must be at most {self._settings.max_lease_ttl:.0f} s")
        return seconds or self._settings.default_lease_ttl

    def _save(self, lease: Lease, expire_time: float, keep_alive: float | None) -> None:
        """Store ``lease`` as expiring at ``expire_time``; the caller sets that in memory once this returns."""
        sl = StoredLease(lease.lease_id, lease.worker_id, expire_time, lease.holder, lease.request_id, keep_alive)
        self._store.save_lease(sl)

    async def acquire(
        self,
        name: str,
        ttl: float,
        holder: str,
        lease_id: str,
        request_id: str,
        deadline: Deadline,
        keep_alive: float | None = None,
    ) -> tuple[Lease, WorkerRecord]:
        ttl = self._ttl(ttl)
        check_length(holder, MAX_HOLDER_BYTES, "holder")
        if keep_alive is not None and keep_alive > MAX_KEEP_ALIVE_S:
            raise InvalidArgument(
                f"keep_alive must be at most {MAX_KEEP_ALIVE_S:.0f} s (negative: no idle sleep)",
                metadata={"field": "keep_alive", "max": f"{MAX_KEEP_ALIVE_S:.0f}s"},
            )
        if keep_alive is not None and keep_alive < 0:
            keep_alive = -1.0  # "never": one value, inside every Duration's range
        rec = self._registry.get(name)
        if lease_id:  # renewal
            lease = self.leases.get(lease_id)
            if lease is None or lease.worker_id != rec.worker_id:
                raise NotFound(f"no lease {lease_id!r} on {rec.name}", metadata={"leaseId": lease_id})
            expire_time = time.time() + ttl
            keep = lease.keep_alive if keep_alive is None else keep_alive
            self._save(lease, expire_time, keep)
            lease.expire_time, lease.keep_alive = expire_time, keep
            return lease, rec

        async def grant(shared: Deadline) -> str:
            return await self._grant(rec, ttl, holder, shared, keep_alive, request_id)

        lease_id = await self._replay.run(request_id, "AcquireWorker", grant, rec.worker_id, deadline)
        if lease_id not in self.leases:  # released or expired since: this retry asks for a new one
            self._replay.forget(request_id, rec.worker_id)
            lease_id = await self._replay.run(request_id, "AcquireWorker", grant, rec.worker_id, deadline)
        return self.leases[lease_id], rec

    async def _grant(
        self, rec: WorkerRecord, ttl: float, holder: str, deadline: Deadline, keep_alive: float | None, request_id: str
    ) -> str:
        self._registry.registered(rec)  # an unavailable one is waited for or refused by _wait_awake
        if len(rec.leases) >= MAX_LEASES_PER_WORKER or len(self.leases) >= MAX_LEASES:
            on_worker = len(rec.leases) >= MAX_LEASES_PER_WORKER
            raise Overloaded(
                f"{rec.worker_id} holds {len(rec.leases)} leases, the most one worker takes; release some"
                if on_worker
                else f"the manager holds {len(self.leases)} leases, its most; release some",
                metadata={"maxLeases": str(MAX_LEASES_PER_WORKER if on_worker else MAX_LEASES)},
            )
        lease = Lease(
            uuid.uuid4().hex, rec.worker_id, float("inf"), holder, keep_alive, request_id
        )  # TTL from the grant
        rec.leases[lease.lease_id] = lease  # from here on no timer or budget puts it to sleep
        self.leases[lease.lease_id] = lease
        try:
            await self._ensure_awake(rec, deadline)
            expire_time = time.time() + ttl
            self._save(lease, expire_time, keep_alive)  # a lease the store cannot keep is not granted
        except BaseException:
            rec.leases.pop(lease.lease_id, None)
            self.leases.pop(lease.lease_id, None)
            self._ingest.update_metrics(rec)  # a refused acquire is not traffic: the idle clock runs on
            raise
        lease.expire_time = expire_time
        self._metrics.leases_granted.inc()
        self._ingest.update_metrics(rec)
        return lease.lease_id

    async def _ensure_awake(self, rec: WorkerRecord, deadline: Deadline) -> None:
        """Return once ``rec`` is awake, waking it (with room on its device) where it sleeps; while it
        is not awake the wait counts among its ``waiting`` acquires."""
        if rec.state == WorkerState.AWAKE and not rec.in_transition and not rec.lock.locked():
            return
        started = time.time()
        rec.waiting.append(started)
        self._ingest.update_metrics(rec)
        try:
            await self._wait_awake(rec, deadline)
        finally:
            rec.waiting.remove(started)
            self._ingest.update_metrics(rec)

    async def _wait_awake(self, rec: WorkerRecord, deadline: Deadline) -> None:
        reachable_by: Deadline | None = None
        """While it is unavailable: when this acquire stops waiting for it (its start_timeout)."""
        while True:
            state = rec.state
            if state == WorkerState.UNAVAILABLE:
                limit = self._policies.effective(rec.name).start_timeout
                reachable_by = reachable_by or Deadline.after(limit)
                if reachable_by.passed() or deadline.passed():
                    waited = f": not reachable within its start_timeout ({limit:g} s) or the deadline" if limit else ""
                    raise Unavailable(f"worker {rec.worker_id} is unavailable{waited}", metadata={"name": rec.name})
                await rec.wait_changed(_sooner(reachable_by, deadline))
                continue
            if state == WorkerState.AWAKE and not rec.in_transition:
                # An idle or budget sleep in flight holds the lock while the state still reads AWAKE:
                # wait for it, then look again (the caller's lease already stops new sleeps).
                async with rec.lock:
                    if rec.state == WorkerState.AWAKE and not rec.in_transition:
                        return
                continue
            if rec.in_transition or state == WorkerState.UNSPECIFIED:
                # A transition the manager did not start (or gave up waiting on) may still change the
                # state: a lease is granted on the state it leaves, not on the one before it.
                if deadline.passed():
                    raise Unavailable(f"worker {rec.worker_id} did not become ready before the deadline")
                await rec.wait_changed(deadline)
                continue
            async with rec.lock:
                if rec.state in (WorkerState.ASLEEP, WorkerState.PARTIALLY_AWAKE) and not rec.in_transition:
                    wake = lambda: self._calls.wake(rec, [], "", deadline, "AcquireWorker")  # noqa: E731
                    try:
                        await self._budgets.wake_with_room(rec, None, deadline, wake)
                    except Unavailable:
                        # its process went away under the wake (memsvc up stopping it just then): one
                        # started on demand is waited for like any other unavailable one
                        if not self._started_on_demand_and_down(rec):
                            raise
                        continue
                    rec.idle_since = time.time()  # if the grant fails now, the idle clock counts from the wake

    def _started_on_demand_and_down(self, rec: WorkerRecord) -> bool:
        """``rec`` is unavailable and its policy waits for it to start (``start_timeout`` above 0)."""
        return rec.state == WorkerState.UNAVAILABLE and self._policies.effective(rec.name).start_timeout > 0

    def release(self, lease_id: str, expired: bool = False) -> WorkerRecord:
        if not lease_id:
            raise InvalidArgument("lease_id is required")
        lease = self.leases.get(lease_id)
        if lease is None:
            raise NotFound(f"no lease {lease_id!r}", metadata={"leaseId": lease_id})
        self._store.delete_lease(lease_id)
        del self.leases[lease_id]
        rec = self._registry.workers[lease.worker_id]
        rec.leases.pop(lease_id, None)
        if not rec.leases:
            rec.idle_since = time.time()  # a drain: the idle clock starts at the last release
            rec.keep_alive = lease.keep_alive  # and the last lease to end says how long it may run
            self._turns.lease_ended()
        if expired:
            self._metrics.leases_expired.inc()
            log.info("lease %s on %s expired", lease_id, rec.worker_id)
        self._ingest.update_metrics(rec)
        return rec

    def page(self, name: str, page_size: int, page_token: str) -> tuple[list[Lease], str]:
        """ListLeases: one page in lease-id order (of one worker's leases when ``name``). A lease still
        being granted (its wake runs; no TTL yet) is not listed: no client holds it yet."""
        pool = self._registry.get(name).leases if name else self.leases
        granted = {i: x for i, x in pool.items() if x.expire_time != math.inf}
        ids, token = page_of(granted, page_size, page_token)
        return [granted[i] for i in ids], token

    def expire(self, now: float) -> None:
        """Release every lease whose TTL has passed. While the store cannot release them, they stay
        until a later tick: the first failure ends this round (each may block for SQLite's busy
        timeout), and the rest of the tick (silence, idle timers) still runs."""
        for lease in [x for x in self.leases.values() if x.expire_time <= now]:
            try:
                self.release(lease.lease_id, expired=True)
            except MemsvcError as exc:
                if str(exc) != self._expiry_refused:  # once per cause, not once per tick
                    log.warning("expired leases stay until the store can release them: %s", exc)
                    self._expiry_refused = str(exc)
                return
            self._expiry_refused = ""


__all__ = ["Leases"]
