"""The worker's model: weights in the ``weights`` pool, a paged KV cache, generation.

This is what the gRPC servicer drives. It validates every request before touching state (a bad
request never changes anything), refuses to run on memory that is asleep (touching a slept range
faults), and offers the two hooks a sleep cycle needs: :meth:`ModelRunner.drop_kv` after the KV
cache was discarded and :meth:`ModelRunner.reload_weights` after the weights were.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypedDict

from memsvc.errors import Cancelled, InvalidArgument, WrongState
from memsvc.vocabulary import KV_CACHE, WEIGHTS, CopyMethod, FinishReason, TagState
from worker.allocator import MemoryAllocator
from worker.model.config import ModelConfig
from worker.model.decoder import Rope, forward
from worker.model.generation import GenerationRequest, GenerationResult
from worker.model.kv_cache import KvCache, KvStats, PendingSwap, SwapDirection
from worker.model.sampling import Sampler
from worker.model.weights import ModelSource, allocate_weights, parse_model_spec

DEFAULT_MAX_NEW_TOKENS = 4096


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
    """One model on one device, serving one sequence at a time.

    ``lock`` serialises generation, swaps and the sleep hooks for callers on several threads (tests,
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
    ) -> None:
        self.alloc = alloc
        self.source = parse_model_spec(source) if isinstance(source, str) else source
        self.config: ModelConfig = self.source.config
        self.max_new_tokens_limit = max_new_tokens_limit
        self.lock = threading.RLock()
        self.kv_cache = KvCache(self.config, alloc, num_device_blocks, num_host_blocks, block_size)
        self.weights = allocate_weights(self.config, alloc)
        self.source.load_into(self.weights)
        self._rope = Rope.build(self.config, alloc.torch_device)

    # ---- generation ----
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sequence_id: str | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[int]:
        """Greedy decoding: the tokens of :meth:`run` with its defaults."""
        request = GenerationRequest(self._check_tokens(prompt_ids), max_new_tokens, sequence_id)
        return self.run(request, should_stop).tokens

    def run(
        self,
        request: GenerationRequest,
        should_stop: Callable[[], bool] | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> GenerationResult:
        """Up to ``max_new_tokens`` tokens after the prompt, each picked by the request's sampling,
        ending after a stop token (the model's EOS unless ``ignore_eos``, or one of the request's).

        With ``sequence_id`` the sequence and its KV cache stay after the call and a later call with
        the same id continues it (``prompt`` may then be empty, or add tokens first). Without, the
        sequence is temporary. ``should_stop`` is asked before every step: when it says yes (the
        caller left) generation stops with Cancelled. ``on_token`` sees each token as it is made.

        A call that fails keeps nothing: a sequence it created is freed, one it continued is put back
        as it was (tokens, cached positions, blocks). Errors: InvalidArgument (bad ids or counts, a new
        sequence without prompt, beyond ``max_position_embeddings``), WrongState (sequence swapped
        out, memory asleep), OutOfMemory (too few free KV blocks, or too many sequences kept),
        Cancelled.
        """
        prompt = self._check_tokens(request.prompt)
        n = request.max_new_tokens
        sequence_id = request.sequence_id
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= self.max_new_tokens_limit:
            raise InvalidArgument(f"max_new_tokens must be an integer in [0, {self.max_new_tokens_limit}], got {n!r}")
        if sequence_id is not None and (not isinstance(sequence_id, str) or not sequence_id):
            raise InvalidArgument(f"sequence_id must be a non-empty string, got {sequence_id!r}")
        self._check_tokens(request.stop_token_ids, "stop_token_ids")
        stops = request.stop_set(self.source.eos_token_ids)
        with self.lock:
            existing = self.kv_cache.sequences.get(sequence_id) if sequence_id is not None else None
            if existing is None and not prompt:
                raise InvalidArgument("a new sequence needs a non-empty prompt")
            if existing is not None and existing.location != "device":
                raise WrongState(f"sequence {sequence_id!r} is swapped out ({existing.location}); swap it in first")
            total = (len(existing.tokens) if existing else 0) + len(prompt) + n
            if total > self.config.max_position_embeddings:
                raise InvalidArgument(
                    f"sequence would reach {total} tokens; the model allows {self.config.max_position_embeddings}"
                )
            self._check_awake(WEIGHTS, KV_CACHE)
            sampler = Sampler(request.sampling, self.alloc.torch_device)

            seq_id = sequence_id if sequence_id is not None else f"tmp-{uuid.uuid4().hex}"
            seq = existing if existing is not None else self.kv_cache.allocate_sequence(seq_id)
            kept = (len(seq.tokens), seq.num_cached, len(seq.block_ids))
            done = False
            try:
                if n:  # the last generated token is not fed, so total - 1 positions get K/V
                    self.kv_cache.ensure_capacity(seq_id, total - 1)
                elif sequence_id is not None:  # a kept prompt: its blocks are held now, not at the next call
                    self.kv_cache.ensure_capacity(seq_id, total)
                self.kv_cache.wait_copies()  # swaps begun earlier may still be writing these blocks
                seq.tokens.extend(prompt)
                out: list[int] = []
                reason = FinishReason.LENGTH
                for _ in range(n):
                    if should_stop is not None and should_stop():
                        raise Cancelled("generation stopped: the caller left")
                    logits = forward(
                        self.weights, self.config, self._rope, self.kv_cache.device.tensor, seq.block_ids,
                        seq.tokens[seq.num_cached :], seq.num_cached,
                    )  # fmt: skip
                    seq.num_cached = len(seq.tokens)
                    token = sampler(logits)
                    seq.tokens.append(token)
                    out.append(token)
                    if on_token is not None:
                        on_token(token)
                    if token in stops:
                        reason = FinishReason.STOP
                        break
                if should_stop is not None and should_stop():  # left during the last step: nothing kept
                    raise Cancelled("generation stopped: the caller left")
                done = True
                if sequence_id is not None and reason == FinishReason.STOP:  # blocks it did not reach go back
                    self.kv_cache.shrink(seq_id, max(kept[2], -(-seq.num_cached // self.kv_cache.block_size)))
                return GenerationResult(out, reason, len(prompt))
            finally:
                if sequence_id is None or (not done and existing is None):
                    self.kv_cache.free_sequence(seq_id)
                elif not done:  # a continued sequence goes back to what it was before the call
                    del seq.tokens[kept[0] :]
                    seq.num_cached = kept[1]
                    self.kv_cache.shrink(seq_id, kept[2])

    def _check_tokens(self, ids: Iterable[int], what: str = "prompt_token_ids") -> list[int]:
        if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
            raise InvalidArgument(f"{what} must be a list of token ids")
        tokens = list(ids)
        vocab = self.config.vocab_size
        for i, t in enumerate(tokens):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidArgument(f"{what}[{i}] = {t!r} is not a token id in [0, {vocab})")
        return tokens

    def _check_awake(self, *tags: str) -> None:
        states = self.alloc.stats().tags
        for tag in tags:
            state = states[tag].state if tag in states else TagState.AWAKE
            if state != TagState.AWAKE:
                raise WrongState(f"the '{tag}' memory is asleep ({state}); wake the worker first")

    # ---- sequences and swaps ----
    def free_sequence(self, sequence_id: str) -> None:
        with self.lock:
            self.kv_cache.free_sequence(sequence_id)

    def swap(self, direction: SwapDirection, pairs: Iterable[Any], method: CopyMethod | str = "auto") -> int:
        """:meth:`KvCache.swap` under the runner's lock; the bytes moved."""
        with self.lock:
            return self.kv_cache.swap(direction, pairs, method)

    def begin_swap(
        self, direction: SwapDirection, src_ids: Any, dst_ids: Any, method: CopyMethod | str = "auto"
    ) -> PendingSwap:
        """:meth:`KvCache.begin_swap` under the runner's lock: wait for the result outside it, so the
        next swap is checked and enqueued while this one copies. Generation waits for every swap
        begun before it."""
        with self.lock:
            return self.kv_cache.begin_swap(direction, src_ids, dst_ids, method)

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
