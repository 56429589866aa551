"""A manager whose SQLite file cannot be written for a while keeps its leases and workers whole.

The file is locked the way another process locks it (a second connection holding ``BEGIN
IMMEDIATE``: an operator's ``sqlite3`` shell, a backup tool, a second manager started on the same
``--db``); a full disk or a file system gone read-only fails the same statements. Every call that
needs a write must then fail with UNAVAILABLE and change nothing, so it can be retried: before, a
release popped the lease from the manager's table and then failed, leaving it on the worker for good
(never expiring, unreleasable, the worker never sleeping and never deregistered), and an expiry that
failed did the same and stopped the timers' tick.

In process (as tests/manager/inmemory_env.py): a real Manager and a real SQLite file, in-memory workers.
The store's busy timeout is cut from SQLite's 5 s to 0.1 s so that each refused write is quick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from asyncwait import wait_until

from memsvc.errors import NotFound, Unavailable, WrongState
from memsvc.manager.controller import Manager
from memsvc.manager.inmemory import InMemoryLinks, InMemoryWorker
from memsvc.manager.settings import ManagerSettings
from memsvc.manager.store_sqlite import SqliteStore
from memsvc.runtime.deadline import NO_DEADLINE
from memsvc.vocabulary import SleepLevel, WorkerState

pytestmark = pytest.mark.asyncio


class Env:
    def __init__(self, manager: Manager, links: InMemoryLinks, db: Path) -> None:
        self.manager = manager
        self.links = links
        self.db = db

    async def worker(self, wid: str) -> InMemoryWorker:
        wk = self.links.add(InMemoryWorker(wid))
        self.manager.registry.register(wid, wk.address, "h1")
        await wait_until(
            lambda: self.manager.registry.get(wid).state == WorkerState.AWAKE, f"{wid} awake at the manager"
        )
        return wk

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Another connection holds the file's write lock for the block."""
        other = sqlite3.connect(self.db, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            yield
            other.execute("ROLLBACK")
        finally:
            other.close()

    def stored_leases(self) -> set[str]:
        return {sl.lease_id for sl in self.manager.store.leases()}


@pytest_asyncio.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    db = tmp_path / "manager.db"
    links = InMemoryLinks()
    store = SqliteStore(db)
    store._exec("PRAGMA busy_timeout = 100")
    manager = Manager(store, ManagerSettings(tick_interval=3600.0), links=links)  # the tests tick
    await manager.start()
    yield Env(manager, links, db)
    await manager.close()
    manager.store.close()


async def test_a_release_the_store_refuses_changes_nothing_and_can_be_retried(env: Env) -> None:
    await env.worker("a")
    lease, _ = await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE)
    with env.locked(), pytest.raises(Unavailable, match="manager database"):
        env.manager.leases.release(lease.lease_id)
    assert set(env.manager.leases.leases) == set(env.manager.registry.get("a").leases) == {lease.lease_id}
    assert env.stored_leases() == {lease.lease_id}
    with pytest.raises(WrongState):  # still leased: still awake
        await env.manager.transitions.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)

    env.manager.leases.release(lease.lease_id)  # the retry
    assert env.manager.registry.get("a").leases == {} and env.stored_leases() == set()
    await env.manager.transitions.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)
    assert env.manager.registry.get("a").state == WorkerState.ASLEEP


async def test_an_expiry_the_store_refuses_waits_for_a_later_tick_and_the_timers_run_on(env: Env) -> None:
    await env.worker("a")
    b = await env.worker("b")
    env.manager.update_policy("", {"idle_sleep_timeout": 60.0})
    lease, _ = await env.manager.leases.acquire("a", 0.01, "t", "", "", NO_DEADLINE)
    env.manager.registry.get("b").idle_since -= 120  # b is due for its idle sleep
    await asyncio.sleep(0.02)
    with env.locked():
        env.manager.timers.tick()  # the expiry cannot be written; the idle timer still runs
        await wait_until(lambda: b.state == WorkerState.ASLEEP, "b's idle sleep in the tick whose expiry failed")
    assert set(env.manager.registry.get("a").leases) == set(env.manager.leases.leases) == {lease.lease_id}
    assert env.stored_leases() == {lease.lease_id}

    env.manager.timers.tick()
    assert env.manager.registry.get("a").leases == {} and env.manager.leases.leases == {}
    assert env.stored_leases() == set()


async def test_a_grant_or_renewal_the_store_refuses_leaves_no_lease_and_the_old_expiry(env: Env) -> None:
    await env.worker("a")
    with env.locked(), pytest.raises(Unavailable, match="manager database"):
        await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE)
    assert env.manager.registry.get("a").leases == {} and env.manager.leases.leases == {}

    lease, _ = await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE)
    before = lease.expire_time
    with env.locked(), pytest.raises(Unavailable, match="manager database"):
        await env.manager.leases.acquire("a", 3600, "t", lease.lease_id, "", NO_DEADLINE)
    assert env.manager.leases.leases[lease.lease_id].expire_time == before
    assert [sl.expire_time for sl in env.manager.store.leases()] == [before]


async def test_a_deregistration_the_store_refuses_keeps_the_worker_and_can_be_retried(env: Env) -> None:
    a = await env.worker("a")
    with env.locked(), pytest.raises(Unavailable, match="manager database"):
        await env.manager.registry.deregister("a")
    assert env.manager.registry.get("a").state == WorkerState.AWAKE
    assert [sw.worker_id for sw in env.manager.store.workers()] == ["a"]
    await env.manager.transitions.sleep_worker("a", SleepLevel.LEVEL_1, {}, "", NO_DEADLINE)  # its link still works
    assert a.state == WorkerState.ASLEEP

    await env.manager.registry.deregister("a")
    with pytest.raises(NotFound):
        env.manager.registry.get("a")
    assert env.manager.store.workers() == []


async def test_a_deleted_file_refuses_every_write_and_says_so_once(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    """A file deleted under the manager (memsvc/manager/store.py): grants, releases and policy updates
    are UNAVAILABLE naming it and change nothing; an expiry that cannot be written waits as with a
    locked file, and neither the store nor the timers log it again on every tick."""
    await env.worker("a")
    lease, _ = await env.manager.leases.acquire("a", 0.01, "t", "", "", NO_DEADLINE)
    env.db.unlink()
    with pytest.raises(Unavailable, match=re.escape(f"manager database {env.db} was deleted")):
        await env.manager.leases.acquire("a", 60, "t", "", "", NO_DEADLINE)
    with pytest.raises(Unavailable, match="was deleted"):
        env.manager.update_policy("", {"idle_sleep_timeout": 60.0})
    assert env.manager.policies.effective(None).idle_sleep_timeout == 0
    await asyncio.sleep(0.02)
    caplog.clear()
    for _ in range(5):
        env.manager.timers.tick()
    assert set(env.manager.registry.get("a").leases) == {lease.lease_id}, "the expiry could not be written: it waits"
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and "expired leases stay" in said[0], said
