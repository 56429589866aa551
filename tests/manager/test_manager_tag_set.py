"""Every tag a worker has takes part in its sleeps and wakes, whatever a policy or a client names.

The ``cuda_graphs`` tag (a cuda worker's decode graphs) is the one nobody names: the default policy
says ``weights`` and ``kv_cache``, and vLLM-style clients wake ``weights`` and then ``kv_cache``. So a
policy's tier-1 sleep acts on every tag of the worker (the tag's level-1 action where the policy does
not name it, memsvc.vocabulary.policy_actions), and a wake of ``kv_cache`` wakes ``cuda_graphs`` with
it (memsvc.vocabulary.wake_set): the worker ends AWAKE and serving. The tag itself exists from the
worker's load on, empty until captured (worker/core.py): checked here on the host backend's
allocator, and through a cuda worker in tests/gpu/test_cuda_worker.py.

In process: a real Manager on a real SQLite file, in-memory workers with a ``cuda_graphs`` tag.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from asyncwait import wait_until
from conftest import AllocatorFactory
from stores import STORE_KINDS, store_for

from memsvc.manager.controller import Manager
from memsvc.manager.inmemory import InMemoryLinks, InMemoryWorker
from memsvc.manager.settings import ManagerSettings
from memsvc.runtime.deadline import NO_DEADLINE
from memsvc.vocabulary import CUDA_GRAPHS, KV_CACHE, WEIGHTS, Action, TagState, WorkerState

MiB = 1 << 20


@pytest_asyncio.fixture(params=STORE_KINDS)
async def manager(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[Manager, InMemoryLinks]]:
    links = InMemoryLinks()
    mgr = Manager(store_for(request, tmp_path), ManagerSettings(tick_interval=3600.0), links=links)  # we tick
    await mgr.start()
    yield mgr, links
    await mgr.close()
    mgr.store.close()


async def _worker(mgr: Manager, links: InMemoryLinks, wid: str) -> InMemoryWorker:
    wk = links.add(InMemoryWorker(wid, weights_bytes=64 * MiB, kv_bytes=16 * MiB, graphs_bytes=4 * MiB))
    mgr.registry.register(wid, wk.address, "h1")
    await wait_until(lambda: mgr.registry.get(wid).state == WorkerState.AWAKE, f"{wid} awake at the manager")
    return wk


@pytest.mark.asyncio
async def test_the_default_idle_sleep_discards_cuda_graphs_too(manager: tuple[Manager, InMemoryLinks]) -> None:
    mgr, links = manager
    wk = await _worker(mgr, links, "g")
    mgr.update_policy("", {"idle_sleep_timeout": 60.0})
    mgr.registry.get("g").idle_since -= 120
    mgr.timers.tick()
    await wait_until(lambda: wk.state == WorkerState.ASLEEP, "the idle sleep")
    assert {t: v.state for t, v in wk.tags.items()} == {
        WEIGHTS: TagState.OFFLOADED,
        KV_CACHE: TagState.DISCARDED,
        CUDA_GRAPHS: TagState.DISCARDED,
    }
    assert mgr.registry.get("g").mapped_bytes == 0, "nothing the policy did not name stays mapped"


@pytest.mark.asyncio
async def test_waking_weights_then_kv_cache_leaves_the_worker_awake(manager: tuple[Manager, InMemoryLinks]) -> None:
    mgr, links = manager
    wk = await _worker(mgr, links, "g")
    await mgr.transitions.sleep_worker("g", None, {}, "", NO_DEADLINE)  # the policy's tier 1
    await mgr.transitions.wake_worker("g", [WEIGHTS], "", NO_DEADLINE)
    assert mgr.registry.get("g").state == WorkerState.PARTIALLY_AWAKE
    await mgr.transitions.wake_worker("g", [KV_CACHE], "", NO_DEADLINE)
    assert mgr.registry.get("g").state == WorkerState.AWAKE, "cuda_graphs wakes with kv_cache"
    assert all(t.state == TagState.AWAKE for t in wk.tags.values())


def test_a_registered_tag_exists_empty_and_sleeps_and_wakes_like_any(make_allocator: AllocatorFactory) -> None:
    """The allocator side of "the tag set does not change under a client": a tag made known before
    anything is allocated in it, as the worker does with cuda_graphs at load."""
    alloc = make_allocator("host")
    alloc.empty(MiB, torch.uint8, WEIGHTS)
    alloc.register_tag(CUDA_GRAPHS)
    tag = alloc.stats().tags[CUDA_GRAPHS]
    assert tag.state == TagState.AWAKE and tag.mapped_bytes == 0 and tag.allocations == 0
    alloc.sleep({WEIGHTS: Action.OFFLOAD, CUDA_GRAPHS: Action.DISCARD})
    assert alloc.stats().tags[CUDA_GRAPHS].state == TagState.DISCARDED
    alloc.wake_up([CUDA_GRAPHS])
    t = alloc.empty(2 * MiB, torch.uint8, CUDA_GRAPHS)  # the capture's memory, later
    assert alloc.stats().tags[CUDA_GRAPHS].allocated_bytes == t.numel()
