"""The model step captured in CUDA graphs, one per row-count bucket, replayed with new inputs.

An eager step of an 8B model launches ~600 kernels from Python; at a few microseconds each that, not
the GPU, sets the pace. A graph launches them all at once. A step goes through the graphs when every
row attends through the block tables: its decodes, and the rows of prompt chunks the engine planned
as paged rows (a burst of short prompts arriving beside a running batch). Each bucket's graph reads
its inputs from one int64 buffer it owns (tokens, positions, write slots, lengths, block tables),
which a step fills with a single host-to-device copy; smaller steps are padded with rows that write
and read a scratch KV block no sequence owns.

Everything a graph owns (its input buffer, the activations its kernels write, its logits) is in the
allocator's ``cuda_graphs`` tag. Its contents live only for one replay, so a sleep discards the tag
and the wake maps it again at the same addresses: a graph captured before a sleep replays after every
wake without being captured again, which is the product's same-address promise kept by its own
engine (tests/gpu/test_cuda_engine.py proves it token for token).

Capturing every bucket of an 8B model takes seconds, so the worker does not wait for it before it
serves: :class:`BackgroundCapture` captures the buckets after the load, one per job on the device
thread while the engine is idle, and a step whose bucket is not captured yet runs eagerly on the
bucket's padded rows while the background capture takes that bucket first (within
:data:`PATIENCE_S`, even under load). An eager step on a bucket's padded rows gives the tokens of the
bucket's replay (tests/gpu/test_background_capture.py), so a request's tokens do not depend on the
moment its bucket was captured. (At `fab6168` they did differ: graphs were then captured on torch's
shared capture stream, and destroying any graph captured there freed the cuBLAS workspace the others
replay with; each model now captures on a stream of its own.) A model runner used alone, with no
background capture, captures a step's bucket first.
A capture reuses the pool's memory whatever the order; smallest first, the order here, may map a
little more than largest first (what :meth:`DecodeGraphs.capture` does when it captures all at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from memsvc.errors import InvalidArgument, WrongState
from memsvc.vocabulary import CUDA_GRAPHS
from worker.allocator import MemoryAllocator
from worker.model.config import ModelConfig
from worker.model.decoder import (
    DecodeRows,
    FusedLayer,
    HostStep,
    Kernels,
    Rope,
    StepInputs,
    forward_step,
    layer_kinds,
)
from worker.model.step_limits import bucket_sizes

_FIELDS = 6
"""Per-row int64 fields ahead of the block tables: token, position, write block, write slot, length,
the row's table."""
IDLE_S = 0.2
"""A background capture waits until no step has run for this long, and starts no sooner than this
after it was set up (the worker's ready): a request that arrives just after the worker is ready (a
client waiting for it) is served first, not after a capture."""
PATIENCE_S = 1.0
"""A bucket that steps need is captured between two steps once it has waited this long, even if the
engine never idles (a capture holds the device loop for a fraction of a second; eager steps of a busy
batch cost more than that within a few seconds)."""

log = logging.getLogger("memsvc.worker")


class StepBuffer:
    """A bucket's inputs in one int64 buffer, laid out as its graph reads them: token, position,
    write block, write slot, length, table row (``[size]`` each), the block tables (``[outputs + 1,
    width]``: the last is the padding rows', on the scratch block) and the rows whose logits come out
    (``[outputs]``). Filled row by row on the host, copied to the device in one piece.

    A fill clears only what the previous fill wrote past its own tables (:attr:`written`): the
    tables are most of the buffer (257 x 512 entries in the 256-row bucket of an 8B model with 16-
    token blocks), and clearing them whole each step made a step's host work follow the bucket's
    size, not the step's (and large enough for torch to wake its CPU thread pool every step)."""

    def __init__(self, buf: torch.Tensor, size: int, outputs: int, width: int, scratch: int, block_size: int) -> None:
        self.buf = buf
        self.size = size
        self.outputs = outputs
        self.width = width
        self.scratch = scratch
        self.block_size = block_size
        self.written = (0, 0)
        """Table rows and columns the last fill wrote (the buffer holds zeros past them)."""
        fields = buf[: _FIELDS * size].view(_FIELDS, size)
        end = _FIELDS * size + (outputs + 1) * width
        self.tokens, self.positions, self.blocks, self.slots, self.lengths, self.table_rows = fields.unbind(0)
        self.tables = buf[_FIELDS * size : end].view(outputs + 1, width)
        self.last = buf[end : end + outputs]

    @staticmethod
    def numel(size: int, outputs: int, width: int) -> int:
        return size * _FIELDS + (outputs + 1) * width + outputs

    def clear(self) -> None:
        """Every row padding, every table empty but the padding rows' (the state before a first fill)."""
        self.buf.zero_()
        self._pad(0, 0)
        self.written = (0, 0)

    def fill(self, step: HostStep) -> int:
        """Write the step's rows, padding the rest; the logits rows it returns."""
        n = step.decodes
        self.tokens[:n] = torch.from_numpy(step.token_ids)
        self.positions[:n] = torch.from_numpy(step.positions)
        self.blocks[:n] = torch.from_numpy(step.write_blocks)
        self.slots[:n] = self.positions[:n] % self.block_size
        self.lengths[:n] = self.positions[:n] + 1
        if step.row_tables is None:
            self.table_rows[:n] = torch.arange(n)
        else:
            self.table_rows[:n] = torch.from_numpy(step.row_tables)
        seqs, width = step.decode_tables.shape
        tables = self.tables
        tables[:seqs, :width] = torch.from_numpy(step.decode_tables)
        old_seqs, old_width = self.written
        tables[seqs:old_seqs, :old_width] = 0  # rows the last fill used and this one does not
        tables[: min(seqs, old_seqs), width:old_width] = 0  # and columns
        self.written = (seqs, width)
        m = len(step.last_rows)
        self.last[:m] = torch.from_numpy(step.last_rows)
        self._pad(n, m)
        return m

    def _pad(self, rows: int, outs: int) -> None:
        """Rows ``rows..size``: a one-position read of the scratch block; logits rows past ``outs``
        from row 0."""
        self.tokens[rows:] = 0
        self.positions[rows:] = 0
        self.blocks[rows:] = self.scratch
        self.slots[rows:] = 0
        self.lengths[rows:] = 1
        self.table_rows[rows:] = self.outputs
        self.tables[self.outputs, 0] = self.scratch
        self.last[outs:] = 0


@dataclass
class _Bucket:
    size: int
    graph: torch.cuda.CUDAGraph
    device_buf: torch.Tensor
    tokens: torch.Tensor
    """The row tokens in ``device_buf`` (what a step's ``device_tokens`` are written over)."""
    hosts: tuple[StepBuffer, StepBuffer]
    """Two pinned host sides of ``device_buf``, filled in turn: the engine fills a step while the
    step before it, maybe of the same bucket, waits to run, and its copy still reads its buffer."""
    logits: torch.Tensor
    copied: tuple[torch.cuda.Event, torch.cuda.Event]
    """Each recorded after each copy of its host buffer to the device: a step waits for it before it
    writes that buffer again (the copy queued two steps before may not have run yet)."""
    turn: int = 0
    """The host buffer the next step fills."""


class DecodeGraphs:
    """Steps captured for the row buckets up to ``max_rows`` (default ``max_batch``): none at first;
    :meth:`capture` captures every one, :meth:`capture_bucket` one. :meth:`run` replays the smallest
    captured bucket that holds a step's rows. A step's rows all attend through the block tables: its
    decodes, and with the engine's paged rows its prompt chunk's rows too. A bucket of ``size`` rows
    holds the tables of up to ``min(size, max_batch)`` sequences and returns that many rows' logits
    (the rows that end a read: one per sequence at most)."""

    def __init__(
        self,
        alloc: MemoryAllocator,
        weights: Mapping[str, torch.Tensor],
        config: ModelConfig,
        rope: Rope,
        kv: torch.Tensor,
        scratch_block: int,
        max_batch: int,
        kernels: Kernels,
        fused: Sequence[FusedLayer] | None = None,
        max_rows: int | None = None,
    ) -> None:
        self._alloc = alloc
        self._weights = weights
        self._config = config
        self._rope = rope
        self._kv = kv
        self._kernels = kernels
        self._fused = fused
        self.block_size = kv.shape[3]
        self.scratch = scratch_block
        self.width = min(-(-config.max_position_embeddings // self.block_size), scratch_block)
        """Block-table columns: the most blocks one sequence can hold."""
        self._warm_layers = layer_kinds(config)
        self.max_batch = max_batch
        self.sizes = bucket_sizes(max_batch, max_batch if max_rows is None else max_rows)
        self._buckets: dict[int, _Bucket] = {}
        self.failed: set[int] = set()
        """Buckets whose capture raised: their steps decode eagerly, and nothing tries them again."""
        self.captures = 0
        self.replays = 0
        self.eager_steps = 0
        """Steps run eagerly on their bucket's padded rows (the bucket not captured yet, or failed)."""
        self.capture_seconds = 0.0
        """Time spent capturing so far (warm-ups included)."""
        self._stream: torch.cuda.Stream | None = None
        """Every bucket is captured on this stream, this model's own (MemoryAllocator.new_stream)."""

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._buckets))

    @property
    def pending(self) -> tuple[int, ...]:
        """Buckets neither captured nor failed, smallest first."""
        return tuple(s for s in self.sizes if s not in self._buckets and s not in self.failed)

    def capture(self) -> None:
        """Capture every pending bucket now (largest first, so the smaller ones reuse its memory in
        the shared pool)."""
        for size in reversed(self.pending):
            self.capture_bucket(size)

    def capture_bucket(self, size: int) -> float:
        """Warm bucket ``size`` up and capture it; the seconds it took. InvalidArgument unless it is
        pending; a capture that raises marks the bucket failed (and raises)."""
        if size not in self.pending:
            raise InvalidArgument(f"batch bucket {size} is not pending; pending: {list(self.pending)}")
        t0 = time.perf_counter()
        try:
            self._buckets[size] = self._capture(size)
        except BaseException:
            self.failed.add(size)
            raise
        self.captures += 1
        seconds = time.perf_counter() - t0
        self.capture_seconds += seconds
        return seconds

    def bucket_for(self, rows: int) -> int:
        """The bucket a step of ``rows`` paged rows belongs to (the smallest that holds it)."""
        return next(s for s in self.sizes if s >= rows)

    def outputs(self, size: int) -> int:
        """Sequences (tables, logits rows) a bucket of ``size`` rows holds."""
        return min(size, self.max_batch)

    def _buffer(self, size: int, buf: torch.Tensor) -> StepBuffer:
        return StepBuffer(buf, size, self.outputs(size), self.width, self.scratch, self.block_size)

    def _numel(self, size: int) -> int:
        return StepBuffer.numel(size, self.outputs(size), self.width)

    @staticmethod
    def _inputs(buf: StepBuffer) -> StepInputs:
        """The model's inputs as views of a bucket's buffer (on the device)."""
        return StepInputs(
            token_ids=buf.tokens,
            positions=buf.positions,
            write_blocks=buf.blocks,
            write_slots=buf.slots,
            decode=DecodeRows(buf.size, buf.tables, buf.lengths, buf.table_rows),
            last_rows=buf.last,
        )

    def _capture(self, size: int) -> _Bucket:
        alloc = self._alloc
        numel = self._numel(size)
        device_buf = alloc.empty((numel,), torch.int64, CUDA_GRAPHS)
        hosts = tuple(self._buffer(size, torch.empty((numel,), dtype=torch.int64, pin_memory=True)) for _ in "ab")
        for host in hosts:
            host.clear()
        device_buf.copy_(hosts[0].buf)
        inputs = self._inputs(self._buffer(size, device_buf))
        stream = torch.cuda.Stream(alloc.device)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        stream.wait_stream(torch.cuda.current_stream(alloc.device))
        with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks its kernels
            for _ in range(2):
                self._warm_step(inputs)
        torch.cuda.current_stream(alloc.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._stream is None:
            self._stream = alloc.new_stream()
        with alloc.capture_graph(graph, CUDA_GRAPHS, self._stream):
            logits = forward_step(self._weights, self._config, self._rope, self._kv, inputs, self._kernels, self._fused)
        copied = (torch.cuda.Event(), torch.cuda.Event())  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return _Bucket(size, graph, device_buf, inputs.token_ids, (hosts[0], hosts[1]), logits, copied)

    def fits(self, step: HostStep) -> bool:
        """Every row of the step attends through the block tables (its decodes, and a paged prompt
        chunk's rows: no spans) and a bucket can hold it."""
        n = step.decodes
        if not (step.decode_only and 0 < n <= self.max_rows and step.decode_tables.shape[1] <= self.width):
            return False
        out = self.outputs(self.bucket_for(n))
        return step.decode_tables.shape[0] <= out and len(step.last_rows) <= out

    def warm(self, size: int) -> None:
        """One eager step on bucket ``size``'s rows with nothing in them (as a capture's warm-up runs),
        so that what a bucket's first step does once is done before a request's step needs it: cuBLAS
        picks and loads the kernels of the bucket's row count, its pinned staging buffer is made. On
        the H200 the first request after ready took 1.25-1.44 times a later one without it (its prompt
        chunk was the first step of its bucket)."""
        self._warm_step(self._inputs(self._staged(size, None)))

    def _warm_step(self, inputs: StepInputs) -> None:
        """A step over one layer of each kind (decoder.layer_kinds): every kernel of a whole step,
        launched for a fraction of its time (an 8B model's 32 layers read 16 GB); for warm-ups, whose
        output nobody reads."""
        forward_step(
            self._weights, self._config, self._rope, self._kv, inputs, self._kernels, self._fused, self._warm_layers
        )

    def _staged(self, size: int, step: HostStep | None) -> StepBuffer:
        """Bucket ``size``'s padded rows filled with ``step``'s (none: empty rows), on the device."""
        # pinned, so the copy does not wait for the step queued before it
        host = self._buffer(size, torch.empty((self._numel(size),), dtype=torch.int64, pin_memory=True))
        host.clear()
        if step is not None:
            host.fill(step)
        return self._buffer(size, host.buf.to(self._kv.device, non_blocking=True))

    def _eager(self, size: int, step: HostStep) -> torch.Tensor:
        """The step's logits launched eagerly on bucket ``size``'s padded rows."""
        inputs = self._inputs(self._staged(size, step))
        step.fed(inputs.token_ids)
        logits = forward_step(self._weights, self._config, self._rope, self._kv, inputs, self._kernels, self._fused)
        return logits[: len(step.last_rows)]

    def run(self, step: HostStep) -> torch.Tensor:
        """The step's ``[len(last_rows), vocab]`` float32 logits (valid until the next step), computed
        over the rows of its bucket (:meth:`bucket_for`): replayed where the bucket is captured, else
        (not captured yet, or its capture failed) launched eagerly on the same padded rows. Always
        its own bucket's rows: a 16-bit product's rounding may depend on the row count it runs at."""
        n = step.decodes
        size = self.bucket_for(n)
        bucket = self._buckets.get(size)
        if bucket is None:
            self.eager_steps += 1
            return self._eager(size, step)
        turn = bucket.turn
        bucket.turn ^= 1
        host, copied = bucket.hosts[turn], bucket.copied[turn]
        copied.synchronize()  # the copy from this host buffer two steps ago has run
        m = host.fill(step)
        bucket.device_buf.copy_(host.buf, non_blocking=True)
        copied.record()
        step.fed(bucket.tokens)
        bucket.graph.replay()
        self.replays += 1
        return bucket.logits[:m]


class BackgroundCapture:
    """Captures a model's pending step graphs after its load, one bucket per job on the worker's
    device loop, while the engine idles, so that few steps have to capture their own bucket first.

    One bucket per job: a capture holds the device loop for a fraction of a second, and between
    two jobs the engine's steps, a Sleep or a SwapBlocks run. The order: buckets that steps needed
    (:meth:`want`, oldest need first), then the smallest (a single stream decodes in bucket 1). A
    capture waits until the engine has been idle for :data:`IDLE_S`, or, for a bucket steps need,
    until it has waited :data:`PATIENCE_S`.

    A capture reads the weights and the KV cache and writes the ``cuda_graphs`` tag, so it must not
    run while any of them sleeps, nor ahead of a transition already accepted (the Sleep would wait
    for it): ``may_capture`` says when it may (the worker: awake, no transition pending), and the
    ``capture`` callable raises WrongState where memory sleeps. Either way the capture stalls and
    :meth:`poke` (each step that could replay a graph) resumes it. A bucket whose capture fails
    otherwise is logged and left to eager steps.

    Threads: :meth:`want`, :meth:`poke` and :meth:`request` from any thread; the waiting happens on
    ``loop`` (call_later), the capture in a job ``submit`` queues on the device loop.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        capture: Callable[[int], object],
        loop: asyncio.AbstractEventLoop,
        submit: Callable[[Callable[[], None]], object],
        may_capture: Callable[[], bool],
        last_busy: Callable[[], float],
    ) -> None:
        self._pending = sorted(sizes)
        self._wanted: dict[int, float] = {}
        """Pending buckets a step needed, and the monotonic time it first did."""
        self._started = time.monotonic()
        self._capture = capture
        self._loop = loop
        self._submit = submit
        self._may_capture = may_capture
        self._last_busy = last_busy
        self._lock = threading.Lock()
        self._scheduled = False
        """A look is scheduled on the loop or a job is queued: at most one at a time."""
        self.stalled = False
        """The last job found capturing not allowed (asleep, a transition pending); :meth:`poke` resumes."""
        self.captured: list[int] = []
        """Buckets this captured, in order."""
        self._all = len(self._pending)

    @property
    def pending(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._pending)

    def want(self, size: int) -> None:
        """A step needed bucket ``size`` and ran eagerly: capture it first (any thread)."""
        with self._lock:
            if size not in self._pending or size in self._wanted:
                return
            self._wanted[size] = time.monotonic()
        self.request()

    def poke(self) -> None:
        """A step ran that could replay a graph: resume a stalled capture (cheap when none is)."""
        if self.stalled and self._pending:
            self.request()

    def request(self) -> None:
        """Look at the next capture soon (any thread)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the worker is gone
            self._loop.call_soon_threadsafe(self._look, False)

    def _next(self) -> int | None:
        if self._wanted:
            return min(self._wanted, key=self._wanted.__getitem__)
        return self._pending[0] if self._pending else None

    def _wait(self, size: int) -> float:
        """Seconds to wait before capturing ``size`` (0: now)."""
        now = time.monotonic()
        wait = IDLE_S - (now - max(self._last_busy(), self._started))
        if size in self._wanted:
            wait = min(wait, PATIENCE_S - (now - self._wanted[size]))
        return max(wait, 0.0)

    def _look(self, timer: bool) -> None:
        """On the loop: queue the next capture, or look again when it may run."""
        with self._lock:
            if self._scheduled and not timer:
                return
            self._scheduled = False
            size = self._next()
            if size is None:
                return
            wait = self._wait(size)
            self._scheduled = True
        if wait > 0:
            self._loop.call_later(wait, self._look, True)
            return
        try:
            self._submit(self._job)
        except RuntimeError:  # the device loop is shut down
            with self._lock:
                self._scheduled = False

    def _job(self) -> None:
        """On the device loop: capture the next bucket if it still may run."""
        more = False
        try:
            if not self._may_capture():
                self.stalled = True
                return
            with self._lock:
                size = self._next()
                if size is None:
                    return
                if self._wait(size) > 0:  # a request came in while this was queued
                    more = True
                    return
            try:
                self._capture(size)
            except WrongState as exc:  # memory asleep: the next step after a wake resumes it
                log.debug("cuda graphs: batch %d not captured now: %s", size, exc)
                self.stalled = True
                return
            except Exception as exc:  # noqa: BLE001 - the worker serves on; that bucket's steps run eagerly
                log.warning("cuda graphs: capturing batch %d failed (%s); its steps run eagerly", size, exc)
            else:
                self.captured.append(size)
            self.stalled = False
            with self._lock:
                if size in self._pending:
                    self._pending.remove(size)
                self._wanted.pop(size, None)
                more = bool(self._pending)
            if not more:
                log.info("cuda graphs: %d of %d buckets captured in the background", len(self.captured), self._all)
        finally:
            with self._lock:
                self._scheduled = False
            if more:
                self.request()


__all__ = ["IDLE_S", "PATIENCE_S", "BackgroundCapture", "DecodeGraphs", "StepBuffer"]
