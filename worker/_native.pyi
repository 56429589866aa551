"""Types of ``worker._native``, the CPython binding of the native core (native/module.c and py_*.c).

Methods parse their arguments with ``PyArg_ParseTuple``, so they are positional-only; only
``Allocator(...)`` takes keywords. Integer arrays (pointers, sizes, block ids) are C-contiguous
buffers of 64-bit integers (numpy int64, ``array('q')``) or sequences of ints; the KV functions take
buffers only, read and written in place. Errors are memsvc.errors classes.
"""

from collections.abc import Sequence
from typing import Final, Literal, TypeAlias, TypedDict, final, overload, type_check_only

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

# Buffers by item kind, as the C code checks them (numpy arrays are Buffers only from Python 3.12).
_Bytes: TypeAlias = Buffer | npt.NDArray[np.generic]
_I64: TypeAlias = Buffer | npt.NDArray[np.int64]
_U64: TypeAlias = Buffer | npt.NDArray[np.int64 | np.uint64]
_Flags: TypeAlias = Buffer | npt.NDArray[np.bool_ | np.int8 | np.uint8]
_Ints: TypeAlias = _U64 | Sequence[int]

BACKEND_HOST: Final[int]
BACKEND_CUDA: Final[int]
COPY_AUTO: Final[int]
COPY_LOOP: Final[int]
COPY_BATCH: Final[int]
COPY_KERNEL: Final[int]
# kv_check's codes.
KV_OK: Final[int]
KV_SRC_RANGE: Final[int]
KV_DST_RANGE: Final[int]
KV_SRC_TWICE: Final[int]
KV_DST_TWICE: Final[int]
KV_DST_IN_USE: Final[int]

@type_check_only
@final
class _DLPackCapsule:
    """A PyCapsule named "dltensor" that owns its memory: hand it to ``torch.from_dlpack``."""

@type_check_only
class _TagStats(TypedDict):
    tag: str
    state: Literal["awake", "offloaded", "discarded", "on_disk"]
    base: int
    mapped_bytes: int
    layout_bytes: int
    allocated_bytes: int
    offloaded_bytes: int
    disk_bytes: int
    discarded_bytes: int
    allocations: int
    extents: int

@type_check_only
class _Info(TypedDict):
    backend: Literal["host", "cuda"]
    device: int
    granularity: int

def cuda_device_count() -> int: ...
def cuda_unavailable_reason() -> str | None: ...
def set_pool_tag(tag: str, /) -> None: ...
def checksum(data: _Bytes, /) -> int: ...
def sleep_rules() -> dict[tuple[str, int], str | None]: ...
def kv_check(src: _U64, dst: _U64, n_src: int, n_dst: int, owner_dst: _I64, /) -> tuple[int, int]: ...
def kv_move(
    src: _U64,
    dst: _U64,
    owner_src: _I64,
    owner_dst: _I64,
    slot_block: _I64,
    slot_host: _Flags,
    to_host: bool,
    /,
) -> int: ...

@final
class Fence:
    """A copy in flight (``copy_block_ids`` with ``wait=False``); not constructible from Python."""

    def wait(self) -> None: ...
    @property
    def done(self) -> bool: ...

@final
class Allocator:
    def __init__(
        self,
        backend: int,
        device: int,
        host_capacity: int = 0,
        granularity: int = 0,
        arena_va_bytes: int = 0,
        host_chunk_bytes: int = 0,
        host_reserve_bytes: int = 0,
        checksum: bool = False,
        prefault_threads: int = 0,
        huge_pages: bool = True,
        offload_dir: str = "",
    ) -> None: ...
    def close(self) -> None: ...
    def alloc(self, tag: str, size: int, /) -> int: ...
    def free(self, address: int, /) -> None: ...
    def tensor(self, tag: str, nbytes: int, shape: Sequence[int], code: int, bits: int, /) -> _DLPackCapsule: ...
    def host_tensor(self, nbytes: int, shape: Sequence[int], code: int, bits: int, /) -> _DLPackCapsule: ...
    def stage_file(self, fd: int, offset: int, length: int, threads: int, /) -> _DLPackCapsule: ...
    def sleep(self, pairs: Sequence[tuple[str, int]], /) -> None: ...
    def wake(self, tags: Sequence[str] | None = None, /) -> None: ...
    def tag_stats(self, nonblocking: bool = False, /) -> list[_TagStats]: ...
    # bytes_*, sleeps, wakes, host_chunks_*, host_*_bytes are ints; the *_seconds floats.
    def counters(self, nonblocking: bool = False, /) -> dict[str, float]: ...
    def cancel_prepin(self) -> None: ...
    def mem_info(self) -> tuple[int, int]: ...
    def copy_blocks(
        self, src_ptrs: _Ints, dst_ptrs: _Ints, sizes: _Ints, method: int = 0, stream: int = 0, /
    ) -> None: ...
    @overload
    def copy_block_ids(
        self,
        src_base: int,
        dst_base: int,
        block_bytes: int,
        src_ids: _Ints,
        dst_ids: _Ints,
        method: int = 0,
        stream: int = 0,
        wait: Literal[True] = True,
        /,
    ) -> None: ...
    @overload
    def copy_block_ids(
        self,
        src_base: int,
        dst_base: int,
        block_bytes: int,
        src_ids: _Ints,
        dst_ids: _Ints,
        method: int,
        stream: int,
        wait: Literal[False],
        /,
    ) -> Fence: ...
    @overload
    def copy_block_ids(
        self,
        src_base: int,
        dst_base: int,
        block_bytes: int,
        src_ids: _Ints,
        dst_ids: _Ints,
        method: int = 0,
        stream: int = 0,
        wait: bool = True,
        /,
    ) -> Fence | None: ...
    def copies_wait(self) -> None: ...
    def has_method(self, method: int, /) -> bool: ...
    def new_stream(self) -> int: ...
    def set_checksum(self, on: bool, /) -> None: ...
    def set_host_reserve(self, nbytes: int, /) -> None: ...
    def prepin_host(self, nbytes: int, /) -> None: ...
    def lookup(self, address: int, size: int = 1, /) -> tuple[int, str]: ...
    def install_torch_hook(self) -> None: ...
    def info(self) -> _Info: ...
