"""The streaming checkpoint loader (worker/model/loader.py) on CPU: byte for byte what
``safetensors.torch.load_file`` reads, through every I/O path (page cache, O_DIRECT, buffered,
partly cached, a file system without RWF_NOWAIT), and every damaged checkpoint refused before a
byte reaches the destination."""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from sharded_checkpoints import CONVERSIONS, PATTERN, destinations, reference, save_sharded, to_convert

from memsvc.errors import InvalidArgument, NotFound
from worker.allocator import AllocatorConfig, MemoryAllocator
from worker.model import PRESETS, CheckpointSource, allocate_weights, fill_synthetic, save_checkpoint
from worker.model.loader import (
    ALIGN,
    INDEX_FILE,
    LoadStats,
    ShardHeader,
    StreamingLoader,
    _File,
    plan_reads,
    read_layout,
)
from worker.model.weights import check_checkpoint

KiB = 1 << 10
CHUNK = 64 * KiB
"""Small chunks, so a few hundred KiB of tensors already take many reads and split tensors."""


@pytest.fixture
def alloc() -> Iterator[MemoryAllocator]:
    """The host backend: destinations are pool tensors in CPU memory, as on a CPU-only worker."""
    a = MemoryAllocator(AllocatorConfig(backend="host", host_capacity_bytes=64 << 20, host_chunk_bytes=8 << 20))
    yield a
    a.close()


def _tensors() -> dict[str, torch.Tensor]:
    """bf16, fp16 and fp32; odd sizes; one tensor of many chunks; many tiny ones that share a chunk."""
    g = torch.Generator().manual_seed(0)
    t: dict[str, torch.Tensor] = {
        "odd.bf16": torch.randn(7, 13, generator=g).to(torch.bfloat16),
        "odd.fp16": torch.randn(13, 7, generator=g).to(torch.float16),
        "odd.fp32": torch.randn(3, 5, 7, generator=g),
        "big.fp32": torch.randn(300, 1001, generator=g),  # 1.2 MB: ~19 chunks
        "big.bf16": torch.randn(257, 1023, generator=g).to(torch.bfloat16),
        "vector": torch.randn(4099, generator=g),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "ints": torch.arange(-50, 51, dtype=torch.int64),
    }
    for i in range(60):
        t[f"small.{i}"] = torch.randn(i % 5 + 1, 3, generator=g).to(torch.float16 if i % 2 else torch.bfloat16)
    return t


def _shapes(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in tensors.items()}


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return bool(torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))


def _unchanged(dst: Mapping[str, torch.Tensor]) -> bool:
    return all(bool((t == PATTERN).all()) for t in dst.values())


def _o_direct_works(directory: Path) -> bool:
    probe = directory / "odirect.probe"
    probe.write_bytes(b"x" * ALIGN)
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    finally:
        probe.unlink()
    os.close(fd)
    return True


def _drop_cache(files: list[Path], ranges: tuple[tuple[int, int], ...] = ((0, 0),)) -> None:
    """Evict the files' pages in ``ranges`` (offset, length; 0: to the end), written back first
    (only clean pages can be dropped)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            for offset, length in ranges:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _load(
    alloc: MemoryAllocator, root: Path, tensors: Mapping[str, torch.Tensor], **kw: Any
) -> tuple[dict[str, torch.Tensor], LoadStats]:
    dst = destinations(alloc, tensors)
    loader = StreamingLoader(threads=3, chunk_bytes=CHUNK, **kw)
    return dst, loader.load(root, dst, _shapes(tensors))


# ---- byte for byte ----
@pytest.mark.parametrize("io", ["auto", "buffered", "direct"])
def test_sharded_checkpoint_is_byte_identical(alloc: MemoryAllocator, tmp_path: Path, io: str) -> None:
    tensors = _tensors()
    save_sharded(tmp_path, tensors)
    ref = reference(tmp_path)
    dst, stats = _load(alloc, tmp_path, tensors, io=io)
    for name in tensors:
        assert _bytes_equal(dst[name], ref[name]), name
    assert stats.tensors == len(tensors) and stats.converted == 0
    assert stats.bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert stats.reads < len(tensors), "small neighbours share a read"
    assert stats.reads > 3 * 2, "a tensor larger than a chunk takes several reads"
    assert stats.read_bytes == stats.cached_bytes + stats.direct_bytes + stats.buffered_bytes
    direct = _o_direct_works(tmp_path)
    if io == "buffered":
        assert stats.buffered_bytes == stats.read_bytes
    elif io == "direct" and direct:
        assert stats.direct_bytes == stats.read_bytes
    elif io == "auto":  # just written: in the page cache
        assert stats.cached_bytes == stats.read_bytes or stats.buffered_bytes == stats.read_bytes


def test_cold_cache_reads_with_o_direct(alloc: MemoryAllocator, tmp_path: Path) -> None:
    tensors = _tensors()
    files = save_sharded(tmp_path, tensors)
    ref = reference(tmp_path)
    _drop_cache(files)
    dst, stats = _load(alloc, tmp_path, tensors, io="auto")
    assert all(_bytes_equal(dst[n], ref[n]) for n in tensors)
    if _o_direct_works(tmp_path):
        assert stats.direct_bytes > stats.read_bytes // 2, stats


def test_partly_cached_file_mixes_cache_and_o_direct(alloc: MemoryAllocator, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    tensors = {f"t{i}": torch.randn(256, 1024, generator=g) for i in range(4)}  # 4 MiB in one file
    save_file(tensors, str(tmp_path / "model.safetensors"))
    MiB = 1 << 20  # MiB 0 and 2 stay cached, 1 and 3 are dropped: runs of both inside one 1.5 MiB read
    _drop_cache([tmp_path / "model.safetensors"], ((MiB, MiB), (3 * MiB, 0)))
    dst = destinations(alloc, tensors)
    stats = StreamingLoader(threads=2, chunk_bytes=1536 * KiB, io="auto").load(tmp_path, dst, _shapes(tensors))
    assert all(_bytes_equal(dst[n], tensors[n]) for n in tensors)
    if _o_direct_works(tmp_path):
        assert 2 * MiB - 8 * KiB <= stats.cached_bytes <= 2 * MiB + 8 * KiB, stats
        assert 2 * MiB - 8 * KiB <= stats.direct_bytes <= 2 * MiB + 8 * KiB, stats


def test_o_direct_refused_falls_back_to_buffered_reads(alloc: MemoryAllocator, tmp_path: Path) -> None:
    """A file system that refuses O_DIRECT (EINVAL on open, like some overlay file systems)."""

    class NoDirect(StreamingLoader):
        def _open_direct(self, fd: int) -> int | None:
            return None

    tensors = _tensors()
    files = save_sharded(tmp_path, tensors)
    _drop_cache(files)
    dst = destinations(alloc, tensors)
    stats = NoDirect(threads=2, chunk_bytes=CHUNK, io="direct").load(tmp_path, dst, _shapes(tensors))
    ref = reference(tmp_path)
    assert all(_bytes_equal(dst[n], ref[n]) for n in tensors)
    assert stats.buffered_bytes == stats.read_bytes and stats.direct_bytes == 0


def test_file_system_without_nowait_reads_buffered(alloc: MemoryAllocator) -> None:
    """tmpfs answers RWF_NOWAIT with EOPNOTSUPP: auto mode reads it buffered (it is memory anyway)."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        pytest.skip("no writable /dev/shm")
    root = shm / f"memsvc-loader-{os.getpid()}"
    try:
        tensors = _tensors()
        save_sharded(root, tensors)
        dst, stats = _load(alloc, root, tensors, io="auto")
        ref = reference(root)
        assert all(_bytes_equal(dst[n], ref[n]) for n in tensors)
        assert stats.read_bytes == stats.cached_bytes + stats.buffered_bytes + stats.direct_bytes
    finally:
        for f in root.glob("*"):
            f.unlink()
        root.rmdir()


@pytest.mark.parametrize(("file_dtype", "dtype"), CONVERSIONS)
def test_config_dtype_differs_from_the_file(
    alloc: MemoryAllocator, tmp_path: Path, file_dtype: torch.dtype, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(2)
    tensors = to_convert(file_dtype, g)
    tensors["same"] = torch.randn(5, 5, generator=g).to(dtype)
    save_sharded(tmp_path, tensors, shards=2)
    ref = reference(tmp_path)
    dst = destinations(alloc, tensors, dtype)
    stats = StreamingLoader(threads=2, chunk_bytes=CHUNK).load(tmp_path, dst, _shapes(tensors))
    for name in tensors:
        assert _bytes_equal(dst[name], ref[name].to(dtype)), name
    assert stats.converted == 2


def test_unused_tensors_are_ignored_and_non_contiguous_destinations_written(tmp_path: Path) -> None:
    tensors = {"used": torch.randn(64, 64), "rotary.inv_freq": torch.randn(1 << 16), "also": torch.randn(3, 4)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    dst = {"used": torch.zeros(64, 64), "also": torch.zeros(4, 3).t()}  # a transposed view: not contiguous
    stats = StreamingLoader(threads=2, chunk_bytes=CHUNK).load(tmp_path, dst, {"used": (64, 64), "also": (3, 4)})
    assert torch.equal(dst["used"], tensors["used"]) and torch.equal(dst["also"], tensors["also"])
    assert stats.tensors == 2 and stats.converted == 1
    assert stats.read_bytes < 64 * 64 * 4 + ALIGN * 4, "the unused tensor was not read"


def test_progress_counts_up_to_what_the_load_reads_fast_path_and_converted(
    alloc: MemoryAllocator, tmp_path: Path
) -> None:
    tensors = _tensors()
    tensors["converted"] = torch.randn(300, 301, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    save_sharded(tmp_path, tensors)
    dst = destinations(alloc, tensors)
    dst["converted"] = torch.zeros(300, 301, dtype=torch.float32)  # another dtype: the slow path
    seen: list[tuple[int, int]] = []
    stats = StreamingLoader(threads=3, chunk_bytes=CHUNK).load(
        tmp_path, dst, _shapes(tensors), lambda d, t: seen.append((d, t))
    )
    assert stats.converted == 1
    (total,) = {t for _, t in seen}
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] == total, "counts up, and ends at the whole"
    assert len(done) >= 2, "the converted tensor is one step after the reads"
    in_files = sum(t.numel() * t.element_size() for t in tensors.values())
    assert in_files <= total <= stats.read_bytes, "the bytes read: the tensors' in the files, plus alignment"


def test_model_checkpoint_through_the_source_keeps_the_ring(alloc: MemoryAllocator, tmp_path: Path) -> None:
    config = PRESETS["tiny"]
    src = allocate_weights(config, alloc)
    fill_synthetic(src, config, seed=5)
    save_checkpoint(tmp_path / "a", src, config)
    loader = StreamingLoader(threads=2, chunk_bytes=CHUNK)
    source = CheckpointSource(tmp_path / "a", loader=loader)
    dst = allocate_weights(config, alloc)
    source.load_into(dst)
    assert all(torch.equal(dst[n], src[n]) for n in src)
    held, ring = loader.staging_bytes, loader._ring
    assert held == loader.buffers * CHUNK
    fill_synthetic(src, config, seed=6)
    save_checkpoint(tmp_path / "b", src, config)
    other = CheckpointSource(tmp_path / "b", same_as=source)  # ReloadWeights from another directory
    assert other.loader is loader
    other.load_into(dst)
    assert all(torch.equal(dst[n], src[n]) for n in src)
    assert loader.staging_bytes == held and loader._ring is ring, "the ring is reused, not reallocated"
    assert loader.last_stats is not None and loader.last_stats.tensors == len(src)
    loader.release()
    assert loader.staging_bytes == 0


# ---- refused, nothing changed ----
def _write_raw(file: Path, header: dict[str, Any], data: bytes, length: int | None = None) -> None:
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def _checkpoint_with_damaged_second_shard(root: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """Two shards; the first is sound, so a loader that copied before checking all would change it."""
    tensors = _tensors()
    files = save_sharded(root, tensors, shards=2)
    return tensors, files[1]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncate", r"model-00002-of-00002\.safetensors.*truncated"),
        ("bad_json", r"model-00002-of-00002\.safetensors.*not valid JSON"),
        ("past_end", r"ends at byte \d+ of the data section"),
        ("huge_header", r"header length \d+ is over"),
        ("header_past_file", r"header length \d+ runs past the end"),
        ("size_mismatch", r"data_offsets span 8 bytes, dtype F32 and shape \(13, 7\) need 364"),
        ("overlap", r"overlap in the data section"),
        ("duplicate_key", r"duplicate key"),
        ("unknown_dtype", r"has dtype F4, which cannot be loaded"),
        ("wrong_shape", r"tensor 'odd\.fp16' has shape \(7, 13\), the config needs \(13, 7\)"),
        ("tiny_file", r"shorter than the 8-byte header length"),
    ],
)
def test_damaged_shard_is_refused_and_nothing_changes(
    alloc: MemoryAllocator, tmp_path: Path, damage: str, message: str
) -> None:
    tensors, shard = _checkpoint_with_damaged_second_shard(tmp_path)
    victim = "odd.fp16"
    assert victim in load_file(str(shard)), "the damage is done to a tensor of the second shard"
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    if damage == "truncate":
        shard.write_bytes(raw[: len(raw) - 100])
    elif damage == "bad_json":
        shard.write_bytes(raw[:8] + b"{" + raw[9 : 8 + n - 1] + b"," + raw[8 + n :])
    elif damage == "past_end":
        header[victim]["data_offsets"][1] = len(data) + 2
        _write_raw(shard, header, data)
    elif damage == "huge_header":
        _write_raw(shard, header, data, length=200_000_000)
    elif damage == "header_past_file":
        body = json.dumps(header).encode()
        shard.write_bytes(struct.pack("<Q", len(body) + len(data) + 1) + body + data)
    elif damage == "size_mismatch":
        header[victim]["dtype"] = "F32"
        b = header[victim]["data_offsets"][0]
        header[victim]["data_offsets"] = [b, b + 8]
        _write_raw(shard, header, data)
    elif damage == "overlap":
        other = next(k for k in header if k not in ("__metadata__", victim))
        header[other] = dict(header[victim])  # its own name, the victim's bytes
        _write_raw(shard, header, data)
    elif damage == "duplicate_key":
        raw_header = json.dumps(header).encode()
        dup = raw_header[:-1] + b', "odd.fp16": ' + json.dumps(header[victim]).encode() + b"}"
        shard.write_bytes(struct.pack("<Q", len(dup)) + dup + data)
    elif damage == "unknown_dtype":
        header[victim]["dtype"] = "F4"
        _write_raw(shard, header, data)
    elif damage == "wrong_shape":
        header[victim]["shape"] = [7, 13]
        _write_raw(shard, header, data)
    elif damage == "tiny_file":
        shard.write_bytes(b"\x01\x00")
    dst = destinations(alloc, tensors)
    with pytest.raises(InvalidArgument, match=message):
        StreamingLoader(threads=2, chunk_bytes=CHUNK).load(tmp_path, dst, _shapes(tensors))
    assert _unchanged(dst)
    with pytest.raises(InvalidArgument, match=message):  # the pre-check refuses it the same way
        read_layout(tmp_path, _shapes(tensors))


def test_missing_shard_missing_tensor_and_bad_index_are_refused(alloc: MemoryAllocator, tmp_path: Path) -> None:
    tensors, shard = _checkpoint_with_damaged_second_shard(tmp_path)
    dst = destinations(alloc, tensors)
    loader = StreamingLoader(threads=2, chunk_bytes=CHUNK)
    shard.unlink()
    with pytest.raises(NotFound, match=r"shard model-00002-of-00002\.safetensors does not exist"):
        loader.load(tmp_path, dst, _shapes(tensors))
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    del index["weight_map"]["big.fp32"]
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(InvalidArgument, match=r"missing tensor 'big\.fp32'"):
        loader.load(tmp_path, dst, _shapes(tensors))
    index["weight_map"]["big.fp32"] = "../elsewhere.safetensors"
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(InvalidArgument, match=r"not a file in the checkpoint directory"):
        loader.load(tmp_path, dst, _shapes(tensors))
    (tmp_path / INDEX_FILE).write_text("{")
    with pytest.raises(InvalidArgument, match="not a safetensors index"):
        loader.load(tmp_path, dst, _shapes(tensors))
    with pytest.raises(NotFound, match="does not exist"):
        loader.load(tmp_path / "nowhere", dst, _shapes(tensors))
    assert _unchanged(dst)
    assert loader.staging_bytes == 0, "refused before the ring was needed"


def test_index_names_a_tensor_its_shard_lacks(alloc: MemoryAllocator, tmp_path: Path) -> None:
    tensors, shard = _checkpoint_with_damaged_second_shard(tmp_path)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    first = next(n for n, f in index["weight_map"].items() if f != shard.name)
    index["weight_map"][first] = shard.name
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    dst = destinations(alloc, tensors)
    with pytest.raises(InvalidArgument, match=rf"shard {shard.name} has no tensor '{first}'"):
        StreamingLoader().load(tmp_path, dst, _shapes(tensors))
    assert _unchanged(dst)


def test_same_tensor_in_two_unindexed_files_is_ambiguous(tmp_path: Path) -> None:
    save_file({"w": torch.ones(4)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.zeros(4)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(InvalidArgument, match=r"'w' is in both a\.safetensors and b\.safetensors"):
        read_layout(tmp_path, {"w": (4,)})


def test_model_checkpoint_check_agrees_with_the_load(alloc: MemoryAllocator, tmp_path: Path) -> None:
    """A level-2 wake's pre-check (CheckpointSource.check) refuses a truncated shard, as the load does."""
    config = PRESETS["tiny"]
    src = allocate_weights(config, alloc)
    fill_synthetic(src, config, seed=7)
    save_checkpoint(tmp_path, src, config)
    source = CheckpointSource(tmp_path)
    assert list(check_checkpoint(tmp_path, config)) == [tmp_path / "model.safetensors"]
    file = tmp_path / "model.safetensors"
    os.truncate(file, file.stat().st_size - 1)
    with pytest.raises(InvalidArgument, match="truncated"):
        source.check()
    dst = allocate_weights(config, alloc)
    for t in dst.values():
        t.fill_(PATTERN)
    with pytest.raises(InvalidArgument, match="truncated"):
        source.load_into(dst)
    assert _unchanged(dst)


def test_a_file_that_shrinks_during_the_load_stops_it_with_an_error(alloc: MemoryAllocator, tmp_path: Path) -> None:
    """After validation the weights are undefined on failure; the error must still come, naming the file."""

    class Shrinking(StreamingLoader):
        def _open(self, header: ShardHeader) -> _File:
            f = super()._open(header)
            os.truncate(header.file, header.file_bytes // 2)  # another writer, between check and read
            return f

    tensors = _tensors()
    save_sharded(tmp_path, tensors, shards=1)
    dst = destinations(alloc, tensors)
    with pytest.raises(InvalidArgument, match=r"model-00001-of-00001\.safetensors.*the file ended at byte"):
        Shrinking(threads=3, chunk_bytes=CHUNK).load(tmp_path, dst, _shapes(tensors))


def test_a_read_error_is_raised(alloc: MemoryAllocator, tmp_path: Path) -> None:
    class Failing(StreamingLoader):
        def _read(self, f: _File, view: memoryview, offset: int, need: int, stats: LoadStats) -> None:
            if offset > 4 * CHUNK:
                raise OSError(errno.EIO, "Input/output error")
            super()._read(f, view, offset, need, stats)

    tensors = _tensors()
    save_sharded(tmp_path, tensors, shards=1)
    with pytest.raises(OSError, match="Input/output error"):
        Failing(threads=3, chunk_bytes=CHUNK).load(tmp_path, destinations(alloc, tensors), _shapes(tensors))


# ---- the plan and the knobs ----
def test_plan_aligns_splits_and_coalesces() -> None:
    f, g = Path("a"), Path("b")
    spans = [
        (f, 100, 200, "x"),
        (f, 200, 300, "y"),
        (f, 5000, 9000, "z"),
        (g, 8, 20_000, "big"),
        (f, 300_000, 300_001, "far"),
    ]
    reads = plan_reads(spans, chunk_bytes=8192, max_gap_bytes=65536)
    for r in reads:
        assert r.offset % ALIGN == 0 and -(-r.need // ALIGN) * ALIGN <= 8192
        for p in r.pieces:
            assert p.buffer_offset + p.nbytes <= r.need
    by_name: dict[str, list[tuple[int, int, int]]] = {}
    for r in reads:
        for p in r.pieces:
            by_name.setdefault(p.name, []).append((r.offset + p.buffer_offset, p.nbytes, p.tensor_offset))
    for _, start, end, name in spans:
        pieces = by_name[name]
        assert sum(n for _, n, _ in pieces) == end - start
        assert all(pos - start == off for pos, _, off in pieces), "each piece lands where it is in the tensor"
    first = reads[0]
    assert first.file == f and [p.name for p in first.pieces] == ["x", "y", "z"] and first.offset == 0
    assert len(by_name["big"]) == 3, "20 KB over 8 KiB chunks"
    far = next(r for r in reads if r.pieces[0].name == "far")
    assert len(far.pieces) == 1 and far.offset == 299008, "a far tensor gets its own read"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"threads": 0}, "threads must be >= 1"),
        ({"chunk_bytes": 1000}, "multiple of 4096"),
        ({"threads": 4, "buffers": 3}, "buffers must be >= its 4 threads"),
        ({"io": "mmap"}, "io must be one of auto, buffered, direct"),
        ({"max_gap_bytes": -1}, "max gap"),
    ],
)
def test_bad_loader_settings_are_refused(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        StreamingLoader(**kw)


def test_destination_that_does_not_match_is_refused(tmp_path: Path) -> None:
    save_file({"w": torch.ones(4, 4)}, str(tmp_path / "model.safetensors"))
    dst = {"w": torch.zeros(16)}
    with pytest.raises(InvalidArgument, match=r"its destination \(16,\)"):
        StreamingLoader().load(tmp_path, dst, {"w": (4, 4)})
    with pytest.raises(InvalidArgument, match="no destination tensor for 'w'"):
        StreamingLoader().load(tmp_path, {}, {"w": (4, 4)})
    assert bool((dst["w"] == 0).all())
