"""The allocator API: tagged memory pools that can sleep and wake at the same addresses.

Usage::

    alloc = get_allocator(AllocatorConfig(backend="auto"))
    w = alloc.empty((4096, 4096), torch.bfloat16, tag="weights")
    with alloc.use_memory_pool("weights"):      # CUDA: ordinary torch allocations land in the pool
        model = build_model()
    alloc.sleep({"weights": Action.OFFLOAD, "kv_cache": Action.DISCARD})
    alloc.wake_up(["weights"])                   # partial wake; kv_cache stays asleep
    alloc.wake_up()                              # the rest

The work happens in the native extension (``worker._native``): the allocation table, arenas,
copies and the host staging pool are C, so torch's allocator hook never calls into Python and long
copies run without the GIL.
"""

from __future__ import annotations

import array
import contextlib
import gc
import os
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from memsvc.errors import InvalidArgument, WrongState
from memsvc.vocabulary import Action, CopyMethod, TagState, check_tag
from worker import _native
from worker._native import Fence

if TYPE_CHECKING:
    import torch

GiB = 1 << 30
MiB = 1 << 20


_METHOD_CODE = {
    CopyMethod.AUTO: _native.COPY_AUTO,
    CopyMethod.LOOP: _native.COPY_LOOP,
    CopyMethod.BATCH: _native.COPY_BATCH,
    CopyMethod.KERNEL: _native.COPY_KERNEL,
}


@dataclass(frozen=True)
class AllocatorConfig:
    """How the process's allocator is built."""

    backend: Literal["auto", "cuda", "host"] = "auto"
    """``auto`` picks ``cuda`` when the driver reports a device, else ``host``."""
    device: int = 0
    """CUDA device ordinal (the worker serves one GPU)."""
    host_capacity_bytes: int = 8 * GiB
    """Host backend only: the simulated device's size, so budgets and out-of-memory paths are testable."""
    granularity_bytes: int = 2 * MiB
    """Host backend only: mapping granularity (cuda uses the driver's, 2 MiB on Hopper)."""
    arena_va_bytes: int = 256 * GiB
    """Virtual address range reserved per tag: the most one tag can ever hold."""
    host_chunk_bytes: int = 256 * MiB
    """Offload engine: size of one page-locked host chunk; copies and pinning are pipelined per chunk."""
    host_reserve_bytes: int = 0
    """Offload engine: page-locked host memory kept between cycles so later sleeps skip pinning.
    Host RAM held vs. sleep speed; 0 frees it all on wake."""
    checksum: bool = False
    """Checksum offloaded data at sleep and verify it on wake (a mismatch raises IntegrityError).
    Off in the library; the worker turns it on (it costs 1.5-2 % of wake time on an H200)."""
    prefault_threads: int = 0
    """Threads that pre-fault fresh host chunks (0: up to 16, by core count)."""
    huge_pages: bool = True
    """Ask for transparent huge pages for host chunks: faster faults and pinning, but under the
    kernel's default THP defrag policy a fragmented host may compact memory on the fault path."""
    offload_dir: str = ""
    """The disk tier's directory (:attr:`Action.OFFLOAD_DISK`): sleeping tags' backups go to unlinked
    files there, streamed through a few host chunks. Empty: no disk tier."""


@dataclass(frozen=True)
class TagStats:
    """One tag's memory, in bytes."""

    tag: str
    state: TagState
    mapped_bytes: int  #: physical device memory mapped now
    allocated_bytes: int  #: bytes of live allocations
    offloaded_bytes: int  #: bytes held in host memory while asleep
    disk_bytes: int  #: bytes held in the disk tier's file while on disk
    discarded_bytes: int  #: bytes dropped by DISCARD, while asleep
    allocations: int
    layout_bytes: int  #: mapped bytes when awake
    extents: int  #: physical mappings now


@dataclass(frozen=True)
class AllocatorStats:
    """A snapshot of the allocator: device memory, per-tag pools and transition counters."""

    backend: str
    device: int
    device_free_bytes: int
    device_total_bytes: int
    tags: dict[str, TagStats] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    """The native layer's counters by name, as the metrics export them; the ones the worker itself
    reads have a property each."""

    @property
    def host_held_bytes(self) -> int:
        """Host memory the allocator's pool holds: all its chunks, in use (backups) or free."""
        return int(self.counters.get("host_held_bytes", 0))

    @property
    def host_reserve_bytes(self) -> int:
        """The most free chunks the pool keeps for later sleeps (``--host-reserve``, or what ``auto`` set)."""
        return int(self.counters.get("host_reserve_bytes", 0))

    @property
    def disk_held_bytes(self) -> int:
        """File bytes the disk tier holds now (tags slept to disk)."""
        return int(self.counters.get("disk_held_bytes", 0))


def _method_code(method: CopyMethod | str) -> int:
    try:
        return _METHOD_CODE[CopyMethod(method)]
    except ValueError:
        raise InvalidArgument(f"unknown copy method {method!r}") from None


def _dlpack_dtype(dtype: torch.dtype) -> tuple[int, int]:
    import torch

    table = {
        torch.float16: (2, 16),
        torch.float32: (2, 32),
        torch.float64: (2, 64),
        torch.bfloat16: (4, 16),
        torch.int8: (0, 8),
        torch.int16: (0, 16),
        torch.int32: (0, 32),
        torch.int64: (0, 64),
        torch.uint8: (1, 8),
        torch.bool: (6, 8),
    }
    try:
        return table[dtype]
    except KeyError:
        raise InvalidArgument(f"unsupported dtype {dtype}") from None


MAX_TENSOR_BYTES = 1 << 50


def _check_shape(shape: Sequence[int] | int, itemsize: int) -> tuple[tuple[int, ...], int]:
    """Validated dims and byte size."""
    try:
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
    except TypeError:
        raise InvalidArgument(f"shape must be a sequence of integers, got {shape!r}") from None
    if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in dims):
        raise InvalidArgument(f"shape must be non-negative integers, got {shape!r}")
    nbytes = itemsize
    for d in dims:
        nbytes *= d
    if nbytes > MAX_TENSOR_BYTES:
        raise InvalidArgument(f"a tensor of shape {dims} is larger than any device")
    return dims, nbytes


def _ints(values: Any, what: str) -> Any:
    """Integers for the native call: an int64 buffer (array('q'), numpy) passes through without a
    per-element conversion (an 8192-block swap stays in C); anything else becomes a list."""
    if isinstance(values, array.array) and values.typecode == "q":
        return values
    if type(values).__name__ == "ndarray" and values.dtype.str == "<i8" and values.flags.c_contiguous:
        return values  # numpy int64 (the KV cache's id arrays): no dtype string to build
    if hasattr(values, "numpy") and hasattr(values, "dtype"):  # a torch tensor: share its memory
        values = values.detach().cpu().contiguous()
        try:
            return values.numpy() if str(values.dtype) == "torch.int64" else values.tolist()
        except RuntimeError:  # torch without numpy
            return values.tolist()
    if hasattr(values, "__array_interface__") and getattr(values, "dtype", None) is not None:
        contiguous = getattr(getattr(values, "flags", None), "c_contiguous", False)
        return values if str(values.dtype) == "int64" and contiguous else values.tolist()
    if isinstance(values, int) or values is None or isinstance(values, str | bytes):
        raise InvalidArgument(f"{what} must be a sequence of integers")
    try:
        return list(values)
    except TypeError:
        raise InvalidArgument(f"{what} must be a sequence of integers") from None


def _torch_with_cuda() -> Any:
    """torch, where this process imported it and initialised CUDA (else there is no torch work to
    wait for)."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and torch.cuda.is_initialized() else None


def resolve_backend(backend: str) -> str:
    """``cuda`` or ``host``: ``auto`` is cuda where the driver reports a device (the allocator's rule,
    and a standby worker's, which makes the context before its allocator exists)."""
    if backend not in ("auto", "cuda", "host"):
        raise InvalidArgument(f"backend must be auto, cuda or host, got {backend!r}")
    if backend == "auto":
        return "cuda" if _native.cuda_device_count() > 0 else "host"
    return backend


class MemoryAllocator:
    """Tagged device memory that sleeps and wakes at the same addresses.

    There is one per process (:func:`get_allocator`), because what it manages is process-wide: the
    device's primary context and memory, and torch's pluggable-allocator hook, which torch loads by
    symbol name from this library and which can route to only one table. Two allocators in one
    process would each believe they own the card, count its memory twice, and could receive each
    other's frees.
    """

    def __init__(self, config: AllocatorConfig) -> None:
        self.config = config
        backend = resolve_backend(config.backend)
        if config.device < 0:
            raise InvalidArgument(f"device must be >= 0, got {config.device}")
        if config.offload_dir and not os.path.isdir(config.offload_dir):
            raise InvalidArgument(f"offload directory {config.offload_dir} does not exist")
        if config.offload_dir and not os.access(config.offload_dir, os.W_OK | os.X_OK):
            raise InvalidArgument(f"offload directory {config.offload_dir} is not writable")
        self._native = _native.Allocator(
            _native.BACKEND_CUDA if backend == "cuda" else _native.BACKEND_HOST,
            config.device,
            host_capacity=config.host_capacity_bytes,
            granularity=config.granularity_bytes,
            arena_va_bytes=config.arena_va_bytes,
            host_chunk_bytes=config.host_chunk_bytes,
            host_reserve_bytes=config.host_reserve_bytes,
            checksum=config.checksum,
            prefault_threads=config.prefault_threads,
            huge_pages=config.huge_pages,
            offload_dir=os.path.abspath(config.offload_dir) if config.offload_dir else "",
        )
        info = self._native.info()
        self.backend: str = info["backend"]
        self.device: int = info["device"]
        self.granularity: int = info["granularity"]
        self._pools: dict[str, Any] = {}
        self._pluggable: Any = None
        self._pool_lock = threading.Lock()
        self._pool_tags = threading.local()

    # ---- tensors ----
    def empty(self, shape: Sequence[int] | int, dtype: torch.dtype, tag: str) -> torch.Tensor:
        """An uninitialised tensor in ``tag``'s pool (on the GPU for cuda, the CPU for host)."""
        import torch
        from torch.utils.dlpack import from_dlpack

        check_tag(tag)
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # no DLPack code to hand it over by: its bytes
            return self.empty(shape, torch.uint8, tag).view(dtype)
        code, bits = _dlpack_dtype(dtype)
        dims, nbytes = _check_shape(shape, bits // 8)
        if nbytes == 0:
            if self._tag_state(tag) not in (None, "awake"):
                raise WrongState(f"tag '{tag}' is asleep: wake it before allocating")
            return torch.empty(dims, dtype=dtype, device=self.torch_device)
        return from_dlpack(self._native.tensor(tag, nbytes, list(dims), code, bits))

    def register_tag(self, tag: str) -> None:
        """Make ``tag`` one of this allocator's tags now, holding nothing (its memory comes later):
        a tag's pool is made by its first allocation, and a client shown a worker's tags must not see
        the set change under it (a Sleep naming the tag refused as unknown, then accepted)."""
        check_tag(tag)
        self._native.free(self._native.alloc(tag, 1))  # the free gives the mapping back at once

    def host_empty(self, shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised page-locked CPU tensor the device can copy to and from (host KV pool)."""
        import torch
        from torch.utils.dlpack import from_dlpack

        code, bits = _dlpack_dtype(dtype)
        dims, nbytes = _check_shape(shape, bits // 8)
        if nbytes == 0:
            return torch.empty(dims, dtype=dtype)
        return from_dlpack(self._native.host_tensor(nbytes, list(dims), code, bits))

    def stage_file(self, fd: int, offset: int, length: int, threads: int) -> Any:
        """``length`` bytes of the file ``fd`` from ``offset``, read into device memory of their own
        (outside every tag) with ``threads`` readers, without the GIL and without torch
        (worker/staging.py says why): a DLPack capsule of a uint8 tensor of those bytes, whose memory
        is unmapped when that tensor dies (or the capsule, if it never becomes one)."""
        return self._native.stage_file(fd, offset, length, threads)

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device("cuda", self.device) if self.backend == "cuda" else torch.device("cpu")

    @contextlib.contextmanager
    def use_memory_pool(self, tag: str) -> Iterator[None]:
        """Route torch CUDA allocations made inside the block into ``tag``'s pool.

        On cuda this is torch's CUDAPluggableAllocator + MemPool (one pool per tag, so a cached
        torch segment never mixes tags). The host backend cannot intercept torch's CPU allocator:
        there, allocate pool tensors with :meth:`empty`.
        """
        check_tag(tag)
        if self._tag_state(tag) not in (None, "awake"):
            raise WrongState(f"tag '{tag}' is asleep: wake it before allocating")
        if self.backend != "cuda":
            yield
            return
        import torch

        pool = self._mem_pool(tag)
        with self._routed_to(tag), torch.cuda.use_mem_pool(pool, device=self.device):
            yield

    def new_stream(self) -> torch.cuda.Stream:
        """A CUDA stream shared with no one and never destroyed, to capture graphs on: torch keeps the
        cuBLAS workspace a capture embeds per stream handle and frees it when any graph captured on
        that stream is destroyed (torch's ``CUDAGraph.reset``), so graphs captured on its shared
        default capture stream (or a stream from its pool) lose their workspace when another
        runner's graphs go: wrong tokens, or an illegal address. Unavailable on the host backend."""
        import torch

        handle = self._native.new_stream()
        return torch.cuda.ExternalStream(handle, device=self.torch_device)  # type: ignore[no-untyped-call]  # unannotated

    @contextlib.contextmanager
    def capture_graph(
        self, graph: torch.cuda.CUDAGraph, tag: str, stream: torch.cuda.Stream | None = None
    ) -> Iterator[None]:
        """Capture ``graph`` with its memory (every tensor the captured work allocates) in ``tag``'s
        pool, so it sleeps with that tag and is mapped at the same addresses on wake: a graph captured
        before a sleep replays after the wake. CUDA only.

        The capture checks only this thread's CUDA calls (``thread_local``): a worker captures while
        it serves, and its other threads' calls (a status's memory query, the host prepin's
        registration) would otherwise invalidate the capture or fail themselves. Python's cyclic
        garbage collector is off meanwhile: a collection that a capture's own allocations set off
        would run finalizers on this thread (a graph, a pool, an event of objects long gone), and a
        CUDA call inside the capture invalidates it."""
        import torch

        check_tag(tag)
        if self.backend != "cuda":
            raise WrongState("CUDA graphs need the cuda backend")
        pool = self._mem_pool(tag)
        collecting = gc.isenabled()
        gc.disable()
        try:
            with (
                self._routed_to(tag),
                torch.cuda.graph(graph, pool=pool.id, stream=stream, capture_error_mode="thread_local"),
            ):
                yield
        finally:
            if collecting:
                gc.enable()

    def _mem_pool(self, tag: str) -> Any:
        """torch's MemPool for ``tag`` (one per tag, so a cached torch segment never mixes tags), its
        segments allocated by this library through torch's CUDAPluggableAllocator."""
        import torch

        with self._pool_lock:
            if self._pluggable is None:
                self._native.install_torch_hook()
                self._pluggable = torch.cuda.memory.CUDAPluggableAllocator(
                    _native.__file__, "msv_torch_malloc", "msv_torch_free"
                )
            pool = self._pools.get(tag)
            if pool is None:
                pool = self._pools[tag] = torch.cuda.MemPool(self._pluggable.allocator())
        return pool

    @contextlib.contextmanager
    def _routed_to(self, tag: str) -> Iterator[None]:
        """New torch segments made on this thread inside the block go to ``tag`` (per thread in C,
        like torch's pool routing; nested blocks restore the outer tag)."""
        previous = getattr(self._pool_tags, "tag", "default")
        _native.set_pool_tag(tag)
        self._pool_tags.tag = tag
        try:
            yield
        finally:
            _native.set_pool_tag(previous)
            self._pool_tags.tag = previous

    # ---- transitions ----
    def sleep(self, actions: Mapping[str, Action | str]) -> None:
        """Apply a per-tag action; tags not named are kept. All-or-nothing: on error nothing changed."""
        pairs = []
        for tag, action in actions.items():
            pairs.append((check_tag(tag), int(Action.parse(action, tag))))  # the native layer speaks proto numbers
        if self.backend == "cuda":
            self._synchronize_torch()
        self._native.sleep(pairs)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Bring back the named sleeping tags (all of them when ``tags`` is None)."""
        if isinstance(tags, str):
            raise InvalidArgument("tags must be a list of tag names, not a string")
        names = None if tags is None else list(tags)
        for tag in names or ():
            check_tag(tag)
        self._native.wake(names)

    def _synchronize_torch(self) -> None:
        # Work queued by torch on the device must finish before its memory is copied or unmapped.
        torch = _torch_with_cuda()
        if torch is not None:
            torch.cuda.synchronize(self.device)

    # ---- block copies ----
    def copy_blocks(
        self,
        src_ptrs: Sequence[int] | Any,
        dst_ptrs: Sequence[int] | Any,
        sizes: Sequence[int] | int | Any,
        method: CopyMethod | str = CopyMethod.AUTO,
        stream: Any = None,
    ) -> None:
        """Copy ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` for every i, in one batch.

        Every range must lie inside one live allocation of an awake tag or a host buffer from
        :meth:`host_empty`, and destinations must not overlap; otherwise nothing moves. ``sizes`` may
        be one int for equal blocks. Returns when the copy is complete; with ``stream`` (a
        torch.cuda.Stream or a raw handle) it is ordered after work already queued there.
        """
        m = _method_code(method)
        src = _ints(src_ptrs, "src_ptrs")
        dst = _ints(dst_ptrs, "dst_ptrs")
        if isinstance(sizes, int):
            if not 0 < sizes < MAX_TENSOR_BYTES:
                raise InvalidArgument(f"block size must be in (0, 2**50), got {sizes}")
            size_list = array.array("q", [sizes]) * len(src)
        else:
            size_list = _ints(sizes, "sizes")
        handle = self._copy_stream(stream)
        self._native.copy_blocks(src, dst, size_list, m, handle)

    def copy_block_ids(
        self,
        src_pool: torch.Tensor,
        dst_pool: torch.Tensor,
        src_ids: Sequence[int] | Any,
        dst_ids: Sequence[int] | Any,
        method: CopyMethod | str = CopyMethod.AUTO,
        stream: Any = None,
        wait: bool = True,
    ) -> Fence | None:
        """Copy block ``src_ids[i]`` of ``src_pool`` to block ``dst_ids[i]`` of ``dst_pool`` for every i.

        A pool is a contiguous tensor whose first dimension indexes equal blocks (the KV cache's
        block-major layout). The fast path of SwapBlocks: ids are checked against each pool's bounds,
        and destinations for duplicates, in O(n) in C, without resolving a pointer per block.

        ``wait=False`` returns once the copy is enqueued, with a :class:`Fence` to ``wait()`` on: the
        caller prepares its next copy while this one runs (copies on one stream run in order). Until
        then the destination blocks hold no defined data; work that reads them on another stream
        must wait for the fence or for :meth:`copies_wait` first. Sleep, freeing a pool and close
        wait for the allocator's own stream before memory goes; a copy on a ``stream`` of the
        caller's is the caller's to wait for.
        """
        m = _method_code(method)
        block_bytes = 0
        for pool in (src_pool, dst_pool):
            if not pool.is_contiguous() or pool.dim() < 1 or pool.shape[0] == 0:
                raise InvalidArgument("a block pool must be a contiguous tensor with at least one block")
            size = pool.numel() * pool.element_size() // pool.shape[0]
            if block_bytes and size != block_bytes:
                raise InvalidArgument(f"pools have different block sizes ({block_bytes} and {size} bytes)")
            block_bytes = size
        handle = self._copy_stream(stream)
        return self._native.copy_block_ids(
            src_pool.data_ptr(),
            dst_pool.data_ptr(),
            block_bytes,
            _ints(src_ids, "src_ids"),
            _ints(dst_ids, "dst_ids"),
            m,
            handle,
            wait,
        )

    def copies_wait(self) -> None:
        """Wait for every copy enqueued on the allocator's own stream (``wait=False`` copies)."""
        self._native.copies_wait()

    def _copy_stream(self, stream: Any) -> int:
        """The raw stream a copy is ordered on. Without one, the allocator's own stream, after the work
        torch queued on its current stream: that stream is synchronised, not the whole device, so
        copies still in flight on the allocator's stream keep running."""
        handle = 0 if stream is None else int(getattr(stream, "cuda_stream", stream))
        torch = _torch_with_cuda() if self.backend == "cuda" and handle == 0 else None
        if torch is not None:
            torch.cuda.current_stream(self.device).synchronize()
        return handle

    def has_method(self, method: CopyMethod | str) -> bool:
        """Whether ``method`` runs natively here (batch falls back to loop when it does not)."""
        return bool(self._native.has_method(_method_code(method)))

    # ---- knobs and numbers ----
    def set_checksum(self, on: bool) -> None:
        self._native.set_checksum(on)

    def set_host_reserve(self, nbytes: int) -> None:
        if nbytes < 0:
            raise InvalidArgument("host reserve must be >= 0 bytes")
        self._native.set_host_reserve(nbytes)

    def prepin_host(self, nbytes: int) -> None:
        """Map, pre-fault and page-lock ``nbytes`` of host staging chunks now, ahead of the first sleep.

        A worker's first sleep is otherwise slow (2.5-30 GB/s on an H200 VM against 52 GB/s once
        chunks are reused) because every host chunk it copies into must first be faulted in and
        page-locked on the sleep path. This pays that cost up front, in offload-sized chunks, and
        raises the host reserve to at least ``nbytes`` so wakes keep them. The trade: ``nbytes`` of
        host RAM is held, locked, from now on instead of only while a tag sleeps; in return a sleep
        of up to ``nbytes`` runs at line rate the first time. Pre-pin the bytes the first sleep will
        offload (the tags slept with ``offload``), no more.

        Safe while other threads allocate, sleep or wake: it holds no allocator lock, and runs
        without the GIL. It stops once ``nbytes`` of chunks are free or the pool has grown by
        ``nbytes`` since it began, whoever made them: a sleep running beside it takes prepinned chunks
        and makes the rest, and the two together pin no more than the sleep needs. :meth:`close`
        stops it before its next chunk. On failure (the memlock limit, host memory exhausted) the
        chunks pinned so far are kept and OutOfMemory is raised. ``0`` does nothing.
        """
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            raise InvalidArgument(f"bytes to pre-pin must be an integer, got {nbytes!r}")
        if nbytes < 0:
            raise InvalidArgument(f"bytes to pre-pin must be >= 0, got {nbytes}")
        if nbytes >= 1 << 63:
            raise InvalidArgument(f"bytes to pre-pin must be < 2**63, got {nbytes}")
        self._native.prepin_host(nbytes)

    def cancel_prepin(self) -> None:
        """Stop a :meth:`prepin_host` running on another thread before its next chunk; later calls
        pin nothing. What it pinned so far stays in the pool, kept up to the host reserve."""
        self._native.cancel_prepin()

    def lookup(self, address: int, size: int = 1) -> tuple[int, str]:
        """The base address and tag of the allocation holding ``[address, address+size)``."""
        base, tag = self._native.lookup(address, size)
        return int(base), str(tag)

    def _tag_state(self, tag: str) -> str | None:
        for s in self._native.tag_stats():
            if s["tag"] == tag:
                return str(s["state"])
        return None

    def stats(self, wait: bool = True) -> AllocatorStats:
        """A snapshot; with ``wait=False`` raise TransitionInProgress instead of waiting for a
        running sleep or wake (status RPCs must answer during transitions)."""
        raw = self._native.tag_stats(not wait)
        free, total = self._native.mem_info()
        tags = {
            s["tag"]: TagStats(
                tag=s["tag"],
                state=TagState(s["state"]),
                mapped_bytes=s["mapped_bytes"],
                allocated_bytes=s["allocated_bytes"],
                offloaded_bytes=s["offloaded_bytes"],
                disk_bytes=s["disk_bytes"],
                discarded_bytes=s["discarded_bytes"],
                allocations=s["allocations"],
                layout_bytes=s["layout_bytes"],
                extents=s["extents"],
            )
            for s in raw
        }
        counters = dict(self._native.counters(not wait))
        return AllocatorStats(self.backend, self.device, free, total, tags, counters)

    def close(self) -> None:
        """Release this handle; device memory goes once the last tensor from it is gone. A
        :meth:`prepin_host` running on another thread stops before its next chunk."""
        self._native.close()


_instance: MemoryAllocator | None = None
_instance_lock = threading.Lock()


def get_allocator(config: AllocatorConfig | None = None) -> MemoryAllocator:
    """The process's allocator, created on first use (with ``config`` or the defaults)."""
    global _instance
    with _instance_lock:
        if _instance is None:
            _instance = MemoryAllocator(config or AllocatorConfig())
        elif config is not None and config != _instance.config:
            raise WrongState("the process allocator already exists with a different configuration")
        return _instance


def close_allocator() -> None:
    """Drop the process's allocator (shutdown and tests); tensors still alive keep their memory."""
    global _instance
    with _instance_lock:
        if _instance is not None:
            _instance.close()
            _instance = None


__all__ = [
    "Action",
    "AllocatorConfig",
    "AllocatorStats",
    "CopyMethod",
    "Fence",
    "MemoryAllocator",
    "TagStats",
    "close_allocator",
    "resolve_backend",
    "get_allocator",
]
