"""The paged KV cache: a device block pool tagged ``kv_cache``, a host block pool, and who owns what.

Layout is block-major, ``[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``,
so one block (K and V of every layer for ``block_size`` positions) is one contiguous byte range.
That is what makes SwapBlocks cheap: moving a block between the device and the host pool is a
single item of one batched copy (``copy_block_ids``), however many layers the model has. The host pool
has the same layout in page-locked memory, so the copy engine can reach it directly.

Sequences own blocks in either pool. A swap moves ownership with the bytes: the sequence's block
table entry follows its block to the other pool, and a sequence runs only while every one of its
blocks is on the device. Ownership lives in arrays: per pool, the block-table slot that owns each
block; per slot, its block and pool. Checking and moving thousands of blocks is one C pass each
(native/kvtable.c).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any, Literal, TypedDict

import numpy as np
import torch

from memsvc.errors import InvalidArgument, NotFound, OutOfMemory, WrongState
from memsvc.vocabulary import KV_CACHE, CopyMethod
from worker import _native
from worker.allocator import Fence, MemoryAllocator
from worker.model.config import ModelConfig
from worker.model.step_limits import DEFAULT_BLOCK_SIZE

Location = Literal["device", "host"]
SwapDirection = Literal["out", "in"]


def kv_block_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim)


TEMPORARY_PREFIX = "tmp-"
"""The id prefix of the sequence a Generate without ``sequence_id`` reads into (freed at its end)."""


class _BlockPool:
    """``num_blocks`` equal, contiguous blocks in one tensor."""

    location: Location

    def __init__(self, tensor: torch.Tensor, block_size: int) -> None:
        self.tensor = tensor
        self.num_blocks = tensor.shape[0]
        self.block_size = block_size
        self.block_bytes = tensor[0].numel() * tensor.element_size() if self.num_blocks else 0


class KvBlockPool(_BlockPool):
    """The device pool, in the allocator's ``kv_cache`` tag (discarded or offloaded with it on sleep).

    With ``scratch``, one block more than ``num_blocks`` is allocated: :attr:`with_scratch`
    includes it, and the padding rows of a CUDA-graph step write and read it; no sequence owns it
    and no swap names it.
    """

    location: Location = "device"

    def __init__(
        self, config: ModelConfig, alloc: MemoryAllocator, num_blocks: int, block_size: int, scratch: bool = False
    ) -> None:
        shape = kv_block_shape(config, num_blocks + int(scratch), block_size)
        self.with_scratch = alloc.empty(shape, config.torch_dtype, KV_CACHE)
        """Every block, the scratch one last; what the model's steps index."""
        super().__init__(self.with_scratch[:num_blocks], block_size)
        self.scratch_block: int | None = num_blocks if scratch else None


class HostKvPool(_BlockPool):
    """Page-locked host blocks that swapped-out sequences live in; untouched by sleep and wake."""

    location: Location = "host"

    def __init__(self, config: ModelConfig, alloc: MemoryAllocator, num_blocks: int, block_size: int) -> None:
        shape = kv_block_shape(config, num_blocks, block_size)
        super().__init__(alloc.host_empty(shape, config.torch_dtype), block_size)


class _Slots:
    """Every block-table entry of every sequence, one *slot* each: the block it names and whether
    that block is in the host pool. Each slot owns exactly one block, so there are never more slots
    than blocks in both pools. A swap rewrites the moved entries with one vectorised assignment
    whatever the sequences they belong to, and a pool's owner array maps a block to its slot."""

    def __init__(self, capacity: int) -> None:
        self.block = np.full(capacity, _FREE, np.int64)
        self.host = np.zeros(capacity, np.bool_)
        self.seq = np.full(capacity, _FREE, np.int64)
        """Handle of the sequence whose table holds the slot."""
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # a stack: the lowest slot on top
        self._n_free = capacity

    def take(self, n: int, handle: int) -> np.ndarray:
        assert n <= self._n_free, "more table entries than blocks"  # callers hand out one per block
        self._n_free -= n
        slots = self._free[self._n_free : self._n_free + n][::-1].copy()
        self.seq[slots] = handle
        return slots

    def give_back(self, slots: np.ndarray) -> None:
        self.seq[slots] = _FREE
        self.block[slots] = _FREE
        self._free[self._n_free : self._n_free + len(slots)] = slots[::-1]
        self._n_free += len(slots)


class Sequence:
    """One sequence's tokens and block table.

    The table is a list of slots in the cache's :class:`_Slots`, so a swap of thousands of blocks
    moves their entries with a few array operations; the list views below are for readers.
    """

    __slots__ = ("_slots", "_table", "handle", "num_cached", "seq_id", "tokens")

    def __init__(self, seq_id: str, table: _Slots, handle: int, tokens: Iterable[int] = ()) -> None:
        self.seq_id = seq_id
        self.tokens: list[int] = list(tokens)
        """Every token of the sequence, prompt and generated."""
        self.num_cached = 0
        """Leading tokens whose K and V are written in the blocks (the rest are still to be fed)."""
        self.handle = handle
        """The cache's integer name for the sequence, stored in its slots."""
        self._table = table
        self._slots = np.zeros(0, np.int64)

    @property
    def block_ids(self) -> list[int]:
        """Block table: entry ``i`` holds positions ``[i * block_size, (i + 1) * block_size)``."""
        return self._table.block[self._slots].tolist()  # type: ignore[no-any-return]

    @property
    def block_locations(self) -> list[Location]:
        """Which pool each entry of :attr:`block_ids` is in."""
        return ["host" if h else "device" for h in self._table.host[self._slots].tolist()]

    @property
    def location(self) -> Literal["device", "host", "mixed"]:
        """``device`` (runnable; also with no blocks yet), ``host`` (all swapped out) or ``mixed``."""
        host = self._table.host[self._slots]
        if not host.any():
            return "device"
        if host.all():
            return "host"
        return "mixed"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        mine = (self.seq_id, self.tokens, self.num_cached, self.block_ids, self.block_locations)
        return mine == (other.seq_id, other.tokens, other.num_cached, other.block_ids, other.block_locations)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id!r}, tokens={len(self.tokens)}, blocks={self.block_ids}, {self.location})"


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


class PendingSwap:
    """A swap whose copy may still run: ``moved_bytes``, and ``wait()`` to block until it is done."""

    __slots__ = ("fence", "moved_bytes")

    def __init__(self, moved_bytes: int, fence: Fence | None) -> None:
        self.moved_bytes = moved_bytes
        self.fence = fence

    def wait(self) -> None:
        """Block (without the GIL) until the copy is done; raises the copy's error if it failed."""
        if self.fence is not None:
            self.fence.wait()


class KvCache:
    """The device and host block pools, which table slot owns each block, and the sequence table.

    Not thread-safe: the :class:`~worker.model.runner.ModelRunner` serialises access.
    """

    def __init__(
        self,
        config: ModelConfig,
        alloc: MemoryAllocator,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        scratch_block: bool = False,
    ) -> None:
        for name, value, least in (
            ("num_device_blocks", num_device_blocks, 1),
            ("num_host_blocks", num_host_blocks, 0),
            ("block_size", block_size, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise InvalidArgument(f"{name} must be an integer >= {least}, got {value!r}")
        self.config = config
        self.block_size = block_size
        self._alloc = alloc
        self.device = KvBlockPool(config, alloc, num_device_blocks, block_size, scratch_block)
        self.host = HostKvPool(config, alloc, num_host_blocks, block_size)
        self.block_bytes = self.device.block_bytes
        self._pools: dict[Location, _BlockPool] = {"device": self.device, "host": self.host}
        self._owner: dict[Location, np.ndarray] = {}
        """Per pool and block: the table slot that names it, or ``_FREE``."""
        self._free: dict[Location, int] = {}
        """Per pool: how many blocks are ``_FREE``, kept as they change (stats() runs off the device
        thread, and must neither scan nor see an array mid-update)."""
        self._table: _Slots  # set by drop_all, as are the owner arrays
        self._seqs: dict[str, Sequence] = {}
        self._by_handle: dict[int, Sequence] = {}
        self._next_handle = 0
        self._copying: list[np.ndarray] = []
        """Device blocks of the swaps begun since the last wait (their copies may still run)."""
        self.drop_all()

    # ---- sequences ----
    @property
    def sequences(self) -> Mapping[str, Sequence]:
        return self._seqs

    def sequence(self, seq_id: str) -> Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise NotFound(f"no sequence {seq_id!r}", metadata={"sequenceId": seq_id}) from None

    @property
    def max_sequences(self) -> int:
        """Most sequences the cache keeps: one per block of both pools (a sequence with tokens
        holds at least one block; this also bounds those kept with none)."""
        return self.device.num_blocks + self.host.num_blocks

    def allocate_sequence(self, seq_id: str, tokens: Iterable[int] = ()) -> Sequence:
        """A new sequence with no blocks yet (see :meth:`ensure_capacity`).

        OutOfMemory when :attr:`max_sequences` are kept already."""
        if not isinstance(seq_id, str) or not seq_id:
            raise InvalidArgument(f"sequence id must be a non-empty string, got {seq_id!r}")
        if seq_id in self._seqs:
            raise InvalidArgument(f"sequence {seq_id!r} already exists")
        if len(self._seqs) >= self.max_sequences:
            raise OutOfMemory(
                f"KV cache: {len(self._seqs)} sequences are kept, the most it holds; free one first",
                metadata={"maxSequences": str(self.max_sequences)},
            )
        seq = Sequence(seq_id, self._table, self._next_handle, tokens)
        self._next_handle += 1
        self._seqs[seq_id] = self._by_handle[seq.handle] = seq
        return seq

    def block_array(self, seq_id: str) -> np.ndarray:
        """The sequence's block table as an int64 array (what a step copies to the device)."""
        return self._table.block[self.sequence(seq_id)._slots]

    @staticmethod
    def blocks_of(seq: Sequence) -> int:
        """How many blocks the sequence holds, in either pool."""
        return len(seq._slots)

    def owner_handles(self, location: Location, block_ids: np.ndarray) -> np.ndarray:
        """The handles of the sequences owning these blocks of one pool (free blocks left out)."""
        slots = self._owner[location][block_ids]
        return self._table.seq[slots[slots != _FREE]]  # type: ignore[no-any-return]

    @staticmethod
    def describe(seq_id: str) -> str:
        """How an error names the sequence: a temporary one (a Generate without ``sequence_id``) is
        the client's request, not an id it never sent."""
        return "this request" if seq_id.startswith(TEMPORARY_PREFIX) else f"sequence {seq_id!r}"

    def ensure_capacity(self, seq_id: str, num_tokens: int) -> None:
        """Give the sequence device blocks for ``num_tokens`` positions in all (the lowest free ids).

        OutOfMemory when the device pool has too few free blocks; then nothing changed.
        """
        seq = self.sequence(seq_id)
        if seq.location != "device":
            raise WrongState(
                f"sequence {seq_id!r} is swapped out ({seq.location}); swap it in first",
                metadata={"sequenceId": seq_id, "location": seq.location},
            )
        needed = -(-num_tokens // self.block_size) - len(seq._slots)
        if needed <= 0:
            return
        owner = self._owner["device"]
        free = np.flatnonzero(owner == _FREE)
        if needed > len(free):
            raise OutOfMemory(
                f"KV cache: {self.describe(seq_id)} needs {needed} more device blocks, {len(free)} are free",
                metadata={"neededBlocks": str(needed), "freeBlocks": str(len(free))},
            )
        blocks = free[:needed]
        slots = self._table.take(needed, seq.handle)
        self._table.block[slots] = blocks
        self._table.host[slots] = False
        owner[blocks] = slots
        self._free["device"] -= needed
        seq._slots = np.concatenate((seq._slots, slots))

    def shrink(self, seq_id: str, num_blocks: int) -> None:
        """Give back the sequence's blocks beyond its first ``num_blocks`` (a failed call's additions)."""
        seq = self.sequence(seq_id)
        self._give_back(seq._slots[num_blocks:])
        seq._slots = seq._slots[:num_blocks].copy()

    def free_sequence(self, seq_id: str) -> None:
        """Forget the sequence and return its blocks, in whichever pool they are, to the free lists."""
        seq = self.sequence(seq_id)
        self._give_back(seq._slots)
        seq._slots = np.zeros(0, np.int64)  # a Sequence object kept by someone must not read reused slots
        del self._seqs[seq_id], self._by_handle[seq.handle]

    def _give_back(self, slots: np.ndarray) -> None:
        """Free the blocks these table slots name, in whichever pool, and the slots themselves."""
        if not len(slots):
            return
        blocks, host = self._table.block[slots], self._table.host[slots]
        self._owner["device"][blocks[~host]] = _FREE
        self._owner["host"][blocks[host]] = _FREE
        on_host = int(np.count_nonzero(host))
        self._free["device"] += len(blocks) - on_host
        self._free["host"] += on_host
        self._table.give_back(slots)

    def drop_all(self) -> None:
        """Forget every sequence and free every block of both pools."""
        for seq in self._seqs.values():
            seq._slots = np.zeros(0, np.int64)
        self._seqs.clear()
        self._by_handle.clear()
        for loc, pool in self._pools.items():
            self._owner[loc] = np.full(pool.num_blocks, _FREE, np.int64)
            self._free[loc] = pool.num_blocks
        self._table = _Slots(self.device.num_blocks + self.host.num_blocks)

    def drop_device(self) -> list[str]:
        """Forget the sequences that hold any device block; return their ids.

        For after the ``kv_cache`` tag was discarded: device blocks hold garbage then, but sequences
        entirely swapped out to the host pool are intact (host blocks do not sleep) and are kept.
        """
        dropped = [s.seq_id for s in self._seqs.values() if not self._table.host[s._slots].all()]
        for seq_id in dropped:
            self.free_sequence(seq_id)
        return dropped

    # ---- swap ----
    def swap(
        self,
        direction: SwapDirection,
        pairs: Iterable[Any],
        method: CopyMethod | str = "auto",
        busy: Collection[int] = (),
    ) -> int:
        """:meth:`swap_ids` with (src, dst) pairs; each pair is checked to be two integers."""
        _locations(direction)
        return self.swap_ids(direction, *pairs_to_ids(pairs), method, busy)

    def swap_ids(
        self,
        direction: SwapDirection,
        src_ids: Any,
        dst_ids: Any,
        method: CopyMethod | str = "auto",
        busy: Collection[int] = (),
    ) -> int:
        """Copy block ``src_ids[i]`` to block ``dst_ids[i]`` of the other pool, in one batched copy;
        return the bytes moved once the copy is done. See :meth:`begin_swap`."""
        pending = self.begin_swap(direction, src_ids, dst_ids, method, busy)
        pending.wait()
        return pending.moved_bytes

    def begin_swap(
        self,
        direction: SwapDirection,
        src_ids: Any,
        dst_ids: Any,
        method: CopyMethod | str = "auto",
        busy: Collection[int] = (),
    ) -> PendingSwap:
        """Check and enqueue a swap and move the blocks' ownership; return before the copy is done.

        ``out``: device blocks to host blocks; ``in``: host blocks to device blocks. Ids are any
        integer sequence or array (a protobuf repeated field converts without a per-block object).
        Every check comes before the copy and a rejected request changes nothing: ids in range, no
        source or destination twice, every destination free. A source owned by a sequence hands its
        place in the block table to the destination; a free source is a plain data copy. The checks
        and the ownership move are one C pass each (native/kvtable.c): 0.08-0.14 ms for 8192 blocks
        on an H200 host, beside a 0.7 ms copy.

        ``busy``: handles of sequences a Generate is reading (:meth:`Engine.busy_sequences`); a source
        block of one of them is refused (FAILED_PRECONDITION) rather than moved under the step.

        The ownership moves at once, so the next swap is checked against it, and copies run in the
        order they were begun (one stream), so a swap back of the same blocks reads what this one
        wrote. The caller prepares the next swap while this one copies; before other work reads the
        blocks, wait for the returned :class:`PendingSwap` or call :meth:`wait_copies`.
        """
        src_loc, dst_loc = _locations(direction)
        try:
            CopyMethod(method)
        except ValueError:
            raise InvalidArgument(f"unknown copy method {method!r}") from None
        src, dst = _id_array(src_ids, "src"), _id_array(dst_ids, "dst")
        if len(src) != len(dst):
            raise InvalidArgument(f"{len(src)} source blocks but {len(dst)} destination blocks")
        if not len(src):
            return PendingSwap(0, None)
        self._check(src, dst, src_loc, dst_loc)
        if busy:
            held = self.owner_handles(src_loc, src)
            running = held[np.isin(held, np.fromiter(busy, np.int64))]
            if len(running):
                name = self._by_handle[int(running[0])].seq_id
                raise WrongState(
                    f"{src_loc} blocks of sequence {name!r} are being read by a Generate; swap them when it ends",
                    metadata={"sequenceId": name},
                )
        fence = self._alloc.copy_block_ids(
            self._pools[src_loc].tensor, self._pools[dst_loc].tensor, src, dst, method, wait=False
        )
        self._move(src, dst, src_loc, dst_loc)
        self._copying.append(src if src_loc == "device" else dst)
        return PendingSwap(len(src) * self.block_bytes, fence)

    def park(self, seq_ids: Iterable[str]) -> list[str]:
        """Move these sequences' device blocks to free host blocks in one batched copy (whole
        sequences, in order, while the host pool has room) and wait for it; return the ids that
        stayed on the device for want of room. For a pause: the device pool is about to sleep."""
        return self._relocate(seq_ids, "out")

    def unpark(self, seq_ids: Iterable[str]) -> list[str]:
        """:meth:`park`'s way back after the wake: these sequences' host blocks to free device
        blocks; return the ids that stayed on the host for want of room."""
        return self._relocate(seq_ids, "in")

    def _relocate(self, seq_ids: Iterable[str], direction: SwapDirection) -> list[str]:
        src_loc, dst_loc = _locations(direction)
        free = np.flatnonzero(self._owner[dst_loc] == _FREE)
        moving: list[np.ndarray] = []
        left: list[str] = []
        used = 0
        for seq_id in seq_ids:
            slots = self.sequence(seq_id)._slots
            blocks = self._table.block[slots][self._table.host[slots] == (src_loc == "host")]
            if used + len(blocks) > len(free):
                left.append(seq_id)
                continue
            moving.append(blocks)
            used += len(blocks)
        if used:
            self.swap_ids(direction, np.concatenate(moving), free[:used])
        return left

    def wait_copies(self) -> None:
        """Wait for every swap begun so far (before work that reads the blocks on another stream)."""
        self._alloc.copies_wait()
        self._copying.clear()

    @property
    def copies_in_flight(self) -> bool:
        """Swaps were begun since the last wait (their copies may still run)."""
        return bool(self._copying)

    def wait_copies_touching(self, blocks: np.ndarray) -> None:
        """Wait for the swaps begun so far if any of them reads or writes one of these device blocks
        (a step's blocks): a swap of other blocks copies on beside the step instead of stalling it.
        A swap-out's sources are free once it is begun, so a step may be about to write one."""
        if self._copying and np.isin(blocks, np.concatenate(self._copying)).any():
            self.wait_copies()

    def _check(self, src: np.ndarray, dst: np.ndarray, src_loc: Location, dst_loc: Location) -> None:
        """One pass in C (native/kvtable.c); the first bad pair is named, as a per-pair check would."""
        n_src, n_dst = self._pools[src_loc].num_blocks, self._pools[dst_loc].num_blocks
        code, i = _native.kv_check(src, dst, n_src, n_dst, self._owner[dst_loc])
        if code == _native.KV_SRC_RANGE:
            raise InvalidArgument(f"pair {i}: src block {src[i]} out of range for {src_loc} pool of {n_src}")
        if code == _native.KV_DST_RANGE:
            raise InvalidArgument(f"pair {i}: dst block {dst[i]} out of range for {dst_loc} pool of {n_dst}")
        if code == _native.KV_SRC_TWICE:
            raise InvalidArgument(f"pair {i}: {src_loc} block {src[i]} is a source twice")
        if code == _native.KV_DST_TWICE:
            raise InvalidArgument(f"pair {i}: {dst_loc} block {dst[i]} is a destination twice")
        if code == _native.KV_DST_IN_USE:
            owner = self._by_handle[int(self._table.seq[self._owner[dst_loc][dst[i]]])].seq_id
            raise InvalidArgument(f"pair {i}: {dst_loc} block {dst[i]} is in use by sequence {owner!r}")

    def _move(self, src: np.ndarray, dst: np.ndarray, src_loc: Location, dst_loc: Location) -> None:
        """Hand each owned source's table entry to its destination (one pass in C)."""
        t = self._table
        owners = self._owner[src_loc], self._owner[dst_loc]
        moved = _native.kv_move(src, dst, *owners, t.block, t.host, dst_loc == "host")
        self._free[src_loc] += moved
        self._free[dst_loc] -= moved

    def stats(self) -> KvStats:
        return KvStats(
            block_size=self.block_size,
            block_bytes=self.block_bytes,
            device_blocks=self.device.num_blocks,
            device_free_blocks=self._free["device"],
            host_blocks=self.host.num_blocks,
            host_free_blocks=self._free["host"],
            sequences=len(self._seqs),
        )


_FREE = -1
"""The owner slot of a free block (and the block of an unused slot)."""


def _locations(direction: str) -> tuple[Location, Location]:
    """(source pool, destination pool) of a swap direction."""
    if direction == "out":
        return "device", "host"
    if direction == "in":
        return "host", "device"
    raise InvalidArgument(f"swap direction must be 'out' or 'in', got {direction!r}")


def _id_array(values: Any, what: str) -> np.ndarray:
    """Block ids as a flat, contiguous int64 array; anything that is not a sequence of integers is
    refused (bools too, as in the pairs form)."""
    if isinstance(values, list | tuple) and any(type(v) is bool for v in values):
        raise InvalidArgument(f"{what} block ids must be integers, not booleans")
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError, OverflowError):
        raise InvalidArgument(f"{what} block ids must be a sequence of integers") from None
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgument(
            f"{what} block ids must be a flat sequence of integers, got {arr.dtype} of shape {arr.shape}"
        )
    if arr.dtype.kind == "u" and int(arr.max()) >= 1 << 63:
        raise InvalidArgument(f"{what} block id {int(arr.max())} out of range")
    return np.ascontiguousarray(arr, dtype=np.int64)


def pairs_to_ids(pairs: Iterable[Any]) -> tuple[np.ndarray, np.ndarray]:
    """(src ids, dst ids) from (src, dst) pairs, each checked to be two integers (not bools)."""
    if isinstance(pairs, str | bytes) or not isinstance(pairs, Iterable):
        raise InvalidArgument("pairs must be a sequence of (src, dst) block pairs")
    src: list[int] = []
    dst: list[int] = []
    for i, pair in enumerate(pairs):
        try:
            s, d = pair
        except (TypeError, ValueError):
            raise InvalidArgument(f"pair {i}: expected (src, dst), got {pair!r}") from None
        for what, block in (("src", s), ("dst", d)):
            if not isinstance(block, int) or isinstance(block, bool):
                raise InvalidArgument(f"pair {i}: {what} block must be an integer, got {block!r}")
            if not -(1 << 63) <= block < 1 << 63:
                raise InvalidArgument(f"pair {i}: {what} block {block} out of range")
        src.append(s)
        dst.append(d)
    return np.array(src, np.int64), np.array(dst, np.int64)


__all__ = [
    "HostKvPool",
    "KvBlockPool",
    "KvCache",
    "KvStats",
    "Location",
    "PendingSwap",
    "Sequence",
    "TEMPORARY_PREFIX",
    "kv_block_shape",
    "pairs_to_ids",
]
