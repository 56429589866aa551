"""The manager's composition root: :class:`Manager` builds the parts that decide when workers sleep
and wake, wires them to one another, and starts and stops them. The servicer (and a test, or an
embedder) calls the parts themselves:

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
evictions, operators and leases never race on one worker. The parts speak the manager's own types;
protos stay at the servicer and the gRPC link (memsvc/manager/wire.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from memsvc.manager.background import Background
from memsvc.manager.budgets import Budgets
from memsvc.manager.calls import WorkerCalls
from memsvc.manager.leases import Leases
from memsvc.manager.links import LinkFactory, grpc_links
from memsvc.manager.metrics import ManagerMetrics
from memsvc.manager.policy import Policies, Policy, check_change, check_clear
from memsvc.manager.registry import Registry
from memsvc.manager.settings import ManagerSettings
from memsvc.manager.store import Store, StoredWorker
from memsvc.manager.telemetry import TelemetryIngest
from memsvc.manager.timers import IdleTimers
from memsvc.manager.transitions import Transitions
from memsvc.manager.turns import Turns
from memsvc.manager.watch import WatchHub
from memsvc.runtime.replay import ReplayCache

REQUEST_CACHE = 1024
"""Transition and lease results kept for retries with the same request_id."""


class Manager:
    """The parts of one manager, built and wired (see the module), and their lifecycle: :meth:`start`
    loads the workers and leases the store knows and starts the timers, :meth:`close` stops them all.

    It decides nothing itself but :meth:`update_policy`, the one request that needs two parts: the
    policies, and the registry that says which workers exist and whose overrides a new default must
    keep valid."""

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

    # ---- the one decision that spans two parts ----
    def update_policy(self, name: str, fields: dict[str, Any], clear: Sequence[str] = ()) -> Policy:
        """Change the default policy (no ``name``) or a worker's overrides: ``fields`` set, ``clear``
        removed (``*``: all), so those fields follow the default again. ``fields`` come checked by
        the policy's rules (memsvc/manager/wire.py's policy_fields does it for a request; the servicer
        checks ``clear`` before that, the order its errors always had). The request is judged before
        the worker is looked up: a bad request is INVALID_ARGUMENT whether or not the worker exists."""
        check_clear(clear, for_worker=bool(name))
        check_change(fields, clear)
        if not name:
            return self.policies.update_default(fields, [r.name for r in self.registry])
        return self.policies.update_override(self.registry.get(name).name, fields, clear)


__all__ = ["Manager"]
