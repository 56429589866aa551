"""Allocator benchmark: 8B-shaped weights sleep/wake GB/s per cycle, device overhead, and
copy_blocks GB/s per method and block size. Runs on the GPU; prints a table and writes JSON.

    python -m bench.bench_allocator --out results.json [--cycles 4] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import time
from typing import Any

import torch

from bench.shapes import llama3_8b_shapes
from worker.allocator import AllocatorConfig, MemoryAllocator

GB = 1e9


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def _device_info() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"device": "cpu", "host": platform.node()}
    p = torch.cuda.get_device_properties(0)
    drv = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip()
    return {"device": p.name, "memory_bytes": p.total_memory, "driver": drv, "torch": torch.__version__}


def load_weights(alloc: MemoryAllocator, shapes: list[tuple[str, tuple[int, ...]]]) -> list[torch.Tensor]:
    gen = torch.Generator(device=alloc.torch_device).manual_seed(0)
    out = []
    for _, shape in shapes:
        t = alloc.empty(shape, torch.bfloat16, tag="weights")
        t.normal_(generator=gen)
        out.append(t)
    return out


def _wait_for_host_trim(alloc: MemoryAllocator) -> None:
    """Wake unpins host chunks beyond the reserve in the background; let it finish so the next
    cycle measures what it claims (a cold first sleep without a reserve)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        c = alloc.stats().counters
        if c["host_held_bytes"] <= c["host_reserve_bytes"]:
            return
        time.sleep(0.05)


def sleep_wake_cycles(
    alloc: MemoryAllocator, tensors: list[torch.Tensor], cycles: int, pause_s: float = 0.0
) -> list[dict[str, float]]:
    """``pause_s``: seconds asleep before each wake. Back to back (0), the wake's copy competes with
    the driver still scrubbing the device memory the sleep released; a real worker sleeps longer."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    probe = [t.view(-1)[:4].float().clone() for t in tensors[::16]]
    rows = []
    for c in range(cycles):
        torch.cuda.synchronize() if alloc.backend == "cuda" else None
        free0, _ = alloc.stats().device_free_bytes, 0
        t0 = time.perf_counter()
        alloc.sleep({"weights": "offload"})
        t1 = time.perf_counter()
        free1 = alloc.stats().device_free_bytes
        time.sleep(pause_s)
        t1p = time.perf_counter()
        alloc.wake_up()
        t2 = time.perf_counter()
        _wait_for_host_trim(alloc)
        ok = all(torch.equal(t.view(-1)[:4].float(), p) for t, p in zip(tensors[::16], probe, strict=True))
        ctr = alloc.stats().counters
        rows.append(
            {
                "cycle": c + 1,
                "bytes": nbytes,
                "sleep_s": t1 - t0,
                "wake_s": t2 - t1p,
                "pause_s": pause_s,
                "sleep_GBps": nbytes / (t1 - t0) / GB,
                "wake_GBps": nbytes / (t2 - t1p) / GB,
                "device_freed_bytes": free1 - free0,
                "host_chunks_created": ctr["host_chunks_created"],
                "host_prefault_s_total": ctr["host_prefault_seconds"],
                "host_register_s_total": ctr["host_register_seconds"],
                "host_chunks_reused": ctr["host_chunks_reused"],
                "sleep_unmap_s": ctr["last_sleep_unmap_seconds"],
                "wake_map_s": ctr["last_wake_map_seconds"],
                "data_ok": ok,
            }
        )
    return rows


def weights_bench(
    cycles: int,
    reserve: bool,
    checksum: bool,
    shapes: list[tuple[str, tuple[int, ...]]],
    prepin: bool = False,
    pause_s: float = 0.0,
) -> dict[str, Any]:
    """Load 8B-shaped weights, then sleep/wake cycles. ``prepin``: page-lock the host memory for the
    offload after the load (what ``memsvc worker --host-prepin weights`` does), timed on its own."""
    total_tensor = sum(math.prod(s) * 2 for _, s in shapes)
    alloc = MemoryAllocator(
        AllocatorConfig(backend="cuda", host_reserve_bytes=(64 << 30) if reserve else 0, checksum=checksum)
    )
    torch.cuda.synchronize()
    free_before = alloc.stats().device_free_bytes
    tensors = load_weights(alloc, shapes)
    torch.cuda.synchronize()
    st = alloc.stats()
    used = free_before - st.device_free_bytes
    tag = st.tags["weights"]
    prepin_s = None
    if prepin:
        t0 = time.perf_counter()
        alloc.prepin_host(tag.mapped_bytes)
        prepin_s = time.perf_counter() - t0
    rows = sleep_wake_cycles(alloc, tensors, cycles, pause_s)
    result = {
        "host_reserve": reserve,
        "prepin_s": prepin_s,
        "prepin_GBps": tag.mapped_bytes / prepin_s / GB if prepin_s else None,
        "checksum": checksum,
        "tensor_bytes": total_tensor,
        "tensors": len(shapes),
        "mapped_bytes": tag.mapped_bytes,
        "mapped_over_tensor": tag.mapped_bytes / total_tensor,
        "device_used_over_tensor": used / total_tensor,
        "extents_initial": tag.extents,
        "freed_on_sleep_over_mapped": rows[0]["device_freed_bytes"] / tag.mapped_bytes,
        "cycles": rows,
    }
    del tensors
    alloc.close()
    torch.cuda.synchronize()
    return result


def copy_bench(block_sizes: list[int], reps: int) -> list[dict[str, Any]]:
    alloc = MemoryAllocator(AllocatorConfig(backend="cuda"))
    rows = []
    rng = random.Random(0)
    for bs in block_sizes:
        n = 8192 if bs <= 64 << 10 else max(64, (512 << 20) // bs)
        slots = n * 2
        dev = alloc.empty((slots, bs), torch.uint8, tag="kv_cache")
        host = alloc.host_empty((slots, bs), torch.uint8)
        dev.random_(0, 255)
        host.random_(0, 255)
        d_slots = rng.sample(range(slots), n)
        h_slots = rng.sample(range(slots), n)
        dptr = [dev.data_ptr() + s * bs for s in d_slots]
        hptr = [host.data_ptr() + s * bs for s in h_slots]
        for direction, (src, dst) in {"d2h": (dptr, hptr), "h2d": (hptr, dptr)}.items():
            for method in ("loop", "batch", "kernel", "auto"):
                if method != "auto" and not alloc.has_method(method):
                    continue
                alloc.copy_blocks(src, dst, bs, method)  # warm up
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    alloc.copy_blocks(src, dst, bs, method)
                    times.append(time.perf_counter() - t0)
                med = statistics.median(times)
                rows.append(
                    {
                        "block_bytes": bs,
                        "blocks": n,
                        "direction": direction,
                        "method": method,
                        "median_s": med,
                        "GBps": n * bs / med / GB,
                    }
                )
        # correctness spot check of the last method run (h2d): device slots equal host slots
        idx = torch.tensor(d_slots[:64], device=dev.device)
        hidx = torch.tensor(h_slots[:64])
        assert torch.equal(dev[idx].cpu(), host[hidx]), "copy_blocks produced wrong bytes"
        del dev, host
    alloc.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench_allocator.json")
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="a 1-layer model, for smoke runs")
    args = ap.parse_args()
    shapes = llama3_8b_shapes()
    if args.quick:
        shapes = shapes[:10]
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": os.environ.get("MEMSVC_COMMIT") or _git_commit(),
        **_device_info(),
    }
    result["weights_reserve"] = weights_bench(args.cycles, True, False, shapes)
    result["weights_prepinned"] = weights_bench(2, True, False, shapes, prepin=True)
    result["weights_paused"] = weights_bench(3, True, False, shapes, pause_s=2.0)
    result["weights_no_reserve"] = weights_bench(2, False, False, shapes)
    result["weights_checksum"] = weights_bench(2, True, True, shapes)
    result["copy_blocks"] = copy_bench([4 << 10, 16 << 10, 64 << 10, 256 << 10, 2 << 20], args.reps)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)

    w = result["weights_reserve"]
    print(f"\n{result['device']} driver {result.get('driver')} commit {result['commit']}")
    print(
        f"weights {w['tensor_bytes'] / 2**30:.2f} GiB in {w['tensors']} tensors; mapped/tensor "
        f"{w['mapped_over_tensor']:.4f}; device used/tensor {w['device_used_over_tensor']:.4f}; "
        f"freed on sleep/mapped {w['freed_on_sleep_over_mapped']:.4f}"
    )
    p = result["weights_prepinned"]
    print(f"prepin before the first sleep: {p['prepin_s']:.2f} s ({p['prepin_GBps']:.1f} GB/s)")
    for name in ("weights_reserve", "weights_prepinned", "weights_paused", "weights_no_reserve", "weights_checksum"):
        for r in result[name]["cycles"]:
            print(
                f"{name:20s} cycle {r['cycle']}: sleep {r['sleep_GBps']:6.1f} GB/s ({r['sleep_s']:.3f}s, unmap "
                f"{r['sleep_unmap_s'] * 1e3:.0f} ms)  wake {r['wake_GBps']:6.1f} GB/s ({r['wake_s']:.3f}s, map "
                f"{r['wake_map_s'] * 1e3:.0f} ms)  ok={r['data_ok']}"
            )
    print(f"{'block':>8} {'dir':>4} " + " ".join(f"{m:>8}" for m in ("loop", "batch", "kernel", "auto")))
    by: dict[tuple[int, str], dict[str, float]] = {}
    for r in result["copy_blocks"]:
        by.setdefault((r["block_bytes"], r["direction"]), {})[r["method"]] = r["GBps"]
    for (bs, d), m in by.items():
        cells = " ".join(f"{m.get(k, float('nan')):8.1f}" for k in ("loop", "batch", "kernel", "auto"))
        print(f"{bs // 1024:>6}Ki {d:>4} {cells}")


if __name__ == "__main__":
    main()
