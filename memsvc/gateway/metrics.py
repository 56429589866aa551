"""The gateway's Prometheus metrics (``GET /metrics``), in a registry of its own.

The ``model`` label takes only names some worker serves (a request for an unknown model counts as
``""``), so a client cannot grow the series without bound. Under ``--processes`` (Prometheus'
multiprocess mode: ``PROMETHEUS_MULTIPROC_DIR`` set by the supervisor) each process writes its
values to that directory and :meth:`GatewayMetrics.exposition` sums every process's.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from memsvc.runtime.metrics import build_info

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        build_info(r)
        self.requests = Counter(
            "memsvc_gateway_requests",
            "Requests answered, by model, endpoint and HTTP status",
            ["model", "endpoint", "code"],
            registry=r,
        )
        self.in_flight = Gauge(
            "memsvc_gateway_requests_in_flight",
            "Completions held now (streaming, waking or queued for room), each one of --max-requests",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queue = Histogram(
            "memsvc_gateway_queue_seconds",
            "Time to first token, part 1: waiting for room on the model's device (every neighbour leased)",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.wake = Histogram(
            "memsvc_gateway_wake_seconds",
            "Time to first token, part 2: the lease's own call (the wake and any eviction; near 0 when awake)",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.prefill = Histogram(
            "memsvc_gateway_prefill_seconds",
            "Time to first token, part 3: from the lease to the first token (the worker's queue and prefill)",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.first_token = Histogram(
            "memsvc_gateway_time_to_first_token_seconds",
            "From the request to its first token: queue, wake and prefill",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.decode_rate = Histogram(
            "memsvc_gateway_tokens_per_second",
            "Each streamed response's decode rate after its first token",
            ["model"],
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000),
            registry=r,
        )
        self.wakes = Counter(
            "memsvc_gateway_wakes",
            "Requests that leased a worker which was not awake (the lease woke it)",
            ["model"],
            registry=r,
        )
        self.unleased = Counter(
            "memsvc_gateway_unleased",
            "Requests sent to a worker without a lease: the manager did not answer, and the model's worker was "
            "awake when it last did",
            ["model"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "memsvc_gateway_completion_tokens", "Tokens generated for the gateway's clients", ["model"], registry=r
        )

    def exposition(self) -> bytes:
        """``GET /metrics``: this process's registry, or under ``--processes`` every process's values
        summed (build info, which multiprocess mode cannot share, is the same in each)."""
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        build_info(registry)
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry)


__all__ = ["GatewayMetrics"]
