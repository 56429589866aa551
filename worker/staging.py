"""Checkpoint staging: the checkpoint's shards copied into device memory while torch is imported.

Why: from the spawn, a warm worker first imports its model layer (``import torch`` alone: 1.2 s on
the H200 host), and only then can its weights be loaded into their tensors (16 GB in 0.5 s from the
page cache), one after the other on the way to serving. Nothing in the load's reading needs torch:
the allocator makes its CUDA context natively before torch is in, so the native layer
(native/filestream.c) reads each shard from the page cache through page-locked chunks into device
memory of its own, meanwhile and without the GIL. Once the weight tensors exist, the loader copies
each tensor from its staged shard, device to device (worker/model/loader.py), and the staged memory
is unmapped.

Bounded, or not done at all (the loader then reads the files as before):

- every shard must be wholly in the page cache, where the kernel says so (worker/page_cache.py): a
  cold shard is the loader's, read with O_DIRECT at the disk's rate while the read-ahead
  (worker/prefetch.py) keeps the disk busy during the imports;
- the device must have room for the staged shards and the weights side by side, with
  :data:`MARGIN_BYTES` to spare (free memory ≥ 2 × the shards + the margin): a model that fills the
  card is loaded the old way, never evicted for this;
- the loader takes the staged shards once, for the first load, and waits at most its stall bound
  for them; a shard whose file changed since (device, inode, size, modification time) is read
  from the file.

No torch here: this runs while torch is being imported.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.checkpoint_files import open_regular
from worker.page_cache import PageCache
from worker.prefetch import shard_order

if TYPE_CHECKING:
    from worker.allocator import MemoryAllocator

log = logging.getLogger("memsvc.worker")

MARGIN_BYTES = 2 << 30
"""Device memory left free beside the staged shards and the weights: the KV cache, CUDA graphs and
torch's own workspace come after."""
THREADS = 16
"""Readers per shard (one per core below that): the loader's own count (worker/model/loader.py's
DEFAULT_THREADS), which reaches 36 GB/s from the H200 host's page cache."""

FileId = tuple[int, int, int, int]
"""A file as :func:`file_id` sees it: device, inode, size, modification time (ns)."""


def file_id(fd: int) -> FileId:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class StagedShard:
    """One shard in device memory: ``capsule`` holds all of its bytes (a DLPack capsule of a uint8
    tensor, consumed once; unmapped when that tensor dies, or with the capsule if never consumed)."""

    file: Path
    id: FileId
    capsule: Any


class CheckpointStaging:
    """Stages ``model``'s shards on a thread from :meth:`start`; :meth:`take` hands them over once."""

    def __init__(self, alloc: MemoryAllocator, model: str, threads: int = 0, margin_bytes: int = MARGIN_BYTES) -> None:
        self.alloc = alloc
        self.files = shard_order(model)
        self.threads = threads or min(THREADS, os.cpu_count() or 1)
        self.margin_bytes = margin_bytes
        self.why_not = ""
        """Why nothing was staged (empty while staging, or once staged)."""
        self._staged: dict[Path, StagedShard] = {}
        self._taken = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> CheckpointStaging:
        if self.files:
            self._thread = threading.Thread(target=self._run, name="memsvc-stage", daemon=True)
            self._thread.start()
        else:
            self.why_not = "no local safetensors shards"
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the staging has ended, waiting up to ``timeout`` for it."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def take(self, timeout: float | None = None) -> dict[Path, StagedShard]:
        """The staged shards, by path, once (later calls: none); waits up to ``timeout`` for the
        staging to end, and gives up on it past that (what it stages then is dropped)."""
        self.wait(timeout)
        with self._lock:
            staged = {} if self._taken else self._staged
            self._taken, self._staged = True, {}
        return staged

    def _run(self) -> None:
        t0 = time.perf_counter()
        staged: dict[Path, StagedShard] = {}
        try:
            self.why_not = self._stage(staged)
        except Exception as exc:  # noqa: BLE001 - an unreadable shard, a mapping refused: the loader reads the files
            self.why_not = str(exc) or type(exc).__name__
            staged = {}
        with self._lock:
            if not self._taken:
                self._staged = staged
        if staged:
            nbytes = sum(s.id[2] for s in staged.values())
            log.info("checkpoint staging: %.2f GB on the device in %.2f s", nbytes / 1e9, time.perf_counter() - t0)
        else:
            log.info("checkpoint staging: none (%s)", self.why_not)

    def _stage(self, staged: dict[Path, StagedShard]) -> str:
        """Every shard into ``staged``, or none and why not."""
        fds: list[tuple[Path, int]] = []
        try:
            for file in self.files:
                fds.append((file, open_regular(file)))
            sizes = [os.fstat(fd).st_size for _, fd in fds]
            for (file, fd), size in zip(fds, sizes, strict=True):
                if not _resident(fd, size):
                    return f"{file.name} is not wholly in the page cache"
            need = 2 * sum(sizes) + self.margin_bytes
            free = self.alloc.stats(wait=False).device_free_bytes
            if free < need:
                return f"{free / 1e9:.1f} GB free on the device, {need / 1e9:.1f} GB needed"
            for (file, fd), size in zip(fds, sizes, strict=True):
                if size:
                    staged[file] = StagedShard(file, file_id(fd), self.alloc.stage_file(fd, 0, size, self.threads))
            return ""
        finally:
            for _, fd in fds:
                os.close(fd)


def _resident(fd: int, size: int) -> bool:
    """Whether the page cache holds every page of the file, where the kernel says so."""
    cache = PageCache(fd, size)
    try:
        return cache.known and all(cached for _, _, cached in cache.runs(0, size))
    finally:
        cache.close()


__all__ = ["MARGIN_BYTES", "THREADS", "CheckpointStaging", "FileId", "StagedShard", "file_id"]
