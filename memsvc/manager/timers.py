"""The manager's clock: lease expiry, silent workers, and tiered idle sleep.

Every ``tick_interval``: leases past their TTL are released; a reachable worker that said nothing for
the silence limit is marked UNAVAILABLE and its link restarted; an unleased worker idle past T1 is put
to sleep with the policy's tag actions (tier 1), and a sleeper idle past T2 is demoted to level 2
(tier 2, which frees its host copy too).
"""

from __future__ import annotations

import asyncio
import logging
import time

from memsvc.errors import MemsvcError
from memsvc.manager.background import Background
from memsvc.manager.budgets import Budgets
from memsvc.manager.calls import WorkerCalls
from memsvc.manager.leases import Leases
from memsvc.manager.metrics import ManagerMetrics
from memsvc.manager.policy import Policies
from memsvc.manager.records import WorkerRecord
from memsvc.manager.registry import Registry
from memsvc.manager.settings import ManagerSettings
from memsvc.manager.telemetry import TelemetryIngest
from memsvc.vocabulary import AWAKE_STATES, SleepLevel, WorkerState

log = logging.getLogger("memsvc.manager")


class IdleTimers:
    def __init__(
        self,
        registry: Registry,
        policies: Policies,
        leases: Leases,
        budgets: Budgets,
        calls: WorkerCalls,
        ingest: TelemetryIngest,
        settings: ManagerSettings,
        metrics: ManagerMetrics,
        background: Background,
    ) -> None:
        self._registry = registry
        self._policies = policies
        self._leases = leases
        self._budgets = budgets
        self._calls = calls
        self._ingest = ingest
        self._settings = settings
        self._metrics = metrics
        self._background = background
        self._next_attempt: dict[str, float] = {}
        """After a failed idle sleep: not before this time again, per worker."""

    async def run_forever(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # a bug here must not stop the timers for good
                log.exception("manager tick failed")
            await asyncio.sleep(self._settings.tick_interval)

    def tick(self) -> None:
        now = time.time()
        self._leases.expire(now)
        for rec in self._registry:  # a hung worker keeps its TCP stream open but says nothing
            if rec.reachable and now - rec.last_seen > self._settings.silence_limit:
                silent = now - rec.last_seen
                rec.last_seen = now  # once per silence period
                self._background.spawn(
                    self._ingest.on_down(rec, f"silent for {silent:.1f} s"), f"silent {rec.worker_id}"
                )
                self._registry.links[rec.worker_id].restart()
        for rec in self._registry:
            if not rec.reachable or rec.leases or rec.lock.locked():
                continue
            if self._next_attempt.get(rec.worker_id, 0.0) > now:
                continue
            p = self._policies.effective(rec.name)
            idle = now - rec.idle_start
            if rec.state in AWAKE_STATES and p.idle_sleep_timeout and idle >= p.idle_sleep_timeout:
                self._background.spawn(self._idle_sleep(rec, 1), f"idle sleep {rec.worker_id}")
            elif (
                rec.state == WorkerState.ASLEEP
                and p.idle_deep_sleep_timeout
                and idle >= p.idle_deep_sleep_timeout
                and rec.offloaded_bytes > 0
            ):
                self._background.spawn(self._idle_sleep(rec, 2), f"deep sleep {rec.worker_id}")

    async def _idle_sleep(self, rec: WorkerRecord, tier: int) -> None:
        if rec.lock.locked():
            return
        async with rec.lock:
            if rec.leases or not rec.reachable:
                return
            try:
                if tier == 1 and rec.state in AWAKE_STATES:
                    await self._budgets.sleep_tier1(rec, None, "idle (tier 1)")
                elif tier == 2 and rec.state == WorkerState.ASLEEP and rec.offloaded_bytes > 0:
                    await self._calls.sleep(rec, SleepLevel.LEVEL_2, {}, "", None, "idle (tier 2)")
                else:
                    return
                self._metrics.idle_sleeps.labels(str(tier)).inc()
                log.info("worker %s idle: tier %d sleep", rec.worker_id, tier)
            except MemsvcError as exc:  # the worker said no (busy, short of memory): try again later
                log.warning("idle sleep of %s failed: %s", rec.worker_id, exc)
                self._next_attempt[rec.worker_id] = time.time() + self._settings.retry_backoff
            except Exception:
                log.exception("idle sleep of %s failed", rec.worker_id)
                self._next_attempt[rec.worker_id] = time.time() + self._settings.retry_backoff


__all__ = ["IdleTimers"]
