"""Line-rate benchmark (issue: sleep, wake and SwapBlocks at PCIe line rate), side by side in one run:

1. 8B-shaped bf16 weights (15 GiB): our sleep/wake per cycle through the allocator API (cold first
   sleep, later sleeps with the host reserve) against a vLLM-style baseline written here (a fresh
   pin_memory tensor per allocation and a synchronous copy on every sleep, copy back on wake);
2. the same through a real worker's gRPC API (Sleep/WakeUp), against the server-side duration;
3. SwapBlocks-shaped copies: 8192 random blocks per size, loop / batch / kernel / auto, both ways;
4. a decode step (every weight matrix read once, as an 8B decode does) alone and beside a running
   swap, for the kernel and the copy-engine methods.

    python -m bench.bench_line_rate --out line_rate.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import rpc_load
from bench.bench_allocator import _device_info, _git_commit, load_weights
from bench.shapes import llama3_8b_shapes
from worker.allocator import AllocatorConfig, MemoryAllocator

GB = 1e9
METHODS = ("loop", "batch", "kernel", "auto")
COLUMNS = (*METHODS, "ids")  # "ids": copy_block_ids (auto), the SwapBlocks fast path


def ours(cycles: int) -> dict[str, Any]:
    alloc = MemoryAllocator(AllocatorConfig(backend="cuda", host_reserve_bytes=64 << 30))
    tensors = load_weights(alloc, llama3_8b_shapes())
    torch.cuda.synchronize()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    ref = [t.view(-1)[:8].clone() for t in tensors[::8]]
    rows = []
    for cycle in range(cycles):
        t0 = time.perf_counter()
        alloc.sleep({"weights": "offload"})
        t1 = time.perf_counter()
        alloc.wake_up()
        t2 = time.perf_counter()
        ok = all(torch.equal(t.view(-1)[:8], r) for t, r in zip(tensors[::8], ref, strict=True))
        rows.append(
            {
                "cycle": cycle + 1,
                "sleep_GBps": nbytes / (t1 - t0) / GB,
                "wake_GBps": nbytes / (t2 - t1) / GB,
                "sleep_s": t1 - t0,
                "wake_s": t2 - t1,
                "data_ok": ok,
            }
        )
    counters = alloc.stats().counters
    del tensors
    alloc.close()
    return {
        "bytes": nbytes,
        "cycles": rows,
        "prefault_s": counters["host_prefault_seconds"],
        "register_s": counters["host_register_seconds"],
    }


def vllm_style(cycles: int) -> dict[str, Any]:
    """Per allocation: a fresh pinned host tensor and a blocking copy on sleep; copy back on wake."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = [
        torch.empty(s, dtype=torch.bfloat16, device="cuda").normal_(generator=gen) for _, s in llama3_8b_shapes()
    ]
    torch.cuda.synchronize()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    rows = []
    for cycle in range(cycles):
        t0 = time.perf_counter()
        backups = []
        for t in tensors:
            cpu = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            cpu.copy_(t)
            backups.append(cpu)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for t, cpu in zip(tensors, backups, strict=True):
            t.copy_(cpu, non_blocking=True)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        del backups
        rows.append(
            {
                "cycle": cycle + 1,
                "sleep_GBps": nbytes / (t1 - t0) / GB,
                "wake_GBps": nbytes / (t2 - t1) / GB,
                "sleep_s": t1 - t0,
                "wake_s": t2 - t1,
            }
        )
    del tensors
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "cycles": rows}


WORKER_BACKEND = os.environ.get("MEMSVC_BENCH_BACKEND", "cuda")
"""The RPC benches' worker backend: ``host`` runs them on a CPU-only machine (a check of the bench
and of the RPC path's CPU cost, not a measurement of copies)."""


def _start_worker(args: list[str], stderr: Any = None) -> tuple[subprocess.Popen[str], str]:
    """A worker process (``WORKER_BACKEND``) with ``args``; returns once it printed "ready", with its
    address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "memsvc.cli", "worker", "--listen", "127.0.0.1:0", "--backend", WORKER_BACKEND, *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    address = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        if " listening on " in line:
            address = line.split(" listening on ")[1].strip()
        if " ready: " in line:
            break
    return proc, address


def through_rpc(cycles: int, huge_pages: bool = True, prepin: bool = False) -> dict[str, Any]:
    """Sleep/WakeUp of a synthetic:8b worker over gRPC: client time vs the worker's own duration.
    ``prepin``: the worker runs with ``--host-prepin weights``; the first sleep waits until it is done."""
    import grpc

    from memsvc.v1 import common_pb2 as common_pb
    from memsvc.v1 import model_worker_service_pb2 as worker_pb
    from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

    errlog = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - a file, not a pipe: a full pipe stalls the worker
    args = ["--model", "synthetic:8b", "--host-reserve", "40GiB", "--kv-blocks", "64"]
    args += ["--huge-pages" if huge_pages else "--no-huge-pages"]
    args += ["--host-prepin", "weights"] if prepin else []
    proc, address = _start_worker(args, stderr=errlog)
    prepin_wait_s = None
    rows = []
    try:
        stub = worker_grpc.ModelWorkerServiceStub(grpc.insecure_channel(address))
        if prepin:
            t0 = time.perf_counter()
            st = stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status
            # done: the weights' size pinned beside the host KV pool (a sleep before that would race it)
            want = next(t.mapped_bytes for t in st.tags if t.tag == "weights")
            want += st.kv_cache.host_block_count * st.kv_cache.block_bytes
            while st.host_pinned_bytes < want and time.perf_counter() - t0 < 300:
                time.sleep(0.1)
                st = stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status
            prepin_wait_s = time.perf_counter() - t0
        for i in range(cycles):
            t0 = time.perf_counter()
            s = stub.Sleep(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1), timeout=300)
            t1 = time.perf_counter()
            k = stub.WakeUp(worker_pb.WakeUpRequest(), timeout=300)
            t2 = time.perf_counter()
            rows.append(
                {
                    "cycle": i + 1,
                    "bytes": s.transition.moved_bytes,
                    "sleep_client_s": t1 - t0,
                    "sleep_server_s": s.transition.duration.ToNanoseconds() / 1e9,
                    "wake_client_s": t2 - t1,
                    "wake_server_s": k.transition.duration.ToNanoseconds() / 1e9,
                }
            )
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    errlog.seek(0)
    log = [line.strip() for line in errlog if "sleep:" in line or "prepin" in line]
    for r in rows:
        r["sleep_GBps_client"] = r["bytes"] / r["sleep_client_s"] / GB
        r["wake_GBps_client"] = r["bytes"] / r["wake_client_s"] / GB
        r["sleep_overhead_ms"] = (r["sleep_client_s"] - r["sleep_server_s"]) * 1e3
        r["wake_overhead_ms"] = (r["wake_client_s"] - r["wake_server_s"]) * 1e3
    return {
        "huge_pages": huge_pages,
        "prepin": prepin,
        "prepin_wait_s": prepin_wait_s,
        "cycles": rows,
        "worker_log": log,
    }


CAPACITY_LOADS = ((1, 8), (2, 4), (4, 4))
"""(client processes, calls in flight each) for the worker's SwapBlocks capacity."""


def rpc_swap(reps: int, depths: tuple[int, ...] = (4, 8)) -> dict[str, Any]:
    """SwapBlocks through a worker's gRPC API: random 4 KiB blocks (synthetic:tiny with 8-token blocks,
    pools of 65536 blocks; other ids call after call), device -> host and back. 8192 blocks per call
    in the three request forms (BlockPair messages, the packed src_blocks/dst_blocks lists, raw
    src_blocks_u32le/dst_blocks_u32le bytes), and 32768 packed and raw. ``client_build_s``: building
    and encoding one request from numpy ids, what a scheduler pays per call before sending (the
    timed calls send requests built beforehand). Each: one call at a time (client time against the
    worker's own duration), and 4 or 8 calls in flight (the worker decodes, checks and enqueues the
    next request while the device copies the current one; the throughput a scheduler streaming swaps
    would see). ``null_rpc_s``: a Health.Check round trip, the floor any call pays on this host.
    ``GBps_raw_clients`` (8192, u32le): client processes sending the requests pre-encoded
    (bench/rpc_load.py), "CxD" = C clients with D calls in flight each: what the worker serves when
    one Python client is not the limit."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from memsvc.v1 import common_pb2 as common_pb
    from memsvc.v1 import model_worker_service_pb2 as worker_pb
    from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

    pool = 65536
    proc, address = _start_worker(
        ["--model", "synthetic:tiny", "--block-size", "8", "--kv-blocks", str(pool), "--host-kv-blocks", str(pool)]
    )
    out: dict[str, Any] = {}
    try:
        channel = grpc.insecure_channel(address)
        stub = worker_grpc.ModelWorkerServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        null = []
        for _ in range(100):
            t0 = time.perf_counter()
            health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            null.append(time.perf_counter() - t0)
        out["null_rpc_s"] = statistics.median(null)
        block = stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status.kv_cache.block_bytes
        rng = random.Random(0)

        def build(
            form: str, direction: common_pb.SwapDirection.ValueType, src: np.ndarray, dst: np.ndarray
        ) -> worker_pb.SwapBlocksRequest:
            """The request a scheduler holding numpy ids would send, in ``form``."""
            if form == "pairs":
                pairs = [
                    worker_pb.BlockPair(src_block=a, dst_block=b)
                    for a, b in zip(src.tolist(), dst.tolist(), strict=True)
                ]
                return worker_pb.SwapBlocksRequest(direction=direction, pairs=pairs)
            if form == "packed":
                return worker_pb.SwapBlocksRequest(direction=direction, src_blocks=src, dst_blocks=dst)
            return worker_pb.SwapBlocksRequest(
                direction=direction,
                src_blocks_u32le=src.astype("<u4").tobytes(),
                dst_blocks_u32le=dst.astype("<u4").tobytes(),
            )

        for form, n in (("pairs", 8192), ("packed", 8192), ("u32le", 8192), ("packed", 32768), ("u32le", 32768)):
            # Fresh ids call after call, over the whole pool: one set repeated would stay in the L2 cache.
            sets = [
                (np.array(rng.sample(range(pool), n)), np.array(rng.sample(range(pool), n))) for _ in range(pool // n)
            ]
            for name, direction, flip in (
                ("d2h", common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, False),
                ("h2d", common_pb.SWAP_DIRECTION_HOST_TO_DEVICE, True),
            ):
                reqs = [build(form, direction, *((h, d) if flip else (d, h))) for d, h in sets]
                builds = []
                for dev, host in sets[:4]:
                    t0 = time.perf_counter()
                    build(form, direction, dev, host).SerializeToString()
                    builds.append(time.perf_counter() - t0)
                stub.SwapBlocks(reqs[0], timeout=60)
                client, server = [], []
                for i in range(reps):
                    t0 = time.perf_counter()
                    r = stub.SwapBlocks(reqs[i % len(reqs)], timeout=60)
                    client.append(time.perf_counter() - t0)
                    server.append(r.duration.ToNanoseconds() / 1e9)
                streamed = {}
                for depth in depths:
                    calls = 8 * reps
                    t0 = time.perf_counter()
                    pending = [stub.SwapBlocks.future(reqs[i % len(reqs)], timeout=60) for i in range(depth)]
                    for i in range(calls):
                        pending.pop(0).result()
                        if i + depth < calls:
                            pending.append(stub.SwapBlocks.future(reqs[(i + depth) % len(reqs)], timeout=60))
                    streamed[str(depth)] = (time.perf_counter() - t0) / calls
                capacity = {}
                if form == "u32le" and n == 8192:
                    bodies = [r.SerializeToString() for r in reqs]
                    for clients, depth in CAPACITY_LOADS:
                        rate = rpc_load.calls_per_second(address, bodies, clients, depth)
                        capacity[f"{clients}x{depth}"] = n * block * rate / GB
                med = statistics.median(client)
                out[f"{form}_{n}_{name}"] = {
                    "form": form,
                    "direction": name,
                    "block_bytes": block,
                    "blocks": n,
                    "client_s": med,
                    "server_s": statistics.median(server),
                    "GBps_client": n * block / med / GB,
                    "GBps_server": n * block / statistics.median(server) / GB,
                    "client_build_s": statistics.median(builds),
                    "in_flight_s_per_call": streamed,
                    "GBps_in_flight": {d: n * block / t / GB for d, t in streamed.items()},
                    "GBps_raw_clients": capacity,
                }
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return out


def kv_swap_bookkeeping(reps: int) -> dict[str, Any]:
    """KvCache.swap_ids in process (the worker's device-loop path without gRPC) on pools of 65536
    4 KiB blocks: 8192 and 32768 random blocks owned by sequences of 128 blocks (every moved block's
    table entry changes hands), against a bare copy_block_ids of as many other random blocks (fresh
    ids each time), the same copy repeated on one set of ids (``copy_repeat``: does a set that fits
    the device's L2 cache copy faster?), the C ownership passes (kv_check + kv_move) alone on arrays
    of the same sizes, and swaps begun back to back with begin_swap, waited for at the end
    (``pipelined``: what the device loop sustains when it never waits for a copy)."""
    from worker import _native
    from worker.model.config import PRESETS
    from worker.model.kv_cache import KvCache

    alloc = MemoryAllocator(AllocatorConfig(backend="cuda"))
    pool, per = 65536, 128
    kv = KvCache(PRESETS["tiny"], alloc, pool, pool, block_size=8)
    for s in range(pool // per):
        kv.allocate_sequence(f"s{s}")
        kv.ensure_capacity(f"s{s}", per * 8)
    rng = np.random.default_rng(0)
    res: dict[str, Any] = {"block_bytes": kv.block_bytes, "pool_blocks": pool, "blocks_per_sequence": per}
    for n in (8192, 32768):
        seqs = rng.permutation(pool // per)[: n // per]
        dev = np.concatenate([np.array(kv.sequence(f"s{s}").block_ids) for s in seqs])
        chosen = {f"s{s}" for s in seqs}
        others = np.concatenate([np.array(q.block_ids) for k, q in kv.sequences.items() if k not in chosen])
        free_dev = np.setdiff1d(np.arange(pool), others)  # free once the sequences are out
        host = rng.permutation(pool)[:n]
        rows: dict[str, list[float]] = {
            "kv_out": [],
            "kv_in": [],
            "copy_out": [],
            "copy_in": [],
            "copy_repeat_out": [],
            "copy_repeat_in": [],
            "native": [],
        }
        fixed = rng.permutation(pool)[:n], rng.permutation(pool)[:n]
        for _ in range(reps):
            target = rng.permutation(free_dev)[:n]  # swap back in to other device blocks
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            kv.swap_ids("out", dev, host)
            rows["kv_out"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            kv.swap_ids("in", host, target)
            rows["kv_in"].append(time.perf_counter() - t0)
            dev = target
            c_dev, c_host = rng.permutation(pool)[:n], rng.permutation(pool)[:n]
            t0 = time.perf_counter()
            alloc.copy_block_ids(kv.device.tensor, kv.host.tensor, c_dev, c_host)
            rows["copy_out"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            alloc.copy_block_ids(kv.host.tensor, kv.device.tensor, c_host, c_dev)
            rows["copy_in"].append(time.perf_counter() - t0)
            for d, (src_pool, dst_pool, ids) in {
                "out": (kv.device.tensor, kv.host.tensor, fixed),
                "in": (kv.host.tensor, kv.device.tensor, fixed[::-1]),
            }.items():
                t0 = time.perf_counter()
                alloc.copy_block_ids(src_pool, dst_pool, *ids)
                rows[f"copy_repeat_{d}"].append(time.perf_counter() - t0)
            owner_src, owner_dst = np.full(pool, -1, np.int64), np.full(pool, -1, np.int64)
            owner_src[c_dev] = np.arange(n)
            slot_block, slot_host = c_dev.copy(), np.zeros(n, np.bool_)
            t0 = time.perf_counter()
            _native.kv_check(c_dev, c_host, pool, pool, owner_dst)
            _native.kv_move(c_dev, c_host, owner_src, owner_dst, slot_block, slot_host, True)
            rows["native"].append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        last = None
        for _ in range(reps):
            target = rng.permutation(free_dev)[:n]
            kv.begin_swap("out", dev, host)
            last = kv.begin_swap("in", host, target)
            dev = target
        assert last is not None
        last.wait()
        pipelined = (time.perf_counter() - t0) / (2 * reps)
        assert all(kv.sequence(f"s{s}").location == "device" for s in seqs)
        med = {k: statistics.median(v) for k, v in rows.items()}
        for d in ("out", "in"):
            res[f"{n}_{d}"] = {
                "blocks": n,
                "sequences": n // per,
                "swap_ids_s": med[f"kv_{d}"],
                "copy_block_ids_s": med[f"copy_{d}"],
                "bookkeeping_s": med[f"kv_{d}"] - med[f"copy_{d}"],
                "kv_check_move_s": med["native"],
                "GBps_swap_ids": n * kv.block_bytes / med[f"kv_{d}"] / GB,
                "GBps_copy_block_ids": n * kv.block_bytes / med[f"copy_{d}"] / GB,
                "GBps_copy_repeat": n * kv.block_bytes / med[f"copy_repeat_{d}"] / GB,
                "pipelined_s_per_swap": pipelined,
                "GBps_pipelined": n * kv.block_bytes / pipelined / GB,
            }
    del kv
    alloc.close()
    return res


def _blocks(alloc: MemoryAllocator, bs: int, n: int, seed: int) -> tuple[Any, Any, list[int], list[int]]:
    rng = random.Random(seed)
    dev = alloc.empty((2 * n, bs), torch.uint8, tag="kv_cache")
    host = alloc.host_empty((2 * n, bs), torch.uint8)
    dev.random_(0, 255)
    host.random_(0, 255)
    d = [dev.data_ptr() + s * bs for s in rng.sample(range(2 * n), n)]
    h = [host.data_ptr() + s * bs for s in rng.sample(range(2 * n), n)]
    return dev, host, d, h


def swaps(reps: int) -> list[dict[str, Any]]:
    import array

    alloc = MemoryAllocator(AllocatorConfig(backend="cuda"))
    rows = []
    for bs in (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20):
        n = 8192 if bs <= (256 << 10) else 1024
        dev, host, d, h = _blocks(alloc, bs, n, bs)
        d_arr, h_arr = array.array("q", d), array.array("q", h)
        for direction, (src, dst) in {"d2h": (d_arr, h_arr), "h2d": (h_arr, d_arr)}.items():
            for m in METHODS:
                alloc.copy_blocks(src, dst, bs, m)
                ts = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    alloc.copy_blocks(src, dst, bs, m)
                    ts.append(time.perf_counter() - t0)
                med = statistics.median(ts)
                ctr = alloc.stats().counters  # the native split of the last call: checks vs copy+sync
                rows.append(
                    {
                        "block_bytes": bs,
                        "blocks": n,
                        "direction": direction,
                        "method": m,
                        "median_s": med,
                        "GBps": n * bs / med / GB,
                        "native_validate_s": ctr["last_copy_validate_seconds"],
                        "native_copy_s": ctr["last_copy_seconds"],
                    }
                )
        # the SwapBlocks fast path: the same blocks as ids into block-major pools
        d_ids = array.array("q", [(p - dev.data_ptr()) // bs for p in d])
        h_ids = array.array("q", [(p - host.data_ptr()) // bs for p in h])
        for direction, (sp, dp, si, di) in {"d2h": (dev, host, d_ids, h_ids), "h2d": (host, dev, h_ids, d_ids)}.items():
            alloc.copy_block_ids(sp, dp, si, di, "auto")
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                alloc.copy_block_ids(sp, dp, si, di, "auto")
                ts.append(time.perf_counter() - t0)
            med = statistics.median(ts)
            ctr = alloc.stats().counters
            rows.append(
                {
                    "block_bytes": bs,
                    "blocks": n,
                    "direction": direction,
                    "method": "ids",
                    "median_s": med,
                    "GBps": n * bs / med / GB,
                    "native_validate_s": ctr["last_copy_validate_seconds"],
                    "native_copy_s": ctr["last_copy_seconds"],
                }
            )
        del dev, host
    alloc.close()
    return rows


def decode_beside_swap(steps: int) -> dict[str, Any]:
    """Median decode-step time (an 8B model's matrices each read once, batch 1) alone and while a
    thread keeps swapping 8192 x 4 KiB blocks with each method."""
    import array

    alloc = MemoryAllocator(AllocatorConfig(backend="cuda"))
    mats = [t for t in load_weights(alloc, llama3_8b_shapes()) if t.dim() == 2]
    x_by_in = {m.shape[1]: torch.randn(1, m.shape[1], device="cuda", dtype=torch.bfloat16) for m in mats}
    # torch leaves Event.__new__ and Event.elapsed_time's result unannotated
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def step_ms() -> float:
        start.record()
        for m in mats:
            torch.matmul(x_by_in[m.shape[1]], m.t())
        end.record()
        end.synchronize()
        ms: float = start.elapsed_time(end)
        return ms

    for _ in range(5):
        step_ms()
    out: dict[str, Any] = {"alone_ms": statistics.median(step_ms() for _ in range(steps))}
    dev, host, d, h = _blocks(alloc, 4 << 10, 8192, 1)
    d_arr, h_arr = array.array("q", d), array.array("q", h)
    for m in ("kernel", "batch", "loop"):
        stop = threading.Event()
        moved = [0]

        def swapper(method: str = m, stop: threading.Event = stop, moved: list[int] = moved) -> None:
            while not stop.is_set():
                alloc.copy_blocks(d_arr, h_arr, 4 << 10, method)
                moved[0] += 8192 * 4096

        th = threading.Thread(target=swapper, daemon=True)
        t0 = time.perf_counter()
        th.start()
        times = [step_ms() for _ in range(steps)]
        stop.set()
        th.join()
        out[f"with_{m}_ms"] = statistics.median(times)
        out[f"swap_{m}_GBps_during"] = moved[0] / (time.perf_counter() - t0) / GB
    del dev, host
    mats.clear()
    alloc.close()
    return out


SECTIONS = ("ours", "vllm_style", "rpc", "swaps", "rpc_swap", "kv_swap", "decode")
"""What main runs, in this order (``rpc``: sleep/wake through the worker's gRPC API)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="line_rate.json")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--skip-rpc", action="store_true")
    ap.add_argument("--only", default="", help=f"comma-separated sections to run, of: {','.join(SECTIONS)}")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    if only - set(SECTIONS):
        ap.error(f"unknown sections: {sorted(only - set(SECTIONS))}")
    rpc = not args.skip_rpc
    run = {name: (not only or name in only) and (rpc or not name.startswith("rpc")) for name in SECTIONS}
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": os.environ.get("MEMSVC_COMMIT") or _git_commit(),
        **_device_info(),
    }
    if run["ours"]:
        res["ours"] = ours(args.cycles)
    if run["vllm_style"]:
        res["vllm_style"] = vllm_style(2)
    if run["rpc"]:
        res["rpc"] = through_rpc(args.cycles, prepin=True)
        res["rpc_no_huge_pages"] = through_rpc(2, huge_pages=False)
    if run["swaps"]:
        res["swaps"] = swaps(args.reps)
    if run["rpc_swap"]:
        res["rpc_swap"] = rpc_swap(5)
    if run["kv_swap"]:
        res["kv_swap"] = kv_swap_bookkeeping(args.reps)
    if run["decode"]:
        res["decode"] = decode_beside_swap(30)
    Path(args.out).write_text(json.dumps(res, indent=2))

    print(f"\n{res['device']} driver {res.get('driver')} commit {res['commit']}")
    for name in ("ours", "vllm_style"):
        for r in res.get(name, {}).get("cycles", []):
            print(f"{name:11s} cycle {r['cycle']}: sleep {r['sleep_GBps']:6.1f} GB/s  wake {r['wake_GBps']:6.1f} GB/s")
    if "ours" in res:
        print(f"ours: first-sleep prefault {res['ours']['prefault_s']:.3f}s register {res['ours']['register_s']:.3f}s")
    for line in res.get("rpc", {}).get("worker_log", []) + res.get("rpc_no_huge_pages", {}).get("worker_log", []):
        print("worker:", line.split("memsvc.worker: ")[-1])
    for r in res.get("rpc_no_huge_pages", {}).get("cycles", []):
        print(f"rpc without huge pages, cycle {r['cycle']}: sleep {r['sleep_GBps_client']:6.1f} GB/s")
    if res.get("rpc", {}).get("prepin_wait_s") is not None:
        print(f"rpc worker (--host-prepin weights): prepin done {res['rpc']['prepin_wait_s']:.2f} s after ready")
    for r in res.get("rpc", {}).get("cycles", []):
        print(
            f"rpc cycle {r['cycle']}: sleep {r['sleep_GBps_client']:6.1f} GB/s (+{r['sleep_overhead_ms']:.1f} ms over "
            f"server)  wake {r['wake_GBps_client']:6.1f} GB/s (+{r['wake_overhead_ms']:.1f} ms)"
        )
    by: dict[tuple[int, str], dict[str, float]] = {}
    for r in res.get("swaps", []):
        by.setdefault((r["block_bytes"], r["direction"]), {})[r["method"]] = r["GBps"]
    print(f"{'block':>8} {'dir':>4} " + " ".join(f"{m:>8}" for m in COLUMNS))
    for (bs, d), m in by.items():
        print(f"{bs // 1024:>6}Ki {d:>4} " + " ".join(f"{m.get(k, float('nan')):8.1f}" for k in COLUMNS))
    for r in res.get("swaps", []):
        if r["block_bytes"] == 4 << 10 and r["method"] in ("kernel", "auto", "ids"):
            print(
                f"4 KiB {r['direction']} {r['method']}: call {r['median_s'] * 1e3:.3f} ms = native checks "
                f"{r['native_validate_s'] * 1e3:.3f} ms + copy/sync {r['native_copy_s'] * 1e3:.3f} ms + Python"
            )
    if "rpc_swap" in res:
        print(f"null RPC (Health.Check) round trip: {res['rpc_swap']['null_rpc_s'] * 1e3:.2f} ms")
    for name, r in res.get("rpc_swap", {}).items():
        if not isinstance(r, dict):
            continue
        print(
            f"SwapBlocks RPC {name}: request built in {r['client_build_s'] * 1e3:.2f} ms; "
            f"{r['blocks']} x {r['block_bytes']} B in {r['client_s'] * 1e3:.2f} ms "
            f"({r['GBps_client']:.1f} GB/s; worker {r['server_s'] * 1e3:.2f} ms = {r['GBps_server']:.1f} GB/s); "
            + "; ".join(
                f"{d} in flight: {t * 1e3:.2f} ms/call = {r['GBps_in_flight'][d]:.1f} GB/s"
                for d, t in r["in_flight_s_per_call"].items()
            )
            + "".join(f"; raw clients {k}: {v:.1f} GB/s" for k, v in r["GBps_raw_clients"].items())
        )
    for key, r in res.get("kv_swap", {}).items():
        if not isinstance(r, dict):
            continue
        print(
            f"KvCache.swap_ids {key} ({r['sequences']} sequences): {r['swap_ids_s'] * 1e3:.3f} ms "
            f"({r['GBps_swap_ids']:.1f} GB/s) = copy_block_ids {r['copy_block_ids_s'] * 1e3:.3f} ms "
            f"({r['GBps_copy_block_ids']:.1f} GB/s) + {r['bookkeeping_s'] * 1e3:.3f} ms (of which kv_check + kv_move "
            f"{r['kv_check_move_s'] * 1e3:.3f} ms); same ids again {r['GBps_copy_repeat']:.1f} GB/s; begun back to "
            f"back {r['GBps_pipelined']:.1f} GB/s (in and out alternating)"
        )
    if "decode" in res:
        print("decode step:", {k: round(v, 3) for k, v in res["decode"].items()})


if __name__ == "__main__":
    main()
