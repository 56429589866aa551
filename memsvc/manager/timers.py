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
from memsvc.manager.turns import Turns
from memsvc.runtime.deadline import NO_DEADLINE
from memsvc.vocabulary import AWAKE_STATES, SleepLevel, WorkerState

log = logging.getLogger("memsvc.manager")


def _tier1_after(keep_alive: float | None, policy_timeout: float) -> float | None:
    """Seconds of idleness before tier 1, or None for never: a lease's keep_alive (0 = at once,
    negative = never) in place of the policy's timeout (0 = never)."""
    if keep_alive is not None:
        return keep_alive if keep_alive >= 0 else None
    return policy_timeout or None


class IdleTimers:
    PAUSE_S = 1.0
    """A gap between ticks longer than this (or 5 intervals) means the manager itself was paused."""

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
        turns: Turns,
    ) -> None:
        self._registry = registry
        self._turns = turns
        self._policies = policies
        self._leases = leases
        self._budgets = budgets
        self._calls = calls
        self._ingest = ingest
        self._settings = settings
        self._metrics = metrics
        self._background = background
        self._last_tick = 0.0
        self._resumed = 0.0

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
        running_since = self._running_since()
        for rec in self._registry:  # a hung worker keeps its TCP stream open but says nothing
            start_timeout = self._policies.effective(rec.name).start_timeout
            self._metrics.start_timeout.labels(rec.worker_id).set(start_timeout)
            silent = time.monotonic() - max(rec.heard, running_since)
            if rec.reachable and silent > self._settings.silence_limit:
                rec.heard = time.monotonic()  # once per silence period
                self._background.spawn(
                    self._ingest.on_down(rec, f"silent for {silent:.1f} s"), f"silent {rec.worker_id}"
                )
                self._registry.links[rec.worker_id].restart()
            elif self._forgotten(rec) and not start_timeout:  # one started on demand is down on purpose
                log.info("worker %s unreachable for %.0f s: forgetting it", rec.worker_id, silent)
                self._background.spawn(self._registry.deregister(rec.name), f"forget {rec.worker_id}")
            elif rec.reachable and not rec.in_transition:
                self._turns.owe(rec)  # asleep with requests paused on it: a turn is due (after a restart too)
        for rec in self._registry:
            if not rec.reachable or rec.leases or rec.lock.locked() or rec.in_transition:
                continue
            if rec.next_idle_attempt > now:
                continue
            p = self._policies.effective(rec.name)
            idle = now - rec.idle_start
            tier1 = _tier1_after(rec.keep_alive, p.idle_sleep_timeout)
            if rec.state in AWAKE_STATES and tier1 is not None and idle >= tier1:
                self._background.spawn(self._idle_sleep(rec, 1), f"idle sleep {rec.worker_id}")
            elif (
                rec.state == WorkerState.ASLEEP
                and p.idle_deep_sleep_timeout
                and idle >= p.idle_deep_sleep_timeout
                and rec.offloaded_bytes > 0
            ):
                self._background.spawn(self._idle_sleep(rec, 2), f"deep sleep {rec.worker_id}")

    def _running_since(self) -> float:
        """When the manager's current run of ticks began (monotonic). A tick that comes far later than
        the interval means the manager itself was not running (SIGSTOP, a long GC or swap pause, a
        starved host): silence is measured from then, not across the pause, or every healthy worker
        would read as silent the moment the manager resumes."""
        now = time.monotonic()
        if now - self._last_tick > max(self.PAUSE_S, 5 * self._settings.tick_interval):
            if self._last_tick:
                log.warning("the manager did not run for %.1f s; silence counts from now", now - self._last_tick)
            self._resumed = now
        self._last_tick = now
        return self._resumed

    def _forgotten(self, rec: WorkerRecord) -> bool:
        after = self._settings.forget_after
        return bool(
            after
            and not rec.reachable
            and not rec.configured
            and not rec.leases
            and not rec.lock.locked()
            and time.monotonic() - rec.heard > after
        )

    async def _idle_sleep(self, rec: WorkerRecord, tier: int) -> None:
        if rec.lock.locked():
            return
        async with rec.lock:
            if rec.leases or not rec.reachable or rec.in_transition:
                return
            try:
                if tier == 1 and rec.state in AWAKE_STATES:
                    await self._budgets.sleep_tier1(rec, NO_DEADLINE, "idle (tier 1)")
                elif tier == 2 and rec.state == WorkerState.ASLEEP and rec.offloaded_bytes > 0:
                    await self._calls.sleep(rec, SleepLevel.LEVEL_2, {}, "", NO_DEADLINE, "idle (tier 2)")
                else:
                    return
                rec.keep_alive = None  # the idle period it governed has ended in this sleep
                self._metrics.idle_sleeps.labels(str(tier)).inc()
                log.info("worker %s idle: tier %d sleep", rec.worker_id, tier)
            except MemsvcError as exc:  # the worker said no (busy, short of memory): try again later
                log.warning("idle sleep of %s failed: %s", rec.worker_id, exc)
                rec.next_idle_attempt = time.time() + self._settings.retry_backoff
            except Exception:
                log.exception("idle sleep of %s failed", rec.worker_id)
                rec.next_idle_attempt = time.time() + self._settings.retry_backoff


__all__ = ["IdleTimers"]
