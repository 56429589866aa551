"""What workers tell the manager: their status (telemetry, RPC answers, heartbeats) applied to
their records, and the changes fanned out to WatchWorkers and the metrics.

Status is ordered by when it was true at the worker, not when it arrived: a telemetry snapshot that
reaches the manager after a Sleep response never moves the worker's state backwards. Watchers still
see every state the worker passed through, in order (see ``vocabulary.passed_through``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

from memsvc.manager.links import STREAM_ENDED
from memsvc.manager.metrics import ManagerMetrics
from memsvc.manager.records import WorkerRecord
from memsvc.manager.reports import StateChange, Telemetry, Transition, WorkerStatus
from memsvc.manager.watch import WatchEvent, WatchHub
from memsvc.vocabulary import AWAKE_STATES, BUSY_STATES, TransitionKind, WorkerState, passed_through

log = logging.getLogger("memsvc.manager")


class TelemetryIngest:
    def __init__(self, metrics: ManagerMetrics, hub: WatchHub) -> None:
        self.metrics = metrics
        self.hub = hub

    async def set_status(
        self, rec: WorkerRecord, status: WorkerStatus | None, reachable: bool, reason: str, when_ns: int = 0
    ) -> None:
        """Apply what a worker said. ``when_ns`` is when it was true at the worker (a response's or
        snapshot's update_time, an event's time); anything older than what was applied is dropped,
        so telemetry that arrives after a Sleep/WakeUp response never moves the state backwards."""
        if status is not None:
            when_ns = when_ns or (status.update_time_ns or 0)
            if when_ns and when_ns < rec.status_time_ns:
                status = None  # stale: keep the newer status; the message still shows the worker answers
            else:
                rec.status_time_ns = max(rec.status_time_ns, when_ns)
        old = rec.state
        if status is not None:
            rec.status = status
        rec.reachable = reachable
        if reachable:
            rec.last_seen, rec.heard = time.time(), time.monotonic()
        new = rec.state
        if old in AWAKE_STATES and new in (WorkerState.SLEEPING, WorkerState.ASLEEP) and rec.leases and not rec.cause:
            # the manager never sleeps a leased worker: someone called the worker's Sleep directly
            log.warning(
                "worker %s is going to sleep (%s) while %d lease(s) hold it: not the manager's doing",
                rec.worker_id,
                reason,
                len(rec.leases),
            )
            self.metrics.leased_sleeps.labels(rec.worker_id).inc()
        if new != old:
            steps = [old, new]
            if (between := passed_through(old, new)) is not None:
                steps.insert(1, between)  # the answer overtook the stream's news of the transition's start
            view = rec.view()
            for frm, to in itertools.pairwise(steps):
                self.hub.publish(WatchEvent(view.showing(to), StateChange(frm, to, reason)))
        self.update_metrics(rec)
        async with rec.changed:
            rec.changed.notify_all()

    async def on_telemetry(self, rec: WorkerRecord, msg: Telemetry) -> None:
        event = msg.event
        if isinstance(event, WorkerStatus):
            first = rec.status is None
            last = event.last_transition
            if first and last is not None and last.kind == TransitionKind.LOAD:
                # the model's load ended before the worker registered, so no transition event told of
                # it: its first snapshot does, once per record (the counters start with the manager)
                self.metrics.transition(rec.worker_id, last)
            await self.set_status(rec, event, True, rec.cause or "telemetry")
        elif isinstance(event, StateChange):
            status = dataclasses.replace(rec.status or WorkerStatus(), state=event.new)
            if status.state not in BUSY_STATES:
                # The worker sets the settled state as the last step of a transition (the one it runs
                # at a time): the snapshot's transition_in_progress is stale from here on.
                status = dataclasses.replace(status, transition_in_progress=False)
            reason = rec.cause or event.reason  # the manager's cause, when it started this
            await self.set_status(rec, status, True, reason, msg.time_ns)
        elif isinstance(event, Transition):
            self.metrics.transition(rec.worker_id, event)
            self.hub.publish(WatchEvent(rec.view(), event))

    async def on_down(self, rec: WorkerRecord, reason: str) -> None:
        if rec.reachable:  # a worker that stops says so by ending its stream: no warning for that
            level = logging.INFO if reason == STREAM_ENDED else logging.WARNING
            log.log(level, "worker %s unavailable: %s", rec.worker_id, reason)
        await self.set_status(rec, None, False, reason)

    def publish_snapshot(self, rec: WorkerRecord) -> None:
        self.hub.publish(WatchEvent(rec.view()))

    def forget(self, rec: WorkerRecord) -> None:
        """A deregistered worker: its metric series go, watchers see it UNSPECIFIED for the last time."""
        self.metrics.forget_worker(rec.worker_id)
        gone = WorkerState.UNSPECIFIED
        self.hub.publish(WatchEvent(rec.view().showing(gone), StateChange(rec.state, gone, "deregistered")))

    def update_metrics(self, rec: WorkerRecord) -> None:
        self.metrics.update_worker(
            rec.worker_id, rec.reachable, rec.state, rec.status, len(rec.leases), len(rec.waiting)
        )


__all__ = ["TelemetryIngest"]
