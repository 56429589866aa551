"""GPU-only proofs: a torch model built under use_memory_pool survives sleep/wake bit for bit, the
device really gets the memory back, CUDA graphs replay after wake, and a slept range faults."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
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

from worker.allocator import AllocatorConfig, MemoryAllocator  # noqa: E402


@pytest.fixture
def cuda_alloc() -> Iterator[MemoryAllocator]:
    a = MemoryAllocator(AllocatorConfig(backend="cuda", host_chunk_bytes=64 << 20))
    yield a
    a.close()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4096, 8192),
        torch.nn.GELU(),
        torch.nn.LayerNorm(8192),
        torch.nn.Linear(8192, 4096),
        torch.nn.SiLU(),
        torch.nn.Linear(4096, 1000),
    ).to(device="cuda", dtype=torch.bfloat16)


def test_model_in_pool_is_bit_identical_and_frees_device_memory(cuda_alloc: MemoryAllocator) -> None:
    with cuda_alloc.use_memory_pool("weights"):
        model = _model()
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        before = model(x).clone()
    ptrs = [p.data_ptr() for p in model.parameters()]
    for p in ptrs:
        assert cuda_alloc.lookup(p)[1] == "weights"
    torch.cuda.synchronize()
    mapped = cuda_alloc.stats().tags["weights"].mapped_bytes
    free_awake = torch.cuda.mem_get_info()[0]

    cuda_alloc.sleep({"weights": "offload"})
    free_asleep = torch.cuda.mem_get_info()[0]
    gained = free_asleep - free_awake
    print(f"pool mapped {mapped} B, device free gained {gained} B ({gained / mapped:.4f})")
    assert gained >= 0.99 * mapped
    assert cuda_alloc.stats().tags["weights"].mapped_bytes == 0

    cuda_alloc.wake_up()
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    with torch.no_grad():
        after = model(x)
    assert torch.equal(before, after)


def test_cuda_graph_replays_after_wake(cuda_alloc: MemoryAllocator) -> None:
    w = cuda_alloc.empty((2048, 2048), torch.float32, tag="weights")
    w.copy_(torch.randn(2048, 2048, device="cuda"))
    x = torch.randn(2048, 2048, device="cuda")
    out = torch.empty(2048, 2048, device="cuda")
    s = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.matmul(x, w, out=out)  # warm up cuBLAS outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.matmul(x, w, out=out)
    g.replay()
    torch.cuda.synchronize()
    ref = out.clone()

    cuda_alloc.sleep({"weights": "offload"})
    cuda_alloc.wake_up()
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


def test_discard_returns_memory_and_wake_maps_it_again(cuda_alloc: MemoryAllocator) -> None:
    kv = cuda_alloc.empty((256, 1 << 20), torch.uint8, tag="kv_cache")  # 256 MiB
    ptr = kv.data_ptr()
    free0 = torch.cuda.mem_get_info()[0]
    cuda_alloc.sleep({"kv_cache": "discard"})
    assert torch.cuda.mem_get_info()[0] - free0 >= 0.99 * (256 << 20)
    cuda_alloc.wake_up(["kv_cache"])
    kv.fill_(7)
    torch.cuda.synchronize()
    assert kv.data_ptr() == ptr and int(kv.sum().item()) == 7 * (256 << 20)


def test_reading_a_slept_tensor_faults_in_a_child() -> None:
    code = textwrap.dedent(
        """
        import torch
        from worker.allocator import AllocatorConfig, MemoryAllocator
        a = MemoryAllocator(AllocatorConfig(backend="cuda"))
        t = a.empty((1 << 20,), torch.float32, tag="weights")
        t.fill_(1.0)
        a.sleep({"weights": "discard"})
        print("sum", t.sum().item(), flush=True)
        torch.cuda.synchronize()
        print("UNREACHABLE")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    print(r.returncode, r.stdout[-300:], r.stderr[-600:])
    assert r.returncode != 0
    assert "UNREACHABLE" not in r.stdout
    assert "illegal" in r.stderr.lower() or "fault" in r.stderr.lower() or r.returncode < 0


def test_freeing_a_pool_tensor_that_kernels_still_read_waits_for_them() -> None:
    """A pool tensor dropped while kernels on torch's stream still read it: its extent is unmapped
    only after the device's work is done (it used to wait for the allocator's own stream only, and
    the kernels then read unmapped memory: an illegal address that poisons the CUDA context). Run in
    a child process, so a regression cannot take the rest of the GPU tests down with it."""
    code = textwrap.dedent(
        """
        import torch
        from worker.allocator import AllocatorConfig, MemoryAllocator

        alloc = MemoryAllocator(AllocatorConfig(backend="cuda"))
        x = alloc.empty((8192, 8192), torch.float32, tag="scratch")
        x.copy_(torch.randn(8192, 8192, device="cuda") / 100)
        expect = None
        for attempt in range(2):  # the second time, the read is still queued when x is dropped
            y = x
            for _ in range(8):  # ~0.1 s of matmuls queued on torch's stream, all reading x
                y = y @ x
            if attempt == 0:
                expect = float(y.double().sum())
            else:
                del x  # the last reference: the tag's extent is freed and trimmed now
                assert alloc.stats().tags["scratch"].mapped_bytes == 0
                got = float(y.double().sum())
                assert abs(got - expect) <= 1e-6 * abs(expect), (got, expect)
        torch.cuda.synchronize()
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
