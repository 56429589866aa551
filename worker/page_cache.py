"""Which pages of a file the page cache holds, without touching them: ``mincore`` over a shared
read-only mapping that is never read (no fault, no I/O). The streaming loader reads resident pages
buffered and the rest with O_DIRECT (worker/model/loader.py); the start-up read-ahead skips what is
resident (worker/prefetch.py). No torch here: the read-ahead runs while torch is being imported.
Python's ``mmap`` offers no address of a read-only mapping, hence libc."""

from __future__ import annotations

import ctypes
import mmap
import os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value
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


__all__ = ["PageCache"]
