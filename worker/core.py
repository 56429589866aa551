"""The worker's domain object: one model, its memory pools, and the state machine around them.

Every piece of device work (load, sleep, wake, reload, swap, generate) runs on one dedicated
thread, so the event loop stays free for status and telemetry, and device work is naturally
serialised. Bookkeeping of a transition (state, busy flag, events) happens on that thread inside
the job itself: a client that cancels mid-Sleep leaves the job to finish, and the worker ends in
a consistent state rather than in the one the cancelled coroutine last saw.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from memsvc.errors import IntegrityError, InvalidArgument, MemsvcError, TransitionInProgress, WrongState
from worker.allocator import Action, AllocatorConfig, AllocatorStats, CopyMethod, MemoryAllocator
from worker.telemetry import Event, TelemetryHub

if TYPE_CHECKING:
    from worker.model.kv_cache import PendingSwap  # imports torch: only where a model is loaded

T = TypeVar("T")
log = logging.getLogger("memsvc.worker")

WEIGHTS, KV_CACHE = "weights", "kv_cache"
LEVEL_ACTIONS: dict[int, dict[str, Action]] = {
    1: {WEIGHTS: Action.OFFLOAD, KV_CACHE: Action.DISCARD},
    2: {WEIGHTS: Action.DISCARD, KV_CACHE: Action.DISCARD},
}


class State:
    """Worker states; the names match memsvc.v1.WorkerState."""

    LOADING = "LOADING"
    AWAKE = "AWAKE"
    SLEEPING = "SLEEPING"
    ASLEEP = "ASLEEP"
    WAKING = "WAKING"
    PARTIALLY_AWAKE = "PARTIALLY_AWAKE"


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker is built (the ``memsvc worker`` flags)."""

    model: str = "synthetic:tiny"
    """A Hugging Face-layout checkpoint directory, or ``synthetic:<preset>``."""
    backend: str = "auto"
    device: int = 0
    worker_id: str = ""
    """Name under which the worker registers; default ``<hostname>-<device>``."""
    kv_blocks: int = 256
    """Device KV cache blocks."""
    host_kv_blocks: int = 256
    """Host KV cache blocks (swap space)."""
    block_size: int = 16
    """Tokens per KV block."""
    host_capacity_bytes: int = 8 << 30
    """Host backend only: size of the simulated device."""
    checksum: bool = True
    """Verify offloaded bytes on wake; a mismatch fails the wake with DATA_LOSS naming the allocation."""
    host_reserve_bytes: int = 0
    host_prepin: int | str = 0
    """Host memory to page-lock in the background once the model is loaded, so the first sleep
    runs at line rate: a byte count, or ``"weights"`` for the size of the weights pool."""
    huge_pages: bool = True
    seed: int = 0
    host_name: str = ""
    """Host reported to the manager, whose host budgets group workers by it; default: hostname."""

    def __post_init__(self) -> None:
        prepin = self.host_prepin
        if isinstance(prepin, bool) or not (prepin == "weights" or (isinstance(prepin, int) and prepin >= 0)):
            raise InvalidArgument(f"host_prepin must be a byte count >= 0 or 'weights', got {prepin!r}")

    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}-{self.device}"


@dataclass(frozen=True)
class Transition:
    """What one finished transition moved, and how fast."""

    kind: str
    moved_bytes: int
    seconds: float
    verified_bytes: int = 0
    end_time: float = field(default_factory=time.time)

    @property
    def gigabytes_per_second(self) -> float:
        return self.moved_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Generation:
    """What Generate returns: new tokens, the kept sequence's KV blocks, and the time taken."""

    tokens: list[int]
    block_ids: list[int]
    seconds: float


@dataclass(frozen=True)
class Status:
    """A snapshot of the worker for GetWorkerStatus and telemetry."""

    worker_id: str
    state: str
    sleep_level: int
    device: dict[str, Any]
    model: dict[str, Any]
    memory: AllocatorStats | None
    kv_cache: dict[str, int]
    last_transition: Transition | None
    time: float
    last_activity: float


class WorkerCore:
    REQUEST_CACHE = 512
    PREPIN_JOIN_S = 30.0
    """How long close waits for a prepin to stop (it stops at its next chunk: well under a second)."""
    COPY_WAITERS = 4
    """Threads that wait for SwapBlocks copies to finish: swaps in flight beyond this wait in turn."""

    def __init__(self, config: WorkerConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.config = config
        self.worker_id = config.resolved_worker_id()
        self.telemetry = TelemetryHub(loop)
        self._loop = loop
        self._device_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="memsvc-device")
        self._swaps_submitted = 0
        """SwapBlocks calls sent to the device thread (written on the event loop only)."""
        self._swaps_started = 0
        """SwapBlocks calls the device thread has begun (written on the device thread only)."""
        self._copy_waiters = concurrent.futures.ThreadPoolExecutor(
            self.COPY_WAITERS, thread_name_prefix="memsvc-copywait"
        )
        self._busy = threading.Lock()
        self._state = State.LOADING
        self._sleep_level = 0
        self._last: Transition | None = None
        self._last_memory: AllocatorStats | None = None
        self._done: collections.OrderedDict[str, tuple[str, Any]] = collections.OrderedDict()
        self._done_lock = threading.Lock()
        self.alloc: MemoryAllocator | None = None
        self.runner: Any = None
        self._prepin: threading.Thread | None = None
        """Page-locks host memory after the load (``host_prepin``); the allocator outlives it."""
        self._device: dict[str, Any] = {}
        self._model_info: dict[str, Any] = {"source": config.model}
        self._last_activity = time.time()
        self._activity_published = 0.0
        """Static after load: status() must not wait for the model's lock while Generate runs."""

    # ---- plumbing ----
    async def _run(self, fn: Callable[[], T]) -> T:
        # Shielded: a client that cancels (or whose deadline passes) must not cancel a queued job,
        # because the job itself releases the transition lock and settles the state.
        return await asyncio.shield(self._loop.run_in_executor(self._device_thread, fn))

    def _set_state(self, new: str, reason: str) -> None:
        old, self._state = self._state, new
        if old != new:
            self.telemetry.publish(Event("state_change", {"from": old, "to": new, "reason": reason}))

    def _finish(self, t: Transition) -> Transition:
        self._last = t
        self.telemetry.publish(Event("transition", {"transition": t}))
        return t

    def _replay(self, request_id: str, method: str) -> Any:
        if not request_id:
            return None
        with self._done_lock:
            hit = self._done.get(request_id)
        if hit is None:
            return None
        if hit[0] != method:
            raise InvalidArgument(
                f"request_id {request_id!r} was already used for {hit[0]}", metadata={"requestId": request_id}
            )
        return hit[1]

    def _remember(self, request_id: str, method: str, result: Any) -> None:
        if request_id:
            with self._done_lock:
                self._done[request_id] = (method, result)
                while len(self._done) > self.REQUEST_CACHE:
                    self._done.popitem(last=False)

    def _begin(self) -> None:
        if not self._busy.acquire(blocking=False):
            raise TransitionInProgress(
                f"worker is {self._state.lower()}: another transition is running", metadata={"state": self._state}
            )

    ACTIVITY_PUBLISH_S = 0.2

    def _note_activity(self) -> None:
        """Traffic resets the manager's idle clock; tell telemetry subscribers soon, not at the next
        periodic snapshot (which may come after an idle timer shorter than the period fired)."""
        now = time.time()
        self._last_activity = now
        if now - self._activity_published >= self.ACTIVITY_PUBLISH_S:
            self._activity_published = now
            self.telemetry.publish(Event("activity"))

    @property
    def state(self) -> str:
        return self._state

    # ---- lifecycle ----
    async def load(self) -> None:
        """Create the allocator and load the model (state LOADING -> AWAKE)."""
        self._busy.acquire()
        await self._run(self._load)

    def _load(self) -> None:
        try:
            from worker.model.runner import ModelRunner
            from worker.model.weights import parse_model_spec

            c = self.config
            t0 = time.perf_counter()
            self.alloc = MemoryAllocator(
                AllocatorConfig(
                    backend=c.backend,
                    device=c.device,
                    host_capacity_bytes=c.host_capacity_bytes,  # type: ignore[arg-type]
                    checksum=c.checksum,
                    host_reserve_bytes=c.host_reserve_bytes,
                    huge_pages=c.huge_pages,
                )
            )
            source = parse_model_spec(c.model, seed=c.seed)
            self.runner = ModelRunner(
                self.alloc,
                source,
                num_device_blocks=c.kv_blocks,
                num_host_blocks=c.host_kv_blocks,
                block_size=c.block_size,
            )
            self._device = self._describe_device()
            info = dict(self.runner.info())
            info.pop("kv_cache", None)
            self._model_info = info
            self._last_memory = self.alloc.stats()
            moved = self._last_memory.tags[WEIGHTS].allocated_bytes if WEIGHTS in self._last_memory.tags else 0
            self._finish(Transition("load", moved, time.perf_counter() - t0))
            self._set_state(State.AWAKE, "model loaded")
            self._start_prepin()
        finally:
            self._busy.release()

    def _start_prepin(self) -> None:
        """Page-lock the configured host memory on a thread of its own: the worker serves meanwhile,
        and a sleep that comes first takes the chunks ready so far and makes the rest itself."""
        assert self.alloc is not None and self._last_memory is not None
        want = self.config.host_prepin
        if want == "weights":
            tag = self._last_memory.tags.get(WEIGHTS)
            want = tag.mapped_bytes if tag is not None else 0
        if not isinstance(want, int) or want <= 0:
            return
        alloc = self.alloc

        def prepin() -> None:
            t0 = time.perf_counter()
            try:
                alloc.prepin_host(want)
            except MemsvcError as exc:
                log.warning("host prepin of %.2f GiB stopped: %s", want / 2**30, exc)
                return
            dt = time.perf_counter() - t0
            log.info("host prepin: %.2f GiB page-locked in %.2f s (%.1f GB/s)", want / 2**30, dt, want / dt / 1e9)

        self._prepin = threading.Thread(target=prepin, name="memsvc-prepin", daemon=True)
        try:
            self._prepin.start()
        except RuntimeError as exc:  # no thread to be had: the worker runs, the first sleep pins
            log.warning("host prepin not started: %s", exc)
            self._prepin = None

    def _describe_device(self) -> dict[str, Any]:
        assert self.alloc is not None
        if self.alloc.backend == "cuda":
            import torch

            p = torch.cuda.get_device_properties(self.alloc.device)
            return {"backend": "cuda", "index": self.alloc.device, "name": p.name, "uuid": str(getattr(p, "uuid", ""))}
        return {"backend": "host", "index": self.alloc.device, "name": "host memory", "uuid": ""}

    async def close(self) -> None:
        """Finish queued device work, then release the model and the allocator."""
        await self._run(self._close)
        self._device_thread.shutdown(wait=True)
        self._copy_waiters.shutdown(wait=True)

    def _close(self) -> None:
        self.runner = None
        if self.alloc is not None:
            self.alloc.close()  # also stops a prepin before its next chunk
            self.alloc = None
        if self._prepin is not None:
            # Not past interpreter exit: it may be inside the driver (cuMemHostRegister).
            self._prepin.join(timeout=self.PREPIN_JOIN_S)
            if self._prepin.is_alive():
                log.warning("host prepin still running after %.0f s; exiting anyway", self.PREPIN_JOIN_S)

    # ---- status ----
    def status(self) -> Status:
        memory = self._last_memory
        if self.alloc is not None:
            try:
                memory = self.alloc.stats(wait=False)
                self._last_memory = memory
            except TransitionInProgress:
                pass  # a transition holds the table: report the last snapshot with the live state
        kv = self.kv_stats()
        model = self._model_info
        return Status(
            self.worker_id,
            self._state,
            self._sleep_level,
            dict(self._device),
            model,
            memory,
            kv,
            self._last,
            time.time(),
            self._last_activity,
        )

    def kv_stats(self) -> dict[str, int]:
        """Block counts of the KV cache alone: what SwapBlocks and FreeSequence answer with, without
        the allocator snapshot a full :meth:`status` takes."""
        return dict(self.runner.kv_cache.stats()) if self.runner is not None else {}

    def _require(self, *states: str) -> None:
        if self._state not in states:
            raise WrongState(
                f"worker is {self._state.lower()}; this needs it {' or '.join(s.lower() for s in states)}",
                metadata={"state": self._state},
            )

    # ---- sleep ----
    def plan_sleep(self, level: int, tag_actions: Mapping[str, Action]) -> dict[str, Action]:
        """Actions per tag for a Sleep request; explicit tag actions override the level."""
        if level not in (0, 1, 2):
            raise InvalidArgument(f"sleep level must be 1 or 2, got {level}", metadata={"level": str(level)})
        if level == 0 and not tag_actions:
            raise InvalidArgument("give a sleep level or tag actions")
        known = set(self._last_memory.tags) if self._last_memory else {WEIGHTS, KV_CACHE}
        for tag in tag_actions:
            if tag not in known:
                raise InvalidArgument(f"unknown tag {tag!r}; this worker has {sorted(known)}", metadata={"tag": tag})
        plan = dict(LEVEL_ACTIONS.get(level, {}))
        plan.update(tag_actions)
        return plan

    async def sleep(self, level: int, tag_actions: Mapping[str, Action], request_id: str = "") -> Transition:
        replay = self._replay(request_id, "Sleep")
        if replay is not None:
            return replay  # type: ignore[no-any-return]
        plan = self.plan_sleep(level, tag_actions)
        self._begin()
        try:
            self._require(State.AWAKE, State.PARTIALLY_AWAKE, State.ASLEEP)
            assert self.alloc is not None
            tags = self.alloc.stats().tags
            # Awake tags go to sleep; an offloaded tag asked to DISCARD is demoted (level 1 -> 2),
            # which frees its host copy without waking it.
            todo = {
                t: a
                for t, a in plan.items()
                if t in tags
                and a != Action.KEEP
                and (tags[t].state == "awake" or (tags[t].state == "offloaded" and a == Action.DISCARD))
            }
            if not todo:
                raise WrongState(
                    f"worker is {self._state.lower()}: every named tag is already asleep or kept",
                    metadata={"state": self._state},
                )
        except BaseException:
            self._busy.release()
            raise
        return await self._run(lambda: self._sleep(todo, level if not tag_actions else 0, request_id))

    def _sleep(self, todo: dict[str, Action], level: int, request_id: str) -> Transition:
        assert self.alloc is not None
        before = self._state
        try:
            self._set_state(State.SLEEPING, "Sleep")
            t0 = time.perf_counter()
            ctr0 = self.alloc.stats().counters
            self.alloc.sleep(todo)
            if todo.get(KV_CACHE) == Action.DISCARD and self.runner is not None:
                self.runner.drop_kv()
            seconds = time.perf_counter() - t0
            self._last_memory = self.alloc.stats()
            moved = sum(self._last_memory.tags[t].offloaded_bytes for t, a in todo.items() if a == Action.OFFLOAD)
            self._sleep_level = max(level, self._sleep_level) if before == State.ASLEEP else level
            self._set_state(State.ASLEEP, "Sleep")
            ctr = self._last_memory.counters
            log.info(
                "sleep: %d bytes offloaded in %.3f s (fresh host memory: faulting %.3f s, pinning %.3f s)",
                moved,
                seconds,
                ctr["host_prefault_seconds"] - ctr0["host_prefault_seconds"],
                ctr["host_register_seconds"] - ctr0["host_register_seconds"],
            )
            t = self._finish(Transition("sleep", moved, seconds))
            self._remember(request_id, "Sleep", t)
            return t
        except BaseException as exc:
            # Native sleep is all-or-nothing except when an unmap fails midway: trust the pools.
            if self._tag_states().get(KV_CACHE) == "discarded" and self.runner is not None:
                self.runner.drop_kv()
            self._settle(f"Sleep failed: {exc}")
            raise
        finally:
            self._busy.release()

    # ---- wake ----
    async def wake(self, tags: Sequence[str], request_id: str = "") -> Transition:
        replay = self._replay(request_id, "WakeUp")
        if replay is not None:
            return replay  # type: ignore[no-any-return]
        if len(set(tags)) != len(tags):
            raise InvalidArgument("a tag is named twice")
        known = set(self._last_memory.tags) if self._last_memory else set()
        for tag in tags:  # bad input is INVALID_ARGUMENT whatever the state
            if known and tag not in known:
                raise InvalidArgument(f"unknown tag {tag!r}; this worker has {sorted(known)}", metadata={"tag": tag})
        self._begin()
        try:
            self._require(State.ASLEEP, State.PARTIALLY_AWAKE)
            assert self.alloc is not None
            stats = self.alloc.stats().tags
            for tag in tags:
                if stats[tag].state == "awake":
                    raise WrongState(f"tag {tag!r} is not asleep", metadata={"tag": tag})
            wanted = list(tags) or [t for t, s in stats.items() if s.state != "awake"]
            reload = stats[WEIGHTS].state == "discarded" if WEIGHTS in wanted else False
        except BaseException:
            self._busy.release()
            raise
        return await self._run(lambda: self._wake(wanted, reload, request_id))

    def _wake(self, tags: list[str], reload: bool, request_id: str) -> Transition:
        assert self.alloc is not None
        try:
            self._set_state(State.WAKING, "WakeUp")
            t0 = time.perf_counter()
            ctr0 = self.alloc.stats().counters
            try:
                self.alloc.wake_up(tags)
            except IntegrityError as exc:
                self._recover_from_corruption(exc, reload)
                raise
            if reload:
                try:
                    self.runner.reload_weights()
                except BaseException:
                    # The weights are mapped but hold nothing valid: back to DISCARDED, so the next
                    # WakeUp reloads them again instead of serving garbage.
                    self.alloc.sleep({WEIGHTS: Action.DISCARD})
                    raise
            seconds = time.perf_counter() - t0
            self._last_memory = self.alloc.stats()
            ctr = self._last_memory.counters
            moved = int(ctr["bytes_restored"] - ctr0["bytes_restored"])
            if reload:
                moved += self._last_memory.tags[WEIGHTS].allocated_bytes
            asleep = {t for t, s in self._last_memory.tags.items() if s.state != "awake"}
            self._last_activity = time.time()
            if not asleep:
                self._sleep_level = 0
                self._set_state(State.AWAKE, "WakeUp")
            else:
                self._set_state(State.PARTIALLY_AWAKE, "WakeUp")
            t = self._finish(Transition("wake", moved, seconds, int(ctr["bytes_verified"] - ctr0["bytes_verified"])))
            self._remember(request_id, "WakeUp", t)
            return t
        except BaseException as exc:
            self._settle(f"WakeUp failed: {exc}")
            raise
        finally:
            self._busy.release()

    def _tag_states(self) -> dict[str, str]:
        assert self.alloc is not None
        return {t: s.state for t, s in self.alloc.stats().tags.items()}

    def _settle(self, reason: str) -> None:
        """After a failed transition, the state is whatever the pools say, not what it was before."""
        assert self.alloc is not None
        self._last_memory = self.alloc.stats()
        states = {s.state for s in self._last_memory.tags.values()}
        if states <= {"awake"}:
            self._sleep_level = 0
            new = State.AWAKE
        elif "awake" in states:
            new = State.PARTIALLY_AWAKE
        else:
            new = State.ASLEEP
        self._set_state(new, reason)

    def _recover_from_corruption(self, exc: IntegrityError, reload_pending: bool) -> None:
        """A restored allocation failed its checksum. The native wake left the tags awake and the
        host copy is gone; the weights' source is still the truth, so reload them (the caller still
        gets DATA_LOSS); a corrupt KV cache is dropped."""
        log.error("wake: %s", exc)
        if self.runner is None:
            return
        if reload_pending or f"'{WEIGHTS}'" in str(exc):  # discarded weights still need their reload too
            self.runner.reload_weights()
            log.error("wake: weights reloaded from %s after the checksum failure", self.config.model)
        if KV_CACHE in str(exc):
            self.runner.drop_kv()

    # ---- weights ----
    async def reload_weights(self, request_id: str = "") -> Transition:
        replay = self._replay(request_id, "ReloadWeights")
        if replay is not None:
            return replay  # type: ignore[no-any-return]
        self._begin()
        try:
            self._require(State.AWAKE)
        except BaseException:
            self._busy.release()
            raise
        return await self._run(lambda: self._reload(request_id))

    def _reload(self, request_id: str) -> Transition:
        try:
            t0 = time.perf_counter()
            self.runner.reload_weights()
            assert self.alloc is not None
            self._last_memory = self.alloc.stats()
            t = self._finish(
                Transition("reload_weights", self._last_memory.tags[WEIGHTS].allocated_bytes, time.perf_counter() - t0)
            )
            self._remember(request_id, "ReloadWeights", t)
            return t
        finally:
            self._busy.release()

    # ---- KV blocks and generation ----
    async def swap_blocks(self, direction: str, src: Any, dst: Any, method: CopyMethod) -> Transition:
        """Move block ``src[i]`` to ``dst[i]`` (id arrays, see :meth:`KvCache.swap_ids`)."""
        if direction not in ("out", "in"):
            raise InvalidArgument("direction must be DEVICE_TO_HOST or HOST_TO_DEVICE")
        if not len(src) and not len(dst):
            raise InvalidArgument("no blocks given")
        self._check_kv_awake()
        result: asyncio.Future[Transition] = self._loop.create_future()
        self._swaps_submitted += 1
        self._device_thread.submit(self._swap_job, direction, src, dst, method, result)
        # Shielded like _run: a client that cancels must not cancel a queued swap.
        return await asyncio.shield(result)

    def _check_kv_awake(self) -> None:
        if self._state in (State.LOADING, State.SLEEPING, State.WAKING):
            raise WrongState(f"worker is {self._state.lower()}", metadata={"state": self._state})
        mem = self._last_memory
        if mem is not None and KV_CACHE in mem.tags and mem.tags[KV_CACHE].state != "awake":
            raise WrongState("the KV cache is asleep: wake it first", metadata={"state": self._state})

    def _swap_job(
        self, direction: str, src: Any, dst: Any, method: CopyMethod, result: asyncio.Future[Transition]
    ) -> None:
        """On the device thread: check and enqueue the swap. With another SwapBlocks call queued
        behind this one, a waiter thread waits for the copy while this thread checks and enqueues the
        next; alone, wait here (one thread fewer on the way). Whichever waits settles ``result``: one
        wake-up of the event loop per call."""
        self._swaps_started += 1
        try:
            self._check_kv_awake()
            t0 = time.perf_counter()
            pending = self.runner.begin_swap(direction, src, dst, method)
            self._note_activity()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self._loop.call_soon_threadsafe(_settle_future, result, None, exc)
            return
        if self._swaps_submitted > self._swaps_started:  # each count has one writer thread
            try:
                self._copy_waiters.submit(self._swap_wait, pending, t0, result)
                return
            except RuntimeError:  # the waiters are shut down (worker closing): wait here
                pass
        self._swap_wait(pending, t0, result)

    def _swap_wait(self, pending: PendingSwap, t0: float, result: asyncio.Future[Transition]) -> None:
        try:
            pending.wait()
            t = self._finish(Transition("swap_blocks", pending.moved_bytes, time.perf_counter() - t0))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self._loop.call_soon_threadsafe(_settle_future, result, None, exc)
            return
        self._loop.call_soon_threadsafe(_settle_future, result, t, None)

    async def free_sequence(self, sequence_id: str) -> None:
        if not sequence_id:
            raise InvalidArgument("sequence_id is required")
        if self._state in (State.LOADING, State.SLEEPING, State.WAKING):
            raise WrongState(f"worker is {self._state.lower()}", metadata={"state": self._state})
        await self._run(lambda: self.runner.free_sequence(sequence_id))
        self._note_activity()

    async def generate(self, prompt: list[int], max_new_tokens: int, sequence_id: str) -> Generation:
        self._require(State.AWAKE)
        return await self._run(lambda: self._generate(prompt, max_new_tokens, sequence_id))

    def _generate(self, prompt: list[int], max_new_tokens: int, sequence_id: str) -> Generation:
        self._require(State.AWAKE)  # a Sleep may have run while this job was queued
        t0 = time.perf_counter()
        tokens = self.runner.generate(prompt, max_new_tokens, sequence_id=sequence_id or None)
        self._note_activity()
        blocks = list(self.runner.kv_cache.sequence(sequence_id).block_ids) if sequence_id else []
        return Generation(list(tokens), blocks, time.perf_counter() - t0)


def _settle_future(fut: asyncio.Future[T], value: T | None, exc: BaseException | None) -> None:
    """Complete a future from another thread's result (through call_soon_threadsafe)."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)  # type: ignore[arg-type]


__all__ = ["LEVEL_ACTIONS", "Generation", "MemsvcError", "State", "Status", "Transition", "WorkerConfig", "WorkerCore"]
