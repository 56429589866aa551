"""Prometheus metrics of the manager, named memsvc_* in base units (bytes, seconds, totals).

Gauges mirror the latest status each worker reported, so the endpoint and GetWorker agree.

The HTTP port (``--metrics-listen``, :func:`serve_http`) answers ``/metrics`` and ``/healthz`` and
404 for anything else. When the manager has a bearer token, ``/metrics`` needs it too
(``Authorization: Bearer <token>``, as Prometheus sends it with ``authorization: {credentials_file}``;
401 with ``WWW-Authenticate: Bearer`` otherwise): the series name every worker, its memory, its
state and its leases, which the gRPC API only shows to token holders. ``/healthz`` stays
open, like gRPC health, so a probe needs no secret; it reveals only that the port answers.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import threading
from collections.abc import Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from memsvc.manager.reports import Device, ServedModel, Transition, WorkerStatus
from memsvc.runtime.auth import bearer_token
from memsvc.runtime.metrics import build_info
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
        self.host_pinned = Gauge(
            "memsvc_worker_host_pinned_bytes",
            "Page-locked host memory the worker holds: backups, staging and its host reserve",
            ["worker"],
            registry=r,
        )
        self.disk = Gauge(
            "memsvc_worker_disk_bytes", "Bytes the worker's disk tier holds in files", ["worker"], registry=r
        )
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
            ["worker", "kind"],
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
        build_info(r)
        self.leased_sleeps = Counter(
            "memsvc_leased_worker_sleeps_total",
            "Leased workers put to sleep by a call the manager did not make (a direct worker Sleep): the lease "
            "promised it awake",
            ["worker"],
            registry=r,
        )
        self.turns = Counter(
            "memsvc_turns_yielded_total",
            "Turns a busy worker gave up: its requests paused and it slept so another could wake on its device",
            ["worker"],
            registry=r,
        )
        self.waiting = Gauge(
            "memsvc_worker_waiting_acquires",
            "AcquireWorker calls waiting for the worker to wake",
            ["worker"],
            registry=r,
        )
        self.paused = Gauge(
            "memsvc_worker_paused_generations",
            "Generate calls paused on the worker until its next wake",
            ["worker"],
            registry=r,
        )
        self.leader = Gauge(
            "memsvc_manager_leader",
            "1 while this manager serves (a replica: while it leads; the others forward to it)",
            registry=r,
        )
        self.calls = Gauge(
            "memsvc_worker_calls_in_flight",
            "Sleep and WakeUp calls the manager sent the worker and has no answer to yet (a stuck one stays up)",
            ["worker"],
            registry=r,
        )
        self.start_timeout = Gauge(
            "memsvc_worker_start_timeout_seconds",
            "The worker's policy start_timeout: how long an acquire waits for it while it is unavailable "
            "(above 0: its process is started on demand, and its being down is not an outage)",
            ["worker"],
            registry=r,
        )
        self.info = Gauge(
            "memsvc_worker_info",
            "1 per worker, labelled with what it serves where: join on worker for per-model panels",
            ["worker", "model", "backend", "device"],
            registry=r,
        )
        self._tags: dict[str, set[str]] = {}
        self._info: dict[str, tuple[str, str, str, str]] = {}

    def serve(self, listen: str, token: str = "") -> tuple[str, int]:
        """Serve ``/metrics`` and ``/healthz`` on ``listen`` (``host:0`` picks a port) from a daemon
        thread; ``/metrics`` needs ``token`` when one is given. The host and the bound port."""
        return serve_http(listen, http_app(self.registry, token))

    def update_worker(
        self,
        worker_id: str,
        reachable: bool,
        state: WorkerState,
        status: WorkerStatus | None,
        leases: int,
        waiting: int = 0,
    ) -> None:
        self.up.labels(worker_id).set(1 if reachable else 0)
        self.waiting.labels(worker_id).set(waiting)
        current = state.label if state != WorkerState.UNSPECIFIED else ""
        for s in STATES:
            self.state.labels(worker_id, s).set(1 if s == current else 0)
        self.leases.labels(worker_id).set(leases)
        if status is None:
            return
        model, device = status.model or ServedModel(), status.device or Device()
        labels = (worker_id, model.served_model_name, device.backend, str(device.index))
        if self._info.get(worker_id) != labels:  # one series per worker: the old one goes when it changes
            if worker_id in self._info:
                self.info.remove(*self._info[worker_id])
            self._info[worker_id] = labels
            self.info.labels(*labels).set(1)
        self.device_free.labels(worker_id).set(device.free_bytes)
        self.host_pinned.labels(worker_id).set(status.host_pinned_bytes)
        self.disk.labels(worker_id).set(status.disk_bytes)
        self.paused.labels(worker_id).set(status.paused_generations)
        seen = set()
        for t in status.tags:
            seen.add(t.tag)
            self.mapped.labels(worker_id, t.tag).set(t.mapped_bytes)
            self.offloaded.labels(worker_id, t.tag).set(t.offloaded_bytes)
            self.allocated.labels(worker_id, t.tag).set(t.allocated_bytes)
        self._tags[worker_id] = seen

    def forget_worker(self, worker_id: str) -> None:
        """Drop every series of a deregistered worker (a scrape must not keep reporting it)."""
        for gauge in (
            self.up,
            self.device_free,
            self.host_pinned,
            self.disk,
            self.leases,
            self.leased_sleeps,
            self.turns,
            self.waiting,
            self.paused,
            self.calls,
            self.start_timeout,
        ):
            with contextlib.suppress(KeyError):
                gauge.remove(worker_id)
        for s in STATES:
            with contextlib.suppress(KeyError):
                self.state.remove(worker_id, s)
        if worker_id in self._info:
            self.info.remove(*self._info.pop(worker_id))
        for tag in self._tags.pop(worker_id, set()):
            for per_tag in (self.mapped, self.offloaded, self.allocated):
                with contextlib.suppress(KeyError):
                    per_tag.remove(worker_id, tag)
        for counter in (self.transitions, self.moved, self.duration):
            for labels in [key for key in counter._metrics if key[0] == worker_id]:
                counter.remove(*labels)

    def transition(self, worker_id: str, t: Transition) -> None:
        self.transitions.labels(worker_id, t.kind).inc()
        self.moved.labels(worker_id, t.kind).inc(t.moved_bytes)
        self.duration.labels(worker_id, t.kind).observe(t.seconds)


# ---- the HTTP port ----
log = logging.getLogger("memsvc.metrics")
METRICS_PATH = "/metrics"
HEALTH_PATH = "/healthz"


def _plain(
    start_response: StartResponse, status: str, text: str, headers: Iterable[tuple[str, str]] = ()
) -> list[bytes]:
    body = text.encode()
    start_response(
        status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))), *headers]
    )
    return [body]


def http_app(registry: CollectorRegistry, token: str = "") -> WSGIApplication:
    """The WSGI app of the metrics port: prometheus_client's exposition behind the token check.

    Exact paths only (prometheus_client alone answers every path with the metrics, which hid typos
    in scrape configs and made every URL a metrics URL). The token is compared with
    ``hmac.compare_digest``, as on the gRPC port; the header arrives as a latin-1 native string
    (PEP 3333), so it is turned back into its bytes before comparing with the token's UTF-8.
    """
    metrics: WSGIApplication = make_wsgi_app(registry)
    expected = token.encode()

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path == HEALTH_PATH:
            return _plain(start_response, "200 OK", "ok\n")
        if path != METRICS_PATH:
            return _plain(start_response, "404 Not Found", f"not found: try {METRICS_PATH} or {HEALTH_PATH}\n")
        if expected:
            header = environ.get("HTTP_AUTHORIZATION")
            given = bearer_token([("authorization", header)]) if header else None
            if given is None:
                return _plain(
                    start_response,
                    "401 Unauthorized",
                    "send 'Authorization: Bearer <token>'\n",
                    [("WWW-Authenticate", 'Bearer realm="memsvc"')],
                )
            if not hmac.compare_digest(given.encode("latin-1"), expected):
                return _plain(
                    start_response,
                    "401 Unauthorized",
                    "invalid bearer token\n",
                    [("WWW-Authenticate", 'Bearer realm="memsvc", error="invalid_token"')],
                )
        return metrics(environ, start_response)

    return app


class _Handler(WSGIRequestHandler):
    """Request lines go to the debug log, not stderr (a scrape every few seconds is noise)."""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s: " + format, self.address_string(), *args)


class _Server(ThreadingMixIn, WSGIServer):
    """A thread per request, daemonic so a stuck client cannot hold up the manager's exit."""

    daemon_threads = True


def serve_http(listen: str, app: WSGIApplication) -> tuple[str, int]:
    """Serve ``app`` on ``listen`` (``host:port``, ``[v6]:port``; an empty host is every IPv4
    address) from a daemon thread; the host as given and the bound port (``:0`` works)."""
    host, _, port = listen.rpartition(":")
    bind = host.strip("[]") or "0.0.0.0"
    family, *_, sockaddr = socket.getaddrinfo(bind, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = type("_FamilyServer", (_Server,), {"address_family": family})
    httpd: WSGIServer = make_server(str(sockaddr[0]), int(port), app, server_class, handler_class=_Handler)
    threading.Thread(target=httpd.serve_forever, name="memsvc-metrics-http", daemon=True).start()
    return host, int(httpd.server_port)
