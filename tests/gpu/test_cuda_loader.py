"""The streaming checkpoint loader onto the cuda backend: every tensor byte for byte what
``safetensors.torch.load_file`` reads, through the allocator's page-locked ring and torch's pinned
one, from the page cache and with O_DIRECT, or from the shards staged in device memory first
(worker/staging.py), and ordered after the work already queued on the caller's stream."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from worker import _native

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_native.cuda_device_count() == 0, reason="needs a CUDA device"),
]

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from worker.allocator import AllocatorConfig, MemoryAllocator  # noqa: E402
from worker.model.loader import INDEX_FILE, IoMode, StreamingLoader  # noqa: E402
from worker.staging import CheckpointStaging  # noqa: E402

MiB = 1 << 20
CHUNK = 4 * MiB
PATTERN = -3.0


@pytest.fixture
def cuda_alloc() -> Iterator[MemoryAllocator]:
    a = MemoryAllocator(AllocatorConfig(backend="cuda", host_chunk_bytes=64 << 20))
    yield a
    a.close()


def _checkpoint(root: Path, file_dtype: torch.dtype | None = None) -> dict[str, tuple[int, ...]]:
    """Three shards with an index: bf16, fp16, fp32, odd sizes, a 40 MiB tensor (ten chunks), many
    small ones that share a chunk."""
    g = torch.Generator().manual_seed(0)
    t = {
        "odd.bf16": torch.randn(7, 13, generator=g).to(torch.bfloat16),
        "odd.fp16": torch.randn(13, 7, generator=g).to(torch.float16),
        "odd.fp32": torch.randn(3, 5, 7, generator=g),
        "big": torch.randn(5120, 2048, generator=g),
        "embed": torch.randn(3001, 1024, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
    }
    for i in range(100):
        t[f"small.{i}"] = torch.randn(i % 7 + 1, 5, generator=g).to(torch.float16 if i % 2 else torch.bfloat16)
    if file_dtype is not None:
        t = {n: v.to(file_dtype) for n, v in t.items()}
    names, weight_map = list(t), {}
    for s in range(3):
        file = f"model-{s + 1:05d}-of-00003.safetensors"
        save_file({n: t[n] for n in names[s::3]}, str(root / file))
        weight_map.update(dict.fromkeys(names[s::3], file))
    (root / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {n: tuple(v.shape) for n, v in t.items()}


def _reference(root: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(root.glob("*.safetensors")):
        out.update({n: v.to("cuda") for n, v in load_file(str(file)).items()})
    return out


def _o_direct_works(directory: Path) -> bool:
    probe = directory / "odirect.probe"
    probe.write_bytes(b"x" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    finally:
        probe.unlink()
    return True


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    )


@pytest.mark.parametrize("io", ["auto", "direct"])
@pytest.mark.parametrize("ring", ["allocator", "torch"])
def test_loads_onto_the_device_byte_for_byte(
    cuda_alloc: MemoryAllocator, tmp_path: Path, ring: str, io: IoMode
) -> None:
    shapes = _checkpoint(tmp_path)
    ref = _reference(tmp_path)
    dst = {n: cuda_alloc.empty(shapes[n], ref[n].dtype, tag="weights") for n in shapes}
    # queued on the caller's stream before the load: a slow kernel, then a pattern into every
    # destination. A load that did not wait for it would be overwritten by the pattern.
    torch.cuda._sleep(100_000_000)  # type: ignore[no-untyped-call]  # unannotated in torch
    for t in dst.values():
        t.fill_(PATTERN)
    loader = StreamingLoader(cuda_alloc if ring == "allocator" else None, threads=4, chunk_bytes=CHUNK, io=io)
    stats = loader.load(tmp_path, dst, shapes)
    torch.cuda.synchronize()
    for n in shapes:
        assert _same_bytes(dst[n], ref[n]), n
    assert stats.converted == 0 and stats.reads >= 10
    assert loader.staging_bytes == loader.buffers * CHUNK
    if io == "direct" and _o_direct_works(tmp_path):
        assert stats.direct_bytes == stats.read_bytes, stats
    for t in dst.values():  # again through the kept ring
        t.fill_(PATTERN)
    loader.load(tmp_path, dst, shapes)
    assert all(_same_bytes(dst[n], ref[n]) for n in shapes)


def test_converts_a_file_dtype_on_the_device(cuda_alloc: MemoryAllocator, tmp_path: Path) -> None:
    shapes = _checkpoint(tmp_path, file_dtype=torch.float32)
    ref = _reference(tmp_path)
    dst = {n: cuda_alloc.empty(shapes[n], torch.bfloat16, tag="weights") for n in shapes}
    stats = StreamingLoader(cuda_alloc, threads=4, chunk_bytes=CHUNK).load(tmp_path, dst, shapes)
    assert stats.converted == len(shapes)
    for n in shapes:
        assert _same_bytes(dst[n], ref[n].to(torch.bfloat16)), n


@pytest.mark.parametrize("file_dtype", [None, torch.float32])
def test_loads_from_shards_staged_in_device_memory_which_are_then_unmapped(
    cuda_alloc: MemoryAllocator, tmp_path: Path, file_dtype: torch.dtype | None
) -> None:
    """The shards staged natively (page cache, page-locked chunks, device), then each tensor copied
    on the device, converted where the file's dtype differs, after the work queued on the caller's
    stream; no file read, and the staged memory unmapped by the end of the load."""
    shapes = _checkpoint(tmp_path, file_dtype)
    ref = _reference(tmp_path)
    dtype = torch.bfloat16 if file_dtype is not None else None
    dst = {n: cuda_alloc.empty(shapes[n], dtype or ref[n].dtype, tag="weights") for n in shapes}
    torch.cuda.synchronize()
    before = cuda_alloc.stats().device_free_bytes
    staging = CheckpointStaging(cuda_alloc, str(tmp_path), threads=4).start()
    assert staging.wait(120) and staging.why_not == "", staging.why_not
    in_files = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert cuda_alloc.stats().device_free_bytes <= before - in_files
    torch.cuda._sleep(100_000_000)  # type: ignore[no-untyped-call]  # unannotated in torch
    for t in dst.values():
        t.fill_(PATTERN)
    stats = StreamingLoader(cuda_alloc, threads=4, chunk_bytes=CHUNK, staging=staging).load(tmp_path, dst, shapes)
    torch.cuda.synchronize()
    for n in shapes:
        assert _same_bytes(dst[n], ref[n].to(dtype) if dtype else ref[n]), n
    assert stats.staged_bytes == sum(t.numel() * t.element_size() for t in ref.values()), "the files' bytes"
    assert stats.read_bytes == 0
    # back, but for what torch's caching allocator kept of a conversion's temporaries
    assert cuda_alloc.stats().device_free_bytes >= before - (64 << 20)
