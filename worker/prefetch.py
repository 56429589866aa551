"""Read-ahead of the checkpoint while the worker imports its model layer.

A cold start from a dropped page cache is two waits in a row: Python importing torch and its
kin (3.5-4 s on the H200 host), then the loader reading 16 GB from the disk (~10 s on that VM's
disk). Nothing in the first needs the disk, so the worker reads the checkpoint's shards into the
page cache (window by window, in the order the loader reads them) from its first moment until the
import is done; the loader then finds those pages cached and reads only the rest from the disk
(worker/model/loader.py reads resident pages buffered, the others with O_DIRECT). With a warm page
cache every file is found resident (one ``cachestat``, worker/page_cache.py's ``resident``) and
skipped: no mapping, no copy, no I/O; a window planned is looked at again just before its read
(another reader's read may have brought it in); where the kernel will not say (a file this process
neither owns nor may write), every window is read.

This module imports nothing heavy: it runs while torch is being imported (for a Hub id, finding its
snapshot imports huggingface_hub, which the load's own lookup imports anyway).
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from memsvc.errors import InvalidArgument, MemsvcError
from worker.checkpoint_files import INDEX_FILE, open_regular, read_weight_map
from worker.model.hub import cached_dir, may_be_local
from worker.page_cache import PageCache, resident

log = logging.getLogger("memsvc.worker")

WINDOW = 8 << 20
"""Bytes read per step (into each reader's own buffer); a window the page cache holds is skipped."""
THREADS = 8
"""Readers (one per core below that)."""


def shard_order(model: str) -> list[Path]:
    """The checkpoint's safetensors files in the order the loader reads them (by path: its
    ``plan_reads``), those the index names or else every one, in the directory ``model`` names or
    the Hub cache's snapshot of it (worker/model/hub.py's ``cached_dir``); none for a synthetic
    model, a Hub id not in the cache or a bad index (the load reports it)."""
    root = cached_dir(model)
    if root is None:
        return []
    index = root / INDEX_FILE
    if index.is_file():
        try:
            files = set(read_weight_map(root, index).values())
        except InvalidArgument:
            return []
        return sorted((f for f in files if f.is_file()), key=str)
    return sorted(root.glob("*.safetensors"), key=str)


class CheckpointPrefetch:
    """Reads ``model``'s shards ahead with :data:`THREADS` threads until :meth:`stop`: one reader
    cannot keep a drive busy (1.0 GB/s on the H200 VM's disk against 1.8 GB/s for eight)."""

    def __init__(self, model: str, threads: int = 0) -> None:
        self.model = model
        self.threads = threads or min(THREADS, os.cpu_count() or 1)
        self.requested = 0
        """Bytes read ahead so far (windows the page cache held are not counted)."""
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._windows: Iterator[tuple[int, PageCache, int, int]] = iter(())
        self._threads: list[threading.Thread] = []
        self._opened: list[tuple[int, PageCache]] = []
        self._live = 0
        """Readers still running; the last one closes the files."""
        self.shards = 0
        """Shards found (logged at the end: a Hub id's snapshot found in the cache, or not)."""

    def start(self) -> CheckpointPrefetch:
        if may_be_local(self.model):  # the shards themselves are found by the readers (see _plan)
            self._threads = [
                threading.Thread(target=self._run, name="memsvc-prefetch", daemon=True) for _ in range(self.threads)
            ]
            self._live = len(self._threads)
            self._windows = self._plan()
            for t in self._threads:
                t.start()
        return self

    def stop(self) -> None:
        """No more read-ahead (the loader is about to read; reads under way finish)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        for t in self._threads:
            t.join(timeout)

    def _plan(self) -> Iterator[tuple[int, PageCache, int, int]]:
        """Every window of every shard, in the loader's order (taken under the lock). The shards are
        found here, on a reader, not before the start: a Hub id's lookup imports huggingface_hub
        (0.2-0.3 s, which the load's own lookup then finds done), and the model layer's import
        thread starts only after this object does."""
        try:
            files = shard_order(self.model)
        except (OSError, MemsvcError) as exc:  # an unreadable directory or cache: the load reports it
            log.debug("read-ahead: no shards found: %s", exc)
            return
        self.shards = len(files)
        for file in files:
            try:
                fd = open_regular(file)  # not a FIFO: its open would block (the load refuses it by name)
            except MemsvcError:
                continue
            size = os.fstat(fd).st_size
            if resident(fd, size):  # a warm page cache: nothing to read, and no mapping to look with
                os.close(fd)
                continue
            cache = PageCache(fd, size)
            self._opened.append((fd, cache))
            # One look at the whole file first: on a warm page cache the only one. A look per window
            # (2,000 for 16 GB, Python between each) held the GIL that ``import torch`` needs.
            cached = [(start, stop) for start, stop, hit in cache.runs(0, size) if hit] if cache.known else []
            starts = [start for start, _ in cached]
            for off in range(0, size, WINDOW):
                n = min(WINDOW, size - off)
                i = bisect.bisect_right(starts, off) - 1
                if i < 0 or cached[i][1] < off + n:  # not wholly within one cached run
                    yield fd, cache, off, n

    def _run(self) -> None:
        """One reader: the next window the page cache lacks, until none is left or the stop. A real
        read, not ``WILLNEED``, whose read-ahead the kernel cuts to a few MiB per call and which
        queues without waiting: reads keep pace with the disk, so stopping leaves nothing queued
        for the loader to wait behind."""
        t0 = time.perf_counter()
        buf: memoryview | None = None  # made at the first window to read: none on a warm page cache
        try:
            while not self._stop.is_set():
                with self._lock:
                    window = next(self._windows, None)
                if window is None:
                    break
                fd, cache, off, n = window
                try:
                    if cache.holds(off, n):
                        continue
                    done = 0
                    if buf is None:
                        buf = memoryview(bytearray(WINDOW))
                    while done < n and (got := os.preadv(fd, [buf[: n - done]], off + done)) > 0:
                        done += got
                except OSError as exc:
                    log.debug("read-ahead stopped: %s", exc)
                    break
                with self._lock:
                    self.requested += done
        finally:
            with self._lock:
                self._live -= 1
                last_out = self._live == 0
            if last_out:  # the files stay open until no reader is left
                for fd, cache in self._opened:
                    cache.close()
                    os.close(fd)
                log.info(
                    "checkpoint read-ahead: %.2f GB read of %d shards in %.2f s",
                    self.requested / 1e9,
                    self.shards,
                    time.perf_counter() - t0,
                )


__all__ = ["THREADS", "WINDOW", "CheckpointPrefetch", "shard_order"]
