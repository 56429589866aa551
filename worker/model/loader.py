"""Streaming safetensors loading: shards read in parallel into a ring of page-locked staging chunks,
each chunk copied into the existing weight tensors while the next ones are read.

Why not ``safe_open`` + ``get_tensor`` + ``copy_``: that path makes a full host copy of every tensor
in pageable memory (one thread, then a 6-11 GB/s pageable copy to the device), ~7.6 GB/s on the
H200 host for an 8B checkpoint in the page cache. Here a few threads ``preadv`` (which releases
the GIL) straight into page-locked chunks of one staging ring, and a dedicated CUDA stream copies
each filled chunk's pieces to their tensors at line rate; a chunk is refilled only once the event
recorded after its copies has completed. No tensor is ever whole in host memory and nothing is
pinned per tensor. The cold start, a level-2 wake and ReloadWeights all go through
:class:`StreamingLoader`.

The header of every shard is parsed here (the safetensors format is a spec: an 8-byte
little-endian length, a JSON header, the data section) and the whole checkpoint validated before a
byte is copied: :func:`read_layout` is the one place that reads headers, so a level-2 wake's
pre-check (``check_checkpoint``) and the load refuse the same files.

I/O: from a cold page cache a buffered read costs an extra copy through the cache (and evicts
other data for pages read once). Each chunk's pages are looked up in the page cache first
(``mincore`` on a mapping of the file that is never touched, so it starts no I/O): cached runs are
read buffered, the others with ``O_DIRECT`` (offsets, lengths and buffer addresses aligned to 4096:
chunks start at aligned file offsets and the ring is aligned). Not ``preadv(..., RWF_NOWAIT)``, the
obvious probe: on Linux 6.18 a NOWAIT read that misses still starts readahead into the cache (a
16 MiB NOWAIT read of a cold file brought 8 MiB in), so a cold load would read most of the data
twice. Where the file system refuses O_DIRECT (EINVAL) plain buffered reads do it; where the
kernel will not tell (``mincore`` reports cache residency only for files the process could write
or owns, and says "all cached" otherwise) the reads are buffered, as before this loader. The price
of O_DIRECT: what it reads does not enter the page cache, so a cold checkpoint stays cold and every
level-2 wake reads it from the disk again (at the disk's rate, not through a second copy).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import itertools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import torch

from memsvc.errors import Cancelled, InvalidArgument, NotFound, Unavailable
from worker.checkpoint_files import INDEX_FILE, open_regular, read_weight_map, reader_threads
from worker.page_cache import PageCache
from worker.staging import CheckpointStaging, file_id

if TYPE_CHECKING:
    from worker.allocator import MemoryAllocator

log = logging.getLogger("memsvc.worker")
T = TypeVar("T")
MiB = 1 << 20
ALIGN = 4096
"""O_DIRECT alignment of file offsets, lengths and buffer addresses (the common logical block size
is 512; 4096 also serves 4Kn disks)."""
MAX_HEADER_BYTES = 100_000_000
"""The safetensors library's own limit on a header's size: anything longer is a damaged file."""
DEFAULT_CHUNK_BYTES = 16 * MiB
"""One staging chunk, one read: large enough that syscall and copy-launch costs vanish (an 8B model is
~1000 reads), small enough that the ring for 16 threads is 512 MiB of host RAM."""
DEFAULT_MAX_GAP_BYTES = 1 * MiB
"""Bytes of unused tensors a read may carry between two needed ones rather than start a new read."""
DEFAULT_STALL_S = 60.0
"""A load whose reads make no progress this long fails (Unavailable): a checkpoint on a network mount
that hangs would otherwise keep the worker in its transition for ever. A slow disk still progresses:
one 16 MiB read at 1 MB/s takes 16 s."""
Progress = Callable[[int, int], None]
"""Told (bytes done, bytes in all) as a load goes: a progress bar (worker/model/progress.py)."""
_POLL_S = 0.05
"""How often a load waiting for its threads looks at the clock and at :meth:`StreamingLoader.cancel`."""
MAX_STUCK_THREADS = 64
"""Threads left inside reads that never returned, at most: past it every load is refused (each
hung load leaves its readers behind; a bound, not a leak per request)."""

IoMode = Literal["auto", "buffered", "direct"]
"""``auto``: what the page cache holds, then O_DIRECT for the rest (buffered where refused);
``buffered``: plain reads through the page cache; ``direct``: O_DIRECT for everything (buffered
where refused). The last two are for tests and benchmarks."""
IO_MODES: tuple[IoMode, ...] = ("auto", "buffered", "direct")


def _dtype_table() -> dict[str, tuple[torch.dtype, int]]:
    """safetensors dtype names this loader reads -> (torch dtype, bytes per element)."""
    names = {
        "BOOL": "bool",
        "U8": "uint8",
        "I8": "int8",
        "I16": "int16",
        "U16": "uint16",
        "F16": "float16",
        "BF16": "bfloat16",
        "I32": "int32",
        "U32": "uint32",
        "F32": "float32",
        "I64": "int64",
        "U64": "uint64",
        "F64": "float64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
    }
    table: dict[str, tuple[torch.dtype, int]] = {}
    for name, attr in names.items():
        dtype = getattr(torch, attr, None)
        if isinstance(dtype, torch.dtype):
            table[name] = (dtype, dtype.itemsize)
    return table


DTYPES = _dtype_table()


# ---- headers ----
@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a shard's header, its data as absolute byte offsets in the file."""

    name: str
    dtype: str
    """The safetensors name (``BF16``, ``F32``, ...)."""
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype | None:
        known = DTYPES.get(self.dtype)
        return known[0] if known else None


@dataclass(frozen=True)
class ShardHeader:
    """A safetensors file's parsed and checked header."""

    file: Path
    file_bytes: int
    """The file's length when its header was read (a load refuses a file that changed since)."""
    data_start: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def _damaged(file: Path, why: str) -> InvalidArgument:
    return InvalidArgument(f"{file}: cannot read safetensors file ({why})")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_header(file: Path, raw: bytes, file_bytes: int) -> ShardHeader:
    """Check one header (``raw``: the JSON after the 8-byte length) against the file's length:
    every entry well formed, its byte range the size its dtype and shape need, inside the data
    section (so a truncated file is refused), and no two tensors sharing bytes."""
    data_start = 8 + len(raw)
    data_bytes = file_bytes - data_start
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:
        raise _damaged(file, f"the header is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise _damaged(file, "the header is not a JSON object")
    metadata: dict[str, str] = {}
    tensors: dict[str, TensorEntry] = {}
    for name, info in doc.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise _damaged(file, "__metadata__ must map strings to strings")
            metadata = dict(info)
            continue
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise _damaged(file, f"tensor '{name}' needs dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str):
            raise _damaged(file, f"tensor '{name}': dtype must be a string, got {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise _damaged(file, f"tensor '{name}': shape must be a list of sizes >= 0, got {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise _damaged(file, f"tensor '{name}': data_offsets must be [begin, end], got {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end:
            raise _damaged(file, f"tensor '{name}': data_offsets {offsets} are not 0 <= begin <= end")
        if end > data_bytes:
            raise _damaged(
                file,
                f"tensor '{name}' ends at byte {end} of the data section, which holds {max(data_bytes, 0)} bytes"
                " (truncated?)",
            )
        known = DTYPES.get(dtype)
        if known is not None:
            need = known[1]
            for d in shape:
                need *= d
            if end - begin != need:
                raise _damaged(
                    file,
                    f"tensor '{name}': data_offsets span {end - begin} bytes, dtype {dtype} and shape"
                    f" {tuple(shape)} need {need}",
                )
        tensors[name] = TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)
    previous: TensorEntry | None = None
    for entry in sorted((t for t in tensors.values() if t.nbytes), key=lambda t: t.start):
        if previous is not None and entry.start < previous.end:
            raise _damaged(file, f"tensors '{previous.name}' and '{entry.name}' overlap in the data section")
        previous = entry
    return ShardHeader(file, file_bytes, data_start, tensors, metadata)


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    parts: list[bytes] = []
    while n > 0:
        part = os.pread(fd, n, offset)
        if not part:
            break
        parts.append(part)
        n -= len(part)
        offset += len(part)
    return b"".join(parts)


def _open_shard(path: Path) -> int:
    """A read-only descriptor of a shard; a missing one is NOT_FOUND, one that is not a regular file
    (a FIFO would block the load for ever) or cannot be opened is INVALID_ARGUMENT naming it."""
    return open_regular(path)


def read_header(file: str | os.PathLike[str]) -> ShardHeader:
    """Read and check one safetensors file's header (not its data)."""
    path = Path(file)
    fd = _open_shard(path)
    try:
        size = os.fstat(fd).st_size
        head = _pread_exact(fd, 8, 0)
        if len(head) < 8:
            raise _damaged(path, f"{size} bytes: shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES:
            raise _damaged(path, f"header length {n} is over the {MAX_HEADER_BYTES}-byte limit")
        if 8 + n > size:
            raise _damaged(path, f"header length {n} runs past the end of the {size}-byte file (truncated?)")
        raw = _pread_exact(fd, n, 8)
        if len(raw) < n:
            raise _damaged(path, "the file ended inside its header")
    except OSError as e:
        raise _damaged(path, e.strerror or str(e)) from None
    finally:
        os.close(fd)
    return parse_header(path, raw, size)


# ---- the checkpoint ----
@dataclass(frozen=True)
class CheckpointLayout:
    """Where each needed tensor of a checkpoint directory is, every one checked."""

    root: Path
    tensors: dict[str, TensorEntry]
    """The needed tensors, in the order they were asked for."""
    files: dict[str, Path]
    """Which file holds each of them."""
    headers: dict[Path, ShardHeader]
    """The headers of the files that hold them."""

    def by_file(self) -> dict[Path, list[str]]:
        out: dict[Path, list[str]] = {}
        for name in self.tensors:
            out.setdefault(self.files[name], []).append(name)
        return out


def read_layout(path: str | os.PathLike[str], shapes: Mapping[str, Sequence[int]]) -> CheckpointLayout:
    """Find and check every tensor of ``shapes`` in a Hugging Face checkpoint directory (the index of
    a sharded one, else every ``*.safetensors`` file): present, a dtype the loader reads, the shape
    asked for, and every header of the files involved valid. Reads headers only."""
    root = Path(path)
    if not root.is_dir():
        raise NotFound(f"checkpoint directory {root} does not exist")
    headers: dict[Path, ShardHeader] = {}
    files: dict[str, Path] = {}
    index = root / INDEX_FILE
    if index.is_file():
        where = read_weight_map(root, index)
        missing = [name for name in shapes if name not in where]
        if not missing:
            for name in shapes:
                file = where[name]
                if file not in headers:
                    if not file.is_file():
                        raise NotFound(f"checkpoint {root}: shard {file.name} does not exist")
                    headers[file] = read_header(file)
                if name not in headers[file].tensors:
                    raise InvalidArgument(
                        f"checkpoint {root}: shard {file.name} has no tensor '{name}' (the index puts it there)"
                    )
                files[name] = file
    else:
        shards = sorted(root.glob("*.safetensors"))
        if not shards:
            raise NotFound(f"{root}: no *.safetensors files")
        for file in shards:
            headers[file] = read_header(file)
            for name in headers[file].tensors:
                if name in shapes and name in files:
                    raise InvalidArgument(
                        f"checkpoint {root}: tensor '{name}' is in both {files[name].name} and {file.name}"
                        f" (and there is no {INDEX_FILE} to say which)"
                    )
                files.setdefault(name, file)
        missing = [name for name in shapes if name not in files]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise InvalidArgument(f"checkpoint {root}: missing tensor '{missing[0]}'{more}")
    tensors: dict[str, TensorEntry] = {}
    for name, shape in shapes.items():
        entry = headers[files[name]].tensors[name]
        if entry.dtype not in DTYPES:
            raise InvalidArgument(f"checkpoint {root}: tensor '{name}' has dtype {entry.dtype}, which cannot be loaded")
        if entry.shape != tuple(shape):
            raise InvalidArgument(
                f"checkpoint {root}: tensor '{name}' has shape {entry.shape}, the config needs {tuple(shape)}"
            )
        tensors[name] = entry
    used = {files[name] for name in shapes}
    return CheckpointLayout(root, tensors, files, {f: h for f, h in headers.items() if f in used})


# ---- the plan ----
@dataclass(frozen=True)
class Piece:
    """Bytes of one read that belong to one tensor."""

    buffer_offset: int
    """Where they start in the read's staging chunk."""
    nbytes: int
    name: str
    tensor_offset: int
    """Where they go in the tensor (bytes)."""


@dataclass(frozen=True)
class Read:
    """One chunk read: ``need`` bytes of ``file`` from ``offset`` (aligned to :data:`ALIGN`),
    scattered to ``pieces``."""

    file: Path
    offset: int
    need: int
    pieces: tuple[Piece, ...]


def _align_down(n: int) -> int:
    return n - n % ALIGN


def _align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_reads(
    spans: Sequence[tuple[Path, int, int, str]],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_gap_bytes: int = DEFAULT_MAX_GAP_BYTES,
) -> list[Read]:
    """The reads that fetch ``spans`` (file, start, end, name; non-overlapping within a file):
    neighbouring tensors coalesced into one read (across gaps of at most ``max_gap_bytes``), a
    tensor larger than a chunk split over several; every read starts at an aligned offset and,
    rounded up to the alignment, fits one chunk of ``chunk_bytes``."""
    reads: list[Read] = []
    file: Path | None = None
    offset = data_end = 0
    pieces: list[Piece] = []

    def flush() -> None:
        if file is not None and pieces:
            reads.append(Read(file, offset, data_end - offset, tuple(pieces)))

    for f, start, end, name in sorted(spans, key=lambda s: (str(s[0]), s[1])):
        pos = start
        while pos < end:
            if file != f or pos >= offset + chunk_bytes or pos - data_end > max_gap_bytes:
                flush()
                file, offset, data_end, pieces = f, _align_down(pos), pos, []
            stop = min(end, offset + chunk_bytes)
            pieces.append(Piece(pos - offset, stop - pos, name, pos - start))
            data_end, pos = stop, stop
    flush()
    return reads


# ---- loading ----
@dataclass
class LoadStats:
    """What one load did."""

    tensors: int = 0
    bytes: int = 0
    """Tensor bytes written."""
    read_bytes: int = 0
    """File bytes read (tensor bytes plus alignment and small gaps)."""
    cached_bytes: int = 0
    """Of those, read through the page cache, which held them."""
    direct_bytes: int = 0
    """Read with O_DIRECT."""
    buffered_bytes: int = 0
    """Read through the page cache otherwise: ``io="buffered"``, or where O_DIRECT was refused."""
    reads: int = 0
    converted: int = 0
    """Tensors written through the slow path (each read whole, then copied): a dtype conversion, or a
    non-contiguous destination, read from its file (from a staged shard, a conversion is a copy on
    the device, counted in :attr:`staged_bytes` only)."""
    staged_bytes: int = 0
    """Tensor bytes copied from shards staged in device memory (worker/staging.py), not read here."""
    threads: int = 0
    seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def add_io(self, other: LoadStats) -> None:
        self.read_bytes += other.read_bytes
        self.cached_bytes += other.cached_bytes
        self.direct_bytes += other.direct_bytes
        self.buffered_bytes += other.buffered_bytes
        self.reads += other.reads


def _buffer_at(address: int, nbytes: int) -> memoryview:
    """A writable view of ``nbytes`` at ``address`` (the ring's memory, kept alive by its tensor)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


class _Slot:
    """One staging chunk of the ring; ``event``: recorded after the copies out of it were enqueued."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.view = _buffer_at(tensor.data_ptr(), tensor.numel())
        self.event: Any = None
        self.pending = False


@dataclass
class _Ring:
    block: torch.Tensor
    pinned: bool
    slots: list[_Slot]


@dataclass
class _File:
    """An open shard. ``direct`` starts as the io mode says and is switched off, for the rest of the
    load, where the file system refuses O_DIRECT."""

    path: Path
    fd: int
    direct_fd: int | None
    cache: PageCache | None
    """Where to look up what the page cache holds (``io="auto"``)."""
    direct: bool = field(init=False)

    def __post_init__(self) -> None:
        self.direct = self.direct_fd is not None

    def close(self) -> None:
        os.close(self.fd)
        if self.direct_fd is not None:
            os.close(self.direct_fd)
        if self.cache is not None:
            self.cache.close()


@dataclass
class _Job:
    reads: list[Read]
    files: dict[Path, _File]
    targets: dict[str, torch.Tensor]
    """Each fast-path tensor as a flat uint8 view."""
    free: queue.SimpleQueue[_Slot]
    stream: Any
    root: str = ""
    """The checkpoint directory (what a reader left stuck blocks)."""
    stop: threading.Event = field(default_factory=threading.Event)
    progress: int = 0
    """Bytes of the reads done so far (the stall watch looks at it: one read is one chunk, 16 MiB by
    default; a lost update between readers only delays it)."""
    reading: dict[int, Path] = field(default_factory=dict)
    """The file each reader thread is reading now (what a stall names)."""
    _next: itertools.count[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _scattering: int = 0
    _abandoned: bool = False
    _idle: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self._idle = threading.Condition(self._lock)

    def take(self) -> Read | None:
        with self._lock:
            i = next(self._next)
        return self.reads[i] if i < len(self.reads) and not self.stop.is_set() else None

    def begin_scatter(self) -> bool:
        """False once the load was abandoned: a read that returns after that copies nothing (the
        weights may be unmapped by then)."""
        with self._lock:
            if self._abandoned:
                return False
            self._scattering += 1
            return True

    def end_scatter(self) -> None:
        with self._lock:
            self._scattering -= 1
            self._idle.notify_all()

    def abandon(self) -> None:
        """Stop every reader, and wait for the copies being enqueued now: none is enqueued after."""
        self.stop.set()
        with self._lock:
            self._abandoned = True
            while self._scattering:
                self._idle.wait()


class StreamingLoader:
    """Loads safetensors checkpoints into existing tensors through a reusable staging ring.

    Keep one for the worker's life: its ring is allocated on the first load and kept, so a level-2
    wake or ReloadWeights pays no allocation or pinning. The ring is ``buffers`` chunks of
    ``chunk_bytes``, host RAM held while the loader lives (:attr:`staging_bytes`; :meth:`release`
    gives it back, the next load allocates it again).

    Where the ring comes from, for CUDA destinations: with an ``allocator`` (cuda backend), one
    :meth:`MemoryAllocator.host_empty` block: anonymous memory on 2 MiB-aligned transparent huge
    pages, pre-faulted by several threads and registered with ``cuMemHostRegister`` (native/
    hostmem.c), i.e. first touch at ~7 GB/s per thread then registration at 13-17 GB/s, a few tens of
    ms for 256 MiB on the H200 host. Without one, ``torch.empty(pin_memory=True)``, whose
    ``cudaHostAlloc`` pins at 1.3-1.9 GB/s there (~0.15-0.2 s for the same ring). Either is paid
    once per loader, but the first load is the cold start, so the worker should pass its
    allocator. The ring is one allocation, not one per chunk: the allocator's host pool hands out
    whole chunks of at least the size asked for, and a chunk per slot could take a 256 MiB offload
    chunk each. For CPU destinations (host backend) the ring is plain memory and the copies run in
    the reader threads.

    ``threads``: reader threads (default ``min(16, cpu_count)``); ``chunk_bytes``: one read (a
    multiple of 4096); ``buffers``: ring slots (default ``2 * threads``, at least ``threads``) -
    the spare slots are what lets reads run ahead of the device copies; ``io``: see :data:`IoMode`;
    ``stall_s``: see :data:`DEFAULT_STALL_S`; ``staging``: the worker's start-up staging of the
    checkpoint (worker/staging.py), which the first load takes: each tensor of a shard staged in
    device memory, and unchanged since, is copied from there instead of read from the file.

    Bounded: every read of a file (headers, data) runs on a daemon thread the load waits for, so a
    read that never returns fails the load after ``stall_s`` without progress, and :meth:`cancel`
    ends it at once, instead of holding the caller (the worker's device loop) for ever. A thread
    left inside such a read cannot be stopped: until it returns, the next load is refused
    (Unavailable) rather than leave more threads behind, and the staging ring it may still write
    into is not used again.
    """

    def __init__(
        self,
        allocator: MemoryAllocator | None = None,
        *,
        threads: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        buffers: int | None = None,
        io: IoMode = "auto",
        max_gap_bytes: int = DEFAULT_MAX_GAP_BYTES,
        stall_s: float = DEFAULT_STALL_S,
        staging: CheckpointStaging | None = None,
    ) -> None:
        threads = reader_threads() if threads is None else threads
        if not _is_int(threads) or threads < 1:
            raise InvalidArgument(f"loader threads must be >= 1, got {threads!r}")
        if not _is_int(chunk_bytes) or chunk_bytes < ALIGN or chunk_bytes % ALIGN:
            raise InvalidArgument(f"loader chunk bytes must be a positive multiple of {ALIGN}, got {chunk_bytes!r}")
        buffers = 2 * threads if buffers is None else buffers
        if not _is_int(buffers) or buffers < threads:
            raise InvalidArgument(f"loader buffers must be >= its {threads} threads, got {buffers!r}")
        if io not in IO_MODES:
            raise InvalidArgument(f"loader io must be one of {', '.join(IO_MODES)}, got {io!r}")
        if not _is_int(max_gap_bytes) or max_gap_bytes < 0:
            raise InvalidArgument(f"loader max gap must be >= 0 bytes, got {max_gap_bytes!r}")
        if not stall_s > 0:
            raise InvalidArgument(f"loader stall bound must be > 0 s, got {stall_s!r}")
        self.allocator = allocator
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self.buffers = buffers
        self.io: IoMode = io
        self.max_gap_bytes = max_gap_bytes
        self.last_stats: LoadStats | None = None
        self._ring: _Ring | None = None
        self.stall_s = float(stall_s)
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._stuck: list[tuple[threading.Thread, str, str]] = []
        """Threads an abandoned load left inside a read: the thread, the file, the checkpoint."""
        self.touched = False
        """The last load wrote into its destination (False: a load that failed left it as it was)."""
        self._staging = staging

    @property
    def staging_bytes(self) -> int:
        """Host RAM the staging ring holds now (page-locked for CUDA destinations)."""
        ring = self._ring
        return ring.block.numel() if ring is not None else 0

    def release(self) -> None:
        """Give the staging ring back (the next load allocates it again)."""
        with self._lock:
            self._ring = None

    def cancel(self) -> None:
        """End the load running now (Cancelled, within :data:`_POLL_S` of a read returning or not) and
        refuse every later one: for a worker that is stopping."""
        self._cancelled.set()

    def check(self, path: str | os.PathLike[str], shapes: Mapping[str, Sequence[int]]) -> CheckpointLayout:
        """:func:`read_layout` (the headers, every needed tensor checked), bounded as a load is."""
        if self._cancelled.is_set():
            raise Cancelled("the load was cancelled: the worker is stopping")
        self._check_stuck(str(path))
        return self.bounded(str(path), lambda: read_layout(path, shapes), root=str(path))

    # ---- bounded waits ----
    def _check_stuck(self, root: str) -> None:
        """Unavailable while a thread an abandoned load of this checkpoint left is still inside its
        read (another checkpoint, on a mount that works, still loads), or while too many are."""
        self._stuck = [entry for entry in self._stuck if entry[0].is_alive()]
        same = [file for _, file, where in self._stuck if where == root]
        if same or len(self._stuck) >= MAX_STUCK_THREADS:
            file = same[0] if same else self._stuck[0][1]
            until = "this checkpoint cannot load until it does" if same else "no load can start until it does"
            raise Unavailable(
                f"a read of {file} by an earlier load has not returned (a hung mount?); {until}",
                metadata={"path": file},
            )

    def _interrupted(self, what: str, last_progress: float) -> BaseException | None:
        """Why a wait must end now: cancelled, or ``stall_s`` since ``last_progress`` (monotonic)."""
        if self._cancelled.is_set():
            return Cancelled("the load was cancelled: the worker is stopping")
        if time.monotonic() - last_progress > self.stall_s:
            return Unavailable(
                f"reading {what}: no progress for {self.stall_s:g} s (a hung mount?); the load stopped",
                metadata={"path": what},
            )
        return None

    def bounded(self, what: str, fn: Callable[[], T], undo: Callable[[T], None] = lambda _: None, root: str = "") -> T:
        """``fn()`` on a daemon thread, waited for at most ``stall_s`` (or until :meth:`cancel`).
        ``fn`` only reads (headers, files opened, a tensor into host memory): abandoned, its thread
        is left to return whenever it does, and ``undo`` is given what it made then. ``root``: the
        checkpoint it reads (what a stuck thread blocks), ``what`` by default."""
        out: list[tuple[bool, Any]] = []
        lock = threading.Lock()
        gone = False

        def run() -> None:
            try:
                result: tuple[bool, Any] = (True, fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                result = (False, e)
            with lock:
                if not gone:
                    out.append(result)
                    return
            if result[0]:
                undo(result[1])

        thread = threading.Thread(target=run, name=f"ckpt-read {what}"[:60], daemon=True)
        thread.start()
        start = time.monotonic()
        while True:
            thread.join(_POLL_S)
            with lock:
                if out:
                    ok, value = out[0]
                    if ok:
                        return cast(T, value)
                    raise value
                stop = self._interrupted(what, start)
                if stop is not None:
                    gone = True
                    self._stuck.append((thread, what, root or what))
                    raise stop

    # ---- the ring ----
    def _ring_for(self, pinned: bool) -> _Ring:
        ring = self._ring
        if ring is not None and (ring.pinned or not pinned):
            return ring
        self._ring = None
        total = self.buffers * self.chunk_bytes
        block = self._allocate(total, pinned)
        if block.data_ptr() % ALIGN:  # O_DIRECT needs aligned buffer addresses
            del block
            padded = self._allocate(total + ALIGN, pinned)
            skip = -padded.data_ptr() % ALIGN
            block = padded[skip : skip + total]
        slots = [_Slot(block[i * self.chunk_bytes : (i + 1) * self.chunk_bytes]) for i in range(self.buffers)]
        self._ring = _Ring(block, pinned, slots)
        return self._ring

    def _allocate(self, nbytes: int, pinned: bool) -> torch.Tensor:
        if not pinned:
            return torch.empty(nbytes, dtype=torch.uint8)
        if self.allocator is not None and self.allocator.backend == "cuda":
            return self.allocator.host_empty(nbytes, torch.uint8)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]  # unannotated in torch
        return self._streams[index]

    # ---- files ----
    def _open_direct(self, fd: int) -> int | None:
        """An O_DIRECT descriptor of the file ``fd`` is open on (the one checked to be a regular file,
        not the path again, which could have been swapped since), or None where it is refused."""
        try:
            return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError:
            return None

    def _open(self, header: ShardHeader) -> _File:
        path = header.file
        fd = _open_shard(path)
        size = os.fstat(fd).st_size
        if size != header.file_bytes:
            os.close(fd)
            raise _damaged(
                path, f"it changed while being loaded: {size} bytes, its header was read at {header.file_bytes}"
            )
        direct = self._open_direct(fd) if self.io != "buffered" else None
        cache = PageCache(fd, size) if self.io == "auto" and direct is not None else None
        return _File(path, fd, direct, cache)

    def _open_all(self, layout: CheckpointLayout, names: list[str]) -> dict[Path, _File]:
        files: dict[Path, _File] = {}
        try:
            for file in dict.fromkeys(layout.files[n] for n in names):
                files[file] = self._open(layout.headers[file])
        except BaseException:
            self._close(files)
            raise
        return files

    @staticmethod
    def _close(files: Mapping[Path, _File]) -> None:
        for f in files.values():
            f.close()

    def _read(self, f: _File, view: memoryview, offset: int, need: int, stats: LoadStats) -> None:
        """Fill ``view[:need]`` with the file's bytes from ``offset`` (aligned): the runs of pages the
        page cache holds buffered, the others with O_DIRECT (buffered where refused)."""
        runs = f.cache.runs(offset, need) if f.cache is not None else [(0, need, not f.direct)]
        for start, stop, cached in runs:
            pos = start
            if not cached and f.direct:
                pos = self._read_direct(f, view, offset, start, stop, stats)
            while pos < stop:
                n = os.preadv(f.fd, [view[pos:stop]], offset + pos)
                if n <= 0:
                    raise _damaged(
                        f.path, f"the file ended at byte {offset + pos}, before the {offset + need} its header promises"
                    )
                pos += n
                if cached and f.cache is not None:
                    stats.cached_bytes += n
                else:
                    stats.buffered_bytes += n
        stats.read_bytes += need
        stats.reads += 1

    @staticmethod
    def _read_direct(f: _File, view: memoryview, offset: int, start: int, stop: int, stats: LoadStats) -> int:
        """O_DIRECT reads of ``[start, stop)`` (``start`` aligned; the length rounded up, which stays
        inside the chunk); returns how far they got (the end of the file, or a refusal, stop them)."""
        assert f.direct_fd is not None
        pos, end = start, _align_up(stop)
        try:
            while pos < stop:
                n = os.preadv(f.direct_fd, [view[pos:end]], offset + pos)
                if n <= 0:
                    break
                stats.direct_bytes += min(n, stop - pos)
                pos += n
                if n % ALIGN:  # the end of the file; O_DIRECT cannot go on from an unaligned offset
                    break
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            f.direct = False  # refused (O_DIRECT, or its alignment): buffered from here on
        return min(pos, stop)

    # ---- the load ----
    def load(
        self,
        path: str | os.PathLike[str],
        weights: Mapping[str, torch.Tensor],
        shapes: Mapping[str, Sequence[int]],
        progress: Progress | None = None,
    ) -> LoadStats:
        """Copy the checkpoint's tensors named in ``shapes`` into ``weights``' tensors, in place.
        ``progress(done, total)``: bytes read so far of what the load reads, called from this thread
        as the reads go (every few tens of milliseconds) and once at the end with ``done == total``.

        Everything is validated before the first byte is copied (every header, every needed tensor's
        presence, dtype and shape, every destination), so a wrong, damaged or truncated checkpoint
        leaves the weights as they were. Tensors not in ``shapes`` are ignored; a file dtype that
        differs from the destination's is converted (slowly: the tensor is read whole, then copied).
        A failure after validation (an I/O error, a file that shrank meanwhile) stops the other
        reads, waits for the copies in flight and raises: the weights' contents are then undefined,
        and the caller must treat them as lost (the worker discards them).
        """
        with self._lock:
            staging, self._staging = self._staging, None  # the first load's, whether it gets that far or not
            try:
                return self._load(path, weights, shapes, progress, staging)
            finally:
                if staging is not None:
                    staging.take(0)  # what it staged, if this load never took it: dropped

    def _load(
        self,
        path: str | os.PathLike[str],
        weights: Mapping[str, torch.Tensor],
        shapes: Mapping[str, Sequence[int]],
        progress: Progress | None,
        staging: CheckpointStaging | None,
    ) -> LoadStats:
        t0 = time.perf_counter()
        self.touched = False
        layout = self.check(path, shapes)
        stats = LoadStats(tensors=len(layout.tensors))
        targets: dict[str, torch.Tensor] = {}
        slow: list[str] = []
        cuda_device: torch.device | None = None
        for name, entry in layout.tensors.items():
            dst = weights.get(name)
            if dst is None:
                raise InvalidArgument(f"checkpoint {layout.root}: no destination tensor for '{name}'")
            if tuple(dst.shape) != entry.shape:
                raise InvalidArgument(
                    f"checkpoint {layout.root}: tensor '{name}' has shape {entry.shape}, its destination"
                    f" {tuple(dst.shape)}"
                )
            if dst.device.type == "cuda":
                if cuda_device is not None and dst.device != cuda_device:
                    raise InvalidArgument(f"destinations on two CUDA devices: {cuda_device} and {dst.device}")
                cuda_device = dst.device
            elif dst.device.type != "cpu":
                raise InvalidArgument(f"cannot load '{name}' into a tensor on {dst.device}")
            stats.bytes += dst.numel() * dst.element_size()
            if dst.numel() == 0:
                continue
            if dst.dtype == entry.torch_dtype and dst.is_contiguous():
                targets[name] = dst.detach().reshape(-1).view(torch.uint8)
            else:
                slow.append(name)
        files: dict[Path, _File] = {}
        staged: dict[Path, torch.Tensor] = {}
        try:
            files = self.bounded(
                str(layout.root), lambda: self._open_all(layout, [*targets, *slow]), self._close, str(path)
            )
            stream = self._stream(cuda_device) if cuda_device is not None else None
            staged = self._staged(staging, files)
            copied = [n for n in [*targets, *slow] if layout.files[n] in staged]
            slow = [n for n in slow if layout.files[n] not in staged]
            spans = [
                (layout.files[n], layout.tensors[n].start, layout.tensors[n].end, n)
                for n in targets
                if layout.files[n] not in staged
            ]
            reads = plan_reads(spans, self.chunk_bytes, self.max_gap_bytes)
            done = sum(layout.tensors[n].nbytes for n in copied)
            total = done + sum(rd.need for rd in reads) + sum(layout.tensors[n].nbytes for n in slow)
            if copied:
                self._copy_staged(copied, layout, staged, targets, weights, stream)
                stats.staged_bytes = done
                if progress is not None:
                    progress(done, total)
            if reads:
                ring = self._ring_for(pinned=cuda_device is not None)
                job = _Job(reads, files, targets, queue.SimpleQueue(), stream, root=str(path))
                self._run(job, ring, stats, (lambda n: progress(done + n, total)) if progress else None)
            done += sum(rd.need for rd in reads)
            if progress is not None:
                progress(done, total)  # the reads are done (a poll may have missed the last of them)
            for name in slow:
                self._convert(files[layout.files[name]], layout.tensors[name], weights[name], stream, stats, str(path))
                done += layout.tensors[name].nbytes
                if progress is not None:
                    progress(done, total)
        finally:
            self._close(files)
            staged.clear()  # unmapped as their tensors die, once all device work is done (native)
        stats.converted = len(slow)
        stats.seconds = time.perf_counter() - t0
        self.last_stats = stats
        return stats

    def make_room(self, nbytes: int) -> None:
        """Before ``nbytes`` of weights are allocated: the start-up staging, once it has ended, is
        dropped (unmapped) unless they fit beside it (worker/staging.py), so that a model which fits
        without it never fails for it."""
        with self._lock:
            staging = self._staging
            if staging is None or (self._wait_for(staging) and staging.leaves_room(nbytes)):
                return
            self._staging = None
            staging.take(0)
            log.info("checkpoint staging: dropped, %.2f GB of weights need its room", nbytes / 1e9)

    def _wait_for(self, staging: CheckpointStaging) -> bool:
        """Whether ``staging`` ended within the stall bound (a :meth:`cancel` ends the wait)."""
        deadline = time.monotonic() + self.stall_s
        while not staging.wait(_POLL_S):
            if self._cancelled.is_set():
                raise Cancelled("the load was cancelled: the worker is stopping")
            if time.monotonic() >= deadline:
                return False
        return True

    def _staged(self, staging: CheckpointStaging | None, files: Mapping[Path, _File]) -> dict[Path, torch.Tensor]:
        """The open files that ``staging`` holds in device memory, unchanged since, as uint8 tensors
        of all their bytes (waited for up to the stall bound, then read from the files instead)."""
        if staging is None:
            return {}
        self._wait_for(staging)
        shards = {shard.id: shard for shard in staging.take(0)}
        out: dict[Path, torch.Tensor] = {}
        for path, f in files.items():
            shard = shards.get(file_id(f.fd))
            if shard is not None:
                out[path] = torch.utils.dlpack.from_dlpack(shard.capsule)
        return out

    @torch.no_grad()
    def _copy_staged(
        self,
        names: Sequence[str],
        layout: CheckpointLayout,
        staged: Mapping[Path, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
        weights: Mapping[str, torch.Tensor],
        stream: Any,
    ) -> None:
        """Each tensor of ``names`` from its staged shard: a copy on the device (on the load's
        stream, after the work queued before the load), converted where its dtype differs."""
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        self.touched = True
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for name in names:
                entry = layout.tensors[name]
                src = staged[layout.files[name]][entry.start : entry.end]
                if name in targets:
                    targets[name].copy_(src, non_blocking=True)
                else:  # a dtype conversion: from an aligned copy of the bytes
                    dtype = entry.torch_dtype
                    assert dtype is not None, "read_layout refuses dtypes it cannot load"
                    weights[name].copy_(src.clone().view(dtype).reshape(entry.shape))
        if stream is not None:
            stream.synchronize()

    def _run(self, job: _Job, ring: _Ring, stats: LoadStats, progress: Callable[[int], None] | None = None) -> None:
        """The reader threads over ``job.reads``; returns once every copy has completed. ``progress``:
        told the bytes read so far at every poll."""
        if job.stream is not None:
            # work already queued on the caller's stream may still read the old weights
            job.stream.wait_stream(torch.cuda.current_stream(job.stream.device))
        for slot in ring.slots:
            slot.pending = False
            job.free.put(slot)
        count = min(self.threads, len(job.reads))
        stats.threads = count
        errors: list[BaseException] = []
        done: list[LoadStats] = []
        # daemon threads, not a pool: a reader stuck in a read must not hold the load (or the
        # process's exit, which joins a pool's threads) for ever
        threads = [
            threading.Thread(target=self._reader, args=(job, errors, done), name="ckpt-read", daemon=True)
            for _ in range(count)
        ]
        try:
            for t in threads:
                t.start()
            seen, last = -1, time.monotonic()
            while alive := [t for t in threads if t.is_alive()]:
                alive[0].join(_POLL_S)
                if job.progress != seen:
                    seen, last = job.progress, time.monotonic()
                    if progress is not None:
                        progress(seen)
                reading = next(iter(dict(job.reading).values()), None)  # a copy: readers change it
                stop = self._interrupted(str(reading or "the checkpoint"), last)
                if stop is not None:
                    job.abandon()
                    where = dict(job.reading)  # the readers inside a read (the others end at once)
                    self._stuck += [(t, str(where[t.ident]), job.root) for t in threads if t.ident in where]
                    self._ring = None  # a stuck read may still write into it
                    raise stop
        finally:
            if job.stream is not None:
                job.stream.synchronize()  # the copies in flight, also after a failure
        for local in done:
            stats.add_io(local)
        if errors:
            raise errors[0]

    @torch.no_grad()  # grad mode is per thread: a Parameter destination must not record the copies
    def _reader(self, job: _Job, errors: list[BaseException], done: list[LoadStats]) -> None:
        local = LoadStats()
        me = threading.get_ident()
        try:
            while (rd := job.take()) is not None:
                slot = job.free.get()
                try:
                    if slot.pending:
                        slot.event.synchronize()  # its last copies are done: the chunk may be refilled
                        slot.pending = False
                    if job.stop.is_set():  # abandoned or failed while it waited: its files may be closed
                        return
                    job.reading[me] = rd.file
                    self._read(job.files[rd.file], slot.view, rd.offset, rd.need, local)
                    del job.reading[me]
                    job.progress += rd.need
                    if not job.begin_scatter():
                        return
                    self.touched = True
                    try:
                        self._scatter(job, slot, rd)
                    finally:
                        job.end_scatter()
                finally:
                    job.free.put(slot)
        except BaseException as e:
            errors.append(e)
            job.stop.set()
        done.append(local)

    @staticmethod
    def _scatter(job: _Job, slot: _Slot, rd: Read) -> None:
        cuda = False
        for p in rd.pieces:
            dst = job.targets[p.name][p.tensor_offset : p.tensor_offset + p.nbytes]
            src = slot.tensor[p.buffer_offset : p.buffer_offset + p.nbytes]
            if dst.is_cuda:
                with torch.cuda.stream(job.stream):
                    dst.copy_(src, non_blocking=True)
                cuda = True
            else:
                dst.copy_(src)
        if cuda:
            if slot.event is None:
                # blocking: a reader waiting for it sleeps instead of spinning on a core another reader needs
                slot.event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            slot.event.record(job.stream)
            slot.pending = True

    @torch.no_grad()
    def _convert(
        self, f: _File, entry: TensorEntry, dst: torch.Tensor, stream: Any, stats: LoadStats, root: str
    ) -> None:
        """The slow path: the whole tensor read into plain memory (one bounded read per chunk, so a
        slow disk progresses where a hung one stops), then ``copy_`` converts it."""
        dtype = entry.torch_dtype
        assert dtype is not None, "read_layout refuses dtypes it cannot load"
        raw = torch.empty(entry.nbytes, dtype=torch.uint8)
        view = _buffer_at(raw.data_ptr(), entry.nbytes)

        def read(start: int, stop: int) -> int:
            got = start
            while got < stop:
                n = os.preadv(f.fd, [view[got:stop]], entry.start + got)
                if n <= 0:
                    end = f"the file ended at byte {entry.start + got}, before the {entry.end} its header promises"
                    raise _damaged(f.path, end)
                got += n
            return got - start

        for start in range(0, entry.nbytes, self.chunk_bytes):
            stop = min(start + self.chunk_bytes, entry.nbytes)
            got = self.bounded(str(f.path), functools.partial(read, start, stop), root=root)
            stats.read_bytes += got
            stats.buffered_bytes += got
        src = raw.view(dtype).reshape(entry.shape)
        self.touched = True
        if dst.is_cuda:
            with torch.cuda.stream(stream):
                dst.copy_(src)
            stream.synchronize()
        else:
            dst.copy_(src)


__all__ = [
    "ALIGN",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_STALL_S",
    "DTYPES",
    "INDEX_FILE",
    "IO_MODES",
    "CheckpointLayout",
    "IoMode",
    "LoadStats",
    "Piece",
    "Progress",
    "Read",
    "ShardHeader",
    "StreamingLoader",
    "TensorEntry",
    "parse_header",
    "plan_reads",
    "read_header",
    "read_layout",
]
