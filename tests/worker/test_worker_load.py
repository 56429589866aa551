"""The worker's load in process (host backend, synthetic model): the state reads AWAKE only once the
load's transition lock is free, so a client that sees AWAKE (a status poll, the telemetry watch) and
sends a Generate at once is served. A fresh-clone run on a busy 2-core machine met the load still
holding the lock: the serving bench's first Generate got FAILED_PRECONDITION ("a transition is
pending")."""

from __future__ import annotations

import asyncio

import pytest

from memsvc.vocabulary import WorkerState
from worker.config import WorkerConfig
from worker.core import WorkerCore
from worker.model.generation import GenerationRequest
from worker.telemetry import Event, StateChange

pytestmark = pytest.mark.asyncio


async def test_the_state_reads_awake_only_once_the_load_lets_go_of_the_transition_lock() -> None:
    core = WorkerCore(
        WorkerConfig(
            model="synthetic:tiny", backend="host", kv_blocks=32, host_kv_blocks=8, host_capacity_bytes=256 << 20
        ),
        asyncio.get_running_loop(),
    )
    publish = core.telemetry.publish
    held_at_awake: list[bool] = []

    def watching(event: Event) -> None:  # called where the state changes (the device loop), as it does
        if isinstance(event.data, StateChange) and event.data.new == WorkerState.AWAKE:
            held_at_awake.append(core._sm.in_progress)
            if not core._sm.in_progress:
                core.reserve_generate().release()  # what a client seeing AWAKE does first
        publish(event)

    core.telemetry.publish = watching  # type: ignore[method-assign]
    try:
        await core.load()
        assert held_at_awake == [False]
        generation = await core.generate(GenerationRequest([5, 6, 7], 3, ignore_eos=True))
        assert len(generation.tokens) == 3
    finally:
        await core.close()
