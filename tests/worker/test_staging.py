"""Checkpoint staging (worker/staging.py, native/filestream.c) on the host backend: the shards copied
into memory of their own before the load, the load then copying each tensor from there, byte for
byte what ``safetensors.torch.load_file`` reads; nothing staged where it would not be safe, and the
staged memory given back however the staging ends."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from sharded_checkpoints import CONVERSIONS, PATTERN, destinations, reference, save_sharded, to_convert

from bench.bench_loader import read_once
from memsvc.errors import MemsvcError
from worker.allocator import AllocatorConfig, MemoryAllocator
from worker.model.loader import StreamingLoader
from worker.prefetch import shard_order
from worker.staging import CheckpointStaging

MiB = 1 << 20
CHUNK = 64 << 10


@pytest.fixture
def alloc() -> Iterator[MemoryAllocator]:
    """The host backend, with host chunks (the staging ring's) small enough that a shard takes many."""
    a = MemoryAllocator(AllocatorConfig(backend="host", host_capacity_bytes=64 * MiB, host_chunk_bytes=2 * MiB))
    yield a
    a.close()


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {
        "big.fp32": torch.randn(700, 1001, generator=g),  # 2.8 MB: more than one staging chunk
        "big.bf16": torch.randn(257, 1023, generator=g).to(torch.bfloat16),
        "odd.fp16": torch.randn(13, 7, generator=g).to(torch.float16),
        "ints": torch.arange(-50, 51, dtype=torch.int64),
        "empty": torch.empty(0, 3),
    }
    for i in range(30):
        t[f"small.{i}"] = torch.randn(i % 5 + 1, 3, generator=g).to(torch.float16 if i % 2 else torch.bfloat16)
    return t


def _shapes(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in tensors.items()}


def _free(alloc: MemoryAllocator) -> int:
    return alloc.stats().device_free_bytes


def _staged(alloc: MemoryAllocator, path: Path, threads: int = 2) -> CheckpointStaging:
    """A staging of ``path``'s shards, ended, that holds every one of them. A shard not wholly in the
    page cache is not staged, by design, and these VMs' kernels page out memory left untouched for a
    moment, page cache included (DAMON's pageout; one CI run saw a shard just written go unstaged):
    each try reads the shards back first, and one that found a shard paged out again is tried again
    (three at most). Any other reason not to stage fails here, with the staging's own words."""
    for _ in range(3):
        read_once(shard_order(str(path)))  # the files the staging stages, through the page cache
        staging = CheckpointStaging(alloc, str(path), threads=threads, margin_bytes=0).start()
        assert staging.wait(60)
        if "page cache" not in staging.why_not:
            break
    assert staging.why_not == "", staging.why_not
    return staging


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def test_a_staged_checkpoint_loads_byte_for_byte_without_reading_its_files_and_is_given_back(
    alloc: MemoryAllocator, tmp_path: Path
) -> None:
    tensors = _tensors()
    files = save_sharded(tmp_path, tensors)
    ref = reference(tmp_path)
    dst = destinations(alloc, tensors)
    before = _free(alloc)
    staging = _staged(alloc, tmp_path, threads=3)
    assert _free(alloc) < before - sum(f.stat().st_size for f in files), "the shards are in memory of their own"
    loader = StreamingLoader(threads=2, chunk_bytes=CHUNK, staging=staging)
    stats = loader.load(tmp_path, dst, _shapes(tensors))
    for name in tensors:
        assert _equal(dst[name], ref[name]), name
    assert stats.staged_bytes == stats.bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert stats.read_bytes == 0 and stats.reads == 0, "no file was read"
    assert _free(alloc) == before, "the staged memory is unmapped once the load is done"
    # the staging is the first load's: a second one (a level-2 wake, ReloadWeights) reads the files
    again = loader.load(tmp_path, destinations(alloc, tensors), _shapes(tensors))
    assert again.staged_bytes == 0 and again.read_bytes >= again.bytes


def test_a_shard_rewritten_after_staging_is_read_from_its_file_and_the_others_from_staging(
    alloc: MemoryAllocator, tmp_path: Path
) -> None:
    tensors = _tensors()
    files = save_sharded(tmp_path, tensors)
    staging = _staged(alloc, tmp_path)
    # the second shard replaced by one of other values (a new file under the same name)
    newer = {n: t + 1 if t.is_floating_point() else t - 1 for n, t in load_file(str(files[1])).items()}
    save_file(newer, str(tmp_path / "replacement"))
    os.replace(tmp_path / "replacement", files[1])
    ref = reference(tmp_path)
    dst = destinations(alloc, tensors)
    stats = StreamingLoader(threads=2, chunk_bytes=CHUNK, staging=staging).load(tmp_path, dst, _shapes(tensors))
    for name in tensors:
        assert _equal(dst[name], ref[name]), name
    in_second = sum(t.numel() * t.element_size() for t in newer.values())
    assert stats.staged_bytes == stats.bytes - in_second and stats.read_bytes >= in_second > 0


def test_without_room_for_the_shards_beside_the_weights_nothing_is_staged_and_the_files_are_read(
    alloc: MemoryAllocator, tmp_path: Path
) -> None:
    tensors = _tensors()
    save_sharded(tmp_path, tensors)
    before = _free(alloc)
    staging = CheckpointStaging(alloc, str(tmp_path), margin_bytes=before).start()
    assert staging.wait(60)
    assert "free on the device" in staging.why_not and _free(alloc) == before
    dst = destinations(alloc, tensors)
    stats = StreamingLoader(threads=2, chunk_bytes=CHUNK, staging=staging).load(tmp_path, dst, _shapes(tensors))
    ref = reference(tmp_path)
    assert all(_equal(dst[n], ref[n]) for n in tensors)
    assert stats.staged_bytes == 0 and stats.read_bytes >= stats.bytes


@pytest.mark.parametrize(("file_dtype", "dtype"), CONVERSIONS)
def test_a_tensor_of_another_dtype_is_converted_from_its_staged_shard(
    alloc: MemoryAllocator, tmp_path: Path, file_dtype: torch.dtype, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(2)
    tensors = to_convert(file_dtype, g)
    save_sharded(tmp_path, tensors, shards=2)
    staging = _staged(alloc, tmp_path)
    dst = destinations(alloc, tensors, dtype)
    stats = StreamingLoader(threads=2, chunk_bytes=CHUNK, staging=staging).load(tmp_path, dst, _shapes(tensors))
    ref = reference(tmp_path)
    assert all(_equal(dst[n], ref[n].to(dtype)) for n in tensors)
    assert stats.staged_bytes == sum(t.numel() * t.element_size() for t in tensors.values()) and stats.read_bytes == 0


def test_a_load_refused_before_its_copies_gives_the_staged_memory_back(alloc: MemoryAllocator, tmp_path: Path) -> None:
    tensors = _tensors()
    save_sharded(tmp_path, tensors)
    dst = destinations(alloc, tensors)
    before = _free(alloc)
    staging = _staged(alloc, tmp_path)
    assert _free(alloc) < before
    shapes = _shapes(tensors)
    shapes["big.fp32"] = (1, 2)  # the config disagrees with the checkpoint
    with pytest.raises(MemsvcError, match="big.fp32"):
        StreamingLoader(threads=2, chunk_bytes=CHUNK, staging=staging).load(tmp_path, dst, shapes)
    assert _free(alloc) == before
    assert all(bool((t == PATTERN).all()) for t in dst.values()), "nothing was written"
    assert staging.take() == [], "handed over once"


def test_a_range_past_the_end_of_its_file_is_refused_and_an_unused_staging_is_unmapped(
    alloc: MemoryAllocator, tmp_path: Path
) -> None:
    data = os.urandom(5 * MiB + 123)
    file = tmp_path / "blob"
    file.write_bytes(data)
    fd = os.open(file, os.O_RDONLY)
    try:
        before = _free(alloc)
        with pytest.raises(MemsvcError, match="it ended first"):
            alloc.stage_file(fd, 1000, len(data), 3)
        assert _free(alloc) == before, "a failed staging keeps nothing"
        capsule = alloc.stage_file(fd, 77, len(data) - 77, 3)
        assert _free(alloc) < before
        staged = torch.utils.dlpack.from_dlpack(capsule)
        assert staged.dtype == torch.uint8 and bytes(staged.numpy()) == data[77:]
        del staged, capsule
        assert _free(alloc) == before, "unmapped when its tensor dies"
        never_used = alloc.stage_file(fd, 0, 4096, 1)
        assert _free(alloc) < before
        del never_used
        assert _free(alloc) == before, "unmapped with the capsule, if it never became a tensor"
    finally:
        os.close(fd)


def test_weights_that_would_not_fit_beside_the_staging_drop_it_first_and_weights_that_fit_keep_it(
    alloc: MemoryAllocator, tmp_path: Path
) -> None:
    """``make_room``, which the runner calls before it allocates the weights: the staging stays only
    where they fit beside it, so a model that fits without staging never fails for it."""
    tensors = _tensors()
    save_sharded(tmp_path, tensors)
    before = _free(alloc)
    fits = StreamingLoader(threads=2, chunk_bytes=CHUNK, staging=_staged(alloc, tmp_path))
    fits.make_room(1 << 20)
    assert _free(alloc) < before, "kept"
    stats = fits.load(tmp_path, destinations(alloc, tensors), _shapes(tensors))
    assert stats.staged_bytes == stats.bytes > 0
    staging = CheckpointStaging(alloc, str(tmp_path), threads=2, margin_bytes=0).start()
    crowded = StreamingLoader(threads=2, chunk_bytes=CHUNK, staging=staging)
    crowded.make_room(before)  # the whole device
    assert staging.wait(0) and _free(alloc) == before, "dropped, and unmapped"
    dst = destinations(alloc, tensors)
    stats = crowded.load(tmp_path, dst, _shapes(tensors))
    ref = reference(tmp_path)
    assert all(_equal(dst[n], ref[n]) for n in tensors)
    assert stats.staged_bytes == 0 and stats.read_bytes >= stats.bytes
