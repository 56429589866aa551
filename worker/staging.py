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
- the device must have room for the staged shards and as much again, with :data:`MARGIN_BYTES` to
  spare; and once the model's configuration is known, the loader drops the staging before the
  weights are allocated unless they fit beside it (``StreamingLoader.make_room``), so a model that
  fits without it never fails for it; the KV cache comes after the load, when it is gone;
- the loader takes the staged shards once, for the first load, and waits at most its stall bound
  for them (a staging given up on stops before its next shard, and what it staged is dropped); a
  shard whose file changed since (:func:`file_id`) is read from the file.

Staged memory is no tag's: for those moments the device's free memory is lower than the tags say.

No torch here: this runs while torch is being imported.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memsvc.errors import MemsvcError
from worker.checkpoint_files import open_regular, reader_threads
from worker.page_cache import resident
from worker.prefetch import shard_order

if TYPE_CHECKING:
    from worker.allocator import MemoryAllocator

log = logging.getLogger("memsvc.worker")

MARGIN_BYTES = 2 << 30
"""Device memory left free beside the staged shards and the weights: CUDA graphs and torch's own
workspace come after."""

FileId = tuple[int, int, int, int, int]
"""A file as :func:`file_id` sees it."""


def file_id(fd: int) -> FileId:
    """Device, inode, size, and the modification and change times (ns): a file replaced, or written
    to, since has another (short of a write within one tick of the file system's clock)."""
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class StagedShard:
    """One shard in device memory: ``capsule`` holds all of its bytes (a DLPack capsule of a uint8
    tensor, consumed once; unmapped when that tensor dies, or with the capsule if never consumed)."""

    id: FileId
    capsule: Any


class CheckpointStaging:
    """Stages ``model``'s shards on a thread from :meth:`start`; :meth:`take` hands them over once."""

    def __init__(self, alloc: MemoryAllocator, model: str, threads: int = 0, margin_bytes: int = MARGIN_BYTES) -> None:
        self.alloc = alloc
        self.model = model
        self.threads = threads or reader_threads()
        self.margin_bytes = margin_bytes
        self.why_not = ""
        """Why nothing was staged (empty while staging, or once staged)."""
        self._staged: list[StagedShard] = []
        self._taken = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="memsvc-stage", daemon=True)

    def start(self) -> CheckpointStaging:
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the staging has ended, waiting up to ``timeout`` for it."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def take(self, timeout: float | None = None) -> list[StagedShard]:
        """The staged shards, once (later calls: none); waits up to ``timeout`` for the staging to
        end, and gives up on it past that (it stops before its next shard; what it staged is dropped)."""
        self.wait(timeout)
        with self._lock:
            staged = [] if self._taken else self._staged
            self._taken, self._staged = True, []
        return staged

    def leaves_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit on the device beside what is staged, with the margin to spare."""
        return self.alloc.stats(wait=False).device_free_bytes >= nbytes + self.margin_bytes

    def _run(self) -> None:
        t0 = time.perf_counter()
        staged: list[StagedShard] = []
        try:
            self.why_not = self._stage(staged)
        except (MemsvcError, OSError) as exc:  # an unreadable shard, a mapping refused: the loader reads the files
            self.why_not = str(exc)
        if self.why_not:
            staged = []
        with self._lock:
            if self._taken:
                self.why_not = self.why_not or "the load did not wait for it"
                staged = []
            self._staged = staged
        if staged:
            nbytes = sum(s.id[2] for s in staged)
            log.info("checkpoint staging: %.2f GB on the device in %.2f s", nbytes / 1e9, time.perf_counter() - t0)
        else:
            log.info("checkpoint staging: none (%s)", self.why_not)

    def _stage(self, staged: list[StagedShard]) -> str:
        """Every shard into ``staged``, or why not (what was staged is then dropped)."""
        files = shard_order(self.model)
        if not files:
            return "no local safetensors shards"
        fds: list[int] = []
        try:
            for file in files:
                fds.append(open_regular(file))
            ids = [file_id(fd) for fd in fds]
            for file, fd, id_ in zip(files, fds, ids, strict=True):
                if not resident(fd, id_[2]):
                    return f"{file.name} is not wholly in the page cache"
            need = 2 * sum(id_[2] for id_ in ids) + self.margin_bytes
            free = self.alloc.stats(wait=False).device_free_bytes
            if free < need:
                return f"{free / 1e9:.1f} GB free on the device, {need / 1e9:.1f} GB needed"
            for file, fd, id_ in zip(files, fds, ids, strict=True):
                if self._taken:
                    return "the load did not wait for it"
                if id_[2]:
                    capsule = self.alloc.stage_file(fd, 0, id_[2], self.threads)
                    if file_id(fd) != id_:
                        return f"{file.name} changed while it was staged"
                    staged.append(StagedShard(id_, capsule))
            return ""
        finally:
            for fd in fds:
                os.close(fd)


__all__ = ["MARGIN_BYTES", "CheckpointStaging", "FileId", "StagedShard", "file_id"]
