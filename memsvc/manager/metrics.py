"""Prometheus metrics of the manager, named memsvc_* in base units (bytes, seconds, totals).

Gauges mirror the latest status each worker reported, so the endpoint and GetWorker agree.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from memsvc.v1 import common_pb2 as c
from memsvc.vocabulary import WorkerState

STATES = [s.label for s in WorkerState if s != WorkerState.UNSPECIFIED]
"""The ``state`` label values of ``memsvc_worker_state``."""


class ManagerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.up = Gauge("memsvc_worker_up", "1 while the manager reaches the worker", ["worker"], registry=r)
        self.state = Gauge("memsvc_worker_state", "1 for the worker's current state", ["worker", "state"], registry=r)
        self.mapped = Gauge("memsvc_worker_mapped_bytes", "Device bytes mapped per tag", ["worker", "tag"], registry=r)
        self.offloaded = Gauge(
            "memsvc_worker_offloaded_bytes", "Host bytes holding offloaded data per tag", ["worker", "tag"], registry=r
        )
        self.allocated = Gauge(
            "memsvc_worker_allocated_bytes", "Bytes of live tensors per tag", ["worker", "tag"], registry=r
        )
        self.device_free = Gauge("memsvc_worker_device_free_bytes", "Free device memory", ["worker"], registry=r)
        self.leases = Gauge("memsvc_worker_leases", "Live leases on the worker", ["worker"], registry=r)
        self.transitions = Counter(
            "memsvc_worker_transitions_total", "Finished transitions", ["worker", "kind"], registry=r
        )
        self.moved = Counter(
            "memsvc_worker_transition_bytes_total", "Bytes moved by transitions", ["worker", "kind"], registry=r
        )
        self.duration = Histogram(
            "memsvc_worker_transition_duration_seconds",
            "Duration of transitions",
            ["kind"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.leases_granted = Counter("memsvc_leases_granted_total", "Leases granted", registry=r)
        self.leases_expired = Counter("memsvc_leases_expired_total", "Leases that expired unreleased", registry=r)
        self.idle_sleeps = Counter("memsvc_idle_sleeps_total", "Sleeps started by idle timers", ["tier"], registry=r)
        self.evictions = Counter(
            "memsvc_budget_evictions_total", "Workers put to sleep to make room on a device", registry=r
        )
        self.demotions = Counter(
            "memsvc_host_demotions_total", "Sleepers demoted to level 2 to free host memory", registry=r
        )
        self._tags: dict[str, set[str]] = {}

    def serve(self, listen: str) -> tuple[str, int]:
        host, _, port = listen.rpartition(":")
        server, _thread = start_http_server(int(port), addr=host or "0.0.0.0", registry=self.registry)
        return host, int(server.server_port)

    def update_worker(
        self, worker_id: str, reachable: bool, state: WorkerState, status: c.WorkerStatus | None, leases: int
    ) -> None:
        self.up.labels(worker_id).set(1 if reachable else 0)
        current = state.label if state != WorkerState.UNSPECIFIED else ""
        for s in STATES:
            self.state.labels(worker_id, s).set(1 if s == current else 0)
        self.leases.labels(worker_id).set(leases)
        if status is None:
            return
        self.device_free.labels(worker_id).set(status.device.free_bytes)
        seen = set()
        for t in status.tags:
            seen.add(t.tag)
            self.mapped.labels(worker_id, t.tag).set(t.mapped_bytes)
            self.offloaded.labels(worker_id, t.tag).set(t.offloaded_bytes)
            self.allocated.labels(worker_id, t.tag).set(t.allocated_bytes)
        self._tags[worker_id] = seen

    def transition(self, worker_id: str, t: c.TransitionStats) -> None:
        self.transitions.labels(worker_id, t.kind).inc()
        self.moved.labels(worker_id, t.kind).inc(t.moved_bytes)
        self.duration.labels(t.kind).observe(t.duration.ToNanoseconds() / 1e9)
