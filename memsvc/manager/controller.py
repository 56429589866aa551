"""The manager's domain object: it decides when workers sleep and wake, and calls them.

Decisions, in one place:
- idle timers, tiered: idle T1 -> the policy's tag actions (tier 1); idle T2 -> level 2 (frees the
  host copy too). A leased worker is never put to sleep; idle time counts from the last release.
- device budget: before a worker wakes, the least recently used idle worker on the same device is
  put to sleep until the waking one fits; RESOURCE_EXHAUSTED only when nothing can be freed.
- host budget: before a sleep offloads, the coldest sleeper on the host is demoted to level 2.
Every transition the manager starts on a worker holds that worker's lock, so timers, budget
evictions, operators and leases never race on one worker.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from memsvc.errors import InvalidArgument, NotFound, OutOfMemory, Unavailable, WrongState
from memsvc.manager.links import WorkerLink
from memsvc.manager.metrics import ManagerMetrics
from memsvc.manager.policy import Policy, check, fields_from_proto
from memsvc.manager.records import Lease, WorkerRecord, worker_id_from_name
from memsvc.manager.store import Store, StoredLease, StoredWorker
from memsvc.manager.watch import WatchEvent, WatchHub
from memsvc.rpc_errors import from_rpc_error
from memsvc.v1 import common_pb2 as c
from memsvc.v1 import memory_manager_service_pb2 as m
from memsvc.v1 import model_worker_service_pb2 as w

log = logging.getLogger("memsvc.manager")

AWAKE_STATES = (c.WORKER_STATE_AWAKE, c.WORKER_STATE_PARTIALLY_AWAKE)
BUSY_STATES = (c.WORKER_STATE_LOADING, c.WORKER_STATE_SLEEPING, c.WORKER_STATE_WAKING, c.WORKER_STATE_UNSPECIFIED)
LEVEL_ACTIONS = {
    1: {"weights": c.TAG_ACTION_OFFLOAD, "kv_cache": c.TAG_ACTION_DISCARD},
    2: {"weights": c.TAG_ACTION_DISCARD, "kv_cache": c.TAG_ACTION_DISCARD},
}


@dataclass(frozen=True)
class ManagerSettings:
    """Timing of the manager (the config file's [manager] table)."""

    heartbeat_interval: float = 2.0
    """Workers re-register this often."""
    tick_interval: float = 0.1
    """How often idle timers and lease expiry are checked."""
    default_lease_ttl: float = 60.0
    max_lease_ttl: float = 24 * 3600.0
    rpc_timeout: float = 600.0
    """Longest call to a worker (a sleep of a large model included)."""
    retry_backoff: float = 5.0
    """After a failed idle sleep, wait this long before trying that worker again."""
    unavailable_after: float = 0.0
    """A worker silent this long (no telemetry, no heartbeat) is UNAVAILABLE; 0 = 3 heartbeats, at
    least 3 s (telemetry snapshots come every second)."""

    @property
    def silence_limit(self) -> float:
        return self.unavailable_after or max(3.0, 3 * self.heartbeat_interval)


@dataclass
class _Replay:
    entries: collections.OrderedDict[tuple[str, str], Any] = field(default_factory=collections.OrderedDict)

    def get(self, method: str, request_id: str) -> Any:
        return self.entries.get((method, request_id)) if request_id else None

    def put(self, method: str, request_id: str, value: Any) -> None:
        """``method`` includes the worker's name: a request_id is unique per worker and method."""
        if request_id:
            self.entries[(method, request_id)] = value
            while len(self.entries) > 1024:
                self.entries.popitem(last=False)


class Manager:
    def __init__(
        self,
        store: Store,
        settings: ManagerSettings | None = None,
        default_policy_fields: dict[str, Any] | None = None,
        static_workers: Sequence[StoredWorker] = (),
    ) -> None:
        self.store = store
        self.settings = settings or ManagerSettings()
        self.metrics = ManagerMetrics()
        self.hub = WatchHub()
        self.workers: dict[str, WorkerRecord] = {}
        self.links: dict[str, WorkerLink] = {}
        self.leases: dict[str, Lease] = {}
        self._replay = _Replay()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._next_attempt: dict[str, float] = {}
        self._ticker: asyncio.Task[None] | None = None
        stored = store.policy_fields(Store.DEFAULT_SCOPE)
        if stored is None:  # the config file seeds the default; later UpdatePolicy calls win
            stored = check(Policy().with_fields(default_policy_fields or {})).to_fields()
            store.save_policy_fields(Store.DEFAULT_SCOPE, stored)
        self._default = Policy().with_fields(stored)
        self._static = list(static_workers)

    # ---- lifecycle ----
    async def start(self) -> None:
        for sw in [*self.store.workers(), *self._static]:
            if sw.configured:
                self.store.save_worker(sw)
            self._add_record(sw.worker_id, sw.address, sw.host, sw.configured)
        now = time.time()
        for sl in self.store.leases():
            rec = self.workers.get(sl.worker_id)
            if rec is None or sl.expire_time <= now:
                self.store.delete_lease(sl.lease_id)
                continue
            lease = Lease(sl.lease_id, sl.worker_id, sl.expire_time, sl.holder)
            self.leases[lease.lease_id] = lease
            rec.leases[lease.lease_id] = lease
        self._ticker = asyncio.create_task(self._tick_forever(), name="manager ticker")

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*(t for t in [self._ticker, *self._tasks] if t), return_exceptions=True)
        await asyncio.gather(*(link.close() for link in self.links.values()), return_exceptions=True)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _add_record(self, worker_id: str, address: str, host: str, configured: bool) -> WorkerRecord:
        rec = self.workers.get(worker_id)
        if rec is None:
            rec = self.workers[worker_id] = WorkerRecord(worker_id, address, host, configured)
            self._publish_snapshot(rec)
        elif rec.address != address:
            rec.address = address
            old = self.links.pop(worker_id, None)
            if old is not None:
                self._spawn(old.close(), f"close link {worker_id}")
        rec.host = host or rec.host
        rec.configured = rec.configured or configured
        if worker_id not in self.links:
            link = self.links[worker_id] = WorkerLink(
                address, lambda msg, r=rec: self._on_telemetry(r, msg), lambda why, r=rec: self._on_down(r, why)
            )
            link.start()
        self._update_metrics(rec)
        return rec

    # ---- what workers tell us ----
    async def _set_status(
        self, rec: WorkerRecord, status: c.WorkerStatus | None, reachable: bool, reason: str, when_ns: int = 0
    ) -> None:
        """Apply what a worker said. ``when_ns`` is when it was true at the worker (a response's or
        snapshot's update_time, an event's time); anything older than what was applied is dropped,
        so telemetry that arrives after a Sleep/WakeUp response never moves the state backwards."""
        if status is not None:
            when_ns = when_ns or (status.update_time.ToNanoseconds() if status.HasField("update_time") else 0)
            if when_ns and when_ns < rec.status_time_ns:
                status = None  # stale: keep the newer status; the message still shows the worker answers
            else:
                rec.status_time_ns = max(rec.status_time_ns, when_ns)
        old = rec.state
        if status is not None:
            rec.status = status
        rec.reachable = reachable
        if reachable:
            rec.last_seen = time.time()
        new = rec.state
        if new != old:
            msg = m.WatchWorkersResponse(worker=rec.to_proto())
            msg.state_change.CopyFrom(c.StateChange(from_state=old, to_state=new, reason=reason))
            self._publish(rec, msg)
        self._update_metrics(rec)
        async with rec.changed:
            rec.changed.notify_all()

    async def _on_telemetry(self, rec: WorkerRecord, msg: w.StreamTelemetryResponse) -> None:
        kind = msg.WhichOneof("event")
        if kind == "snapshot":
            await self._set_status(rec, msg.snapshot, True, "telemetry")
        elif kind == "state_change":
            status = c.WorkerStatus()
            if rec.status is not None:
                status.CopyFrom(rec.status)
            status.state = msg.state_change.to_state
            await self._set_status(rec, status, True, msg.state_change.reason, msg.time.ToNanoseconds())
        elif kind == "transition":
            self.metrics.transition(rec.worker_id, msg.transition)
            out = m.WatchWorkersResponse(worker=rec.to_proto())
            out.transition.CopyFrom(msg.transition)
            self._publish(rec, out)

    async def _on_down(self, rec: WorkerRecord, reason: str) -> None:
        if rec.reachable:
            log.warning("worker %s unavailable: %s", rec.worker_id, reason)
        await self._set_status(rec, None, False, reason)

    def _publish(self, rec: WorkerRecord, msg: m.WatchWorkersResponse) -> None:
        msg.time.GetCurrentTime()
        self.hub.publish(WatchEvent(rec.worker_id, msg))

    def _publish_snapshot(self, rec: WorkerRecord) -> None:
        msg = m.WatchWorkersResponse(worker=rec.to_proto())
        msg.snapshot.CopyFrom(msg.worker)
        self._publish(rec, msg)

    def _update_metrics(self, rec: WorkerRecord) -> None:
        self.metrics.update_worker(rec.worker_id, rec.reachable, rec.state, rec.status, len(rec.leases))

    # ---- registry ----
    async def register(self, worker_id: str, address: str, host: str, status: c.WorkerStatus | None) -> WorkerRecord:
        worker_id = worker_id_from_name(worker_id)
        host_part, _, port = address.rpartition(":")
        if not host_part or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(
                f"address must be host:port with a port in 1..65535, got {address!r}", metadata={"address": address}
            )
        known = worker_id in self.workers
        rec = self._add_record(worker_id, address, host, False)
        self.store.save_worker(StoredWorker(worker_id, address, rec.host, rec.configured, time.time()))
        rec.last_seen = time.time()
        if not rec.reachable:
            self.links[worker_id].poke()
        if not known:
            log.info("worker %s registered at %s", worker_id, address)
        return rec

    def get(self, name: str) -> WorkerRecord:
        wid = worker_id_from_name(name)
        rec = self.workers.get(wid)
        if rec is None:
            raise NotFound(f"no worker {name!r}", metadata={"name": name})
        return rec

    def list(self, page_size: int, page_token: str) -> tuple[list[WorkerRecord], str]:
        if page_size < 0:
            raise InvalidArgument("page_size must not be negative")
        size = min(page_size or 50, 1000)
        after = ""
        if page_token:
            try:
                after = base64.b64decode(page_token.encode(), altchars=b"-_", validate=True).decode()
                worker_id_from_name(after)
            except (ValueError, UnicodeDecodeError, InvalidArgument):
                raise InvalidArgument("bad page_token: pass next_page_token from a previous response") from None
        ids = sorted(i for i in self.workers if i > after)
        page = ids[:size]
        token = base64.urlsafe_b64encode(page[-1].encode()).decode() if len(ids) > size else ""
        return [self.workers[i] for i in page], token

    # ---- policy ----
    def policy(self, rec: WorkerRecord | None) -> Policy:
        if rec is None:
            return self._default
        override = self.store.policy_fields(rec.name) or {}
        return self._default.with_fields(override)

    def update_policy(self, name: str, p: m.Policy, paths: list[str]) -> Policy:
        fields = fields_from_proto(p, paths)
        if not name:
            new = check(self._default.with_fields(fields))
            for rec in self.workers.values():  # every worker's effective policy must stay valid too
                override = self.store.policy_fields(rec.name)
                if override:
                    try:
                        check(new.with_fields(override))
                    except InvalidArgument as exc:
                        raise InvalidArgument(f"{rec.name}'s overrides would become invalid: {exc}") from None
            self.store.save_policy_fields(Store.DEFAULT_SCOPE, new.to_fields())
            self._default = new
            return new
        rec = self.get(name)
        override = {**(self.store.policy_fields(rec.name) or {}), **fields}
        new = check(self._default.with_fields(override))
        self.store.save_policy_fields(rec.name, override)
        return new

    # ---- calls to workers ----
    def _link(self, rec: WorkerRecord) -> WorkerLink:
        if not rec.reachable:
            raise Unavailable(f"worker {rec.worker_id} is unavailable", metadata={"name": rec.name})
        return self.links[rec.worker_id]

    def _timeout(self, deadline: float | None) -> float:
        t = self.settings.rpc_timeout
        if deadline is not None:
            t = min(t, deadline - time.monotonic())
            if t <= 0:
                raise Unavailable("deadline exceeded before the worker could be called")
        return t

    async def _call(self, rec: WorkerRecord, method: str, request: Any, deadline: float | None) -> Any:
        stub = self._link(rec).stub
        try:
            return await getattr(stub, method)(request, timeout=self._timeout(deadline))
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, rec.worker_id) from None

    async def _sleep_call(
        self, rec: WorkerRecord, level: int, actions: dict[str, int], request_id: str, deadline: float | None, why: str
    ) -> c.TransitionStats:
        req = w.SleepRequest(level=level, tag_actions=actions, request_id=request_id)  # type: ignore[arg-type]
        resp = await self._call(rec, "Sleep", req, deadline)
        await self._set_status(rec, resp.status, True, why)
        return resp.transition  # type: ignore[no-any-return]

    async def _wake_call(self, rec: WorkerRecord, tags: list[str], request_id: str, deadline: float | None) -> Any:
        resp = await self._call(rec, "WakeUp", w.WakeUpRequest(tags=tags, request_id=request_id), deadline)
        await self._set_status(rec, resp.status, True, "wake")
        return resp.transition

    # ---- budgets ----
    def _device_group(self, rec: WorkerRecord) -> list[WorkerRecord]:
        return [r for r in self.workers.values() if r is not rec and r.reachable and r.device_key == rec.device_key]

    async def _make_device_room(self, rec: WorkerRecord, tags: list[str] | None, deadline: float | None) -> None:
        """Put LRU idle neighbours to sleep until ``rec`` waking ``tags`` fits its device budget."""
        group = self._device_group(rec)
        budget = self.policy(rec).device_budget_bytes or min(
            [r.device_total_bytes for r in [rec, *group] if r.device_total_bytes] or [0]
        )
        if not budget:
            return
        need = rec.wake_need_bytes(tags)
        while True:
            used = rec.mapped_bytes + sum(r.mapped_bytes for r in group)
            if used + need <= budget:
                return
            idle = [
                r
                for r in group
                if not r.leases and r.state in AWAKE_STATES and r.mapped_bytes > 0 and not r.lock.locked()
            ]
            if not idle:
                raise OutOfMemory(
                    f"device budget of {budget} bytes: {rec.worker_id} needs {need} more, {used} in use, "
                    "and no idle worker on the device can be put to sleep",
                    metadata={"budgetBytes": str(budget), "neededBytes": str(need), "usedBytes": str(used)},
                )
            victim = min(idle, key=lambda r: r.idle_start)
            log.info("making room for %s: putting %s to sleep", rec.worker_id, victim.worker_id)
            async with victim.lock:
                if victim.leases or victim.state not in AWAKE_STATES:
                    continue
                await self._sleep_tier1(victim, deadline, "device budget")
                self.metrics.evictions.inc()

    async def _make_host_room(self, rec: WorkerRecord, need: int, deadline: float | None) -> bool:
        """Demote the coldest sleepers on ``rec``'s host to level 2 until ``need`` more bytes fit."""
        budget = self.policy(rec).host_budget_bytes
        if not budget or not need:
            return True
        while True:
            used = sum(r.offloaded_bytes for r in self.workers.values() if r.host == rec.host and r.reachable)
            if used + need <= budget:
                return True
            cold = [
                r
                for r in self.workers.values()
                if r is not rec
                and r.host == rec.host
                and r.reachable
                and not r.leases
                and r.state == c.WORKER_STATE_ASLEEP
                and r.offloaded_bytes > 0
                and not r.lock.locked()
            ]
            if not cold:
                return False
            victim = min(cold, key=lambda r: r.idle_start)
            log.info("host budget: demoting %s to level 2", victim.worker_id)
            async with victim.lock:
                if victim.state == c.WORKER_STATE_ASLEEP and not victim.leases:
                    await self._sleep_call(victim, 2, {}, "", deadline, "host budget")
                    self.metrics.demotions.inc()

    async def _sleep_tier1(
        self, rec: WorkerRecord, deadline: float | None, why: str, request_id: str = ""
    ) -> c.TransitionStats:
        """Sleep with the policy's tag actions, falling back to level 2 when host RAM is short."""
        actions = dict(self.policy(rec).tag_actions)
        if await self._make_host_room(rec, rec.offload_need_bytes(actions), deadline):
            return await self._sleep_call(rec, 0, actions, request_id, deadline, why)
        log.info("host budget: %s sleeps at level 2 (no host room for its offload)", rec.worker_id)
        return await self._sleep_call(rec, 2, {}, request_id, deadline, why + " (level 2: host budget)")

    # ---- operator transitions ----
    async def sleep_worker(
        self, name: str, level: int, tag_actions: dict[str, int], request_id: str, deadline: float | None
    ) -> tuple[WorkerRecord, c.TransitionStats]:
        rec = self.get(name)
        hit = self._replay.get(f"SleepWorker {rec.worker_id}", request_id)
        if hit is not None:
            return rec, hit
        if level not in (0, 1, 2):
            raise InvalidArgument(f"sleep level must be 1 or 2, got {level}")
        for tag, act in tag_actions.items():
            if act not in (c.TAG_ACTION_OFFLOAD, c.TAG_ACTION_DISCARD, c.TAG_ACTION_KEEP):
                raise InvalidArgument(f"tag {tag!r}: action must be OFFLOAD, DISCARD or KEEP", metadata={"tag": tag})
        self._link(rec)
        async with rec.lock:
            if rec.leases:
                raise WrongState(
                    f"worker {rec.worker_id} holds {len(rec.leases)} lease(s); it sleeps after they are released",
                    metadata={"leaseCount": str(len(rec.leases))},
                )
            if level == 0 and not tag_actions:
                t = await self._sleep_tier1(rec, deadline, "SleepWorker", request_id)
            else:
                actions = {**LEVEL_ACTIONS.get(level, {}), **tag_actions}
                need = rec.offload_need_bytes(actions)
                if not await self._make_host_room(rec, need, deadline):
                    raise OutOfMemory(
                        f"host budget: offloading {need} bytes does not fit and no sleeper can be demoted",
                        metadata={"neededBytes": str(need)},
                    )
                t = await self._sleep_call(rec, level, tag_actions, request_id, deadline, "SleepWorker")
        self._replay.put(f"SleepWorker {rec.worker_id}", request_id, t)
        return rec, t

    async def wake_worker(
        self, name: str, tags: list[str], request_id: str, deadline: float | None
    ) -> tuple[WorkerRecord, c.TransitionStats]:
        rec = self.get(name)
        hit = self._replay.get(f"WakeWorker {rec.worker_id}", request_id)
        if hit is not None:
            return rec, hit
        self._link(rec)
        async with rec.lock:
            await self._make_device_room(rec, tags or None, deadline)
            t = await self._wake_call(rec, tags, request_id, deadline)
            rec.idle_since = time.time()
        self._replay.put(f"WakeWorker {rec.worker_id}", request_id, t)
        return rec, t

    async def swap_blocks(
        self, name: str, request: w.SwapBlocksRequest, deadline: float | None
    ) -> w.SwapBlocksResponse:
        rec = self.get(name)
        return await self._call(rec, "SwapBlocks", request, deadline)  # type: ignore[no-any-return]

    # ---- leases ----
    def _ttl(self, seconds: float) -> float:
        if seconds < 0:
            raise InvalidArgument("ttl must not be negative")
        if seconds > self.settings.max_lease_ttl:
            raise InvalidArgument(f"ttl must be at most {self.settings.max_lease_ttl:.0f} s")
        return seconds or self.settings.default_lease_ttl

    async def acquire(
        self, name: str, ttl: float, holder: str, lease_id: str, request_id: str, deadline: float | None
    ) -> tuple[Lease, WorkerRecord]:
        ttl = self._ttl(ttl)
        if len(holder) > 256:
            raise InvalidArgument("holder must be at most 256 characters")
        rec = self.get(name)
        if lease_id:  # renewal
            lease = self.leases.get(lease_id)
            if lease is None or lease.worker_id != rec.worker_id:
                raise NotFound(f"no lease {lease_id!r} on {rec.name}", metadata={"leaseId": lease_id})
            lease.expire_time = time.time() + ttl
            self.store.save_lease(StoredLease(lease.lease_id, lease.worker_id, lease.expire_time, lease.holder))
            return lease, rec
        hit = self._replay.get(f"AcquireWorker {rec.worker_id}", request_id)
        if hit is not None and hit in self.leases:
            return self.leases[hit], rec
        self._link(rec)
        lease = Lease(uuid.uuid4().hex, rec.worker_id, float("inf"), holder)  # TTL starts at the grant
        rec.leases[lease.lease_id] = lease  # from here on no timer or budget puts it to sleep
        self.leases[lease.lease_id] = lease
        try:
            await self._ensure_awake(rec, deadline)
        except BaseException:
            rec.leases.pop(lease.lease_id, None)
            self.leases.pop(lease.lease_id, None)
            if not rec.leases:
                rec.idle_since = time.time()
            self._update_metrics(rec)
            raise
        lease.expire_time = time.time() + ttl
        self.store.save_lease(StoredLease(lease.lease_id, lease.worker_id, lease.expire_time, lease.holder))
        self.metrics.leases_granted.inc()
        self._update_metrics(rec)
        self._replay.put(f"AcquireWorker {rec.worker_id}", request_id, lease.lease_id)
        return lease, rec

    async def _ensure_awake(self, rec: WorkerRecord, deadline: float | None) -> None:
        while True:
            state = rec.state
            if state == c.WORKER_STATE_AWAKE:
                # An idle or budget sleep in flight holds the lock while the state still reads AWAKE:
                # wait for it, then look again (the caller's lease already stops new sleeps).
                async with rec.lock:
                    if rec.state == c.WORKER_STATE_AWAKE:
                        return
                continue
            if state == c.WORKER_STATE_UNAVAILABLE:
                raise Unavailable(f"worker {rec.worker_id} is unavailable", metadata={"name": rec.name})
            if state in BUSY_STATES:
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    raise Unavailable(f"worker {rec.worker_id} did not become ready before the deadline")
                async with rec.changed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(rec.changed.wait(), timeout=min(timeout or 1.0, 1.0))
                continue
            async with rec.lock:
                if rec.state in (c.WORKER_STATE_ASLEEP, c.WORKER_STATE_PARTIALLY_AWAKE):
                    await self._make_device_room(rec, None, deadline)
                    await self._wake_call(rec, [], "", deadline)

    def release(self, lease_id: str, expired: bool = False) -> WorkerRecord:
        if not lease_id:
            raise InvalidArgument("lease_id is required")
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            raise NotFound(f"no lease {lease_id!r}", metadata={"leaseId": lease_id})
        self.store.delete_lease(lease_id)
        rec = self.workers[lease.worker_id]
        rec.leases.pop(lease_id, None)
        if not rec.leases:
            rec.idle_since = time.time()  # a drain: the idle clock starts at the last release
        if expired:
            self.metrics.leases_expired.inc()
            log.info("lease %s on %s expired", lease_id, rec.worker_id)
        self._update_metrics(rec)
        return rec

    # ---- timers ----
    async def _tick_forever(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # a bug here must not stop the timers for good
                log.exception("manager tick failed")
            await asyncio.sleep(self.settings.tick_interval)

    def tick(self) -> None:
        now = time.time()
        for lease in [x for x in self.leases.values() if x.expire_time <= now]:
            self.release(lease.lease_id, expired=True)
        for rec in self.workers.values():  # a hung worker keeps its TCP stream open but says nothing
            if rec.reachable and now - rec.last_seen > self.settings.silence_limit:
                silent = now - rec.last_seen
                rec.last_seen = now  # once per silence period
                self._spawn(self._on_down(rec, f"silent for {silent:.1f} s"), f"silent {rec.worker_id}")
                self.links[rec.worker_id].restart()
        for rec in self.workers.values():
            if not rec.reachable or rec.leases or rec.lock.locked():
                continue
            if self._next_attempt.get(rec.worker_id, 0.0) > now:
                continue
            p = self.policy(rec)
            idle = now - rec.idle_start
            if rec.state in AWAKE_STATES and p.idle_sleep_timeout and idle >= p.idle_sleep_timeout:
                self._spawn(self._idle_sleep(rec, 1), f"idle sleep {rec.worker_id}")
            elif (
                rec.state == c.WORKER_STATE_ASLEEP
                and p.idle_deep_sleep_timeout
                and idle >= p.idle_deep_sleep_timeout
                and rec.offloaded_bytes > 0
            ):
                self._spawn(self._idle_sleep(rec, 2), f"deep sleep {rec.worker_id}")

    async def _idle_sleep(self, rec: WorkerRecord, tier: int) -> None:
        if rec.lock.locked():
            return
        async with rec.lock:
            if rec.leases or not rec.reachable:
                return
            try:
                if tier == 1 and rec.state in AWAKE_STATES:
                    await self._sleep_tier1(rec, None, "idle (tier 1)")
                elif tier == 2 and rec.state == c.WORKER_STATE_ASLEEP and rec.offloaded_bytes > 0:
                    await self._sleep_call(rec, 2, {}, "", None, "idle (tier 2)")
                else:
                    return
                self.metrics.idle_sleeps.labels(str(tier)).inc()
                log.info("worker %s idle: tier %d sleep", rec.worker_id, tier)
            except Exception as exc:
                log.warning("idle sleep of %s failed: %s", rec.worker_id, exc)
                self._next_attempt[rec.worker_id] = time.time() + self.settings.retry_backoff
