"""A manager in process against in-memory workers (memsvc.manager.inmemory), for the suites that
test its decisions that way: :class:`Env` and the ``env`` fixture (import ``inmemory_env`` to use it),
on each store: the store is a real SQLite file or PostgreSQL database; timers are driven by calling
``tick()`` with idle clocks moved back, not by sleeping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypedDict, Unpack

import pytest
import pytest_asyncio
from asyncwait import wait_until
from stores import STORE_KINDS, store_for

from memsvc.manager.controller import Manager
from memsvc.manager.inmemory import InMemoryLinks, InMemoryWorker
from memsvc.manager.records import WorkerRecord
from memsvc.manager.settings import ManagerSettings
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
    idle_sleep_timeout: float
    idle_deep_sleep_timeout: float
    time_slice: float
    start_timeout: float


class Env:
    def __init__(self, manager: Manager, links: InMemoryLinks) -> None:
        self.manager = manager
        self.links = links

    async def worker(self, wid: str, host: str = "h1", **sizes: Unpack[_Sizes]) -> InMemoryWorker:
        wk = self.links.add(InMemoryWorker(wid, **sizes))
        self.manager.registry.register(wid, wk.address, host)
        await wait_until(lambda: self.rec(wid).state == WorkerState.AWAKE, f"{wid} awake at the manager")
        return wk

    def rec(self, wid: str) -> WorkerRecord:
        return self.manager.registry.get(wid)

    def idle_for(self, wid: str, seconds: float) -> None:
        """Move the worker's idle clock back, as if it had been idle that long."""
        rec = self.rec(wid)
        rec.idle_since -= seconds
        if rec.status is not None and rec.status.last_activity_ns is not None:
            rec.status = dataclasses.replace(
                rec.status, last_activity_ns=rec.status.last_activity_ns - int(seconds * 1e9)
            )

    async def policy(self, **fields: Unpack[_PolicyFields]) -> None:
        """Change these fields of the default policy (durations in seconds)."""
        self.manager.update_policy("", dict(fields))


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
