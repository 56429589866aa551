"""Which pages of a file the page cache holds, without touching them: ``mincore`` over a shared
read-only mapping that is never read (no fault, no I/O). The streaming loader reads resident pages
buffered and the rest with O_DIRECT (worker/model/loader.py); the start-up read-ahead skips what is
resident (worker/prefetch.py). No torch here: the read-ahead runs while torch is being imported.
Python's ``mmap`` offers no address of a read-only mapping, hence libc.

Whether a whole file is resident, the start's question (the read-ahead's and the checkpoint
staging's), is asked with ``cachestat`` first (:func:`resident`): one call over the page cache's own
index, with no mapping. ``mincore`` over a 16 GB shard walks 4 million pages (0.10 s on an H100
host) and takes the process's address-space lock about a thousand times meanwhile, while torch's
import maps its libraries and grows its heap under that same lock: the import thread waited in
``mprotect`` and ``mmap`` for 8-11% of its time, and for 0-1% once ``cachestat`` (0.4 ms there)
asked instead (docs/benchmarks.md)."""

from __future__ import annotations

import ctypes
import mmap
import os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_libc.syscall.restype = ctypes.c_long
_MAP_FAILED = ctypes.c_void_p(-1).value
_CACHESTAT = 451
"""cachestat(2)'s number: the same in every architecture's table (Linux 6.5)."""


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Counts(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


_RESIDENT = bytes(i & 1 for i in range(256))
"""mincore's vector: bit 0 of each byte says the page is resident; the other bits are reserved."""


class PageCache:
    """Which pages of one open file the page cache holds (see the module docstring)."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        uid = os.geteuid()
        self.known = uid == 0 or os.fstat(fd).st_uid == uid or os.access(f"/proc/self/fd/{fd}", os.W_OK)
        """Whether mincore tells: the kernel answers "resident" for every page of a file the caller
        neither owns nor may write (Linux 5.2), so :meth:`runs` then says all cached."""
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        self.addr: int | None = None if addr in (None, _MAP_FAILED) else int(addr)

    def runs(self, offset: int, length: int) -> list[tuple[int, int, bool]]:
        """``(start, stop, cached)`` runs covering ``[0, length)`` of the file from ``offset``,
        split at page boundaries; all cached where the kernel will not say."""
        page = mmap.PAGESIZE
        if self.addr is None:
            return [(0, length, True)]
        first, last = offset // page, -(-(offset + length) // page)
        vec = (ctypes.c_ubyte * (last - first))()
        if _libc.mincore(self.addr + first * page, (last - first) * page, vec) != 0:
            return [(0, length, True)]
        flags = bytes(vec).translate(_RESIDENT)
        runs: list[tuple[int, int, bool]] = []
        i = 0
        while i < len(flags):
            cached = flags[i] == 1
            j = flags.find(b"\x00" if cached else b"\x01", i)
            j = len(flags) if j < 0 else j
            start = max(0, (first + i) * page - offset)
            stop = min(length, (first + j) * page - offset)
            runs.append((start, stop, cached))
            i = j
        return runs

    def holds(self, offset: int, length: int) -> bool:
        """Whether the page cache holds every page of ``length`` bytes from ``offset``: False where the
        kernel will not say (:attr:`known`), so a caller reads rather than trusts it."""
        return self.known and all(cached for _, _, cached in self.runs(offset, length))

    def close(self) -> None:
        if self.addr is not None:
            _libc.munmap(self.addr, self.size)
            self.addr = None


def _cached_pages(fd: int, length: int) -> int | None:
    """How many pages of the first ``length`` bytes of ``fd``'s file the page cache holds, by
    ``cachestat``; None where the kernel will not say: before Linux 6.5 (ENOSYS), a file the caller
    neither owns nor may write (EPERM, as ``mincore`` keeps quiet about it), hugetlbfs (EOPNOTSUPP)."""
    counts, span = _Counts(), _Range(0, length)
    done = _libc.syscall(ctypes.c_long(_CACHESTAT), ctypes.c_int(fd), ctypes.byref(span), ctypes.byref(counts), 0)
    return None if done != 0 else int(counts.cache)


def resident(fd: int, size: int) -> bool:
    """Whether the page cache holds every page of the file's ``size`` bytes: ``cachestat``, else
    ``mincore`` (:class:`PageCache`); False where neither will say, so a caller reads rather than trusts it."""
    if size <= 0:
        return True
    pages = _cached_pages(fd, size)
    if pages is not None:
        return pages >= -(-size // mmap.PAGESIZE)
    cache = PageCache(fd, size)
    try:
        return cache.holds(0, size)
    finally:
        cache.close()


__all__ = ["PageCache", "resident"]
