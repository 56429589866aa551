"""What workers tell the manager: their status (telemetry, RPC answers, heartbeats) applied to
their records, and the changes fanned out to WatchWorkers and the metrics.

Status is ordered by when it was true at the worker, not when it arrived: a telemetry snapshot that
reaches the manager after a Sleep response never moves the worker's state backwards. Watchers still
see every state the worker passed through, in order (see ``vocabulary.passed_through``).
"""

from __future__ import annotations

import itertools
import logging
import time

from memsvc.manager.links import STREAM_ENDED
from memsvc.manager.metrics import ManagerMetrics
from memsvc.manager.records import WorkerRecord
from memsvc.manager.watch import WatchEvent, WatchHub
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.vocabulary import AWAKE_STATES, BUSY_STATES, TransitionKind, WorkerState, passed_through

log = logging.getLogger("memsvc.manager")


class TelemetryIngest:
    def __init__(self, metrics: ManagerMetrics, hub: WatchHub) -> None:
        self.metrics = metrics
        self.hub = hub

    async def set_status(
        self, rec: WorkerRecord, status: common_pb.WorkerStatus | None, reachable: bool, reason: str, when_ns: int = 0
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
            for frm, to in itertools.pairwise(steps):
                msg = manager_pb.WatchWorkersResponse(worker=rec.to_proto())
                msg.worker.state = to.proto
                msg.state_change.CopyFrom(common_pb.StateChange(from_state=frm.proto, to_state=to.proto, reason=reason))
                self.publish(rec, msg)
        self.update_metrics(rec)
        async with rec.changed:
            rec.changed.notify_all()

    async def on_telemetry(self, rec: WorkerRecord, msg: worker_pb.StreamTelemetryResponse) -> None:
        kind = msg.WhichOneof("event")
        if kind == "snapshot":
            first = rec.status is None
            if first and msg.snapshot.last_transition.kind == TransitionKind.LOAD:
                # the model's load ended before the worker registered, so no transition event told of
                # it: its first snapshot does, once per record (the counters start with the manager)
                self.metrics.transition(rec.worker_id, msg.snapshot.last_transition)
            await self.set_status(rec, msg.snapshot, True, rec.cause or "telemetry")
        elif kind == "state_change":
            status = common_pb.WorkerStatus()
            if rec.status is not None:
                status.CopyFrom(rec.status)
            status.state = msg.state_change.to_state
            if WorkerState.of(status.state) not in BUSY_STATES:
                # The worker sets the settled state as the last step of a transition (the one it runs
                # at a time): the snapshot's transition_in_progress is stale from here on.
                status.transition_in_progress = False
            reason = rec.cause or msg.state_change.reason  # the manager's cause, when it started this
            await self.set_status(rec, status, True, reason, msg.time.ToNanoseconds())
        elif kind == "transition":
            self.metrics.transition(rec.worker_id, msg.transition)
            out = manager_pb.WatchWorkersResponse(worker=rec.to_proto())
            out.transition.CopyFrom(msg.transition)
            self.publish(rec, out)

    async def on_down(self, rec: WorkerRecord, reason: str) -> None:
        if rec.reachable:  # a worker that stops says so by ending its stream: no warning for that
            level = logging.INFO if reason == STREAM_ENDED else logging.WARNING
            log.log(level, "worker %s unavailable: %s", rec.worker_id, reason)
        await self.set_status(rec, None, False, reason)

    def publish(self, rec: WorkerRecord, msg: manager_pb.WatchWorkersResponse) -> None:
        msg.time.GetCurrentTime()
        self.hub.publish(WatchEvent(rec.worker_id, msg))

    def publish_snapshot(self, rec: WorkerRecord) -> None:
        msg = manager_pb.WatchWorkersResponse(worker=rec.to_proto())
        msg.snapshot.CopyFrom(msg.worker)
        self.publish(rec, msg)

    def forget(self, rec: WorkerRecord) -> None:
        """A deregistered worker: its metric series go, watchers see it UNSPECIFIED for the last time."""
        self.metrics.forget_worker(rec.worker_id)
        msg = manager_pb.WatchWorkersResponse(worker=rec.to_proto())
        msg.worker.state = WorkerState.UNSPECIFIED.proto
        msg.state_change.CopyFrom(
            common_pb.StateChange(
                from_state=rec.state.proto, to_state=WorkerState.UNSPECIFIED.proto, reason="deregistered"
            )
        )
        self.publish(rec, msg)

    def update_metrics(self, rec: WorkerRecord) -> None:
        self.metrics.update_worker(
            rec.worker_id, rec.reachable, rec.state, rec.status, len(rec.leases), len(rec.waiting)
        )


__all__ = ["TelemetryIngest"]
