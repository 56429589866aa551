"""An honest in-memory worker behind the :class:`~memsvc.manager.links.WorkerLink` interface.

For fast, in-process tests of the manager's decisions (budgets, leases, idle timers) and for
embedders who want to try the manager without a GPU or a worker process. :class:`InMemoryWorker`
keeps the state a real worker reports (per-tag sizes and states, the worker state, the sleep level)
and applies Sleep and WakeUp with the worker's rules: the level table, explicit tag actions over it,
level-1 to level-2 demotion, partial wake, FAILED_PRECONDITION for a transition that does not fit
the state, ABORTED while another runs, UNAVAILABLE while it is "down", and a repeated request_id
answered with the first call's result (memsvc/runtime/replay.py, as the worker). It sends telemetry the way
a worker does: a snapshot when the link starts, then a state change and a snapshot per transition.

It speaks the manager's own types (memsvc/manager/reports.py), as every link does to the manager:
no message is built or read here but SwapBlocks's, which the manager forwards as the worker's message.

    links = InMemoryLinks()
    a = links.add(InMemoryWorker("a", weights_bytes=8 << 30, kv_bytes=2 << 30, device_total_bytes=16 << 30))
    manager = Manager(store, links=links)
    await manager.start()
    manager.registry.register("a", a.address, "host1")
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from memsvc.errors import (
    InvalidArgument,
    MemsvcError,
    NotFound,
    OutOfMemory,
    TransitionInProgress,
    Unavailable,
    WrongState,
)
from memsvc.manager.links import OnDown, OnMessage, WorkerLink
from memsvc.manager.reports import (
    Answer,
    Device,
    SleepCall,
    StateChange,
    TagMemory,
    Telemetry,
    Transition,
    WakeCall,
    WorkerStatus,
)
from memsvc.runtime.replay import ReplayCache
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.vocabulary import (
    CUDA_GRAPHS,
    KEPT_IN,
    KV_CACHE,
    SLEEP_RULES,
    WEIGHTS,
    Action,
    TagState,
    TransitionKind,
    WorkerState,
    check_known_tags,
    plan_actions,
    sleep_acts_on,
    wake_set,
)

R = TypeVar("R")


@dataclass
class _Tag:
    awake_bytes: int
    state: TagState = TagState.AWAKE


class InMemoryWorker:
    """One simulated worker: tags and their sizes, state, and the transitions that change them."""

    def __init__(
        self,
        worker_id: str,
        *,
        weights_bytes: int = 1 << 30,
        kv_bytes: int = 256 << 20,
        device_total_bytes: int = 8 << 30,
        device_index: int = 0,
        address: str = "",
        offload_dir: str = "",
        graphs_bytes: int = 0,
    ) -> None:
        """``graphs_bytes``: a ``cuda_graphs`` tag of that size, as a cuda worker's decode graphs have."""
        self.worker_id = worker_id
        self.offload_dir = offload_dir
        """Non-empty: the worker has a disk tier (OFFLOAD_DISK); nothing is written anywhere."""
        self.disk_full = False
        """True: a sleep to disk fails as a worker's on a full disk (RESOURCE_EXHAUSTED, nothing changed)."""
        self.address = address or f"inmemory-{worker_id}:1"
        self.device_total_bytes = device_total_bytes
        self.device_index = device_index
        self.tags: dict[str, _Tag] = {WEIGHTS: _Tag(weights_bytes), KV_CACHE: _Tag(kv_bytes)}
        if graphs_bytes:
            self.tags[CUDA_GRAPHS] = _Tag(graphs_bytes)
        self.state = WorkerState.AWAKE
        self.sleep_level = 0
        self.up = True
        """False: every call fails UNAVAILABLE and the telemetry stream ends (a crashed worker)."""
        self.gate: asyncio.Event | None = None
        """When set to an unset Event, transitions wait on it (a slow sleep or wake, held open)."""
        self.calls: list[str] = []
        """Every transition call received, in order (``Sleep``, ``WakeUp``, ``SwapBlocks``)."""
        self.pausing_sleeps = 0
        """Sleeps that asked to pause the running generations (a turn given up; this double runs none)."""
        self.refuse: MemsvcError | None = None
        """When set, transitions fail with it and change nothing (a worker that says no)."""
        self._busy = False
        self._replay = ReplayCache(512)
        self._last = Transition()
        self._links: list[_InMemoryLink] = []
        """Links following this worker's telemetry."""
        self.handlers: set[asyncio.Task[Any]] = set()
        """Calls running here, whoever still waits for them."""

    # ---- what a worker reports ----
    def status(self) -> WorkerStatus:
        tags = tuple(
            TagMemory(
                tag=name,
                state=t.state,
                mapped_bytes=t.awake_bytes if t.state == TagState.AWAKE else 0,
                allocated_bytes=t.awake_bytes,
                offloaded_bytes=t.awake_bytes if t.state == TagState.OFFLOADED else 0,
                discarded_bytes=t.awake_bytes if t.state == TagState.DISCARDED else 0,
                awake_bytes=t.awake_bytes,
                disk_bytes=t.awake_bytes if t.state == TagState.ON_DISK else 0,
            )
            for name, t in sorted(self.tags.items())
        )
        mapped = sum(t.mapped_bytes for t in tags)
        return WorkerStatus(
            worker_id=self.worker_id,
            state=self.state,
            device=Device(
                backend="inmemory",
                index=self.device_index,
                total_bytes=self.device_total_bytes,
                free_bytes=self.device_total_bytes - mapped,
            ),
            tags=tags,
            last_transition=self._last,
            update_time_ns=time.time_ns(),
            sleep_level=self.sleep_level,
            transition_in_progress=self._busy,
            offload_dir=self.offload_dir,
        )

    async def _send(self, event: WorkerStatus | StateChange) -> None:
        msg = Telemetry(time.time_ns(), event)
        for link in list(self._links):
            await link.on_message(msg)

    async def hold_transition(self, held: bool) -> None:
        """Report a transition accepted but not begun (one queued behind device work, asked for by
        someone else than the manager), or no longer; tell telemetry subscribers."""
        self._busy = held
        await self._send(self.status())

    async def crash(self) -> None:
        """Go down: calls fail UNAVAILABLE, and every telemetry stream ends."""
        self.up = False
        links, self._links = self._links, []
        for link in links:
            await link.on_down("UNAVAILABLE: telemetry stream ended")

    async def revive(self) -> None:
        """Come back (as after a restart, state kept): links that try again reconnect."""
        self.up = True

    async def _set_state(self, new: WorkerState, reason: str) -> None:
        old, self.state = self.state, new
        if old != new:
            await self._send(StateChange(old, new, reason))

    # ---- transitions ----
    @contextlib.asynccontextmanager
    async def _transition(self, method: str) -> AsyncIterator[None]:
        self.calls.append(method)
        if not self.up:
            raise Unavailable(f"worker {self.worker_id}: UNAVAILABLE: connection refused")
        if self._busy:
            raise TransitionInProgress(f"worker {self.worker_id}: another transition is running")
        if self.refuse is not None:
            raise self.refuse
        self._busy = True
        try:
            if self.gate is not None:
                await self.gate.wait()
            yield
        finally:
            self._busy = False
        await self._send(self.status())

    def _finish(self, kind: TransitionKind, moved: int) -> Transition:
        self._last = Transition(kind=kind, moved_bytes=moved, end_time_ns=time.time_ns())
        return self._last

    async def sleep(self, call: SleepCall) -> Answer:
        return await self._replay.run(call.request_id, "Sleep", lambda _: self._sleep(call))

    async def wake_up(self, call: WakeCall) -> Answer:
        return await self._replay.run(call.request_id, "WakeUp", lambda _: self._wake_up(call))

    async def _sleep(self, call: SleepCall) -> Answer:
        level, explicit = call.level, dict(call.actions)
        if level is None and not explicit:
            raise InvalidArgument("give a sleep level or tag actions")
        check_known_tags(explicit, self.tags)
        async with self._transition("Sleep"):
            self.pausing_sleeps += call.pause_generations
            if self.state not in (WorkerState.AWAKE, WorkerState.PARTIALLY_AWAKE, WorkerState.ASLEEP):
                raise WrongState(f"worker is {self.state.label}")
            todo = {
                t: a
                for t, a in plan_actions(level, explicit).items()
                if t in self.tags and sleep_acts_on(self.tags[t].state, a)
            }
            if not todo:
                raise WrongState(f"worker is {self.state.label}: every named tag is already asleep or kept")
            if Action.OFFLOAD_DISK in todo.values() and not self.offload_dir:
                raise WrongState("this worker has no disk tier: start it with an offload directory")
            if Action.OFFLOAD_DISK in todo.values() and self.disk_full:
                raise OutOfMemory(f"the offload directory {self.offload_dir} is full")
            before = self.state
            await self._set_state(WorkerState.SLEEPING, "Sleep")
            moved = 0
            for tag, action in todo.items():
                t = self.tags[tag]
                after = SLEEP_RULES[(t.state, action)]
                if after is None:  # todo holds only what sleep_acts_on let through
                    raise WrongState(f"tag {tag!r} is {t.state.value}: a sleep with {action.label} is refused")
                t.state = after
                moved += t.awake_bytes if action in KEPT_IN else 0
            reported = int(level) if level is not None and not explicit else 0
            self.sleep_level = max(reported, self.sleep_level) if before == WorkerState.ASLEEP else reported
            await self._set_state(WorkerState.ASLEEP, "Sleep")
            transition = self._finish(TransitionKind.SLEEP, moved)
        return Answer(self.status(), transition)

    async def _wake_up(self, call: WakeCall) -> Answer:
        tags = list(call.tags)
        check_known_tags(tags, self.tags)
        async with self._transition("WakeUp"):
            if self.state not in (WorkerState.ASLEEP, WorkerState.PARTIALLY_AWAKE):
                raise WrongState(f"worker is {self.state.label}; this needs it asleep or partially_awake")
            for tag in tags:
                if self.tags[tag].state == TagState.AWAKE:
                    raise WrongState(f"tag {tag!r} is not asleep")
            await self._set_state(WorkerState.WAKING, "WakeUp")
            moved = 0
            asleep = [t for t, v in self.tags.items() if v.state != TagState.AWAKE]
            for tag in wake_set(tags, asleep) if tags else asleep:
                moved += self.tags[tag].awake_bytes
                self.tags[tag].state = TagState.AWAKE
            if all(t.state == TagState.AWAKE for t in self.tags.values()):
                self.sleep_level = 0
                await self._set_state(WorkerState.AWAKE, "WakeUp")
            else:
                await self._set_state(WorkerState.PARTIALLY_AWAKE, "WakeUp")
            transition = self._finish(TransitionKind.WAKE, moved)
        return Answer(self.status(), transition)

    async def swap_blocks(self, request: worker_pb.SwapBlocksRequest) -> worker_pb.SwapBlocksResponse:
        self.calls.append("SwapBlocks")
        if not self.up:
            raise Unavailable(f"worker {self.worker_id}: UNAVAILABLE: connection refused")
        if self.tags[KV_CACHE].state != TagState.AWAKE:
            raise WrongState("the KV cache is asleep: wake it first")
        n = len(request.pairs) or len(request.src_blocks) or len(request.src_blocks_u32le) // 4
        if not n:
            raise InvalidArgument("no blocks given")
        return worker_pb.SwapBlocksResponse(moved_bytes=n * 4096)


class _InMemoryLink:
    """The link to one :class:`InMemoryWorker`: calls go straight to it, telemetry comes back.

    Connecting (start, restart, poke) runs as a task, as a real link's stream does; the task is
    kept until it ends."""

    def __init__(self, worker: InMemoryWorker, on_message: OnMessage, on_down: OnDown) -> None:
        self.address = worker.address
        self._worker = worker
        self.on_message = on_message
        self.on_down = on_down
        self._connecting: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self.restart()

    def restart(self) -> None:
        task = asyncio.get_running_loop().create_task(self._connect())
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    def poke(self) -> None:
        if self not in self._worker._links:
            self.restart()

    async def _connect(self) -> None:
        if not self._worker.up:
            await self.on_down("UNAVAILABLE: connection refused")
            return
        if self not in self._worker._links:
            self._worker._links.append(self)
        await self.on_message(Telemetry(time.time_ns(), self._worker.status()))

    async def close(self) -> None:
        for task in list(self._connecting):
            task.cancel()
        await asyncio.gather(*self._connecting, return_exceptions=True)
        if self in self._worker._links:
            self._worker._links.remove(self)

    async def status(self, timeout: float) -> WorkerStatus:
        if not self._worker.up:
            raise Unavailable(f"worker {self._worker.worker_id}: UNAVAILABLE: connection refused")
        return self._worker.status()

    async def sleep(self, call: SleepCall, timeout: float) -> Answer:
        return await self._call(self._worker.sleep(call), timeout)

    async def wake_up(self, call: WakeCall, timeout: float) -> Answer:
        return await self._call(self._worker.wake_up(call), timeout)

    async def swap_blocks(self, request: worker_pb.SwapBlocksRequest, timeout: float) -> worker_pb.SwapBlocksResponse:
        return await self._call(self._worker.swap_blocks(request), timeout)

    async def _call(self, handler: Coroutine[Any, Any, R], timeout: float) -> R:
        """The worker runs the call as a server runs a handler, on its own: a caller whose deadline
        passes (or who is cancelled) stops waiting, and a transition that began runs to its end."""
        task = asyncio.ensure_future(handler)
        self._worker.handlers.add(task)
        task.add_done_callback(self._worker.handlers.discard)
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:  # as the gRPC link reports DEADLINE_EXCEEDED
            raise Unavailable(f"worker {self._worker.worker_id}: DEADLINE_EXCEEDED after {timeout:.1f} s") from None


class InMemoryLinks:
    """A :data:`~memsvc.manager.links.LinkFactory` over in-memory workers, found by address."""

    def __init__(self) -> None:
        self.workers: dict[str, InMemoryWorker] = {}

    def add(self, worker: InMemoryWorker) -> InMemoryWorker:
        self.workers[worker.address] = worker
        return worker

    def __call__(self, worker_id: str, address: str, on_message: OnMessage, on_down: OnDown) -> WorkerLink:
        worker = self.workers.get(address)
        if worker is None:
            raise NotFound(f"no in-memory worker at {address!r}")
        return _InMemoryLink(worker, on_message, on_down)


__all__ = ["InMemoryLinks", "InMemoryWorker"]
