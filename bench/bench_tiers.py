"""Where a sleeping worker's weights go, measured through one ``memsvc worker`` process's RPCs with
its default flags: host RAM (level 1), nowhere (level 2: reloaded from the checkpoint), and the disk
tier (``--offload-dir``), each against the floor that bounds it, in one run.

Why: the memory layer moves bytes at line rate with the right flags; this checks what a user gets
without them and where weights come from disk (issue 17's targets).

A. An 8B-shaped Llama 3 bf16 checkpoint (transformers ``save_pretrained``, 16 GB in 4 shards), or
   ``--model DIR``; read once so the page cache holds it.
B. One ``memsvc worker --model DIR --offload-dir DIR2`` with nothing else set (so ``--host-reserve
   auto --host-prepin auto``); the time from AWAKE until the automatic prepin has pinned the weights'
   size (``host_pinned_bytes``) is reported.
C. Through the worker's Sleep / WakeUp RPCs (the worker's own TransitionStats):
   1. the first level-1 sleep, then later level-1 sleep/wake cycles (``--cycles``): GB/s;
   2. level-2 sleep and wake (the wake reloads the checkpoint through the streaming loader), with the
      checkpoint in the page cache and with its pages dropped (``posix_fadvise(DONTNEED)``);
   3. the disk tier: sleep with weights ``offload_disk``, wake; and a level-1 sleep moved to disk
      (the host-budget demotion's path).
D. Floors, same run, same directories: the disk's O_DIRECT write and read rate (8 threads x 16 MiB
   requests into a file of the weights' size in the offload directory, the tier's own pattern), and
   its O_DIRECT read rate over the checkpoint's shards (the cold level-2 wake's floor).
E. JSON: metadata (UTC date, device, driver, commit), every number, and pass/fail per target:
   later sleeps >= 45 GB/s, first sleep >= 20 GB/s, level-2 wake from page cache >= 25 GB/s, the
   disk tier's sleep and wake within 1.2x of the disk's write and read time.

    python -m bench.bench_tiers --out tiers.json                                  # 8B on the GPU
    python -m bench.bench_tiers --shape tiny --backend host --out t.json --cycles 1   # smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from bench.bench_allocator import _device_info, _git_commit
from bench.bench_gateway import MEMSVC, Service, write_checkpoint
from bench.bench_loader import direct_read_rate, drop_page_cache, read_once
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

IO_PIECE = 16 << 20
IO_THREADS = 8
TARGETS = {"later_sleep_gbps": 45.0, "first_sleep_gbps": 20.0, "level2_wake_gbps": 25.0, "disk_ratio": 1.2}
PREPIN_WAIT_S = 120.0


def _aligned(n: int) -> mmap.mmap:
    """An anonymous page-aligned buffer (O_DIRECT needs aligned memory)."""
    buf = mmap.mmap(-1, n)
    buf.write(os.urandom(min(n, 1 << 20)) * (n // min(n, 1 << 20)))
    return buf


def write_rate(path: Path, nbytes: int) -> dict[str, Any]:
    """O_DIRECT sequential write of ``nbytes`` at ``path``: 8 threads x 16 MiB requests (buffered
    with ``fdatasync`` where O_DIRECT is refused)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o600)
        direct = True
    except OSError:
        fd, direct = os.open(path, flags, 0o600), False
    bufs = [_aligned(IO_PIECE) for _ in range(IO_THREADS)]
    pieces = iter(range(0, nbytes, IO_PIECE))
    lock = threading.Lock()

    def worker(k: int) -> None:
        view = memoryview(bufs[k])
        while True:
            with lock:
                off = next(pieces, None)
            if off is None:
                return
            n = min(IO_PIECE, nbytes - off)
            done = os.pwrite(fd, view[:n], off)
            assert done == n, (done, n)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(IO_THREADS) as pool:
        list(pool.map(worker, range(IO_THREADS)))
    if not direct:
        os.fdatasync(fd)
    seconds = time.perf_counter() - t0
    os.close(fd)
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9, "o_direct": direct}


def read_floor(files: list[Path]) -> dict[str, Any]:
    """The disk's read rate of ``files``, their pages dropped first: O_DIRECT with the tier's pattern
    (bench_loader's probe, 8 threads x 16 MiB requests), or buffered where O_DIRECT is refused."""
    drop_page_cache(files, whole_cache=False)
    r = direct_read_rate(files, IO_THREADS, IO_PIECE)
    if "error" in r:
        r = {**read_once(files), "o_direct": False}
        drop_page_cache(files, whole_cache=False)
    return {"bytes": r["bytes"], "seconds": r["s"], "gbps": r["GBps"], "o_direct": r.get("o_direct", True)}


def _t(resp: Any) -> dict[str, Any]:
    t = resp.transition
    return {
        "bytes": t.moved_bytes,
        "seconds": t.duration.ToNanoseconds() / 1e9,
        "gbps": t.gigabytes_per_second,
        "verified_bytes": t.verified_bytes,
    }


def main(argv: list[str] | None = None) -> int:  # noqa: PLR0915 - one run, phase by phase
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="checkpoint directory (default: write an 8B-shaped one)")
    ap.add_argument("--shape", default="8b", choices=["8b", "tiny"])
    ap.add_argument("--backend", default="cuda", choices=["cuda", "host"])
    ap.add_argument("--workdir", default="", help="where the checkpoint and the offload directory go")
    ap.add_argument("--cycles", type=int, default=3, help="later level-1 sleep/wake cycles")
    ap.add_argument("--worker-args", default="", help="extra flags for the worker (default: none, all defaults)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="memsvc-tiers-"))
    out: dict[str, Any] = {
        "bench": "tiers",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": os.environ.get("MEMSVC_COMMIT") or _git_commit(),
        "device": _device_info(),
        "backend": args.backend,
        "worker_args": args.worker_args,
    }
    ckpt = Path(args.model) if args.model else work / "ckpt"
    if not args.model:
        ckpt.mkdir(parents=True, exist_ok=True)
        out["checkpoint"] = write_checkpoint(ckpt, args.shape, "cuda" if args.backend == "cuda" else "cpu")
    shards = sorted(ckpt.glob("*.safetensors"))
    offload = work / "offload"
    offload.mkdir(exist_ok=True)
    read_once(shards)

    argv = [
        *MEMSVC,
        "worker",
        "--backend",
        args.backend,
        "--model",
        str(ckpt),
        "--listen",
        "127.0.0.1:0",
        "--offload-dir",
        str(offload),
        *args.worker_args.split(),
    ]
    worker = Service(argv, r" listening on (\S+)", "worker")
    try:
        stub = worker_grpc.ModelWorkerServiceStub(grpc.insecure_channel(worker.address))
        t0 = time.perf_counter()
        while True:
            st = stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=30).status
            if st.state == common_pb.WORKER_STATE_AWAKE:
                break
            time.sleep(0.05)
        weights = next(t for t in st.tags if t.tag == "weights")
        out["weights_bytes"] = weights.allocated_bytes
        ready = time.perf_counter()
        while st.host_pinned_bytes < weights.mapped_bytes and time.perf_counter() - ready < PREPIN_WAIT_S:
            time.sleep(0.05)
            st = stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=30).status
        out["prepin"] = {
            "seconds_after_awake": time.perf_counter() - ready,
            "host_pinned_bytes": st.host_pinned_bytes,
            "awake_after_spawn_s": ready - t0,
        }

        def sleep(**kw: Any) -> dict[str, Any]:
            return _t(stub.Sleep(worker_pb.SleepRequest(**kw), timeout=600))

        def wake() -> dict[str, Any]:
            return _t(stub.WakeUp(worker_pb.WakeUpRequest(), timeout=600))

        level1: dict[str, Any] = {"first_sleep": sleep(level=common_pb.SLEEP_LEVEL_1), "first_wake": wake()}
        cycles = []
        for _ in range(args.cycles):
            time.sleep(1.0)  # past the wake's hold (worker/host_release.py): the reserve is what is kept
            cycles.append({"sleep": sleep(level=common_pb.SLEEP_LEVEL_1), "wake": wake()})
        out["level1"] = {**level1, "later": cycles}

        level2: dict[str, Any] = {"sleep": sleep(level=common_pb.SLEEP_LEVEL_2), "wake_warm": wake()}
        sleep(level=common_pb.SLEEP_LEVEL_2)
        drop_page_cache(shards, whole_cache=False)
        level2["wake_cold"] = wake()
        out["level2"] = level2
        read_once(shards)

        to_disk = {"weights": common_pb.TAG_ACTION_OFFLOAD_DISK, "kv_cache": common_pb.TAG_ACTION_DISCARD}
        if any(t.tag == "cuda_graphs" for t in st.tags):
            to_disk["cuda_graphs"] = common_pb.TAG_ACTION_DISCARD
        disk: dict[str, Any] = {"sleep": sleep(tag_actions=to_disk), "wake": wake()}
        sleep(level=common_pb.SLEEP_LEVEL_1)
        disk["demote"] = sleep(tag_actions={"weights": common_pb.TAG_ACTION_OFFLOAD_DISK})
        disk["wake_after_demote"] = wake()
        out["disk_tier"] = disk
    finally:
        worker.stop()
        out["worker_log_tail"] = worker.tail(30)

    nbytes = out["weights_bytes"] // 4096 * 4096
    probe = offload / "rate-probe.bin"
    floors = {"disk_write": write_rate(probe, nbytes)}
    floors["disk_read"] = read_floor([probe])
    probe.unlink()
    floors["checkpoint_read"] = read_floor(shards)
    out["floors"] = floors

    later = out["level1"]["later"]

    def vs_floor(seconds: float, floor: str) -> float:
        """How many times the floor's time for the weights' bytes a transition took."""
        return float(seconds / (out["weights_bytes"] / floors[floor]["gbps"] / 1e9))

    disk_sleep_ratio = vs_floor(out["disk_tier"]["sleep"]["seconds"], "disk_write")
    disk_wake_ratio = vs_floor(out["disk_tier"]["wake"]["seconds"], "disk_read")
    cold_ratio = vs_floor(out["level2"]["wake_cold"]["seconds"], "checkpoint_read")
    out["summary"] = {
        "first_sleep_gbps": out["level1"]["first_sleep"]["gbps"],
        "later_sleep_gbps_min": min((x["sleep"]["gbps"] for x in later), default=0.0),
        "later_wake_gbps_min": min((x["wake"]["gbps"] for x in later), default=0.0),
        "level2_wake_warm_gbps": out["level2"]["wake_warm"]["gbps"],
        "level2_wake_cold_gbps": out["level2"]["wake_cold"]["gbps"],
        "level2_wake_cold_vs_read_floor": cold_ratio,
        "disk_sleep_gbps": out["disk_tier"]["sleep"]["gbps"],
        "disk_wake_gbps": out["disk_tier"]["wake"]["gbps"],
        "disk_sleep_vs_write_floor": disk_sleep_ratio,
        "disk_wake_vs_read_floor": disk_wake_ratio,
    }
    s = out["summary"]
    out["passed"] = {
        "first_sleep": s["first_sleep_gbps"] >= TARGETS["first_sleep_gbps"],
        "later_sleeps": s["later_sleep_gbps_min"] >= TARGETS["later_sleep_gbps"],
        "level2_wake_warm": s["level2_wake_warm_gbps"] >= TARGETS["level2_wake_gbps"],
        "disk_sleep": disk_sleep_ratio <= TARGETS["disk_ratio"],
        "disk_wake": disk_wake_ratio <= TARGETS["disk_ratio"],
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({"summary": s, "passed": out["passed"], "floors": floors, "prepin": out["prepin"]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
