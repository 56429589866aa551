"""A manager in process against in-memory workers (memsvc.manager.inmemory), for the suites that
test its decisions that way: :class:`Env` and the ``env`` fixture (import ``inmemory_env`` to use it),
on each store: the store is a real SQLite file or PostgreSQL database; timers are driven by calling
``tick()`` with idle clocks moved back, not by sleeping.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypedDict, Unpack

import pytest
import pytest_asyncio
from asyncwait import wait_until
from google.protobuf.duration_pb2 import Duration
from stores import STORE_KINDS, store_for

from memsvc.manager.controller import Manager
from memsvc.manager.inmemory import InMemoryLinks, InMemoryWorker
from memsvc.manager.records import WorkerRecord
from memsvc.manager.settings import ManagerSettings
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.vocabulary import WorkerState

GiB = 1 << 30


class _Sizes(TypedDict, total=False):
    weights_bytes: int
    kv_bytes: int
    device_total_bytes: int
    offload_dir: str


class _PolicyFields(TypedDict, total=False):
    device_budget_bytes: int
    host_budget_bytes: int
    device_swap_headroom_bytes: int
    idle_sleep_timeout: Duration
    idle_deep_sleep_timeout: Duration
    time_slice: Duration
    start_timeout: Duration


class Env:
    def __init__(self, manager: Manager, links: InMemoryLinks) -> None:
        self.manager = manager
        self.links = links

    async def worker(self, wid: str, host: str = "h1", **sizes: Unpack[_Sizes]) -> InMemoryWorker:
        wk = self.links.add(InMemoryWorker(wid, **sizes))
        await self.manager.register(wid, wk.address, host)
        await wait_until(lambda: self.rec(wid).state == WorkerState.AWAKE, f"{wid} awake at the manager")
        return wk

    def rec(self, wid: str) -> WorkerRecord:
        return self.manager.get(wid)

    def idle_for(self, wid: str, seconds: float) -> None:
        """Move the worker's idle clock back, as if it had been idle that long."""
        rec = self.rec(wid)
        rec.idle_since -= seconds
        if rec.status is not None:
            t = rec.status.last_activity_time
            t.FromNanoseconds(t.ToNanoseconds() - int(seconds * 1e9))

    async def policy(self, **fields: Unpack[_PolicyFields]) -> None:
        p = manager_pb.Policy(**fields)
        self.manager.update_policy("", p, list(fields))


@pytest_asyncio.fixture(params=STORE_KINDS, name="env")
async def inmemory_env(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Env]:
    """Every test here on each store: the manager's decisions must not depend on where it keeps them."""
    links = InMemoryLinks()
    # a tick interval of an hour: the tests call tick() themselves
    manager = Manager(store_for(request, tmp_path), ManagerSettings(tick_interval=3600.0), links=links)
    await manager.start()
    yield Env(manager, links)
    await manager.close()
    manager.store.close()


__all__ = ["GiB", "Env", "inmemory_env"]
