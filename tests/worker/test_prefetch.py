"""The checkpoint read-ahead a worker starts while it imports its model layer (worker/prefetch.py):
which files, in which order, and that a dropped file's pages are in the page cache afterwards
(read through mincore, as the loader does)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.bench_loader import drop_page_cache
from worker.page_cache import PageCache
from worker.prefetch import CheckpointPrefetch, shard_order

MiB = 1 << 20


def _resident(path: Path) -> float:
    """The fraction of ``path``'s bytes the page cache holds."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        cache = PageCache(fd, size)
        try:
            return sum(stop - start for start, stop, cached in cache.runs(0, size) if cached) / size
        finally:
            cache.close()
    finally:
        os.close(fd)


def test_the_shards_come_in_the_order_the_loader_reads_them(tmp_path: Path) -> None:
    """The loader plans its reads by path (worker/model/loader.py plan_reads), whatever the index's order."""
    for name in ("b.safetensors", "a.safetensors", "c.safetensors"):
        (tmp_path / name).write_bytes(b"x")
    assert shard_order(str(tmp_path)) == [tmp_path / n for n in ("a.safetensors", "b.safetensors", "c.safetensors")]
    weight_map = {"w1": "c.safetensors", "w2": "a.safetensors", "w3": "c.safetensors", "w4": "gone.safetensors"}
    index = {"weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert shard_order(str(tmp_path)) == [tmp_path / "a.safetensors", tmp_path / "c.safetensors"]  # by path
    escaping = {"weight_map": {"w1": "a.safetensors", "w2": "../outside.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(escaping))
    assert shard_order(str(tmp_path)) == []  # the loader refuses it: nothing outside the directory is read
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    assert shard_order(str(tmp_path)) == []  # the load reports a bad index; the read-ahead just does nothing
    assert shard_order("synthetic:tiny") == [] and shard_order(str(tmp_path / "missing")) == []


def test_a_dropped_checkpoint_is_in_the_page_cache_after_the_read_ahead(tmp_path: Path) -> None:
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(os.urandom(8 * MiB) * 3)
    drop_page_cache([shard], whole_cache=False)
    if _resident(shard) > 0.5:
        pytest.skip("this file system keeps the pages (tmpfs?): nothing to read ahead")
    prefetch = CheckpointPrefetch(str(tmp_path)).start()
    prefetch.join(timeout=60)
    # the kernel's own read-ahead behind one reader may fill a window before another reader gets to it
    assert 0 < prefetch.requested <= 24 * MiB
    assert _resident(shard) == 1.0
    again = CheckpointPrefetch(str(tmp_path)).start()  # a warm page cache: every window is skipped
    again.join(timeout=60)
    assert again.requested == 0


def test_a_stopped_read_ahead_asks_for_nothing_more(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\0" * MiB)
    prefetch = CheckpointPrefetch(str(tmp_path))
    prefetch.stop()
    prefetch.start().join(timeout=60)
    assert prefetch.requested == 0


def test_a_warm_checkpoint_is_skipped_without_mapping_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard wholly in the page cache is found so by one ``cachestat`` and left: no mapping is made
    to look at its pages (``mincore`` over 16 GB held the address-space lock that torch's import
    waits for); where ``cachestat`` cannot say, the mapping looks, as before."""
    from worker import page_cache, prefetch

    shard = tmp_path / "model.safetensors"
    shard.write_bytes(os.urandom(8 * MiB))
    shard.read_bytes()
    mapped: list[int] = []

    class Recorded(PageCache):
        def __init__(self, fd: int, size: int) -> None:
            mapped.append(size)
            super().__init__(fd, size)

    monkeypatch.setattr(prefetch, "PageCache", Recorded)
    monkeypatch.setattr(page_cache, "PageCache", Recorded)  # what worker/page_cache.py's resident() falls back on
    warm = CheckpointPrefetch(str(tmp_path)).start()
    warm.join(timeout=60)
    assert (warm.shards, warm.requested, mapped) == (1, 0, [])
    monkeypatch.setattr(page_cache, "_CACHESTAT", 100_000)  # no such syscall: ENOSYS, as before Linux 6.5
    old_kernel = CheckpointPrefetch(str(tmp_path)).start()
    old_kernel.join(timeout=60)
    assert (old_kernel.requested, mapped) == (0, [8 * MiB])
