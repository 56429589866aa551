"""The manager's domain object: a small façade over the parts that decide when workers sleep and
wake, and that call them.

- :mod:`~memsvc.manager.registry`: the workers it knows, one link each (``links``: the injected
  :data:`~memsvc.manager.links.LinkFactory`; gRPC by default, in-memory in unit tests);
- :mod:`~memsvc.manager.telemetry`: what workers report, applied to their records;
- :mod:`~memsvc.manager.policy`: default and per-worker tag policy;
- :mod:`~memsvc.manager.transitions`: SleepWorker, WakeWorker, SwapWorkerBlocks;
- :mod:`~memsvc.manager.budgets`: device and host budgets, LRU eviction and demotion;
- :mod:`~memsvc.manager.turns`: busy workers that share a device take turns on it;
- :mod:`~memsvc.manager.leases`: AcquireWorker and ReleaseWorker;
- :mod:`~memsvc.manager.timers`: lease expiry, silent workers, tiered idle sleep.

Every transition the manager starts on a worker holds that worker's lock, so timers, budget
evictions, operators and leases never race on one worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from memsvc.errors import InvalidArgument
from memsvc.manager.background import Background
from memsvc.manager.budgets import Budgets
from memsvc.manager.calls import WorkerCalls
from memsvc.manager.leases import Leases
from memsvc.manager.links import LinkFactory, grpc_links
from memsvc.manager.metrics import ManagerMetrics
from memsvc.manager.policy import FIELDS, Policies, Policy, fields_from_proto
from memsvc.manager.records import Lease, WorkerRecord
from memsvc.manager.registry import Registry
from memsvc.manager.settings import ManagerSettings
from memsvc.manager.store import Store, StoredWorker
from memsvc.manager.telemetry import TelemetryIngest
from memsvc.manager.timers import IdleTimers
from memsvc.manager.transitions import Transitions
from memsvc.manager.turns import Turns
from memsvc.manager.watch import WatchHub
from memsvc.runtime.deadline import NO_DEADLINE, Deadline
from memsvc.runtime.replay import ReplayCache
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.vocabulary import Action, SleepLevel

REQUEST_CACHE = 1024
"""Transition and lease results kept for retries with the same request_id."""


class Manager:
    def __init__(
        self,
        store: Store,
        settings: ManagerSettings | None = None,
        default_policy_fields: dict[str, Any] | None = None,
        static_workers: Sequence[StoredWorker] = (),
        links: LinkFactory | None = None,
        metrics: ManagerMetrics | None = None,
    ) -> None:
        self.store = store
        self.settings = settings or ManagerSettings()
        self.metrics = metrics or ManagerMetrics()
        self.hub = WatchHub()
        self.background = Background()
        self.policies = Policies(store, default_policy_fields)
        ingest = TelemetryIngest(self.metrics, self.hub)
        self.registry = Registry(store, links or grpc_links(), ingest, self.background, self.policies)
        replay = ReplayCache(REQUEST_CACHE)
        self._calls = calls = WorkerCalls(self.registry, ingest, self.settings)
        turns = Turns(self.registry, self.policies, self.background)
        budgets = Budgets(self.registry, self.policies, calls, self.metrics, self.background, turns)
        self.transitions = Transitions(self.registry, calls, budgets, replay)
        self.leases = Leases(
            self.registry, store, self.settings, calls, budgets, ingest, self.metrics, replay, turns, self.policies
        )
        self.timers = IdleTimers(
            self.registry,
            self.policies,
            self.leases,
            budgets,
            calls,
            ingest,
            self.settings,
            self.metrics,
            self.background,
            turns,
        )
        self._static = list(static_workers)
        self._ticker: asyncio.Task[None] | None = None

    # ---- lifecycle ----
    async def start(self) -> None:
        for sw in [*self.store.workers(), *self._static]:
            if sw.configured:
                self.store.save_worker(sw)
            self.registry.add(sw.worker_id, sw.address, sw.host, sw.configured)
        self.leases.restore()
        self._ticker = asyncio.create_task(self.timers.run_forever(), name="manager ticker")

    async def close(self) -> None:
        self._calls.closing = True  # a call cancelled now does not wait to learn how it ended
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        await self.background.close()
        await self.registry.close()

    # ---- the RPCs ----
    @property
    def workers(self) -> dict[str, WorkerRecord]:
        return self.registry.workers

    async def register(self, worker_id: str, address: str, host: str) -> WorkerRecord:
        return self.registry.register(worker_id, address, host)

    async def deregister(self, name: str) -> WorkerRecord:
        return await self.registry.deregister(name)

    def get(self, name: str) -> WorkerRecord:
        return self.registry.get(name)

    def list_workers(self, page_size: int, page_token: str) -> tuple[list[WorkerRecord], str]:
        return self.registry.page(page_size, page_token)

    def policy(self, rec: WorkerRecord | None) -> Policy:
        return self.policies.effective(rec.name if rec is not None else None)

    def update_policy(
        self, name: str, p: manager_pb.Policy | None, paths: list[str], clear: Sequence[str] = ()
    ) -> Policy:
        """Change the default policy (no ``name``) or a worker's overrides; ``clear``: overrides to
        remove (``*``: all), so those fields follow the default again."""
        if clear and not name:
            raise InvalidArgument(
                "clear_fields applies to a worker's overrides; the default policy has none",
                metadata={"field": "clear_fields"},
            )
        unknown = sorted(set(clear) - {*FIELDS, "*"})
        if unknown:
            raise InvalidArgument(
                f"unknown policy field(s) in clear_fields: {', '.join(unknown)}; known: {', '.join(FIELDS)} or *",
                metadata={"field": "clear_fields"},
            )
        fields = fields_from_proto(p, paths) if p is not None else {}
        both = sorted(set(fields) & set(clear)) if "*" not in clear else sorted(fields)
        if both:
            raise InvalidArgument(f"{', '.join(both)}: both changed and cleared", metadata={"field": "clear_fields"})
        if not name:
            return self.policies.update_default(fields, [r.name for r in self.registry])
        return self.policies.update_override(self.get(name).name, fields, clear)

    async def sleep_worker(
        self,
        name: str,
        level: SleepLevel | None,
        tag_actions: dict[str, Action],
        request_id: str,
        deadline: Deadline | None = None,
    ) -> tuple[manager_pb.Worker, common_pb.TransitionStats]:
        return await self.transitions.sleep_worker(name, level, tag_actions, request_id, deadline or NO_DEADLINE)

    async def wake_worker(
        self, name: str, tags: list[str], request_id: str, deadline: Deadline | None = None
    ) -> tuple[manager_pb.Worker, common_pb.TransitionStats]:
        return await self.transitions.wake_worker(name, tags, request_id, deadline or NO_DEADLINE)

    async def swap_blocks(
        self, name: str, request: worker_pb.SwapBlocksRequest, deadline: Deadline | None = None
    ) -> worker_pb.SwapBlocksResponse:
        return await self.transitions.swap_blocks(name, request, deadline or NO_DEADLINE)

    async def acquire(
        self,
        name: str,
        ttl: float,
        holder: str,
        lease_id: str,
        request_id: str,
        deadline: Deadline | None = None,
        keep_alive: float | None = None,
    ) -> tuple[Lease, WorkerRecord]:
        return await self.leases.acquire(name, ttl, holder, lease_id, request_id, deadline or NO_DEADLINE, keep_alive)

    def release(self, lease_id: str) -> WorkerRecord:
        return self.leases.release(lease_id)

    def tick(self) -> None:
        self.timers.tick()


__all__ = ["Manager"]
