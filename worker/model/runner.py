"""The worker's model: weights in the ``weights`` pool, a paged KV cache, generation.

This is what the gRPC servicer drives. It validates every request before touching state (a bad
request never changes anything), refuses to run on memory that is asleep (touching a slept range
faults), and offers the two hooks a sleep cycle needs: :meth:`ModelRunner.drop_kv` after the KV
cache was discarded and :meth:`ModelRunner.reload_weights` after the weights were.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypedDict

import torch

from memsvc._limits import MAX_GENERATE_TOKENS
from memsvc.errors import InvalidArgument, WrongState
from memsvc.vocabulary import KV_CACHE, WEIGHTS, CopyMethod, TagState
from worker.allocator import MemoryAllocator
from worker.model.config import ModelConfig
from worker.model.decoder import HostStep, Rope, forward_step, fused_layers
from worker.model.engine import DEFAULT_MAX_BATCH, DEFAULT_MAX_STEP_TOKENS, Engine, check_tokens
from worker.model.generation import GenerationRequest, GenerationResult
from worker.model.graphs import DecodeGraphs
from worker.model.kernels import TRITON_KERNELS, kernels_for
from worker.model.kv_cache import KvCache, KvStats, PendingSwap, SwapDirection
from worker.model.weights import ModelSource, allocate_weights, parse_model_spec

DEFAULT_MAX_NEW_TOKENS = MAX_GENERATE_TOKENS


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
    has_tokenizer: bool
    has_chat_template: bool
    kv_cache: KvStats


class ModelRunner:
    """One model on one device: its weights, its paged KV cache and the engine that batches its
    requests (worker/model/engine.py).

    ``lock`` serialises steps, swaps and the sleep hooks for callers on several threads (tests,
    embedders). The worker needs no lock around sleep and wake: it calls the runner, ``alloc.sleep``
    and ``alloc.wake_up`` from its one device thread only (worker/device_thread.py), so no step can
    read a range while it is being unmapped.
    """

    def __init__(
        self,
        alloc: MemoryAllocator,
        source: ModelSource | str,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int = 16,
        max_new_tokens_limit: int = DEFAULT_MAX_NEW_TOKENS,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS,
        cuda_graphs: bool = False,
    ) -> None:
        self.alloc = alloc
        self.source = parse_model_spec(source) if isinstance(source, str) else source
        self.config: ModelConfig = self.source.config
        self.lock = threading.RLock()
        self.kv_cache = KvCache(self.config, alloc, num_device_blocks, num_host_blocks, block_size, cuda_graphs)
        self.weights = allocate_weights(self.config, alloc)
        self.source.load_into(self.weights)
        self._rope = Rope.build(self.config, alloc.torch_device)
        self._kernels = kernels_for(alloc.torch_device, self.config)
        self._fused = fused_layers(self.weights, self.config)
        self.engine = Engine(
            self.kv_cache, self._run_step, alloc.torch_device, self.config.vocab_size,
            self.config.max_position_embeddings, lambda: self.source.eos_token_ids,
            lambda: self._check_awake(WEIGHTS, KV_CACHE), max_batch, max_step_tokens, max_new_tokens_limit,
        )  # fmt: skip
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs:
            if self._kernels is not TRITON_KERNELS:
                raise InvalidArgument("CUDA graphs need the cuda backend, Triton and a power-of-two head_dim")
            scratch = self.kv_cache.device.scratch_block
            assert scratch is not None, "a KV cache for graphs has its scratch block"
            self.graphs = DecodeGraphs(
                alloc, self.weights, self.config, self._rope, self.kv_cache.device.with_scratch,
                scratch, max_batch, self._kernels, self._fused,
            )  # fmt: skip
            self.graphs.capture()

    @property
    def max_new_tokens_limit(self) -> int:
        return self.engine.max_new_tokens_limit

    def _run_step(self, step: HostStep) -> torch.Tensor:
        """A step on the model: replayed from a CUDA graph when every row decodes and one fits."""
        if self.graphs is not None and self.graphs.fits(step):
            return self.graphs.run(step)
        kv = self.kv_cache.device
        inputs = step.to_device(self.alloc.torch_device, kv.block_size)
        return forward_step(self.weights, self.config, self._rope, kv.with_scratch, inputs, self._kernels, self._fused)

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
        future = self.engine.submit(request, should_stop, on_token)
        with self.lock:
            while not future.done():
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
            return self.kv_cache.swap(direction, pairs, method, self.engine.busy_sequences())

    def begin_swap(
        self, direction: SwapDirection, src_ids: Any, dst_ids: Any, method: CopyMethod | str = "auto"
    ) -> PendingSwap:
        """:meth:`KvCache.begin_swap` under the runner's lock: wait for the result outside it, so the
        next swap is checked and enqueued while this one copies. Generation waits for every swap
        begun before it."""
        with self.lock:
            return self.kv_cache.begin_swap(direction, src_ids, dst_ids, method, self.engine.busy_sequences())

    # ---- sleep hooks ----
    def reload_weights(self, source: ModelSource | None = None) -> None:
        """Rewrite every weight into the same pool tensors: from the model's source (after a level-2
        wake), or from ``source``, which then is the model's source (ReloadWeights from another
        directory; see CheckpointSource's ``same_as``)."""
        with self.lock:
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
            return self.kv_cache.drop_device()

    def info(self) -> ModelInfo:
        with self.lock:
            c = self.config
            text = self.source.text
            return ModelInfo(
                source=self.source.name, family=c.family, dtype=c.dtype, parameter_count=c.param_count(),
                weights_bytes=c.param_bytes(), vocab_size=c.vocab_size, layer_count=c.num_layers,
                context_length=c.max_position_embeddings, eos_token_ids=list(self.source.eos_token_ids),
                has_tokenizer=text is not None, has_chat_template=text is not None and text.has_chat_template,
                kv_cache=self.kv_cache.stats(),
            )  # fmt: skip


__all__ = ["DEFAULT_MAX_NEW_TOKENS", "ModelInfo", "ModelRunner"]
