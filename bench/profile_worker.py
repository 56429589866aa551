"""Where a loaded worker spends its time: py-spy samples a ``memsvc worker`` process while
bench_serving's clients load it at one concurrency, and the hottest functions come out as a table.

Why: issue 26's targets are missed where host work, not the GPU, sets the pace; which host work (the
engine's Python, the gRPC front, the GIL between them) is a question for a profiler, not a guess.
py-spy (a wheel carried to the GPU machine) reads the process from outside, so the worker runs as
users run it, and its RPC front (a child process) with it. Each sample counts once for every
function on its stack (inclusive) and once for the function at its top (self); samples are taken on
every thread of both processes (the device loop, the event loops, gRPC's own) and idle ones are left
out, so a thread's samples over the rate times the seconds is how busy it was.

    python -m bench.profile_worker --model /tmp/ck8b --path worker --concurrency 256 --out prof.json
"""

from __future__ import annotations

import argparse
import collections
import json
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


def main(argv: Sequence[str] | None = None) -> int:
    from bench.bench_gateway import MEMSVC, Service

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a checkpoint directory (bench_gateway's)")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--path", default="worker", choices=("worker", "unary"))
    ap.add_argument("--shape", default="40x64")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--seconds", type=int, default=15, help="py-spy takes whole seconds")
    ap.add_argument("--kv-blocks", type=int, default=8192)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--worker-args", default="")
    ap.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    shape = bench_serving.Shape.parse(args.shape)
    vocab = bench_serving._model_facts(Path(args.model))["vocab"]
    wk = Service([*MEMSVC, "worker", "--backend", args.backend, "--model", args.model, "--listen", "127.0.0.1:0",
                  "--kv-blocks", str(args.kv_blocks), "--max-batch", str(args.max_batch),
                  *shlex.split(args.worker_args)], r" listening on (\S+)", "worker")  # fmt: skip
    try:
        bench_serving._wait_ready(wk.address)
        c = args.concurrency
        bench_serving.run_level(args.path, wk.address, "", shape, c, c, 8, vocab, 1)  # warm every bucket
        raw = Path(args.out).with_suffix(".raw")
        spy = subprocess.Popen([args.py_spy, "record", "--pid", str(wk.proc.pid), "--duration", str(int(args.seconds)),
                                "--format", "raw", "--output", str(raw), "--threads", "--nonblocking",
                                "--subprocesses"],  # the RPC front is the worker's child
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        time.sleep(1.0)  # py-spy attached
        row = bench_serving.run_level(args.path, wk.address, "", shape, c, 8 * c, 8, vocab, 2)
        _, err = spy.communicate(timeout=args.seconds + 120)
        profile = summarize(raw.read_text()) if raw.exists() else {}
        out = {"level": row, "py_spy_rc": spy.returncode, "py_spy_stderr": err[-2000:], "profile": profile}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(row))
        for thread, t in profile.items():
            print(f"{thread}: {t['samples']} samples; self: {t['self'][:8]}")
    finally:
        wk.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
