"""The serving engine: one scheduler loop that batches every running Generate into each model step.

Requests join and leave the running batch at every step (continuous batching). A step feeds one
token of every decoding request and, within the step's token budget, the next chunk of each
request still reading its prompt; so a long prompt is prefilled in chunks beside the decodes
instead of stalling them for its whole length. Each request keeps its own sampler and stop rules.

KV blocks come from the paged pool on demand: a request is admitted (first come, first served)
when the blocks for its prompt are free, and a decode that needs a new block when none is free
takes them from the newest running request, which is preempted: its blocks go back, it waits at
the head of the queue, and on resume it re-reads its tokens (recomputation; the sampler keeps its
state, so a seeded request draws the same random numbers as if nothing happened, and gets the same
tokens wherever the recomputed K/V round as the decoded ones did). A request that could not
fit even alone fails at once: INVALID_ARGUMENT past the whole pool, OutOfMemory past what kept
sequences leave of it; no request fails because running ones hold blocks. One that asks for "up to"
(``stop_at_context``) ends where the context or the pool would end it, with finish reason LENGTH.

A sleep may *pause* the requests instead of waiting for them to end (:meth:`Engine.pause`, the
manager's turns between busy workers): between two steps each one's KV blocks move to the host pool
in one batched copy, and after the wake they come back (:meth:`Engine.resume`) and the request goes
on where it stopped, its prompt not read again. One the host pool has no room for is preempted as
above instead. While paused, the engine runs no step.

A step is queued on the device before the tokens of the step before it are read: the host plans and
launches step t+1 while the device runs step t, and only then waits for t's tokens and hands them
out, so the device never idles while the host plans. Each row that continues a request whose token
the device has not handed back yet reads that token on the device (HostStep.device_tokens). The cost:
a request that stops on a stop token or stop string at t has a row in t+1 computed for nothing (its
K/V lands past the positions it keeps); a request that ends by its length gets no such row. Anything
else that touches the device (a swap, a sleep, a capture, freeing a sequence) first waits for the
step in flight (:meth:`Engine.land`): the worker's device loop does that before each of its commands.

Threads: the engine is used from one thread at a time: the worker's device loop
(worker/device_loop.py), which admits requests and runs transitions and swaps as commands between
steps, or a caller holding the model runner's lock. A request whose caller left is dropped at the
next step and keeps nothing.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from memsvc.errors import Cancelled, InvalidArgument, NotFound, OutOfMemory, WrongState
from memsvc.runtime.limits import MAX_GENERATE_TOKENS
from memsvc.vocabulary import FinishReason
from worker.model.decoder import HostStep, rope_long
from worker.model.generation import GenerationRequest, GenerationResult
from worker.model.kv_cache import TEMPORARY_PREFIX, KvCache, Sequence
from worker.model.sampling import Sampler, sample_tokens, to_device
from worker.model.step_limits import DEFAULT_MAX_BATCH, step_tokens
from worker.stop_strings import StopMatcher

if TYPE_CHECKING:
    from worker.model.text import Decoding

log = logging.getLogger("memsvc.worker")

SHORT_PREFIX = 256
"""A step of more than ``paged_rows`` rows is still planned as paged rows while its rows read, on
average, prefixes no longer than this (in tokens): every paged row reads its own prefix, where a span
reads it once; but each span costs its own handful of launches per layer, so the 51 forty-token
prompts of a burst of new requests would be 51 x layers x ~10 launches as spans."""


@dataclass(eq=False)
class _Request:
    """One Generate inside the engine."""

    request: GenerationRequest
    prompt: list[int]
    stops: frozenset[int]
    should_stop: Callable[[], bool] | None
    on_token: Callable[[int], None] | None
    future: concurrent.futures.Future[GenerationResult]
    seq: Sequence | None = None
    """Bound at admission (the sequence it creates or continues)."""
    created: bool = False
    """The sequence is this call's own (a temporary one, or a new kept one)."""
    kept: tuple[int, int, int] = (0, 0, 0)
    """A continued sequence's (tokens, cached positions, blocks) before the call, to go back to."""
    preempted: bool = False
    """Its blocks were taken while it ran (its cache is re-read on resume)."""
    sampler: Sampler | None = None
    limit: int = 0
    """Tokens it may generate: ``max_new_tokens``, or fewer where the context ends it first."""
    out: list[int] = field(default_factory=list)
    short_rope: bool = False
    """LongRoPE: its sequence's cached rows were computed with the short frequencies (while it was
    within the original context); it is read again, whole, once its next rows take the long ones."""
    stop_text: StopMatcher | None = None
    """The request's stop strings over its text (None: it has none)."""
    flying: int = 0
    """Its tokens the device made, or is making, that are not handed out yet (steps in flight that
    end a read of it: at most two, for a moment, while a step is queued behind the one in flight)."""

    @property
    def seq_id(self) -> str:
        assert self.seq is not None
        return self.seq.seq_id

    @property
    def pending(self) -> int:
        """Tokens of its sequence still to be fed (1 while decoding)."""
        assert self.seq is not None
        return len(self.seq.tokens) - self.seq.num_cached

    def left(self) -> bool:
        return self.should_stop is not None and self.should_stop()

    @property
    def continues(self) -> bool:
        """It decodes next while its last token is still on the device: one in flight, fed, and not
        its last by its length (a stop token or string is only seen when the token is handed out)."""
        return self.flying == 1 and self.pending == 0 and len(self.out) + 1 < self.limit


@dataclass(eq=False)
class _Flight:
    """A step queued on the device whose tokens are not read yet."""

    ends: list[_Request]
    """The requests whose rows end a read, in the order of ``tokens``."""
    fed: list[_Request]
    """Every request with rows in it."""
    tokens: torch.Tensor
    """``[len(ends)]`` int64 on the device: the step's sampled tokens."""
    host: torch.Tensor
    """Their copy on the host (pinned, on CUDA), valid once ``done`` has happened."""
    done: torch.cuda.Event | None
    """Recorded after the copy to ``host`` (None off CUDA: the copy happened before it returned)."""

    @classmethod
    def launch(cls, ends: list[_Request], fed: list[_Request], tokens: torch.Tensor) -> _Flight:
        """The flight of a step just queued: its tokens' copy to the host queued behind it."""
        if tokens.device.type != "cuda":
            return cls(ends, fed, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        done.record()
        return cls(ends, fed, tokens, host, done)

    def read(self) -> list[int]:
        """The tokens, once the step has run (waits for it)."""
        if self.done is not None:
            self.done.synchronize()
        return [int(t) for t in self.host.tolist()]


class Engine:
    """Continuous batching over one model's paged KV cache (see the module docstring)."""

    def __init__(
        self,
        kv_cache: KvCache,
        run_step: Callable[[HostStep], torch.Tensor],
        device: torch.device,
        vocab_size: int,
        max_position: int,
        eos_token_ids: Callable[[], tuple[int, ...]],
        check_ready: Callable[[], None],
        text: Callable[[], Decoding | None] = lambda: None,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_step_tokens: int | None = None,
        max_new_tokens_limit: int = MAX_GENERATE_TOKENS,
        long_rope_after: int | None = None,
    ) -> None:
        """``long_rope_after``: a LongRoPE model's original context (ModelConfig.long_rope_after):
        each step then says which rows take the long frequencies (decoder.rope_long)."""
        if not isinstance(max_batch, int) or max_batch < 1:
            raise InvalidArgument(f"max_batch must be an integer >= 1, got {max_batch!r}")
        max_step_tokens = step_tokens(max_batch, max_step_tokens)
        if not isinstance(max_step_tokens, int) or max_step_tokens < max_batch:
            raise InvalidArgument(
                f"max_step_tokens must be an integer >= max_batch ({max_batch}), got {max_step_tokens!r}"
            )
        self.kv_cache = kv_cache
        self._run_step = run_step
        self._device = device
        self._vocab = vocab_size
        self._max_position = max_position
        self._eos = eos_token_ids
        self._text = text
        self._check_ready = check_ready
        """Asked as a request is admitted (the model's memory awake)."""
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.paged_rows = 0
        """Plan a step of at most this many rows as rows read through the block tables (see
        :meth:`_plan`; 0: never): the model runner sets it where its attention kernel takes them
        (CUDA, Triton; worker/model/step_limits.py's MIXED_ROWS)."""
        self.max_new_tokens_limit = max_new_tokens_limit
        self._long_rope_after = long_rope_after
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._flight: _Flight | None = None
        """The step queued on the device whose tokens are not handed out yet (see the module docstring)."""
        self.steps = 0
        self.preemptions = 0
        self.recomputed_tokens = 0
        """Tokens read again because their request lost its KV blocks (preemptions)."""
        self.paused = False
        """Between :meth:`pause` and :meth:`resume`: no step runs."""
        self._parked: list[str] = []
        """The sequences :meth:`pause` moved to the host pool, for :meth:`resume` to bring back (a kept
        one whose request ended meanwhile too)."""
        self._last_step = time.monotonic()

    # ---- requests ----
    def check(self, request: GenerationRequest) -> list[int]:
        """The request's own checks (no state read): INVALID_ARGUMENT before anything is queued."""
        prompt = check_tokens(request.prompt, self._vocab)
        n = request.max_new_tokens
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= self.max_new_tokens_limit:
            raise InvalidArgument(f"max_new_tokens must be an integer in [0, {self.max_new_tokens_limit}], got {n!r}")
        sid = request.sequence_id
        if sid is not None and (not isinstance(sid, str) or not sid):
            raise InvalidArgument(f"sequence_id must be a non-empty string, got {sid!r}")
        check_tokens(request.stop_token_ids, self._vocab, "stop_token_ids")
        return prompt

    def submit(
        self,
        request: GenerationRequest,
        should_stop: Callable[[], bool] | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> concurrent.futures.Future[GenerationResult]:
        """Queue a request (on the stepping thread); its future is resolved when it ends. ``on_token`` sees
        each token; ``should_stop`` is asked before every step (yes: it ends with Cancelled).
        InvalidArgument is raised here, at once; every other error is set on the future."""
        prompt = self.check(request)
        stop_text = None
        if request.stop_strings:
            text = self._text()
            if text is None:
                raise WrongState("stop strings need the model's tokenizer (tokenizer.json): this model has none")
            stop_text = StopMatcher(text.stream().step, request.stop_strings)
        fut: concurrent.futures.Future[GenerationResult] = concurrent.futures.Future()
        req = _Request(request, prompt, request.stop_set(self._eos()), should_stop, on_token, fut, stop_text=stop_text)
        self._waiting.append(req)
        return fut

    @property
    def has_work(self) -> bool:
        """A step would do something: requests wait or run (and are not paused), or a step is in flight."""
        return bool(self._flight) or (not self.paused and bool(self._waiting or self._running))

    @property
    def in_flight(self) -> bool:
        """A step is queued on the device whose tokens are not handed out yet."""
        return self._flight is not None

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def paused_requests(self) -> int:
        """Requests waiting for :meth:`resume` (0 unless paused)."""
        return len(self._waiting) if self.paused else 0

    def pause(self) -> int:
        """Stop stepping until :meth:`resume`, for a sleep (the step in flight has landed): every request
        leaves the batch and waits, the running ones first in their order, and the KV blocks of each
        one that holds some move to the host pool in one batched copy (:meth:`KvCache.park`); one the
        host pool has no room for gives its blocks back and reads its tokens again on resume (a
        preemption). Requests whose callers left end now. Returns how many requests are paused."""
        assert self._flight is None, "pause after the step in flight has landed"
        self.drop_leavers()
        requests = [*self._running, *self._waiting]
        self._running.clear()
        self._waiting = collections.deque(requests)
        kv = self.kv_cache
        holding = [r for r in requests if r.seq is not None and kv.blocks_of(r.seq)]
        stayed = set(kv.park(r.seq_id for r in holding))
        for req in holding:
            if req.seq_id in stayed:
                self._drop_cache(req)
        self._parked = [r.seq_id for r in holding if r.seq_id not in stayed]
        self.paused = bool(requests)
        return len(requests)

    def resume(self) -> None:
        """After the wake that ends a pause: the paused requests' blocks come back from the host pool
        in one batched copy (one that finds no room on the device reads its tokens again) and the
        requests step on, in their order."""
        if not self.paused:
            return
        self.paused = False
        self.drop_leavers()
        kv = self.kv_cache
        parked, self._parked = self._parked, []
        back = [i for i in parked if i in kv.sequences and kv.sequence(i).location != "device"]
        stayed = set(kv.unpark(back))
        for req in self._waiting:
            if req.seq is not None and req.seq_id in stayed:
                self._drop_cache(req)
        if stayed - {r.seq_id for r in self._waiting if r.seq is not None}:
            log.warning("kept sequences stay swapped out to the host pool: no room on the device for them")

    def end_paused(self, exc: BaseException) -> int:
        """End every paused request with ``exc`` (the worker is stopping: no wake will come); how many."""
        if not self.paused:
            return 0
        n = len(self._waiting)
        self.fail_all(exc)
        self.paused, self._parked = False, []
        return n

    def _drop_cache(self, req: _Request) -> None:
        """Give the request's blocks back (either pool): it reads its tokens again when it runs."""
        assert req.seq is not None
        self.kv_cache.shrink(req.seq_id, 0)
        self.recomputed_tokens += req.seq.num_cached
        req.seq.num_cached = 0
        req.short_rope = False
        req.preempted = True
        self.preemptions += 1

    def last_busy(self) -> float:
        """Monotonic time the engine last worked: now while requests wait or run, else its last step."""
        return time.monotonic() if self.has_work else self._last_step

    def busy_sequences(self) -> set[int]:
        """Handles of the sequences requests are generating (SwapBlocks and FreeSequence refuse them)."""
        return {r.seq.handle for r in (*self._running, *self._waiting) if r.seq is not None}

    def fail_all(self, exc: BaseException) -> None:
        """End every request with ``exc`` (the worker is closing), once the step in flight has run."""
        flight, self._flight = self._flight, None
        if flight is not None:
            with contextlib.suppress(Exception):  # the device failed: nothing of it is handed out anyway
                flight.read()
        for req in (*self._waiting, *self._running):
            self._fail(req, exc)
        self._waiting.clear()
        self._running.clear()

    # ---- the step ----
    def step(self) -> bool:
        """Admit, preempt if blocks ran out, queue one model step on the device, then hand out the
        tokens of the step queued before it; True while work remains."""
        self.drop_leavers()
        self._admit()
        try:
            if self._long_rope_after is not None:
                self._reread_for_long_rope()
            self._grow()
            before, self._flight = self._flight, None
            if self._running:
                self._flight = self._launch(before)
            if before is not None:
                self._hand_out(before)
            flight = self._flight
            if flight is not None and all(r.future.done() for r in flight.fed):
                self.land()  # every request in it ended: it is work for nothing, nobody waits for it
        except BaseException as exc:
            self._fail_running(exc)
            if not isinstance(exc, Exception):
                raise
        self._last_step = time.monotonic()
        return self.has_work

    def _reread_for_long_rope(self) -> None:
        """LongRoPE, as transformers' Phi-3 generates: a sequence whose next rows pass the original
        context while its cached rows were computed within it is read again from its first token, in
        one call with the long frequencies (transformers drops the cache there and recomputes), so
        that every row of a sequence past the original context is a long one. The step in flight is
        landed first: the reread needs every token on the host."""
        after = self._long_rope_after
        assert after is not None
        for req in list(self._running):
            seq = req.seq
            if seq is None or not req.short_rope or max(seq.num_cached + 1, len(seq.tokens)) <= after:
                continue
            if req.flying:
                self.land()  # its last token is still on the device
                if req not in self._running or req.seq is None:
                    continue  # it ended with that token
            try:
                self.kv_cache.ensure_capacity(seq.seq_id, len(seq.tokens))  # its next position's block too
            except OutOfMemory:
                self._preempt(req)  # it reads everything again from the queue, once there is room
                continue
            seq.num_cached, req.short_rope = 0, False
            log.debug(
                "longrope: %s passes the original context (%d): read again with the long frequencies", req.seq_id, after
            )

    def land(self) -> None:
        """Wait for the step in flight and hand out its tokens (no-op when none is): before anything
        else touches the device memory a step reads or writes. Its error ends the running requests
        (and is raised)."""
        flight, self._flight = self._flight, None
        if flight is not None:
            try:
                self._hand_out(flight)
            except BaseException as exc:
                self._fail_running(exc)
                raise

    def _fail_running(self, exc: BaseException) -> None:
        """A step failed: the batch's requests end with its error (the worker serves on)."""
        self._flight = None
        for req in list(self._running):
            self._fail(req, exc)
        self._running.clear()

    def drop_leavers(self) -> None:
        """End the requests whose callers left (at every step; while paused, when one leaves)."""
        for queue in (self._waiting, self._running):
            for req in [r for r in queue if r.left()]:
                queue.remove(req)
                self._fail(req, Cancelled("generation stopped: the caller left"))

    def _admit(self) -> None:
        """Bind and admit waiting requests in order while the batch has room and their prompts fit."""
        while self._waiting and len(self._running) < self.max_batch:
            req = self._waiting[0]
            try:
                if req.seq is None and not self._bind(req):
                    continue  # done without a step (nothing to generate, nothing to keep)
            except BaseException as exc:
                self._waiting.popleft()
                self._fail(req, exc)
                continue
            try:
                self.kv_cache.ensure_capacity(req.seq_id, len(req.seq.tokens))  # type: ignore[union-attr]
            except OutOfMemory as exc:
                if self._running:
                    return  # its prompt fits once running requests end; those behind it wait too
                self._waiting.popleft()  # nothing runs: only kept sequences hold the blocks it needs
                self._fail(req, exc)
                continue
            self._waiting.popleft()
            if req.request.max_new_tokens:
                self._running.append(req)
            else:  # a kept prompt: its blocks are held now, it is read at the next call
                self._finish(req, FinishReason.LENGTH)

    def _bind(self, req: _Request) -> bool:
        """Check the request against the state and attach its sequence; False when it is already
        done (a temporary sequence with nothing to generate). Raises what the request gets."""
        self._check_ready()
        request, kv = req.request, self.kv_cache
        sid = request.sequence_id
        existing = kv.sequences.get(sid) if sid is not None else None
        if existing is None and not req.prompt:
            if sid is not None:  # no prompt: a continuation, of a sequence that is not here
                raise NotFound(
                    f"no sequence {sid!r}: never created here, freed, or discarded by a sleep that discarded "
                    "the KV cache (send its tokens again as a prompt)",
                    metadata={"sequenceId": sid},
                )
            raise InvalidArgument("a new sequence needs a non-empty prompt")
        if existing is not None:
            if existing.handle in self.busy_sequences():
                raise WrongState(f"sequence {sid!r} is being generated by another Generate; wait for it to end")
            if existing.location != "device":
                raise WrongState(f"sequence {sid!r} is swapped out ({existing.location}); swap it in first")
        n = request.max_new_tokens
        before = (len(existing.tokens) if existing else 0) + len(req.prompt)
        if request.stop_at_context and n and before + n > self._max_position:
            n = max(self._max_position - before, 0)  # the model's context ends it, not the request's bound
            if n == 0:
                raise InvalidArgument(
                    f"the sequence is {before} tokens: no room for a new one in the model's {self._max_position}"
                )
        total = before + n
        if total > self._max_position:
            raise InvalidArgument(f"sequence would reach {total} tokens; the model allows {self._max_position}")
        # Blocks are taken as tokens are made (admission needs the prompt's, each decode grows by one),
        # so only what could never be had is refused here: more than the pool, or than what kept
        # sequences leave of it. The last generated token is never fed, so it needs no block.
        temporary = {r.seq.handle for r in (*self._running, *self._waiting) if r.seq and r.request.sequence_id is None}
        held = sum(kv.blocks_of(s) for s in kv.sequences.values() if s is not existing and s.handle not in temporary)
        room = (kv.device.num_blocks - held) * kv.block_size  # tokens this sequence can ever feed
        if request.stop_at_context and n and before + n - 1 > room:
            n = max(room + 1 - before, 0)  # like the context: the pool ends it (LENGTH), not a refusal
        req.limit = n
        fed = before + n - 1 if n else before
        need = -(-fed // kv.block_size)
        pool = kv.device.num_blocks * kv.block_size
        if need > kv.device.num_blocks:
            raise InvalidArgument(
                f"the sequence would reach {before + n} tokens; the KV cache holds {pool} ({kv.device.num_blocks} "
                f"blocks of {kv.block_size} tokens: the worker's --kv-blocks)",
                metadata={"neededBlocks": str(need), "kvCacheTokens": str(pool)},
            )
        if need > kv.device.num_blocks - held:
            raise OutOfMemory(
                f"KV cache: the request needs {need} device blocks; {kv.device.num_blocks} exist and kept "
                f"sequences hold {held} (free some with FreeSequence)",
                metadata={"neededBlocks": str(need)},
            )
        if n == 0 and sid is None:
            req.future.set_result(GenerationResult([], FinishReason.LENGTH, len(req.prompt)))
            self._waiting.popleft()
            return False
        if existing is None:
            req.seq = kv.allocate_sequence(sid if sid is not None else f"{TEMPORARY_PREFIX}{uuid.uuid4().hex}")
            req.created = True
        else:
            req.seq = existing
            req.kept = (len(existing.tokens), existing.num_cached, kv.blocks_of(existing))
        after = self._long_rope_after
        req.short_rope = after is not None and 0 < req.seq.num_cached <= after  # a kept prefix, read short
        req.seq.tokens.extend(req.prompt)
        if req.seq.num_cached == len(req.seq.tokens):  # every token read: read the last again for its logits
            req.seq.num_cached -= 1
        req.sampler = Sampler(request.sampling, self._device)
        return True

    def _grow(self) -> None:
        """Give each decoding request the block its next position needs, preempting the newest
        running requests when the pool is out of blocks (their prompts' blocks were taken at admission)."""
        kv = self.kv_cache
        room = kv.block_size
        for req in list(self._running):
            seq = req.seq
            if seq is None or not (req.pending == 1 or req.continues):
                continue  # still reading its prompt, or its last token is in flight
            if seq.num_cached < kv.blocks_of(seq) * room:
                continue  # its last block has room for the position (the common case: no call below)
            if req not in self._running:
                continue  # preempted for an earlier one
            while True:
                try:
                    kv.ensure_capacity(seq.seq_id, seq.num_cached + 1)
                    break
                except OutOfMemory:
                    if self._flight is not None:  # preempt only with every token handed out
                        self.land()
                        self._grow()
                        return
                    victim = self._running[-1]
                    self._preempt(victim)
                    if victim is req:
                        break

    def _preempt(self, req: _Request) -> None:
        """Take a running request's blocks back; it waits at the head of the queue and re-reads its tokens."""
        self._running.remove(req)
        self._drop_cache(req)
        self._waiting.appendleft(req)

    def _plan(self, before: _Flight | None) -> tuple[HostStep, list[tuple[_Request, int]], list[_Request], list[int]]:
        """The step's rows, decodes first, then prompt chunks within the token budget; how many
        tokens each request feeds; the requests whose last row ends a read (they get a token); and
        for the leading decodes, whose tokens ``before`` (the step in flight) makes, the index of
        each one's token among its tokens.

        With at most :attr:`paged_rows` rows, or more rows whose prefixes are short (see
        :data:`SHORT_PREFIX`), every row attends through the block tables (one table per sequence,
        ``row_tables`` naming each row's): a step of decodes and prompt chunks is then one attention
        launch per layer, where each chunk was a few of its own. Otherwise a chunk is a span whose
        attention runs per sequence: the host backend's way (its torch kernel would gather a table per
        row; ``paged_rows`` is 0 there), and a long chunk's (the decode kernel reads a row's whole
        prefix for every row, where a span's flash attention reads it once per tile of rows)."""
        kv = self.kv_cache
        bs = kv.block_size
        running = set(self._running)
        fed: list[int] = []
        if before is not None:
            fed = [i for i, r in enumerate(before.ends) if r in running and r.continues]
        decodes = [before.ends[i] for i in fed] if before is not None else []
        decodes += [r for r in self._running if r.pending == 1]
        budget = self.max_step_tokens - len(decodes)
        chunks: list[tuple[_Request, int]] = []
        for req in self._running:
            if req.pending > 1 and budget > 0:
                take = min(req.pending, budget)
                chunks.append((req, take))
                budget -= take
        d = len(decodes)
        rows = d + sum(take for _, take in chunks)
        paged = 0 < rows <= self.paged_rows or (
            self.paged_rows > 0 and _prefix_reads(decodes, chunks) <= rows * SHORT_PREFIX
        )
        seqs = [r.seq for r in decodes] + [r.seq for r, _ in chunks]
        tables = [kv.block_array(s.seq_id) for s in seqs]  # type: ignore[union-attr]
        width = max(((len(t) for t in tables) if paged else (len(t) for t in tables[:d])), default=0)
        table = np.zeros((len(seqs) if paged else d, width), np.int64)
        for i, t in enumerate(tables[: len(table)]):
            table[i, : len(t)] = t
        positions = [np.fromiter((s.num_cached for s in seqs[:d]), np.int64, d)]  # type: ignore[union-attr]
        k = len(fed)  # the first k decodes' tokens are on the device: placeholders here
        tokens = [np.fromiter((0 if i < k else s.tokens[-1] for i, s in enumerate(seqs[:d])), np.int64, d)]  # type: ignore[union-attr]
        blocks = [np.fromiter((t[p // bs] for t, p in zip(tables, positions[0].tolist(), strict=False)), np.int64, d)]
        row_tables = [np.arange(d, dtype=np.int64)]
        spans: list[tuple[int, int, int, np.ndarray | None]] = []
        last_rows = list(range(d))
        ends = list(decodes)
        row = d
        for i, (req, take) in enumerate(chunks, start=d):
            seq = req.seq
            assert seq is not None
            start = seq.num_cached
            tokens.append(np.asarray(seq.tokens[start : start + take], np.int64))
            pos = np.arange(start, start + take, dtype=np.int64)
            positions.append(pos)
            blocks.append(tables[i][pos // bs])
            if paged:
                row_tables.append(np.full(take, i, np.int64))
            else:
                spans.append((row, start, take, tables[i] if start else None))
            row += take
            if start + take == len(seq.tokens):
                last_rows.append(row - 1)
                ends.append(req)
        all_positions = np.concatenate(positions)
        long = None
        planned = [(r, 1) for r in decodes] + chunks
        if self._long_rope_after is not None and planned:
            lengths = np.repeat([len(r.seq.tokens) for r, _ in planned], [n for _, n in planned])  # type: ignore[union-attr]
            long = rope_long(self._long_rope_after, all_positions, lengths)
            for (req, _), marks in zip(planned, np.split(long, np.cumsum([n for _, n in planned])[:-1]), strict=True):
                req.short_rope = req.short_rope or not marks.all()
        step = HostStep(
            token_ids=np.concatenate(tokens),
            positions=all_positions,
            write_blocks=np.concatenate(blocks),
            decode_tables=table,
            spans=tuple(spans),
            last_rows=np.asarray(last_rows, np.int64),
            row_tables=np.concatenate(row_tables) if paged else None,
            rope_long=long,
        )
        return step, planned, ends, fed

    def _launch(self, before: _Flight | None) -> _Flight | None:
        """Queue one model step over the running batch and the sampling of the token of each request
        whose row ends a read; the rows that continue ``before``'s requests read its tokens on the
        device. None when no request has a row to feed (each one's last token is in ``before``)."""
        step, fed, ends, index = self._plan(before)
        if not fed:
            return None
        if index:
            assert before is not None
            src = before.tokens
            if index != list(range(len(index))):  # a request of it left or ends: pick the others'
                src = src.index_select(0, to_device(index, torch.int64, src.device))
            step = dataclasses.replace(step, device_tokens=src[: len(index)])
        # swaps begun between steps may still copy: wait for them only if they touch this step's blocks
        if self.kv_cache.copies_in_flight:
            spans = [b for _, _, _, b in step.spans if b is not None]
            self.kv_cache.wait_copies_touching(np.concatenate([step.write_blocks, step.decode_tables.ravel(), *spans]))
        logits = self._run_step(step)
        for req, n in fed:
            assert req.seq is not None
            req.seq.num_cached += n
        for req in ends:
            req.flying += 1
        self.steps += 1
        tokens = sample_tokens(logits, [req.sampler for req in ends])  # type: ignore[misc]  # bound at admission
        return _Flight.launch(ends, [req for req, _ in fed], tokens)

    def _hand_out(self, flight: _Flight) -> None:
        """Wait for ``flight``'s tokens and deliver each to its request, unless it ended meanwhile."""
        for req, token in zip(flight.ends, flight.read(), strict=True):
            req.flying -= 1
            if not req.future.done():
                self._deliver(req, token)

    def _deliver(self, req: _Request, token: int) -> None:
        seq = req.seq
        assert seq is not None
        seq.tokens.append(token)
        req.out.append(token)
        if req.on_token is not None:
            req.on_token(token)
        if token in req.stops or (req.stop_text is not None and req.stop_text.push(token)):
            self._finish(req, FinishReason.STOP)
        elif len(req.out) >= req.limit:
            self._finish(req, FinishReason.LENGTH)

    def _finish(self, req: _Request, reason: FinishReason) -> None:
        if req in self._running:
            self._running.remove(req)
        if req.flying:  # the step in flight feeds its last token: a row for nothing, uncounted
            assert req.seq is not None
            req.seq.num_cached -= req.flying
        if req.left():  # left during the last step: nothing kept
            self._fail(req, Cancelled("generation stopped: the caller left"))
            return
        kv, seq = self.kv_cache, req.seq
        assert seq is not None
        blocks: list[int] = []
        if req.request.sequence_id is None:
            kv.free_sequence(seq.seq_id)
        else:
            if reason == FinishReason.STOP:  # blocks it did not reach go back
                kv.shrink(seq.seq_id, max(req.kept[2], -(-seq.num_cached // kv.block_size)))
            blocks = seq.block_ids
        matched = req.stop_text.matched if req.stop_text is not None else ""
        req.future.set_result(GenerationResult(req.out, reason, len(req.prompt), blocks, matched))

    def _fail(self, req: _Request, exc: BaseException) -> None:
        """End a request with ``exc`` and keep nothing: a sequence it created is freed, one it
        continued goes back to what it was (its cache re-read on the next call if it was preempted).
        A request that already ended (in the step that then failed) keeps its result."""
        if req.future.done():
            return
        seq, kv = req.seq, self.kv_cache
        if seq is not None and seq.seq_id in kv.sequences:
            if req.created:
                kv.free_sequence(seq.seq_id)
            else:
                del seq.tokens[req.kept[0] :]
                if req.preempted:
                    kv.shrink(seq.seq_id, 0)
                    seq.num_cached = 0
                else:
                    seq.num_cached = req.kept[1]
                    kv.shrink(seq.seq_id, req.kept[2])
        req.seq = None
        req.future.set_exception(exc)


def _prefix_reads(decodes: list[_Request], chunks: list[tuple[_Request, int]]) -> int:
    """Positions the step's rows read as paged rows: each row its sequence's prefix up to itself."""
    reads = 0
    for req in decodes:
        assert req.seq is not None
        reads += req.seq.num_cached + 1
    for req, take in chunks:
        assert req.seq is not None
        reads += take * req.seq.num_cached + take * (take + 1) // 2
    return reads


def check_tokens(ids: object, vocab: int, what: str = "prompt_token_ids") -> list[int]:
    """A list of token ids in ``[0, vocab)``, or INVALID_ARGUMENT naming the first bad one."""
    if isinstance(ids, str | bytes) or not hasattr(ids, "__iter__"):
        raise InvalidArgument(f"{what} must be a list of token ids")
    tokens = list(ids)  # type: ignore[call-overload,unused-ignore]
    for i, t in enumerate(tokens):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise InvalidArgument(f"{what}[{i}] = {t!r} is not a token id in [0, {vocab})")
    return tokens


__all__ = ["SHORT_PREFIX", "Engine", "check_tokens"]
