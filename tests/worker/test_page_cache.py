"""Whether a whole file is in the page cache (worker/page_cache.py's ``resident``), the start's
question before it reads ahead or stages a checkpoint: asked with ``cachestat``, which maps nothing,
and answered as ``mincore`` over a mapping answers it, on a real file whose pages are dropped and read
back; where ``cachestat`` cannot say (a kernel before 6.5), ``mincore`` answers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.bench_loader import drop_page_cache
from worker import page_cache
from worker.page_cache import PageCache, resident

MiB = 1 << 20


@pytest.fixture
def shard(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    path = tmp_path / "model.safetensors"
    path.write_bytes(os.urandom(4 * MiB) + b"tail")  # not a whole number of pages
    fd = os.open(path, os.O_RDONLY)
    try:
        yield path, fd
    finally:
        os.close(fd)


def _mincore_says(fd: int, size: int) -> bool:
    cache = PageCache(fd, size)
    try:
        return cache.holds(0, size)
    finally:
        cache.close()


def _states(path: Path, fd: int) -> Iterator[bool]:
    """Each state of the file's pages in turn: read in (True), then dropped (False, where this file
    system drops them)."""
    path.read_bytes()
    yield True
    drop_page_cache([path], whole_cache=False)
    if _mincore_says(fd, path.stat().st_size):
        pytest.skip("this file system keeps the pages (tmpfs?): nothing is ever out of the page cache")
    yield False


def test_resident_answers_as_mincore_does_read_in_and_dropped(shard: tuple[Path, int]) -> None:
    path, fd = shard
    size = path.stat().st_size
    if page_cache._cached_pages(fd, size) is None:
        pytest.skip("cachestat is not here (Linux before 6.5): the fallback's test covers this host")
    for expected in _states(path, fd):
        assert resident(fd, size) is expected
        assert _mincore_says(fd, size) is expected


def test_where_cachestat_cannot_say_mincore_answers(shard: tuple[Path, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A syscall number no kernel has: ENOSYS, as before Linux 6.5."""
    path, fd = shard
    size = path.stat().st_size
    monkeypatch.setattr(page_cache, "_CACHESTAT", 100_000)
    assert page_cache._cached_pages(fd, size) is None
    for expected in _states(path, fd):
        assert resident(fd, size) is expected


def test_an_empty_file_is_resident(tmp_path: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    fd = os.open(tmp_path / "empty", os.O_RDONLY)
    try:
        assert resident(fd, 0)
    finally:
        os.close(fd)
