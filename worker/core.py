"""The worker's domain object: one model, its memory pools, and what each transition does to them.

The servicer calls this; this calls the allocator and the model runner. Every piece of device work
is a command of the :class:`~worker.device_loop.DeviceLoop`; every transition takes the path of
:meth:`~worker.state_machine.WorkerStateMachine.run` (replay, input check, lock, state check, job);
SwapBlocks goes through the :class:`~worker.swaps.SwapPipeline`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from memsvc.errors import (
    Cancelled,
    IntegrityError,
    InvalidArgument,
    Loading,
    MemsvcError,
    Overloaded,
    TransitionInProgress,
    Unavailable,
    WrongState,
)
from memsvc.runtime.deadline import NO_DEADLINE, Deadline
from memsvc.runtime.limits import MAX_PATH_BYTES, MAX_QUEUED_GENERATES, check_length
from memsvc.vocabulary import (
    BUSY_STATES,
    CUDA_GRAPHS,
    KEPT_IN,
    KV_CACHE,
    WEIGHTS,
    Action,
    CopyMethod,
    SleepLevel,
    TagState,
    TransitionKind,
    WorkerState,
    check_known_tags,
    plan_actions,
    sleep_acts_on,
    wake_set,
)
from worker.allocator import AllocatorConfig, AllocatorStats, MemoryAllocator
from worker.config import WorkerConfig
from worker.device_loop import DeviceLoop, LoopPost
from worker.host_memory import (
    AUTO,
    IDLE_S,
    BackgroundPrepin,
    HostReserveGuard,
    auto_reserve,
    read_host_memory,
    until_idle,
)
from worker.host_release import HostRelease
from worker.model.hub import known_dir
from worker.model.text_source import TextInfo, TextSource
from worker.staging import CheckpointStaging
from worker.state_machine import Job, WorkerStateMachine
from worker.status import DeviceInfo, Generation, ServedModel, Status, Transition
from worker.swaps import SwapPipeline
from worker.telemetry import Event, EventKind, TelemetryHub

if TYPE_CHECKING:
    from worker.model.generation import GenerationRequest, GenerationResult
    from worker.model.kv_cache import KvStats, PendingSwap  # imports torch: only where a model is loaded
    from worker.model.loader import StreamingLoader
    from worker.model.runner import ModelRunner
    from worker.model.text import ModelText
    from worker.model.weights import ModelSource

log = logging.getLogger("memsvc.worker")

LOADING_RETRY_S = 1.0
"""The retry delay a data-plane call gets while the model loads (its RetryInfo): short beside a load,
long beside a health check, which is how a client that can wait learns the moment it serves."""

_SLEPT_AS = {state: action for action, state in KEPT_IN.items()}
"""The action that puts a tag back where a failed wake found it (anything else: DISCARD)."""


class WorkerCore:
    MAX_QUEUED_GENERATES = MAX_QUEUED_GENERATES
    """Generate calls queued or running at once; more are refused with RESOURCE_EXHAUSTED (Overloaded)."""
    PREPIN_JOIN_S = 5.0
    """How long close waits for a prepin to stop (it stops at its next chunk: well under a second);
    within worker/main.py's grace after the drain."""
    ACTIVITY_PUBLISH_S = 0.2

    def __init__(self, config: WorkerConfig, loop: asyncio.AbstractEventLoop, text_in_front: bool = False) -> None:
        """``text_in_front``: an RPC front in a process of its own reads and serves the model's text
        (worker/main.py relays :attr:`text_source` and :attr:`text_found` between it and the load)."""
        self.config = config
        self.worker_id = config.resolved_worker_id()
        self.telemetry = TelemetryHub(loop)
        self._loop = loop
        self._device_loop = DeviceLoop(loop)
        self.post = LoopPost(loop)
        """What a stream's per-token callback runs through (worker/device_loop.py's LoopPost)."""
        self._sm = WorkerStateMachine(self.telemetry, self._device_loop)
        self._swaps = SwapPipeline(self._device_loop, self._begin_swap, self._sm.finish)
        self._last_memory: AllocatorStats | None = None
        self.alloc: MemoryAllocator | None = None
        self.runner: ModelRunner | None = None
        self._host_release: HostRelease | None = None
        self._prepin: BackgroundPrepin | None = None
        """Page-locks host memory after the load (``host_prepin``) and after a wake that takes back a
        parked reserve; the allocator outlives it."""
        self._reserve_guard: HostReserveGuard | None = None
        """Gives an automatic host reserve back while the host is short (worker/host_memory.py)."""
        self._loader: StreamingLoader | None = None
        """Reads the checkpoint at the load, a level-2 wake and ReloadWeights (cancelled at the stop)."""
        self._loads_cancelled = False
        self._device: DeviceInfo | None = None
        self._model_info = ServedModel(config.model, config.resolved_served_model_name())
        """Static after load: status() must not wait for the model's lock while Generate runs."""
        self._last_activity = time.time()
        self._activity_published = 0.0
        self._generate_lock = threading.Lock()
        self._generates = 0
        """Generate calls queued or running (bounded by MAX_QUEUED_GENERATES)."""
        self.text_in_front = text_in_front
        """The RPC front's process reads the model's text and serves it (worker/front_text.py); this
        one reads it only for stop strings. Else the load reads it here."""
        self.text_source: concurrent.futures.Future[TextSource] = concurrent.futures.Future()
        """Where the model's text is, set by the load as it begins (a directory here), else once it has
        resolved the model: worker/main.py hands it to the RPC front, which reads it while this process
        loads the model."""
        self.text_found: concurrent.futures.Future[TextInfo] = concurrent.futures.Future()
        """What the front found there (worker/main.py sets it); the load waits for it, checks it
        against the model, and reports it (with the text in front only)."""
        self._decoding_file = ""
        """Where the front wrote the model's decoding alone ("": nowhere, or not said yet)."""
        self._decoding_told = asyncio.Event()
        """The front has said where the decoding is, or that there is none (:meth:`decode_with`)."""

    def decode_with(self, file: str) -> None:
        """The RPC front wrote the model's decoding alone to ``file`` ("": it wrote none), after the
        text, which the load waits for: the engine matches stop strings with it
        (worker/model/text_source.py). On the event loop, whenever it comes: the load hands it over
        if the model is not built yet."""
        self._decoding_file = file
        if file and self.runner is not None:
            self.runner.source.text_once.decode_with(file)
        self._decoding_told.set()

    async def stop_strings_ready(self) -> None:
        """Before a request with stop strings goes to the engine: with the text in the RPC front,
        once the load knows there is a tokenizer, wait until the front has said where the decoding
        is (it is written beside the front's read of the text, and comes soon after it), up to
        ``read_timeout``. Waiting here holds neither the engine nor the GIL; without it, a request
        that came first made the engine read the whole text, 0.6 s of every stream's time on the
        H200 (docs/benchmarks.md)."""
        if self.text_in_front and self._model_info.has_tokenizer and not self._decoding_told.is_set():
            with contextlib.suppress(TimeoutError):  # then the engine reads the whole text
                await asyncio.wait_for(self._decoding_told.wait(), self.config.read_timeout)

    def _note_activity(self) -> None:
        """Traffic resets the manager's idle clock; tell telemetry subscribers soon, not at the next
        periodic snapshot (which may come after an idle timer shorter than the period fired)."""
        now = time.time()
        self._last_activity = now
        if now - self._activity_published >= self.ACTIVITY_PUBLISH_S:
            self._activity_published = now
            self.telemetry.publish(Event(EventKind.ACTIVITY))

    @property
    def state(self) -> WorkerState:
        return self._sm.state

    def _model(self) -> ModelRunner:
        assert self.runner is not None, "the model is loaded before any RPC reaches it"
        return self.runner

    def _allocator(self) -> MemoryAllocator:
        assert self.alloc is not None, "the allocator exists from the load until close"
        return self.alloc

    # ---- lifecycle ----
    async def load(self) -> None:
        """Create the allocator and load the model (state LOADING -> AWAKE)."""
        self._sm.begin_blocking()
        await self._device_loop.run(self._load)

    def _load(self) -> None:
        try:
            c = self.config
            t0 = time.perf_counter()
            # A checkpoint directory here: the RPC front reads its text from now, beside the whole
            # load (on a GPU host, torch's import: at a lower priority, worker/background.py). A Hub
            # id's directory, or a synthetic model's vocabulary, is known once the load resolves it.
            if self.text_in_front and (here := known_dir(c.model)) is not None:
                self.text_source.set_result(TextSource(directory=str(here)))
            self.alloc = MemoryAllocator(
                AllocatorConfig(
                    backend=c.backend,  # type: ignore[arg-type]  # checked by MemoryAllocator
                    device=c.device,
                    host_capacity_bytes=c.host_capacity_bytes,
                    checksum=c.checksum,
                    host_reserve_bytes=c.host_reserve_bytes if isinstance(c.host_reserve_bytes, int) else 0,
                    huge_pages=c.huge_pages,
                    offload_dir=c.offload_dir,
                )
            )
            log.info("allocator: %s backend ready in %.2f s", self.alloc.backend, time.perf_counter() - t0)
            if self._loads_cancelled:  # the server did not start (worker/main.py starts the load beside it)
                raise Cancelled("the load was cancelled: the worker is stopping")
            # the shards into device memory while the model layer imports, where they are in the page
            # cache and the device has room (worker/staging.py); the first load copies from there
            staging = CheckpointStaging(self.alloc, c.model).start() if c.checkpoint_staging else None
            # After the allocator (its CUDA context made without the GIL): torch meanwhile imports on
            # worker/main.py's thread, and these wait for what is left of it.
            from worker.model import hub
            from worker.model.loader import StreamingLoader
            from worker.model.paged_attention import graphs_supported
            from worker.model.runner import ModelRunner
            from worker.model.weights import SYNTHETIC_PREFIX, parse_model_spec

            # the loader keeps its staging ring for level-2 wakes and ReloadWeights (allocator memory:
            # pre-faulted and page-locked by native/hostmem.c, counted in host_pinned_bytes)
            self._loader = StreamingLoader(self.alloc, stall_s=c.read_timeout, staging=staging)
            if self._loads_cancelled:
                self._loader.cancel()
            loader = self._loader
            # a Hub id: its snapshot, downloaded into the Hub's cache unless there (not bounded: a
            # download is long and shows its own progress; the Hub's client has its own timeouts)
            spec = c.model if c.model.startswith(SYNTHETIC_PREFIX) else str(hub.resolve(c.model))
            if spec != c.model:
                log.info("model %s: %s", c.model, spec)
            # config and generation config: read bounded as the shards are (a hung mount)
            source = loader.bounded(c.model, lambda: parse_model_spec(spec, seed=c.seed, loader=loader, name=c.model))
            if not self.text_source.done():
                self.text_source.set_result(source.text_once.source)
            elif self.text_source.result() != source.text_once.source:  # known_dir's promise broken
                raise MemsvcError(f"the RPC front read the text at {self.text_source.result()}, not the model's")
            graphs = c.cuda_graphs and self.alloc.backend == "cuda"
            if graphs and not graphs_supported(source.config):
                log.warning(
                    "CUDA graphs off for this model (worker/model/paged_attention.py's triton_supports: "
                    "its head size or numerics); decoding eagerly"
                )
                graphs = False
            self.runner = ModelRunner(
                self.alloc,
                source,
                num_device_blocks=c.kv_blocks,
                num_host_blocks=c.host_kv_blocks,
                block_size=c.block_size,
                max_batch=c.max_batch,
                max_step_tokens=c.max_step_tokens,
                cuda_graphs=graphs,
                defer_graph_capture=True,
            )
            if self.runner.graphs is not None and CUDA_GRAPHS not in self.alloc.stats().tags:
                # captured in the background, once serving: the tag exists (empty) from the start, so
                # a Sleep or WakeUp naming it does not depend on how far the capture got
                self.alloc.register_tag(CUDA_GRAPHS)
            if self.alloc.backend == "cuda":  # the first request must not pay for compiling kernels
                captured = " and the one-sequence decode captured" if self.runner.graphs is not None else ""
                log.info("warm-up: kernels compiled%s in %.2f s", captured, self.runner.warm_up())
            text = self._model_text(source, loader)
            self._host_release = HostRelease(self.alloc, self._device_loop, self._loop, self.runner.engine.last_busy)
            self._device = self._describe_device()
            self._model_info = self._served_model(c.resolved_served_model_name(), text)
            self._last_memory = self.alloc.stats()
            tags = self._last_memory.tags
            moved = tags[WEIGHTS].allocated_bytes if WEIGHTS in tags else 0
            self._sm.finish(Transition(TransitionKind.LOAD, moved, time.perf_counter() - t0))
            self._device_loop.serve(self.runner.engine)
            self._prepin = BackgroundPrepin(self.alloc, self.runner.engine.last_busy)
            self._prepin.request(self._hold_host_memory(), self._unparked, self._repark)
        finally:
            self._sm.release()
            if not self.text_source.done():  # the load failed before it knew: the front reads nothing
                self.text_source.cancel()
        # AWAKE only now, with the load's lock released: a client that sees it (a status poll, the
        # watch) and sends a Generate at once must not meet the load still holding the lock
        # ("a transition is pending"), which it did on a loaded machine while the lines above ran
        self._sm.set_state(WorkerState.AWAKE, "model loaded")
        if self.runner.graphs is not None:  # serving now: the graphs are captured between steps
            self.runner.capture_graphs_in_background(
                self._loop,
                self._device_loop.submit,
                lambda: self.runner is not None and self.state == WorkerState.AWAKE and not self._sm.in_progress,
            )
        if self.text_in_front and self._model_info.has_tokenizer:
            self._loop.call_soon_threadsafe(self._read_decoding_when_idle, self.runner, time.monotonic())

    def _read_decoding_when_idle(self, runner: ModelRunner, since: float) -> None:
        """Read the model's decoding (what the engine matches stop strings with) on the device loop
        once the engine has been idle for host_memory's IDLE_S since ``since``: the read holds the
        GIL (0.11-0.15 s at Llama 3's size on the GPU hosts), and the first request with stop
        strings would otherwise stall every stream for it. A request that comes meanwhile waits for
        it, as for a graph's capture between steps (on this process's event loop). It waits for the
        front to say where it wrote the decoding, if it has not yet (else the whole text is read)."""
        told = self._decoding_told.is_set()
        wait = until_idle(lambda: max(runner.engine.last_busy(), since)) if told else IDLE_S
        if wait > 0:
            self._loop.call_later(wait, self._read_decoding_when_idle, runner, since)
            return

        def read() -> None:
            try:
                runner.source.text_once.decoding()
            except MemsvcError as exc:  # the first request with stop strings meets it again
                log.warning("the model's decoding did not read: %s", exc)

        with contextlib.suppress(RuntimeError):  # the worker stopped meanwhile
            self._device_loop.submit(read)

    def _hold_host_memory(self) -> int:
        """Resolve ``auto`` (worker/host_memory.py): set the reserve, start its guard, and return the
        bytes to pre-pin."""
        alloc, memory, c = self._allocator(), self._last_memory, self.config
        assert memory is not None
        tag = memory.tags.get(WEIGHTS)
        weights = tag.mapped_bytes if tag is not None else 0
        auto = 0
        if AUTO in (c.host_reserve_bytes, c.host_prepin) and alloc.backend == "cuda":
            try:
                auto = auto_reserve(weights, read_host_memory())
            except (OSError, InvalidArgument) as exc:
                log.warning("host memory unreadable, no automatic host reserve: %s", exc)
        if c.host_reserve_bytes == AUTO and auto:
            alloc.set_host_reserve(auto)
            release = self._host_release
            assert release is not None

            def apply(nbytes: int) -> None:
                if nbytes == 0:
                    alloc.cancel_prepin()  # a prepin still running would pin it all again
                self._device_loop.submit(release.set_base, nbytes)

            self._reserve_guard = HostReserveGuard(auto, apply)
            self._loop.call_soon_threadsafe(self._reserve_guard.start)
        prepin = c.host_prepin
        if prepin == AUTO:
            if alloc.backend != "cuda":
                return 0  # nothing to page-lock (worker/host_memory.py)
            # with an explicit reserve, no more than it keeps (a prepin raises the reserve to itself)
            return auto if c.host_reserve_bytes == AUTO else min(weights, int(c.host_reserve_bytes))
        return weights if prepin == WEIGHTS else int(prepin)

    def _describe_device(self) -> DeviceInfo:
        alloc = self._allocator()
        if alloc.backend == "cuda":
            import torch

            p = torch.cuda.get_device_properties(alloc.device)
            return DeviceInfo("cuda", alloc.device, p.name, str(getattr(p, "uuid", "")))
        return DeviceInfo("host", alloc.device, "host memory")

    def _model_text(self, source: ModelSource, loader: StreamingLoader) -> TextInfo:
        """The model's text side, checked against the model: as the front found it (it read it while
        this process loaded the model; waited for here, up to ``read_timeout``), or read here."""
        c = self.config
        if self.text_in_front:
            t0 = time.perf_counter()
            try:
                text = self.text_found.result(timeout=c.read_timeout)
            except concurrent.futures.CancelledError:
                raise Cancelled("the load was cancelled: the worker is stopping") from None
            except TimeoutError:
                raise Unavailable(f"the RPC front did not read the model's text in {c.read_timeout:.0f} s") from None
            log.info("model text: read by the RPC front; waited %.2f s for it", time.perf_counter() - t0)
            if self._decoding_file:  # (else decode_with hands it to the runner when it comes)
                source.text_once.decode_with(self._decoding_file)
        else:  # bounded as the shards are (a hung mount)
            text = TextInfo.of(loader.bounded(c.model, lambda: source.text))
        text.check(source.config.vocab_size, source.name)
        return text

    def _served_model(self, served_model_name: str, text: TextInfo) -> ServedModel:
        """What the loaded model is, for status (fixed until ReloadWeights changes its source)."""
        info = self._model().info()
        return ServedModel(
            source=info["source"],
            served_model_name=served_model_name,
            family=info["family"],
            parameter_count=info["parameter_count"],
            weights_bytes=info["weights_bytes"],
            vocab_size=info["vocab_size"],
            layer_count=info["layer_count"],
            context_length=info["context_length"],
            eos_token_ids=tuple(info["eos_token_ids"]),
            has_tokenizer=text.has_tokenizer,
            has_chat_template=text.has_chat_template,
        )

    def cancel_loads(self) -> None:
        """End the checkpoint read running now (the load, a level-2 wake, ReloadWeights) and refuse
        later ones: the worker is stopping (any thread)."""
        self._loads_cancelled = True
        self.text_found.cancel()  # (a no-op once set)
        if self._loader is not None:
            self._loader.cancel()

    async def close(self) -> None:
        """Finish queued device work, then release the model and the allocator."""
        if self._reserve_guard is not None:
            await self._reserve_guard.stop()
        await self._device_loop.run(self._close)
        self._device_loop.shutdown()
        self._swaps.shutdown()

    def _close(self) -> None:
        self._device_loop.serve(None)
        if self.runner is not None:
            self.runner.engine.fail_all(Unavailable("the worker is shutting down"))
        self.runner = None
        if self._prepin is not None:
            self._prepin.stop()
        if self.alloc is not None:
            self.alloc.close()  # also stops a prepin before its next chunk
            self.alloc = None
        # Not past interpreter exit: it may be inside the driver (cuMemHostRegister).
        if self._prepin is not None and not self._prepin.join(self.PREPIN_JOIN_S):
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
        return Status(
            self.worker_id,
            self._sm.state,
            self._sm.sleep_level,
            self._device,
            self._model_info,
            memory,
            self.kv_stats(),
            self._sm.last,
            time.time(),
            self._last_activity,
            self._sm.in_progress,
            self.config.offload_dir,
            self.runner.engine.paused_requests if self.runner is not None else 0,
            self.recomputed_tokens,
        )

    @property
    def recomputed_tokens(self) -> int:
        """Tokens the engine read again because their request lost its KV blocks."""
        return self.runner.engine.recomputed_tokens if self.runner is not None else 0

    def kv_stats(self) -> KvStats | None:
        """Block counts of the KV cache alone (None before the load): what SwapBlocks and
        FreeSequence answer with, without the allocator snapshot a full :meth:`status` takes."""
        return self.runner.kv_cache.stats() if self.runner is not None else None

    def _check_tags(self, tags: Iterable[str], default: Sequence[str]) -> None:
        """INVALID_ARGUMENT for a tag named twice or one this worker does not have (before its first
        stats: ``default``'s tags, and none are checked when that is empty), whatever the state."""
        check_known_tags(tags, set(self._last_memory.tags) if self._last_memory else set(default))

    def _pool_states(self) -> dict[str, TagState]:
        return {t: s.state for t, s in self._allocator().stats().tags.items()}

    def _settle(self, reason: str) -> None:
        """After a failed transition, the state is whatever the pools say, not what it was before; if
        that is awake, requests a Sleep paused go on (they would wait for a wake that never comes)."""
        self._last_memory = self._allocator().stats()
        self._sm.settle([s.state for s in self._last_memory.tags.values()], reason)
        if self.state == WorkerState.AWAKE:
            self._resume_paused()

    # ---- sleep ----
    def plan_sleep(self, level: SleepLevel | None, tag_actions: Mapping[str, Action]) -> dict[str, Action]:
        """Actions per tag for a Sleep request; explicit tag actions override the level."""
        if level is None and not tag_actions:
            raise InvalidArgument("give a sleep level or tag actions")
        self._check_tags(tag_actions, (WEIGHTS, KV_CACHE))
        return plan_actions(level, tag_actions)

    def _answer(self, t: Transition) -> tuple[Transition, Status]:
        """A transition RPC's result: the transition and the status it left (what a retry gets too)."""
        return t, self.status()

    async def sleep(
        self,
        level: SleepLevel | None,
        tag_actions: Mapping[str, Action],
        request_id: str = "",
        deadline: Deadline = NO_DEADLINE,
        pause: bool = False,
    ) -> tuple[Transition, Status]:
        """Sleep once the Generate calls running end, or with ``pause`` at the next step: they are
        paused (worker/model/engine.py's Engine.pause) and go on after the next whole wake."""
        plan: dict[str, Action] = {}

        def validate() -> None:
            plan.update(self.plan_sleep(level, tag_actions))

        def start() -> Job:
            self._sm.require(WorkerState.AWAKE, WorkerState.PARTIALLY_AWAKE, WorkerState.ASLEEP)
            tags = self._allocator().stats().tags
            # Awake tags go to sleep; a sleeper may be demoted without waking it: an offloaded tag to
            # disk (frees its host copy, keeps its bytes) or, like one on disk, to DISCARD (level 2).
            todo: dict[str, Action] = {t: a for t, a in plan.items() if t in tags and sleep_acts_on(tags[t].state, a)}
            if not todo:
                raise WrongState(
                    f"worker is {self.state.label}: every named tag is already asleep or kept",
                    metadata={"state": self.state.name},
                )
            reported_level = int(level) if level is not None and not tag_actions else 0
            return lambda: self._sleep(todo, reported_level, pause)

        return await self._sm.run("Sleep", request_id, validate, start, deadline, self._answer, idle=not pause)

    def _sleep(self, todo: dict[str, Action], level: int, pause: bool = False) -> Transition:
        alloc = self._allocator()
        before = self.state
        engine = self.runner.engine if self.runner is not None else None
        try:
            self._sm.set_state(WorkerState.SLEEPING, "Sleep")
            t0 = time.perf_counter()
            ctr0 = alloc.stats().counters
            if pause and engine is not None and (paused := engine.pause()):
                log.info("sleep: %d generations paused until the next wake", paused)
            alloc.sleep(todo)
            if todo.get(KV_CACHE) == Action.DISCARD and self.runner is not None:
                self.runner.drop_kv()
            seconds = time.perf_counter() - t0
            if self._host_release is not None:
                self._host_release.restore_reserve()  # chunks a wake held and this sleep did not reuse
            self._last_memory = alloc.stats()
            tags = self._last_memory.tags
            self._park_reserve()
            moved = sum(tags[t].offloaded_bytes + tags[t].disk_bytes for t, a in todo.items() if a in KEPT_IN)
            self._sm.sleep_level = max(level, self._sm.sleep_level) if before == WorkerState.ASLEEP else level
            self._sm.set_state(WorkerState.ASLEEP, "Sleep")
            ctr = self._last_memory.counters
            fault = ctr["host_prefault_seconds"] - ctr0["host_prefault_seconds"]
            pin = ctr["host_register_seconds"] - ctr0["host_register_seconds"]
            acted = ", ".join(f"{t} {a.name.lower()}" for t, a in sorted(todo.items()))
            how = f"level {level}" if level else "tag actions"
            if moved:
                fresh = f" (fresh host memory: faulting {fault:.3f} s, pinning {pin:.3f} s)" if fault or pin else ""
                log.info("sleep (%s: %s): %d bytes offloaded in %.3f s%s", how, acted, moved, seconds, fresh)
            else:  # a sleep that only discards (level 2, or a demotion) moved nothing: say what it did
                log.info("sleep (%s: %s): nothing offloaded, %.3f s", how, acted, seconds)
            return self._sm.finish(Transition(TransitionKind.SLEEP, moved, seconds))
        except BaseException as exc:
            # Native sleep is all-or-nothing except when an unmap fails midway: trust the pools.
            if self._pool_states().get(KV_CACHE) == TagState.DISCARDED and self.runner is not None:
                self.runner.drop_kv()
            self._settle(f"Sleep failed: {exc}")  # nothing slept: the paused requests go on at once
            raise

    # ---- wake ----
    async def wake(
        self, tags: Sequence[str], request_id: str = "", deadline: Deadline = NO_DEADLINE
    ) -> tuple[Transition, Status]:
        wanted: list[str] = []
        reload = False

        def validate() -> None:
            self._check_tags(tags, ())

        def start() -> Job:
            nonlocal reload
            self._sm.require(WorkerState.ASLEEP, WorkerState.PARTIALLY_AWAKE)
            stats = self._allocator().stats().tags
            for tag in tags:
                if stats[tag].state == TagState.AWAKE:
                    raise WrongState(f"tag {tag!r} is not asleep", metadata={"tag": tag})
            asleep = [t for t, s in stats.items() if s.state != TagState.AWAKE]
            wanted.extend(wake_set(tags, asleep) if tags else asleep)
            reload = stats[WEIGHTS].state == TagState.DISCARDED if WEIGHTS in wanted else False
            return lambda: self._wake(wanted, reload)

        return await self._sm.run("WakeUp", request_id, validate, start, deadline, self._answer)

    def _wake(self, tags: list[str], reload: bool) -> Transition:
        alloc = self._allocator()
        if reload:
            self._check_source("the worker stays asleep")
        before = self._pool_states()
        try:
            self._sm.set_state(WorkerState.WAKING, "WakeUp")
            t0 = time.perf_counter()
            ctr0 = alloc.stats().counters
            if self._host_release is not None:
                self._host_release.hold()  # freed chunks go when idle, not under the first requests
            try:
                alloc.wake_up(tags)
            except IntegrityError as exc:
                self._recover_from_corruption(exc, reload)
                raise
            if reload:
                try:
                    self._model().reload_weights()
                except BaseException as exc:
                    # The weights are mapped but hold nothing valid: every tag this wake woke goes back
                    # to how it slept (DISCARDED weights reload on the next WakeUp instead of serving
                    # garbage; an OFFLOADED tag is copied out again), so nothing has changed.
                    alloc.sleep({t: _SLEPT_AS.get(before[t], Action.DISCARD) for t in tags})
                    if isinstance(exc, MemsvcError):
                        raise self._unreadable(exc, "the worker stays asleep as it was") from exc
                    raise
            seconds = time.perf_counter() - t0
            self._last_memory = alloc.stats()
            ctr = self._last_memory.counters
            moved = int(ctr["bytes_restored"] - ctr0["bytes_restored"])
            if reload:
                moved += self._last_memory.tags[WEIGHTS].allocated_bytes
            asleep = {t for t, s in self._last_memory.tags.items() if s.state != TagState.AWAKE}
            self._last_activity = time.time()
            if not asleep:
                self._sm.sleep_level = 0
                self._resume_paused()
                self._sm.set_state(WorkerState.AWAKE, "WakeUp")
            else:
                self._sm.set_state(WorkerState.PARTIALLY_AWAKE, "WakeUp")
            verified = int(ctr["bytes_verified"] - ctr0["bytes_verified"])
            if self._host_release is not None:
                self._host_release.release_when_idle()
                if self._prepin is not None:  # the reserve parked by the sleep, unless a sleep parks it again
                    self._prepin.request(self._host_release.unpark(), self._unparked, self._repark)
            return self._sm.finish(Transition(TransitionKind.WAKE, moved, seconds, verified))
        except BaseException as exc:
            if self._host_release is not None:
                self._host_release.restore_reserve()
            self._settle(f"WakeUp failed: {exc}")
            self._park_reserve()
            raise

    def _resume_paused(self) -> None:
        """Every tag is awake: the requests a Sleep paused go on (their KV blocks come back first). A
        resume that fails ends them with its error; the worker serves on."""
        engine = self.runner.engine if self.runner is not None else None
        if engine is None or not engine.paused:
            return
        try:
            engine.resume()  # no longer paused from its first line, whatever follows
        except Exception as exc:
            log.exception("resuming the paused generations failed: they end")
            engine.fail_all(exc)

    async def end_paused(self) -> None:
        """The worker is stopping: requests a Sleep paused end now (UNAVAILABLE) rather than hold the
        drain for a wake that will not come."""
        engine = self.runner.engine if self.runner is not None else None
        if engine is None or not engine.paused:
            return
        gone = Unavailable("the worker is stopping; this request was paused (its model slept for another)")
        with contextlib.suppress(RuntimeError):  # the device loop is shut down: nothing to end
            if n := await self._device_loop.run(lambda: engine.end_paused(gone)):
                log.info("stopping: %d paused generations ended", n)

    def _unparked(self) -> bool:
        return self._host_release is None or not self._host_release.parked

    def _repark(self) -> None:
        """A prepin that ended while the worker sleeps with its reserve given back: give back what it
        pinned too (on the device loop, where the reserve is changed)."""
        release = self._host_release
        if release is not None:
            with contextlib.suppress(RuntimeError):  # shut down: the allocator's close frees it all
                self._device_loop.submit(lambda: release.park() if release.parked else None)

    def _park_reserve(self) -> None:
        """With no tag awake, the host reserve waits for the wake, not for a sleep: give it back
        (worker/host_release.py) so a sleeper on disk or at level 2 holds no host RAM it cannot use."""
        memory = self._last_memory
        if self._host_release is None or memory is None:
            return
        if all(t.state != TagState.AWAKE for t in memory.tags.values()):
            self._host_release.park()

    def _check_source(self, outcome: str) -> None:
        """Before a reload (a level-2 wake, ReloadWeights) copies a byte: refuse if the weights' source
        cannot be read (its files changed under the worker), with nothing changed."""
        try:
            self._model().source.check()
        except MemsvcError as exc:
            raise self._unreadable(exc, outcome) from exc

    def _unreadable(self, exc: MemsvcError, outcome: str) -> WrongState:
        """FAILED_PRECONDITION, not the loader's INVALID_ARGUMENT: the request was fine, the worker's
        model source is not."""
        source = self._model().source.name
        return WrongState(
            f"the weights cannot be reloaded from {source} ({exc}); {outcome}", metadata={"source": source}
        )

    def _recover_from_corruption(self, exc: IntegrityError, reload_pending: bool) -> None:
        """A restored allocation failed its checksum. The native wake left the tags awake and the
        host copy is gone; the weights' source is still the truth, so reload them (the caller still
        gets DATA_LOSS); a corrupt KV cache is dropped."""
        log.error("wake: %s", exc)
        if self.runner is None:
            return
        failed = exc.metadata.get("tag", "")
        if reload_pending or failed == WEIGHTS:  # discarded weights still need their reload too
            self.runner.reload_weights()
            log.error("wake: weights reloaded from %s after the checksum failure", self.config.model)
        if failed == KV_CACHE:
            self.runner.drop_kv()

    # ---- weights ----
    async def reload_weights(
        self, request_id: str = "", model_path: str = "", deadline: Deadline = NO_DEADLINE
    ) -> tuple[Transition, Status]:
        """The source's weights again, or ``model_path``'s: another checkpoint of exactly this model's
        configuration, which then is the source (see CheckpointSource's ``same_as``)."""

        def start() -> Job:
            self._sm.require(WorkerState.AWAKE)
            return lambda: self._reload(model_path)

        def validate() -> None:
            check_length(model_path, MAX_PATH_BYTES, "model_path")

        return await self._sm.run("ReloadWeights", request_id, validate, start, deadline, self._answer)

    def _reload(self, model_path: str) -> Transition:
        """Checked first (a source that cannot be read, or a checkpoint that does not fit, changes
        nothing). A copy that fails midway leaves a mix of old and new weights: they are discarded, so
        no Generate serves them, and the error says so; the next WakeUp reloads them. A load that
        fails before it wrote a byte (a read that hung from the start) leaves them serving."""
        t0 = time.perf_counter()
        runner = self._model()
        loader = self._loader
        assert loader is not None, "the worker made its loader at the load"
        if model_path:
            from worker.model.weights import CheckpointSource

            # reads its config and headers: bounded as the load is (a directory on a hung mount)
            try:
                source = loader.bounded(
                    model_path, lambda: CheckpointSource(model_path, same_as=runner.source), root=model_path
                )
            except (Unavailable, Cancelled) as exc:
                raise self._unreadable(exc, "the weights are unchanged") from exc
        else:
            self._check_source("the weights are unchanged")
            source = None
        try:
            runner.reload_weights(source)
            if source is not None:
                self._model_info = dataclasses.replace(self._model_info, source=source.name)
        except BaseException as exc:
            if isinstance(exc, MemsvcError) and not loader.touched:  # nothing was written: they still serve
                raise self._unreadable(exc, "the weights are unchanged") from exc
            self._allocator().sleep({WEIGHTS: Action.DISCARD})
            self._settle(f"ReloadWeights failed: {exc}")
            if isinstance(exc, MemsvcError):
                raise self._unreadable(exc, "the weights were discarded: WakeUp reloads them") from exc
            raise
        self._last_memory = self._allocator().stats()
        moved = self._last_memory.tags[WEIGHTS].allocated_bytes
        return self._sm.finish(Transition(TransitionKind.RELOAD_WEIGHTS, moved, time.perf_counter() - t0))

    # ---- KV blocks and generation ----
    async def swap_blocks(self, direction: str, src: Any, dst: Any, method: CopyMethod) -> Transition:
        """Move block ``src[i]`` to ``dst[i]`` (id arrays, see :meth:`KvCache.begin_swap`)."""
        if direction not in ("out", "in"):
            raise InvalidArgument("direction must be DEVICE_TO_HOST or HOST_TO_DEVICE")
        if not len(src) and not len(dst):
            raise InvalidArgument("no blocks given")
        self._check_kv_awake()
        return await self._swaps.swap(direction, src, dst, method)

    def _begin_swap(self, direction: str, src: Any, dst: Any, method: CopyMethod) -> PendingSwap:
        """On the device loop: the state again (a Sleep may have run since), then check and enqueue."""
        self._check_kv_awake()
        pending = self._model().begin_swap(direction, src, dst, method)  # type: ignore[arg-type]
        self._note_activity()
        return pending

    def _refuse_while_loading(self) -> None:
        """UNAVAILABLE (:class:`Loading`, with a retry delay) while the model loads: the data plane's
        calls succeed once it has loaded, so a client retries them, as gRPC means UNAVAILABLE to be."""
        if self.state == WorkerState.LOADING:
            raise Loading(
                "the worker is loading its model; retry, or watch health for SERVING",
                metadata={"state": self.state.name},
                retry_after_s=LOADING_RETRY_S,
            )

    def _require_settled(self) -> None:
        """UNAVAILABLE while the model loads; FAILED_PRECONDITION while a transition is sleeping or
        waking the worker."""
        self._refuse_while_loading()
        if self.state in BUSY_STATES:
            raise WrongState(f"worker is {self.state.label}", metadata={"state": self.state.name})

    def _check_kv_awake(self) -> None:
        self._require_settled()
        mem = self._last_memory
        if mem is not None and KV_CACHE in mem.tags and mem.tags[KV_CACHE].state != TagState.AWAKE:
            raise WrongState("the KV cache is asleep: wake it first", metadata={"state": self.state.name})

    async def free_sequence(self, sequence_id: str) -> None:
        if not sequence_id:
            raise InvalidArgument("sequence_id is required")
        self._require_settled()
        await self._device_loop.run(lambda: self._model().free_sequence(sequence_id))
        self._note_activity()

    def reserve_generate(self) -> GenerateSlot:
        """A place among the :attr:`MAX_QUEUED_GENERATES` Generate calls queued or running, taken before
        the prompt is encoded (a long one is work too): Overloaded when none is free, FAILED_PRECONDITION
        unless the worker is awake and no transition is pending (a Sleep waits for the Generate calls
        it found, so it must not find new ones forever), UNAVAILABLE while the model loads. Pass it to
        :meth:`generate`, or release it."""
        self._refuse_while_loading()
        self._sm.require(WorkerState.AWAKE)
        if self._sm.in_progress:
            raise WrongState(
                "a transition is pending: it runs once the Generate calls already running end",
                metadata={"state": self.state.name},
            )
        with self._generate_lock:
            if self._generates >= self.MAX_QUEUED_GENERATES:
                raise Overloaded(
                    f"{self._generates} Generate calls are queued or running, the most this worker takes; retry later",
                    metadata={"maxQueued": str(self.MAX_QUEUED_GENERATES)},
                )
            self._generates += 1
        return GenerateSlot(self._generate_done)

    async def generate(
        self,
        request: GenerationRequest,
        on_token: Callable[[int], None] | None = None,
        slot: GenerateSlot | None = None,
    ) -> Generation:
        """Run Generate in the engine's batch, for as long as its caller waits; ``on_token`` sees each
        token as it is made (on the device loop). ``slot`` (from :meth:`reserve_generate`, taken here
        when not given) is released when the request ends in the engine.

        The request is admitted by a command of the device loop, in order with the transitions: one
        that comes after a Sleep's command meets the sleeping worker (FAILED_PRECONDITION). A caller
        that leaves (cancelled, deadline passed) stops its request before the engine's next step; it
        keeps nothing (see ModelRunner.run).
        """
        slot = slot or self.reserve_generate()
        stop = threading.Event()
        t0 = time.perf_counter()

        def admit() -> concurrent.futures.Future[GenerationResult]:
            self._sm.require(WorkerState.AWAKE)
            future = self._model().engine.submit(request, stop.is_set, on_token)
            future.add_done_callback(lambda _: slot.release())
            return future

        try:
            admitted = self._device_loop.admit(admit)
        except BaseException:
            slot.release()
            raise
        admitted.add_done_callback(lambda f: slot.release() if f.cancelled() or f.exception() is not None else None)
        try:
            future = await asyncio.shield(asyncio.wrap_future(admitted))
            result = await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            stop.set()  # the engine drops it at its next step (the slot goes when it has)
            engine = self.runner.engine if self.runner is not None else None
            if engine is not None and engine.paused:  # no step runs while paused: its host blocks go back now
                with contextlib.suppress(RuntimeError):  # the device loop is shut down: nothing to free
                    self._device_loop.submit(engine.drop_leavers)
            raise
        self._note_activity()
        return Generation(
            result.tokens,
            result.block_ids,
            time.perf_counter() - t0,
            result.finish_reason,
            result.prompt_tokens,
            result.matched_stop,
        )

    def _generate_done(self) -> None:
        with self._generate_lock:
            self._generates -= 1

    def text_or_none(self) -> ModelText | None:
        return self._model().source.text

    def eos_token_ids(self) -> tuple[int, ...]:
        return self._model().source.eos_token_ids

    def text(self) -> ModelText:
        """The served model's tokenizer and chat template; FAILED_PRECONDITION without one."""
        text = self._model().source.text
        if text is None:
            source = self._model().source.name
            raise WrongState(
                f"{source} has no tokenizer (tokenizer.json): send prompt_token_ids", metadata={"model": source}
            )
        return text


class GenerateSlot:
    """One place in the Generate bound; released once, from whichever thread ends the call."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            release, self._release = self._release, None
        if release is not None:
            release()


__all__ = ["GenerateSlot", "WorkerCore"]
