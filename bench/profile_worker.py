"""Where a loaded worker spends its time: py-spy samples a ``memsvc worker`` process while
bench_serving's clients load it at one concurrency, and the hottest functions come out as a table.

Why: issue 26's targets are missed where host work, not the GPU, sets the pace; which host work (the
engine's Python, the gRPC front, the GIL between them) is a question for a profiler, not a guess.
py-spy (a wheel carried to the GPU machine) reads the process from outside, so the worker runs as
users run it. Each sample counts once for every function on its stack (inclusive) and once for the
function at its top (self); samples are taken on every thread (the device loop and the event loop
show apart) and idle ones are left out. A thread waiting for the GIL counts as idle there, so the
CPU seconds of every thread of the worker and of its RPC front (read from /proc around the same
load) say which thread is the busy one; ``--gil`` samples only the thread that holds the GIL.

    python -m bench.profile_worker --model /tmp/ck8b --path worker --concurrency 256 --out prof.json

``--path gateway`` samples the gateway instead (with a manager and the worker behind it, as
bench_serving runs them), and reads the CPU seconds of the gateway's threads beside the worker's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import bench_serving


def summarize(raw: str, top: int = 25) -> dict[str, Any]:
    """py-spy's raw (collapsed) output: per thread (of each process, with ``--subprocesses``), the
    functions with the most samples, self and inclusive."""
    by_thread: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    selfs: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [f for f in stack.split(";") if f]
        labels = []  # with --subprocesses a stack starts with its process, with --threads its thread
        while frames and frames[0].startswith(("process ", "thread ")):
            labels.append(frames.pop(0))
        thread = " ".join(labels) or "process"
        funcs = frames
        n = int(count)
        totals[thread] += n
        for f in dict.fromkeys(funcs):
            by_thread[thread][f] += n
        if funcs:
            selfs[thread][funcs[-1]] += n
    return {
        thread: {
            "samples": totals[thread],
            "inclusive": [(f, n) for f, n in by_thread[thread].most_common(top)],
            "self": [(f, n) for f, n in selfs[thread].most_common(top)],
        }
        for thread in sorted(totals, key=totals.__getitem__, reverse=True)
    }


def family(pid: int) -> list[int]:
    """``pid`` and its descendants (the worker's RPC front is its child), from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(text[text.rindex(")") + 2 :].split()[1])
    found = [pid]
    for p in found:  # grows as children are found
        found += [child for child, parent in parents.items() if parent == p]
    return found


def thread_cpu(pids: Sequence[int]) -> dict[str, float]:
    """CPU seconds (user + system) so far of every thread of ``pids``, keyed ``pid/tid name``: the
    threads' own clocks, which a sampling profiler's idle filter cannot hide (a thread waiting for the
    GIL looks idle to py-spy; the thread holding it does not)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                stat, name = (task / "stat").read_text(), (task / "comm").read_text().strip()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            out[f"{pid}/{task.name} {name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def busy_threads(before: dict[str, float], after: dict[str, float], seconds: float) -> list[tuple[str, float]]:
    """Each thread's CPU seconds per second between the two readings, busiest first."""
    rates = {t: round((after[t] - before.get(t, 0.0)) / seconds, 3) for t in after}
    return sorted(((t, r) for t, r in rates.items() if r > 0), key=lambda tr: -tr[1])


def main(argv: Sequence[str] | None = None) -> int:
    from bench.bench_gateway import MEMSVC, Service

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a checkpoint directory (bench_gateway's)")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument(
        "--path",
        default="worker",
        choices=("worker", "unary", "gateway"),
        help="gateway: a manager, the worker and the gateway; py-spy samples the gateway",
    )
    ap.add_argument("--shape", default="40x64")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--seconds", type=int, default=15, help="py-spy takes whole seconds")
    ap.add_argument("--kv-blocks", type=int, default=8192)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--worker-args", default="")
    ap.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    ap.add_argument("--gil", action="store_true", help="py-spy samples only the thread holding the GIL")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    shape = bench_serving.Shape.parse(args.shape)
    vocab = bench_serving._model_facts(Path(args.model))["vocab"]
    services: list[Service] = []
    try:
        registration: list[str] = []
        if args.path == "gateway":  # the gateway finds the worker through a manager, as users run it
            tmp = Path(args.out).with_suffix(".manager.db")
            tmp.unlink(missing_ok=True)
            mgr = Service(
                [
                    *MEMSVC,
                    "manager",
                    "--listen",
                    "127.0.0.1:0",
                    "--db",
                    str(tmp),
                    "--idle-sleep-timeout",
                    "0",
                    "--idle-deep-sleep-timeout",
                    "0",
                ],
                r"manager listening on (\S+)",
                "manager",
            )
            services.append(mgr)
            registration = ["--served-model-name", "bench", "--worker-id", "bench", "--manager", mgr.address]
        wk = Service(
            [
                *MEMSVC,
                "worker",
                "--backend",
                args.backend,
                "--model",
                args.model,
                "--listen",
                "127.0.0.1:0",
                "--kv-blocks",
                str(args.kv_blocks),
                "--max-batch",
                str(args.max_batch),
                *registration,
                *shlex.split(args.worker_args),
            ],
            r" listening on (\S+)",
            "worker",
        )
        services.append(wk)
        target, model, sampled = wk.address, "", wk
        if args.path == "gateway":
            sampled = Service(
                [*MEMSVC, "gateway", "--listen", "127.0.0.1:0", "--manager", mgr.address],
                r"gateway listening on (\S+)",
                "gateway",
            )
            services.append(sampled)
            target, model = sampled.address, "bench"
        bench_serving._wait_ready(wk.address)
        bench_serving._wait_model(args.path, target)
        c = args.concurrency
        bench_serving.run_level(args.path, target, model, shape, c, c, 8, vocab, 1)  # warm every bucket
        raw = Path(args.out).with_suffix(".raw")
        spy = subprocess.Popen(
            [
                args.py_spy,
                "record",
                "--pid",
                str(sampled.proc.pid),
                "--duration",
                str(int(args.seconds)),
                "--format",
                "raw",
                "--output",
                str(raw),
                "--threads",
                "--nonblocking",
                *(["--gil"] if args.gil else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)  # py-spy attached
        pids = family(wk.proc.pid) + (family(sampled.proc.pid) if sampled is not wk else [])
        before, t0 = thread_cpu(pids), time.monotonic()
        row = bench_serving.run_level(args.path, target, model, shape, c, 8 * c, 8, vocab, 2)
        busy = busy_threads(before, thread_cpu(pids), time.monotonic() - t0)
        _, err = spy.communicate(timeout=args.seconds + 120)
        profile = summarize(raw.read_text()) if raw.exists() else {}
        out = {
            "level": row,
            "busy_threads": busy,
            "py_spy_rc": spy.returncode,
            "py_spy_stderr": err[-2000:],
            "profile": profile,
        }
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(row))
        print("busiest threads (CPU seconds per second of the level):", busy[:10])
        for thread, t in profile.items():
            print(f"{thread}: {t['samples']} samples; self: {t['self'][:8]}")
    finally:
        for service in reversed(services):
            service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
