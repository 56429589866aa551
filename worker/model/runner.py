"""The worker's model: weights in the ``weights`` pool, a paged KV cache, generation.

This is what the gRPC servicer drives. It validates every request before touching state (a bad
request never changes anything), refuses to run on memory that is asleep (touching a slept range
faults), and offers the two hooks a sleep cycle needs: :meth:`ModelRunner.drop_kv` after the KV
cache was discarded and :meth:`ModelRunner.reload_weights` after the weights were.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypedDict

import torch

from memsvc.errors import InvalidArgument, WrongState
from memsvc.runtime.limits import MAX_GENERATE_TOKENS
from memsvc.vocabulary import CUDA_GRAPHS, KV_CACHE, WEIGHTS, CopyMethod, TagState
from worker.allocator import MemoryAllocator
from worker.model import first_products, kept_kernels
from worker.model.config import ModelConfig
from worker.model.decoder import HostStep, Rope, forward_step, fused_layers
from worker.model.engine import Engine, check_tokens
from worker.model.generation import GenerationRequest, GenerationResult
from worker.model.graphs import BackgroundCapture, DecodeGraphs
from worker.model.kernels import TRITON_KERNELS, hash_ahead, kernels_for
from worker.model.kv_cache import KvCache, KvStats, PendingSwap, SwapDirection
from worker.model.progress import load_bar
from worker.model.step_limits import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_BATCH, MIXED_ROWS, WARM_UP_PROMPT, graph_rows
from worker.model.weights import ModelSource, allocate_weights, parse_model_spec

DEFAULT_MAX_NEW_TOKENS = MAX_GENERATE_TOKENS
log = logging.getLogger("memsvc.worker")


class ModelInfo(TypedDict):
    """What the worker serves; a plain dict, so status messages and JSON take it as is."""

    source: str
    """The model spec: ``synthetic:<preset>`` or the checkpoint directory."""
    family: str
    dtype: str
    parameter_count: int
    weights_bytes: int
    vocab_size: int
    layer_count: int
    context_length: int
    eos_token_ids: list[int]
    kv_cache: KvStats
    cuda_graph_buckets: list[int]
    """The step graphs' row-count buckets (empty: CUDA graphs off)."""
    cuda_graphs_captured: list[int]
    """The buckets captured so far (a step needing another captures it first)."""


class ModelRunner:
    """One model on one device: its weights, its paged KV cache and the engine that batches its
    requests (worker/model/engine.py).

    ``lock`` serialises submissions, steps, swaps and the sleep hooks for callers on several threads
    (tests, embedders); each of those that touches device memory first waits for the engine's step in
    flight (:meth:`Engine.land`). The worker needs no lock around sleep and wake: it calls the runner,
    ``alloc.sleep`` and ``alloc.wake_up`` from its device loop only (worker/device_loop.py), which
    lands the step in flight before each, so no step can read a range while it is being unmapped.
    """

    def __init__(
        self,
        alloc: MemoryAllocator,
        source: ModelSource | str,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_new_tokens_limit: int = DEFAULT_MAX_NEW_TOKENS,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_step_tokens: int | None = None,
        cuda_graphs: bool = False,
        defer_graph_capture: bool = False,
    ) -> None:
        """``cuda_graphs``: capture the step for every row-count bucket (cuda backend, Triton); here,
        unless ``defer_graph_capture``: then none is captured yet, the owner captures them
        (:meth:`capture_graph`, :meth:`capture_graphs_in_background`), and a step whose bucket is
        not captured yet captures it first."""
        t0 = time.perf_counter()
        self.alloc = alloc
        self.source = parse_model_spec(source) if isinstance(source, str) else source
        self.config: ModelConfig = self.source.config
        self.lock = threading.RLock()
        self._kernels = kernels_for(alloc.torch_device, self.config)
        if self.config.fp8 is not None and alloc.torch_device.type == "cuda" and self.config.dtype != "bfloat16":
            raise InvalidArgument("FP8 products on CUDA return bfloat16: an FP8 model there is a bfloat16 one")
        if cuda_graphs and self._kernels is not TRITON_KERNELS:  # before any allocation: a refusal leaves nothing
            raise InvalidArgument(
                "CUDA graphs need the cuda backend, Triton and a model the Triton kernels take "
                "(worker/model/paged_attention.py's triton_supports)"
            )
        # the weights before the KV cache: a checkpoint staged at start-up (worker/staging.py) is
        # unmapped by their load, and the KV cache then has its room
        first_products.settle()  # its scratch back with the device before the room is reckoned
        self.source.make_room(self.config.param_bytes())
        self.weights = allocate_weights(self.config, alloc)
        t1 = time.perf_counter()
        with load_bar(f"loading {self.source.name}") as progress:
            self.source.load_into(self.weights, progress)
        t2 = time.perf_counter()
        self.kv_cache = KvCache(self.config, alloc, num_device_blocks, num_host_blocks, block_size, cuda_graphs)
        nbytes = self.config.param_bytes()
        log.info(
            "weights: %.2f GB from %s in %.2f s (%.1f GB/s)",
            nbytes / 1e9,
            self.source.name,
            t2 - t1,
            nbytes / (t2 - t1) / 1e9 if t2 > t1 else 0.0,
        )
        self._rope = Rope.build(self.config, alloc.torch_device)
        self._fused = fused_layers(self.weights, self.config)
        self.engine = Engine(
            self.kv_cache,
            self._run_step,
            alloc.torch_device,
            self.config.vocab_size,
            self.config.max_position_embeddings,
            lambda: self.source.eos_token_ids,
            lambda: self._check_awake(WEIGHTS, KV_CACHE),
            lambda: self.source.text_once.decoding(),
            max_batch,
            max_step_tokens,
            max_new_tokens_limit,
            self.config.long_rope_after,
        )
        self.graphs: DecodeGraphs | None = None
        self.background_capture: BackgroundCapture | None = None
        if cuda_graphs:
            scratch = self.kv_cache.device.scratch_block
            assert scratch is not None, "a KV cache for graphs has its scratch block"
            rows = graph_rows(max_batch, self.engine.max_step_tokens)
            self.graphs = DecodeGraphs(
                alloc,
                self.weights,
                self.config,
                self._rope,
                self.kv_cache.device.with_scratch,
                scratch,
                max_batch,
                self._kernels,
                self._fused,
                rows,
            )
            if not defer_graph_capture:
                self.graphs.capture()
                graphs, seconds = len(self.graphs.sizes), self.graphs.capture_seconds
                log.info("cuda graphs: %d buckets captured in %.2f s", graphs, seconds)
        # Where the Triton kernel attends, a step's prompt chunk rows attend through the block tables
        # as decodes do, up to the rows a graph holds: a step that mixes them is one launch per layer,
        # replayed (an 8B model's eager step of a few hundred rows took twice its replay's time).
        if self._kernels is TRITON_KERNELS:
            self.engine.paged_rows = self.graphs.max_rows if self.graphs is not None else MIXED_ROWS
        log.info(
            "model: built in %.2f s (weight tensors %.2f s, weights %.2f s, the KV cache and the rest %.2f s)",
            time.perf_counter() - t0,
            t1 - t0,
            t2 - t1,
            time.perf_counter() - t2,
        )

    @property
    def max_new_tokens_limit(self) -> int:
        return self.engine.max_new_tokens_limit

    def _run_step(self, step: HostStep) -> torch.Tensor:
        """A step on the model: replayed from its bucket's graph when every row attends through the
        block tables and a bucket holds them, else eagerly. A bucket not captured yet runs the step
        eagerly on its padded rows while the background capture takes it first, or, with no
        background capture, is captured first (worker/model/graphs.py)."""
        graphs = self.graphs
        if graphs is not None and graphs.fits(step):
            background = self.background_capture
            size = graphs.bucket_for(step.decodes)
            if background is not None:
                background.poke()
                if size in graphs.pending:
                    background.want(size)
            elif size in graphs.pending:
                try:
                    self.capture_graph(size)
                except Exception as exc:  # noqa: BLE001 - the step runs eagerly on the bucket's rows; it fails if that fails
                    log.warning("cuda graphs: capturing batch %d for a step failed (%s); it runs eagerly", size, exc)
            return graphs.run(step)
        kv = self.kv_cache.device
        inputs = step.to_device(self.alloc.torch_device, kv.block_size)
        return forward_step(self.weights, self.config, self._rope, kv.with_scratch, inputs, self._kernels, self._fused)

    # ---- CUDA graphs ----
    def warm_up(self) -> float:
        """Before the first request: one short generation (a prompt chunk, then decodes) compiles every
        kernel it uses (Triton's first launch of each compiles it) and starts cuBLAS, and the decode
        step of one sequence, what a first request spends most of its time in, is captured (when
        graphs are on). Without it the first request after ``ready`` paid for all of that (1.2 s for
        16 tokens of an 8B model on the H200, against 0.3 s for the next). Then one eager step of
        each other bucket (:meth:`DecodeGraphs.warm`): the first request's prompt chunk runs
        eagerly in its bucket until the background capture takes it, at a later request's speed.
        The seconds it took."""
        t0 = time.perf_counter()
        if self._kernels is TRITON_KERNELS:
            hash_ahead()  # made by worker/main.py's import thread, or being made: waited for, not made twice
        t1 = time.perf_counter()
        self.run(GenerationRequest(list(WARM_UP_PROMPT), 2, ignore_eos=True))
        t2 = time.perf_counter()
        graphs = self.graphs
        if graphs is not None and 1 in graphs.pending:
            self.capture_graph(1)
        t3 = time.perf_counter()
        warmed: list[str] = []
        if graphs is not None:
            with self.lock:
                for size in graphs.pending:
                    t = time.perf_counter()
                    graphs.warm(size)
                    warmed.append(f"{size}:{1e3 * (time.perf_counter() - t):.0f}")
        if self._kernels is TRITON_KERNELS:
            kept_kernels.keep()  # what this start compiled, loaded ahead by the next (a file's write)
        end = time.perf_counter()
        # where a start's last second goes (bench/bench_startup.py reads it)
        log.info(
            "warm-up parts: hashes waited %.3f s, generation %.3f s, capture %.3f s, buckets warmed %.3f s (ms: %s)",
            t1 - t0,
            t2 - t1,
            t3 - t2,
            end - t3,
            " ".join(warmed) or "none",
        )
        return end - t0

    def capture_graph(self, size: int) -> float:
        """Capture the decode step of batch bucket ``size`` now, between steps; the seconds it took.

        WrongState when CUDA graphs are off, or while the weights, the KV cache or the graphs' own
        memory sleeps (a capture reads the first two and writes the third); InvalidArgument for a
        bucket that is not pending (see :attr:`DecodeGraphs.pending`).
        """
        graphs = self.graphs
        if graphs is None:
            raise WrongState("CUDA graphs are off for this model")
        with self.lock:
            self.engine.land()
            self._check_awake(WEIGHTS, KV_CACHE, CUDA_GRAPHS)
            seconds = graphs.capture_bucket(size)
        done, total = len(graphs.captured), len(graphs.sizes)
        log.info("cuda graphs: batch %d captured in %.3f s (%d of %d buckets)", size, seconds, done, total)
        return seconds

    def capture_graphs_in_background(
        self,
        loop: asyncio.AbstractEventLoop,
        submit: Callable[[Callable[[], None]], object],
        may_capture: Callable[[], bool] = lambda: True,
    ) -> BackgroundCapture:
        """Capture the pending buckets one per ``submit`` job (the device loop's), while the engine
        idles (see :class:`~worker.model.graphs.BackgroundCapture`), as long as ``may_capture`` says
        so. Steps run eagerly on their bucket's padded rows until it is captured."""
        if self.graphs is None:
            raise WrongState("CUDA graphs are off for this model")
        if self.background_capture is not None:
            raise WrongState("the graphs are already captured in the background")
        self.background_capture = BackgroundCapture(
            self.graphs.pending, self.capture_graph, loop, submit, may_capture, self.engine.last_busy
        )
        self.background_capture.request()
        return self.background_capture

    # ---- generation ----
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sequence_id: str | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[int]:
        """Greedy decoding: the tokens of :meth:`run` with its defaults."""
        request = GenerationRequest(check_tokens(prompt_ids, self.config.vocab_size), max_new_tokens, sequence_id)
        return self.run(request, should_stop).tokens

    def run(
        self,
        request: GenerationRequest,
        should_stop: Callable[[], bool] | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> GenerationResult:
        """Up to ``max_new_tokens`` tokens after the prompt, each picked by the request's sampling,
        ending after a stop token (the model's EOS unless ``ignore_eos``, or one of the request's).
        The engine steps on this thread until the request ends; calls from several threads share
        its steps (one batch).

        With ``sequence_id`` the sequence and its KV cache stay after the call and a later call with
        the same id continues it (``prompt`` may then be empty, or add tokens first). Without, the
        sequence is temporary. ``should_stop`` is asked before every step: when it says yes (the
        caller left) generation stops with Cancelled. ``on_token`` sees each token as it is made.

        A call that fails keeps nothing: a sequence it created is freed, one it continued is put back
        as it was (tokens, cached positions, blocks). Errors: InvalidArgument (bad ids or counts, a new
        sequence without prompt, beyond ``max_position_embeddings``), WrongState (sequence swapped
        out or being generated, memory asleep), OutOfMemory (more KV blocks than the pool has beside
        the kept sequences, or too many sequences kept), Cancelled.
        """
        with self.lock:
            future = self.engine.submit(request, should_stop, on_token)
        while not future.done():
            with self.lock:  # one step at a time: another thread's request joins between two
                if not future.done():
                    self.engine.step()
        return future.result()

    def _check_awake(self, *tags: str) -> None:
        states = self.alloc.stats().tags
        for tag in tags:
            state = states[tag].state if tag in states else TagState.AWAKE
            if state != TagState.AWAKE:
                raise WrongState(f"the '{tag}' memory is asleep ({state}); wake the worker first")

    # ---- sequences and swaps ----
    def free_sequence(self, sequence_id: str) -> None:
        with self.lock:
            self.engine.land()
            seq = self.kv_cache.sequence(sequence_id)
            if seq.handle in self.engine.busy_sequences():
                raise WrongState(
                    f"sequence {sequence_id!r} is being generated; free it when its Generate ends",
                    metadata={"sequenceId": sequence_id},
                )
            self.kv_cache.free_sequence(sequence_id)

    def swap(self, direction: SwapDirection, pairs: Iterable[Any], method: CopyMethod | str = "auto") -> int:
        """:meth:`KvCache.swap` under the runner's lock; the bytes moved."""
        with self.lock:
            self.engine.land()
            return self.kv_cache.swap(direction, pairs, method, self.engine.busy_sequences())

    def begin_swap(
        self, direction: SwapDirection, src_ids: Any, dst_ids: Any, method: CopyMethod | str = "auto"
    ) -> PendingSwap:
        """:meth:`KvCache.begin_swap` under the runner's lock: wait for the result outside it, so the
        next swap is checked and enqueued while this one copies. Generation waits for every swap
        begun before it."""
        with self.lock:
            self.engine.land()
            return self.kv_cache.begin_swap(direction, src_ids, dst_ids, method, self.engine.busy_sequences())

    # ---- sleep hooks ----
    def reload_weights(self, source: ModelSource | None = None) -> None:
        """Rewrite every weight into the same pool tensors: from the model's source (after a level-2
        wake), or from ``source``, which then is the model's source (ReloadWeights from another
        directory; see CheckpointSource's ``same_as``)."""
        with self.lock:
            self.engine.land()
            self._check_awake(WEIGHTS)
            (source or self.source).load_into(self.weights)
            if source is not None:
                self.source = source

    def drop_kv(self) -> list[str]:
        """Forget the sequences whose device blocks were discarded; return their ids.

        Call after waking from a sleep that discarded ``kv_cache``. Sequences entirely swapped out
        to the host pool kept their data and stay.
        """
        with self.lock:
            self.engine.land()
            return self.kv_cache.drop_device()

    def info(self) -> ModelInfo:
        with self.lock:
            c = self.config
            return ModelInfo(
                source=self.source.name,
                family=c.family,
                dtype=c.dtype,
                parameter_count=c.param_count(),
                weights_bytes=c.param_bytes(),
                vocab_size=c.vocab_size,
                layer_count=c.num_layers,
                context_length=c.max_position_embeddings,
                eos_token_ids=list(self.source.eos_token_ids),
                kv_cache=self.kv_cache.stats(),
                cuda_graph_buckets=list(self.graphs.sizes) if self.graphs is not None else [],
                cuda_graphs_captured=list(self.graphs.captured) if self.graphs is not None else [],
            )


__all__ = ["DEFAULT_MAX_NEW_TOKENS", "ModelInfo", "ModelRunner"]
