"""Read-ahead of the checkpoint while the worker imports its model layer.

A cold start from a dropped page cache is two waits in a row: Python importing torch and its
kin (3.5-4 s on the H200 host), then the loader reading 16 GB from the disk (~10 s on that VM's
disk). Nothing in the first needs the disk, so the worker reads the checkpoint's shards into the
page cache (window by window, in the order the loader reads them) from its first moment until the
import is done; the loader then finds those pages cached and reads only the rest from the disk
(worker/model/loader.py reads resident pages buffered, the others with O_DIRECT). With a warm page
cache every window is found resident (``mincore``) and skipped: no copy, no I/O.

This module imports nothing heavy: it runs while torch is being imported.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from worker.page_cache import PageCache

log = logging.getLogger("memsvc.worker")

WINDOW = 8 << 20
"""Bytes read per step (into one reused buffer); a window the page cache holds already is skipped."""
INDEX_FILE = "model.safetensors.index.json"


def shard_order(model: str) -> list[Path]:
    """The checkpoint's safetensors files in the order the loader reads them (the index's order of
    first use, else sorted); none for a synthetic model or anything unreadable (the load reports it)."""
    root = Path(model)
    if not root.is_dir():
        return []
    index = root / INDEX_FILE
    try:
        if index.is_file():
            files = dict.fromkeys(str(f) for f in json.loads(index.read_text())["weight_map"].values())
            return [root / f for f in files if (root / f).is_file()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return sorted(root.glob("*.safetensors"))


class CheckpointPrefetch:
    """Reads ``model``'s shards ahead on a thread of its own until :meth:`stop`."""

    def __init__(self, model: str) -> None:
        self.files = shard_order(model)
        self.requested = 0
        """Bytes read ahead so far (windows the page cache held are not counted)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._buf = bytearray(WINDOW)

    def start(self) -> CheckpointPrefetch:
        if self.files:
            self._thread = threading.Thread(target=self._run, name="memsvc-prefetch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """No more read-ahead (the loader is about to read; what is queued still completes)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _read(self, fd: int, off: int, n: int) -> None:
        """Read ``n`` bytes at ``off`` into the page cache. A real read, not ``WILLNEED``, whose
        read-ahead the kernel cuts to a few MiB per call and which queues without waiting: this
        keeps pace with the disk, so stopping it leaves nothing queued for the loader to wait behind."""
        view = memoryview(self._buf)
        while n > 0:
            got = os.preadv(fd, [view[: min(n, len(view))]], off)
            if got <= 0:
                return
            off += got
            n -= got

    def _run(self) -> None:
        t0 = time.perf_counter()
        for file in self.files:
            try:
                fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                size = os.fstat(fd).st_size
                cache = PageCache(fd, size)
                try:
                    off = 0
                    while off < size and not self._stop.is_set():
                        n = min(WINDOW, size - off)
                        if not all(cached for _, _, cached in cache.runs(off, n)):
                            self._read(fd, off, n)
                            self.requested += n
                        off += n
                finally:
                    cache.close()
            except OSError as exc:
                log.debug("prefetch of %s stopped: %s", file, exc)
            finally:
                os.close(fd)
            if self._stop.is_set():
                break
        log.info("checkpoint read-ahead: %.2f GB read in %.2f s", self.requested / 1e9, time.perf_counter() - t0)


__all__ = ["WINDOW", "CheckpointPrefetch", "shard_order"]
