"""The decode step captured in CUDA graphs, one per batch-size bucket, replayed with new inputs.

An eager decode step of an 8B model launches ~600 kernels from Python; at a few microseconds each
that, not the GPU, sets the pace. A graph launches them all at once. Each bucket's graph reads its
inputs from one int64 buffer it owns (tokens, positions, write slots, lengths, block tables), which a
step fills with a single host-to-device copy; smaller batches are padded with rows that write and
read a scratch KV block no sequence owns.

Everything a graph owns (its input buffer, the activations its kernels write, its logits) is in the
allocator's ``cuda_graphs`` tag. Its contents live only for one replay, so a sleep discards the tag
and the wake maps it again at the same addresses: the graphs captured at start-up replay after every
wake without being captured again, which is the product's same-address promise kept by its own
engine (tests/gpu/test_cuda_engine.py proves it token for token).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from memsvc.vocabulary import CUDA_GRAPHS
from worker.allocator import MemoryAllocator
from worker.model.config import ModelConfig
from worker.model.decoder import DecodeRows, FusedLayer, HostStep, Kernels, Rope, StepInputs, forward_step

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""Batch sizes captured (up to the engine's max_batch, which is captured too)."""
_FIELDS = 5
"""Per-row int64 fields ahead of the block tables: token, position, write block, write slot, length."""


@dataclass
class _Bucket:
    size: int
    graph: torch.cuda.CUDAGraph
    device_buf: torch.Tensor
    host_buf: torch.Tensor
    logits: torch.Tensor


class DecodeGraphs:
    """Captured decode steps for every bucket up to ``max_batch``; :meth:`run` replays the smallest
    that holds a step's rows."""

    def __init__(
        self, alloc: MemoryAllocator, weights: Mapping[str, torch.Tensor], config: ModelConfig, rope: Rope,
        kv: torch.Tensor, scratch_block: int, max_batch: int, kernels: Kernels,
        fused: Sequence[FusedLayer] | None = None,
    ) -> None:  # fmt: skip
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
        self.sizes = tuple(sorted({b for b in BUCKETS if b < max_batch} | {max_batch}))
        self._buckets: dict[int, _Bucket] = {}
        self.captures = 0
        self.replays = 0

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def capture(self) -> None:
        """Warm every bucket up, then capture it (largest first, so the smaller ones reuse its
        memory in the shared pool)."""
        for size in reversed(self.sizes):
            self._buckets[size] = self._capture(size)
            self.captures += 1

    def _views(self, buf: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
        fields = buf[: _FIELDS * size].view(_FIELDS, size)
        return (*fields.unbind(0), buf[_FIELDS * size :].view(size, self.width))

    def _pad(self, host: torch.Tensor, size: int, rows: int) -> None:
        """Rows ``rows..size`` (and every row when first filled): a one-position read of the scratch block."""
        tokens, positions, blocks, slots, lengths, tables = self._views(host, size)
        tokens[rows:] = 0
        positions[rows:] = 0
        blocks[rows:] = self.scratch
        slots[rows:] = 0
        lengths[rows:] = 1
        tables[rows:] = 0
        tables[rows:, 0] = self.scratch

    def _capture(self, size: int) -> _Bucket:
        alloc = self._alloc
        numel = size * (_FIELDS + self.width)
        device_buf = alloc.empty((numel,), torch.int64, CUDA_GRAPHS)
        host_buf = torch.empty((numel,), dtype=torch.int64, pin_memory=True)
        self._pad(host_buf, size, 0)
        device_buf.copy_(host_buf)
        tokens, positions, blocks, slots, lengths, tables = self._views(device_buf, size)
        inputs = StepInputs(
            token_ids=tokens, positions=positions, write_blocks=blocks, write_slots=slots,
            decode=DecodeRows(size, tables, lengths),
        )  # fmt: skip
        stream = torch.cuda.Stream(alloc.device)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        stream.wait_stream(torch.cuda.current_stream(alloc.device))
        with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks its kernels
            for _ in range(2):
                forward_step(self._weights, self._config, self._rope, self._kv, inputs, self._kernels, self._fused)
        torch.cuda.current_stream(alloc.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with alloc.capture_graph(graph, CUDA_GRAPHS):
            logits = forward_step(self._weights, self._config, self._rope, self._kv, inputs, self._kernels, self._fused)
        return _Bucket(size, graph, device_buf, host_buf, logits)

    def fits(self, step: HostStep) -> bool:
        return step.decode_only and 0 < step.decodes <= self.max_rows and step.decode_tables.shape[1] <= self.width

    def run(self, step: HostStep) -> torch.Tensor:
        """The step's ``[rows, vocab]`` float32 logits (valid until the next replay of its bucket)."""
        n = step.decodes
        bucket = self._buckets[next(s for s in self.sizes if s >= n)]
        host = bucket.host_buf
        tokens, positions, blocks, slots, lengths, tables = self._views(host, bucket.size)
        tokens[:n] = torch.from_numpy(step.token_ids)
        positions[:n] = torch.from_numpy(step.positions)
        blocks[:n] = torch.from_numpy(step.write_blocks)
        slots[:n] = positions[:n] % self.block_size
        lengths[:n] = positions[:n] + 1
        width = step.decode_tables.shape[1]
        tables[:n, :width] = torch.from_numpy(step.decode_tables)
        tables[:n, width:] = 0
        self._pad(host, bucket.size, n)
        bucket.device_buf.copy_(host, non_blocking=True)  # the step's argmax waits for the replay, so for this
        bucket.graph.replay()
        self.replays += 1
        return bucket.logits[:n]


__all__ = ["BUCKETS", "DecodeGraphs"]
