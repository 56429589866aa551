"""The paged KV cache: a device block pool tagged ``kv_cache``, a host block pool, and who owns what.

Layout is block-major, ``[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``,
so one block (K and V of every layer for ``block_size`` positions) is one contiguous byte range.
That is what makes SwapBlocks cheap: moving a block between the device and the host pool is a
single item of one batched ``copy_blocks`` call, however many layers the model has. The host pool
has the same layout in page-locked memory, so the copy engine can reach it directly.

Sequences own blocks in either pool. A swap moves ownership with the bytes: the sequence's block
table entry follows its block to the other pool, and a sequence runs only while every one of its
blocks is on the device.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

import torch

from memsvc.errors import InvalidArgument, NotFound, OutOfMemory, WrongState
from worker.allocator import CopyMethod, MemoryAllocator
from worker.model.config import ModelConfig

KV_TAG = "kv_cache"

Location = Literal["device", "host"]
SwapDirection = Literal["out", "in"]


def kv_block_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim)


class _BlockPool:
    """``num_blocks`` equal, contiguous blocks in one tensor."""

    location: Location

    def __init__(self, tensor: torch.Tensor, block_size: int) -> None:
        self.tensor = tensor
        self.num_blocks = tensor.shape[0]
        self.block_size = block_size
        self.block_bytes = tensor[0].numel() * tensor.element_size() if self.num_blocks else 0

    def block_ptr(self, block_id: int) -> int:
        return int(self.tensor.data_ptr()) + block_id * self.block_bytes


class KvBlockPool(_BlockPool):
    """The device pool, in the allocator's ``kv_cache`` tag (discarded or offloaded with it on sleep)."""

    location: Location = "device"

    def __init__(self, config: ModelConfig, alloc: MemoryAllocator, num_blocks: int, block_size: int) -> None:
        shape = kv_block_shape(config, num_blocks, block_size)
        super().__init__(alloc.empty(shape, config.torch_dtype, KV_TAG), block_size)


class HostKvPool(_BlockPool):
    """Page-locked host blocks that swapped-out sequences live in; untouched by sleep and wake."""

    location: Location = "host"

    def __init__(self, config: ModelConfig, alloc: MemoryAllocator, num_blocks: int, block_size: int) -> None:
        shape = kv_block_shape(config, num_blocks, block_size)
        super().__init__(alloc.host_empty(shape, config.torch_dtype), block_size)


@dataclass
class Sequence:
    """One sequence's tokens and block table."""

    seq_id: str
    tokens: list[int] = field(default_factory=list)
    """Every token of the sequence, prompt and generated."""
    block_ids: list[int] = field(default_factory=list)
    """Block table: entry ``i`` holds positions ``[i * block_size, (i + 1) * block_size)``."""
    block_locations: list[Location] = field(default_factory=list)
    """Which pool each entry of ``block_ids`` is in."""
    num_cached: int = 0
    """Leading tokens whose K and V are written in the blocks (the rest are still to be fed)."""

    @property
    def location(self) -> Literal["device", "host", "mixed"]:
        """``device`` (runnable; also with no blocks yet), ``host`` (all swapped out) or ``mixed``."""
        if all(loc == "device" for loc in self.block_locations):
            return "device"
        if all(loc == "host" for loc in self.block_locations):
            return "host"
        return "mixed"


class KvStats(TypedDict):
    """Block counts of both pools; a plain dict, so status messages and JSON take it as is."""

    block_size: int
    """Token positions per block."""
    block_bytes: int
    device_blocks: int
    device_free_blocks: int
    host_blocks: int
    host_free_blocks: int
    sequences: int


class KvCache:
    """The device and host block pools, their free lists, and the sequence table.

    Not thread-safe: the :class:`~worker.model.runner.ModelRunner` serialises access.
    """

    def __init__(
        self, config: ModelConfig, alloc: MemoryAllocator, num_device_blocks: int, num_host_blocks: int,
        block_size: int = 16,
    ) -> None:  # fmt: skip
        for name, value, least in (
            ("num_device_blocks", num_device_blocks, 1), ("num_host_blocks", num_host_blocks, 0),
            ("block_size", block_size, 1),
        ):  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise InvalidArgument(f"{name} must be an integer >= {least}, got {value!r}")
        self.config = config
        self.block_size = block_size
        self._alloc = alloc
        self.device = KvBlockPool(config, alloc, num_device_blocks, block_size)
        self.host = HostKvPool(config, alloc, num_host_blocks, block_size)
        self.block_bytes = self.device.block_bytes
        self._pools: dict[Location, _BlockPool] = {"device": self.device, "host": self.host}
        self._free: dict[Location, set[int]] = {"device": set(), "host": set()}
        self._owner: dict[tuple[Location, int], tuple[str, int]] = {}
        """(pool, block) -> (sequence, index in its block table), for every owned block."""
        self._seqs: dict[str, Sequence] = {}
        self.drop_all()

    # ---- sequences ----
    @property
    def sequences(self) -> Mapping[str, Sequence]:
        return self._seqs

    def sequence(self, seq_id: str) -> Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise NotFound(f"no sequence {seq_id!r}") from None

    def allocate_sequence(self, seq_id: str, tokens: Iterable[int] = ()) -> Sequence:
        """A new sequence with no blocks yet (see :meth:`ensure_capacity`)."""
        if not isinstance(seq_id, str) or not seq_id:
            raise InvalidArgument(f"sequence id must be a non-empty string, got {seq_id!r}")
        if seq_id in self._seqs:
            raise InvalidArgument(f"sequence {seq_id!r} already exists")
        seq = self._seqs[seq_id] = Sequence(seq_id, list(tokens))
        return seq

    def ensure_capacity(self, seq_id: str, num_tokens: int) -> None:
        """Give the sequence device blocks for ``num_tokens`` positions in all.

        OutOfMemory when the device pool has too few free blocks; then nothing changed.
        """
        seq = self.sequence(seq_id)
        if seq.location != "device":
            raise WrongState(f"sequence {seq_id!r} is swapped out ({seq.location}); swap it in first")
        needed = -(-num_tokens // self.block_size) - len(seq.block_ids)
        if needed <= 0:
            return
        free = self._free["device"]
        if needed > len(free):
            raise OutOfMemory(f"KV cache: sequence {seq_id!r} needs {needed} more device blocks, {len(free)} are free")
        for block in heapq.nsmallest(needed, free):
            free.remove(block)
            self._owner[("device", block)] = (seq_id, len(seq.block_ids))
            seq.block_ids.append(block)
            seq.block_locations.append("device")

    def free_sequence(self, seq_id: str) -> None:
        """Forget the sequence and return its blocks, in whichever pool they are, to the free lists."""
        seq = self.sequence(seq_id)
        for block, loc in zip(seq.block_ids, seq.block_locations, strict=True):
            del self._owner[(loc, block)]
            self._free[loc].add(block)
        del self._seqs[seq_id]

    def drop_all(self) -> None:
        """Forget every sequence and free every block of both pools."""
        self._seqs.clear()
        self._owner.clear()
        for loc, pool in self._pools.items():
            self._free[loc] = set(range(pool.num_blocks))

    def drop_device(self) -> list[str]:
        """Forget the sequences that hold any device block; return their ids.

        For after the ``kv_cache`` tag was discarded: device blocks hold garbage then, but sequences
        entirely swapped out to the host pool are intact (host blocks do not sleep) and are kept.
        """
        dropped = [s.seq_id for s in self._seqs.values() if "device" in s.block_locations]
        for seq_id in dropped:
            self.free_sequence(seq_id)
        return dropped

    # ---- swap ----
    def swap(self, direction: SwapDirection, pairs: Iterable[Any], method: CopyMethod | str = "auto") -> int:
        """Copy blocks between the pools in one batched copy; return the bytes moved.

        ``out``: each pair is (device block, host block); ``in``: (host block, device block). Every
        check comes before the copy and a rejected request changes nothing: ids in range, no source
        or destination twice, every destination free. A source owned by a sequence hands its place
        in the block table to the destination; a free source is a plain data copy.
        """
        if direction == "out":
            src_loc: Location = "device"
            dst_loc: Location = "host"
        elif direction == "in":
            src_loc, dst_loc = "host", "device"
        else:
            raise InvalidArgument(f"swap direction must be 'out' or 'in', got {direction!r}")
        try:
            CopyMethod(method)
        except ValueError:
            raise InvalidArgument(f"unknown copy method {method!r}") from None
        checked = self._check_pairs(pairs, src_loc, dst_loc)
        if not checked:
            return 0
        src_pool, dst_pool = self._pools[src_loc], self._pools[dst_loc]
        self._alloc.copy_block_ids(
            src_pool.tensor, dst_pool.tensor, [s for s, _ in checked], [d for _, d in checked], method
        )
        for src, dst in checked:
            owner = self._owner.pop((src_loc, src), None)
            if owner is None:
                continue  # a free block: the data moved, nothing owns it
            seq_id, index = owner
            seq = self._seqs[seq_id]
            seq.block_ids[index] = dst
            seq.block_locations[index] = dst_loc
            self._owner[(dst_loc, dst)] = owner
            self._free[src_loc].add(src)
            self._free[dst_loc].remove(dst)
        return len(checked) * self.block_bytes

    def _check_pairs(self, pairs: Iterable[Any], src_loc: Location, dst_loc: Location) -> list[tuple[int, int]]:
        src_n, dst_n = self._pools[src_loc].num_blocks, self._pools[dst_loc].num_blocks
        checked: list[tuple[int, int]] = []
        seen_src: set[int] = set()
        seen_dst: set[int] = set()
        for i, pair in enumerate(pairs):
            try:
                src, dst = pair
            except (TypeError, ValueError):
                raise InvalidArgument(f"pair {i}: expected (src, dst), got {pair!r}") from None
            for what, block, n, loc in (("src", src, src_n, src_loc), ("dst", dst, dst_n, dst_loc)):
                if not isinstance(block, int) or isinstance(block, bool):
                    raise InvalidArgument(f"pair {i}: {what} block must be an integer, got {block!r}")
                if not 0 <= block < n:
                    raise InvalidArgument(f"pair {i}: {what} block {block} out of range for {loc} pool of {n}")
            if src in seen_src:
                raise InvalidArgument(f"pair {i}: {src_loc} block {src} is a source twice")
            if dst in seen_dst:
                raise InvalidArgument(f"pair {i}: {dst_loc} block {dst} is a destination twice")
            if dst not in self._free[dst_loc]:
                owner = self._owner[(dst_loc, dst)][0]
                raise InvalidArgument(f"pair {i}: {dst_loc} block {dst} is in use by sequence {owner!r}")
            seen_src.add(src)
            seen_dst.add(dst)
            checked.append((src, dst))
        return checked

    def stats(self) -> KvStats:
        return KvStats(
            block_size=self.block_size, block_bytes=self.block_bytes,
            device_blocks=self.device.num_blocks, device_free_blocks=len(self._free["device"]),
            host_blocks=self.host.num_blocks, host_free_blocks=len(self._free["host"]),
            sequences=len(self._seqs),
        )  # fmt: skip


__all__ = ["KV_TAG", "HostKvPool", "KvBlockPool", "KvCache", "KvStats", "Location", "Sequence", "kv_block_shape"]
