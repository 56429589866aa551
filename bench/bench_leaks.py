"""Leak test of sleep/wake cycles (CPU, host backend): file descriptors, threads, RSS, mappings.

Two variants:

- ``worker``: one ``memsvc worker`` process (host backend, ``synthetic:tiny``) driven over gRPC
  with ``--cycles`` Sleep/WakeUp pairs (level 1, every ``--level2-every``-th cycle level 2, which
  reloads the weights on wake; every ``--partial-every``-th wake goes weights first, then the
  rest), once per ``--host-reserve`` value. The WORKER process is sampled from outside.
- ``allocator``: a MemoryAllocator (host backend) in this process, ``--cycles`` sleep/wake rounds
  over a few tags with OFFLOAD, DISCARD, KEEP, a level-1 -> level-2 demotion and partial wakes,
  checking the offloaded bytes come back; this process is sampled.

Every ``--sample-every`` cycles: open fds (/proc/PID/fd), threads (/proc/PID/task), VmRSS
(/proc/PID/status) and memory mappings (/proc/PID/maps lines). Reported: start / after warm-up /
end / max and a robust (Theil-Sen) slope per 1000 cycles over the samples after warm-up.

"No growth" means, after warm-up (the first ``--warmup`` cycles, default 10 %: lazily started
threads such as the host pool's reaper, torch's first-use state, allocator caches):
fds and threads identical in every later sample, gRPC's elastic pool's threads apart (within
``GRPC_POOL_TOLERANCE`` of the warm-up value); maps count within ``MAPS_TOLERANCE`` of the
warm-up value; RSS slope at most ``RSS_SLOPE_LIMIT_KIB`` per 1000 cycles and RSS end at most
``RSS_END_LIMIT_KIB`` above the warm-up value.

    python -m bench.bench_leaks --out leaks.json [--cycles 1000] [--host-reserve 0 --host-reserve 8MiB]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests"))

from bench.bench_load import machine  # noqa: E402

MAPS_TOLERANCE = 16
"""Mappings may vary a little (glibc arenas, Python's allocator); a leak grows without bound."""
RSS_SLOPE_LIMIT_KIB = 2048.0
"""Per 1000 cycles, fitted over the samples after warm-up."""
RSS_END_LIMIT_KIB = 4096.0
"""End minus warm-up RSS."""

GRPC_POOL_THREAD = "event_engine"
"""The name of gRPC's EventEngine pool threads. The pool is elastic: while all of its threads are busy it
starts one more, at most one a second, and reclaims a thread only after 20 s idle (gRPC's
work_stealing_thread_pool.cc). On a machine whose cores are busy, the worker's gRPC traffic alone can
make it grow by one mid-run, a thread that outlives the run (CI, 2026-12-07: 13 threads after the
warm-up, 14 at the end), which is the pool's policy, not a leak."""
GRPC_POOL_TOLERANCE = 4
"""Threads gRPC's pool may add after the warm-up; a leak grows without bound."""

KEYS = ("fds", "threads", "grpc_pool_threads", "rss_kib", "maps")
METRIC_CHECKS = {
    "fds": "fds_flat",
    "threads": "threads_flat",
    "grpc_pool_threads": "grpc_pool_bounded",
    "maps": "maps_bounded",
    "rss_kib": "rss_slope_small",
}
"""Each of :data:`KEYS`' check in :func:`analyse` (RSS has a second one, ``rss_end_bounded``), for the table."""


def thread_names(pid: int | str = "self") -> list[str]:
    """A process's threads' names (/proc/PID/task/TID/comm), one per thread."""
    base = f"/proc/{pid}/task"
    names = []
    for task in os.listdir(base):
        try:
            with open(f"{base}/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended since the listing: not there
            pass
    return names


def sample(pid: int | str = "self") -> dict[str, int]:
    """One reading of a process's fds, threads (gRPC's pool's apart), RSS (KiB) and mapping count, from
    /proc."""
    base = f"/proc/{pid}"
    fds = len(os.listdir(f"{base}/fd"))
    names = thread_names(pid)
    pool = names.count(GRPC_POOL_THREAD)
    rss = 0
    with open(f"{base}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
                break
    with open(f"{base}/maps") as f:
        maps = sum(1 for _ in f)
    return {"fds": fds, "threads": len(names) - pool, "grpc_pool_threads": pool, "rss_kib": rss, "maps": maps}


def quiet(stub: Any, timeout: float = 10.0, still: float = 0.75) -> None:
    """Wait until the worker's page-locked host memory has not changed for ``still`` seconds: a sleep
    with nothing awake gives the host reserve back and the wake pins it again in the background, and
    the chunks a wake freed are given back once it has been idle for 0.5 s (worker/host_release.py);
    until then its RSS is off by up to the reserve, which is no leak. Bounded: a worker whose pinned
    memory never goes still is sampled as it is, and a leak shows in every sample."""
    from memsvc.v1 import model_worker_service_pb2 as worker_pb

    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        held = stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=30).status.host_pinned_bytes
        if held != last:
            last, since = held, time.monotonic()
        elif time.monotonic() - since >= still:
            return
        time.sleep(0.05)


def quiet_sample(pid: int, readings: int = 10, interval: float = 0.02) -> dict[str, int]:
    """A :func:`sample` without the process's short-lived threads: the reading with the fewest threads
    of ``readings`` taken ``interval`` apart. A wake that takes back a host reserve its sleep gave up
    pins it again on the worker's prepin thread, whose native helper thread lives for a chunk's
    pinning (milliseconds); a thread that leaked is in every reading."""
    got = [sample(pid)]
    for _ in range(readings - 1):
        time.sleep(interval)
        got.append(sample(pid))
    return min(got, key=lambda x: x["threads"])


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Theil-Sen slope of ys over xs: the median of the slopes between every two samples (0 with
    fewer than two distinct xs). A leak raises every pair's slope; a one-off spike, such as a
    staging chunk sampled before the reaper thread unmapped it, moves a least-squares fit but not
    the median."""
    pairs = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    return statistics.median(pairs) if pairs else 0.0


def analyse(samples: list[dict[str, int]], warmup: int) -> dict[str, Any]:
    """Summary and verdict of a series of samples (each with its "cycle")."""
    after = [s for s in samples if s["cycle"] >= warmup] or samples[-1:]
    warm = after[0]
    out: dict[str, Any] = {"warmup_cycles": warmup, "samples": len(samples)}
    for k in KEYS:
        vals = [s[k] for s in after]
        out[k] = {
            "start": samples[0][k],
            "after_warmup": warm[k],
            "end": samples[-1][k],
            "max": max(s[k] for s in samples),
            "min_after_warmup": min(vals),
            "max_after_warmup": max(vals),
            "slope_per_1000": slope([s["cycle"] for s in after], vals) * 1000,
        }
    checks = {
        "fds_flat": out["fds"]["min_after_warmup"] == out["fds"]["max_after_warmup"] == warm["fds"],
        "threads_flat": out["threads"]["min_after_warmup"] == out["threads"]["max_after_warmup"] == warm["threads"],
        "grpc_pool_bounded": out["grpc_pool_threads"]["max_after_warmup"] - warm["grpc_pool_threads"]
        <= GRPC_POOL_TOLERANCE,
        "maps_bounded": out["maps"]["max_after_warmup"] - warm["maps"] <= MAPS_TOLERANCE,
        "rss_slope_small": out["rss_kib"]["slope_per_1000"] <= RSS_SLOPE_LIMIT_KIB,
        "rss_end_bounded": samples[-1]["rss_kib"] - warm["rss_kib"] <= RSS_END_LIMIT_KIB,
    }
    out["checks"] = checks
    out["passed"] = all(checks.values())
    return out


# ---- a worker process over gRPC ----


def run_worker(
    cycles: int,
    host_reserve: str,
    sample_every: int = 20,
    warmup: int | None = None,
    level2_every: int = 10,
    partial_every: int = 7,
) -> dict[str, Any]:
    from workerproc import WorkerProcess

    from memsvc.v1 import common_pb2 as common_pb
    from memsvc.v1 import model_worker_service_pb2 as worker_pb

    warmup = max(10, cycles // 10) if warmup is None else warmup
    args = ["--model", "synthetic:tiny", "--host-capacity", "64MiB", "--host-reserve", host_reserve]
    samples: list[dict[str, int]] = []
    t0 = time.perf_counter()
    with WorkerProcess(args) as wp:
        assert wp.address.startswith("127.0.0.1:"), wp.address
        assert wp.proc is not None
        pid = wp.proc.pid
        stub = wp.stub
        stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=30)
        samples.append({"cycle": 0, **quiet_sample(pid)})
        names: dict[int, list[str]] = {}  # each sample's threads, by cycle: which one came, if one did
        for i in range(1, cycles + 1):
            level = common_pb.SLEEP_LEVEL_2 if level2_every and i % level2_every == 0 else common_pb.SLEEP_LEVEL_1
            stub.Sleep(worker_pb.SleepRequest(level=level), timeout=60)
            if partial_every and i % partial_every == 0:
                stub.WakeUp(worker_pb.WakeUpRequest(tags=["weights"]), timeout=60)
                stub.WakeUp(worker_pb.WakeUpRequest(tags=["kv_cache"]), timeout=60)
            else:
                stub.WakeUp(worker_pb.WakeUpRequest(), timeout=60)
            if i % sample_every == 0 or i == cycles:
                quiet(stub)
                samples.append({"cycle": i, **quiet_sample(pid)})
                names[i] = sorted(thread_names(pid))
        st = stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=30).status
        final_state = st.state == common_pb.WORKER_STATE_AWAKE
        wp.stop()
    result = analyse(samples, warmup)
    result["checks"]["awake_at_end"] = final_state
    result["passed"] = all(result["checks"].values())
    warm = min((c for c in names if c >= warmup), default=cycles)
    return {
        "variant": "worker",
        "host_reserve": host_reserve,
        "cycles": cycles,
        "seconds": time.perf_counter() - t0,
        "level2_every": level2_every,
        "partial_every": partial_every,
        **result,
        "thread_names": {"after_warmup": names[warm], "end": names[cycles]},
        "series": samples,
    }


# ---- the allocator in this process ----

MiB = 1 << 20


def run_allocator(
    cycles: int, host_reserve_bytes: int, sample_every: int = 20, warmup: int | None = None
) -> dict[str, Any]:
    import gc

    import torch

    from worker.allocator import AllocatorConfig, MemoryAllocator

    warmup = max(10, cycles // 10) if warmup is None else warmup
    alloc = MemoryAllocator(
        AllocatorConfig(
            backend="host",
            host_capacity_bytes=64 * MiB,
            host_chunk_bytes=4 * MiB,
            host_reserve_bytes=host_reserve_bytes,
            checksum=True,
        )
    )
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, list[torch.Tensor]] = {"weights": [], "kv_cache": [], "aux": []}
    sizes = {"weights": [256 * 1024, 256 * 1024, 1 * MiB, 3 * MiB], "kv_cache": [2 * MiB], "aux": [64 * 1024] * 4}
    for tag, ss in sizes.items():
        for nbytes in ss:
            t = alloc.empty((nbytes // 4,), torch.float32, tag=tag)
            t.copy_(torch.randn(nbytes // 4, generator=gen))
            tensors[tag].append(t)
    golden = {tag: [t.clone() for t in ts] for tag, ts in tensors.items()}

    def intact(tag: str) -> bool:
        return all(torch.equal(t, g) for t, g in zip(tensors[tag], golden[tag], strict=True))

    def refill(tag: str) -> None:
        for t, g in zip(tensors[tag], golden[tag], strict=True):
            t.copy_(g)

    bad: list[str] = []
    samples: list[dict[str, int]] = [{"cycle": 0, **sample()}]
    t0 = time.perf_counter()
    try:
        for i in range(1, cycles + 1):
            pattern = i % 4
            if pattern == 0:  # level 1 plus an offloaded side tag, one wake
                alloc.sleep({"weights": "offload", "kv_cache": "discard", "aux": "offload"})
                alloc.wake_up()
                offloaded = ["weights", "aux"]
            elif pattern == 1:  # aux kept; partial wakes, weights first
                alloc.sleep({"weights": "offload", "kv_cache": "discard", "aux": "keep"})
                alloc.wake_up(["weights"])
                alloc.wake_up(["kv_cache"])
                offloaded = ["weights", "aux"]
            elif pattern == 2:  # level 1, then demoted to level 2 while asleep (host copy freed)
                alloc.sleep({"weights": "offload", "kv_cache": "discard"})
                alloc.sleep({"weights": "discard"})
                alloc.wake_up()
                offloaded = ["aux"]
            else:  # everything dropped but aux
                alloc.sleep({"weights": "discard", "kv_cache": "discard", "aux": "offload"})
                alloc.wake_up(["aux", "weights"])
                alloc.wake_up()
                offloaded = ["aux"]
            for tag in offloaded:
                if not intact(tag) and len(bad) < 10:
                    bad.append(f"cycle {i}: tag {tag} differs after wake")
            for tag in ("weights", "kv_cache"):
                if tag not in offloaded:
                    refill(tag)
            refill("kv_cache")
            if i % sample_every == 0 or i == cycles:
                samples.append({"cycle": i, **sample()})
        counters = alloc.stats().counters
    finally:
        tensors.clear()
        golden.clear()
        alloc.close()
        gc.collect()
    seconds = time.perf_counter() - t0
    result = analyse(samples, warmup)
    result["checks"]["data_intact"] = not bad
    result["passed"] = all(result["checks"].values())
    return {
        "variant": "allocator",
        "host_reserve": host_reserve_bytes,
        "cycles": cycles,
        "seconds": seconds,
        "errors": bad,
        "counters": {k: counters[k] for k in ("sleeps", "wakes", "host_held_bytes") if k in counters},
        **result,
        "series": samples,
    }


def format_table(runs: list[dict[str, Any]]) -> str:
    head = f"{'variant':<10}{'reserve':>9}{'cycles':>7}  {'metric':<18}{'start':>9}{'warm':>9}{'end':>9}{'max':>9}"
    lines = [head + f"{'slope/1000':>12}  verdict"]
    for r in runs:
        for k in KEYS:
            v = r[k]
            ok = METRIC_CHECKS[k]
            verdict = "ok" if r["checks"][ok] and (k != "rss_kib" or r["checks"]["rss_end_bounded"]) else "GROWTH"
            lines.append(
                f"{r['variant']:<10}{r['host_reserve']!s:>9}{r['cycles']:>7}  {k:<18}{v['start']:>9}"
                f"{v['after_warmup']:>9}{v['end']:>9}{v['max']:>9}{v['slope_per_1000']:>12.1f}  {verdict}"
            )
        shown = {*METRIC_CHECKS.values(), "rss_end_bounded"}
        others = {k: v for k, v in r["checks"].items() if k not in shown}
        lines.append(f"{'':<10}{r['seconds']:>8.1f}s  other checks: {others}  -> {'PASS' if r['passed'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--cycles", type=int, default=1000)
    p.add_argument("--sample-every", type=int, default=20)
    p.add_argument("--warmup", type=int, default=None, help="cycles ignored by the checks (default 10 %%, >= 10)")
    p.add_argument(
        "--host-reserve",
        action="append",
        default=None,
        help="worker --host-reserve values, one run each (default: 0 and 8MiB)",
    )
    p.add_argument("--variant", choices=["worker", "allocator", "both"], default="both")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    a = p.parse_args(argv)
    reserves = a.host_reserve or ["0", "8MiB"]
    runs = []
    if a.variant in ("worker", "both"):
        for r in reserves:
            runs.append(run_worker(a.cycles, r, a.sample_every, a.warmup))
    if a.variant in ("allocator", "both"):
        for r in (0, 8 * MiB):
            runs.append(run_allocator(a.cycles, r, a.sample_every, a.warmup))
    print(format_table(runs))
    result = {
        "bench": "leaks",
        "machine": machine(),
        "limits": {
            "maps_tolerance": MAPS_TOLERANCE,
            "grpc_pool_tolerance": GRPC_POOL_TOLERANCE,
            "rss_slope_limit_kib_per_1000": RSS_SLOPE_LIMIT_KIB,
            "rss_end_limit_kib": RSS_END_LIMIT_KIB,
        },
        "runs": runs,
        "passed": all(r["passed"] for r in runs),
    }
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
