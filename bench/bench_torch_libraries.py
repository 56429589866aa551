"""How much of ``import torch`` is loading its shared libraries, and whether loading them ahead frees
the GIL: a worker's start is bound by the GIL until its first token (docs/benchmarks.md, "Where the
interpreter lock goes"), and the import loads them holding it.

Each variant runs in a fresh interpreter, the variants in turn for ``--rounds`` rounds. A variant
loads some of torch's libraries first, timed, while a Python thread spins beside it (its count of
loop turns meanwhile, against its count alone for as long, is the share of that time the GIL was
free for it); then ``import torch``, ``import triton`` where it is installed, and CUDA's start, each
timed:

- ``plain``: nothing ahead;
- ``global_deps``: ``libtorch_global_deps`` (``RTLD_GLOBAL``), as torch/__init__.py loads it first;
- ``cuda_wheels``: that, then the CUDA wheels' libraries as torch 2.11's ``_preload_cuda_deps`` loads
  them (its list and order, each from the first ``sys.path`` entry that has it), through ctypes;
- ``libtorch``: ``cuda_wheels``, then ``libtorch`` (with libtorch_cpu, libtorch_cuda, c10), through ctypes;
- ``libtorch_cpu``: ``libtorch_global_deps``, then ``libtorch_cpu`` alone, through ctypes.

One more ``plain`` process lists the shared objects mapped after the imports, their sizes, and any
name mapped from two files. On the GPU machine, from the repository root::

    python -m bench.bench_torch_libraries --rounds 4 --out torch_libraries.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.bench_startup import REPO_ROOT, _device, _git_commit, _median

VARIANTS = ("plain", "global_deps", "cuda_wheels", "libtorch", "libtorch_cpu")

CHILD = r"""
import ctypes, glob, importlib.util, json, os, sys, threading, time
variant, inventory = sys.argv[1], sys.argv[2] == "1"
lib = os.path.join(os.path.dirname(importlib.util.find_spec("torch").origin), "lib")
# torch 2.11's _preload_cuda_deps: its list, in its order
WHEELS = [
    ("cublas", "libcublasLt.so.*[0-9]"), ("cublas", "libcublas.so.*[0-9]"), ("cudnn", "libcudnn.so.*[0-9]"),
    ("cuda_nvrtc", "libnvrtc.so.*[0-9]"), ("cuda_nvrtc", "libnvrtc-builtins.so.*[0-9]"),
    ("cuda_runtime", "libcudart.so.*[0-9]"), ("cuda_cupti", "libcupti.so.*[0-9]"), ("cufft", "libcufft.so.*[0-9]"),
    ("curand", "libcurand.so.*[0-9]"), ("nvjitlink", "libnvJitLink.so.*[0-9]"), ("cusparse", "libcusparse.so.*[0-9]"),
    ("cusparselt", "libcusparseLt.so.*[0-9]"), ("cusolver", "libcusolver.so.*[0-9]"), ("nccl", "libnccl.so.*[0-9]"),
    ("nvshmem", "libnvshmem_host.so.*[0-9]"), ("cufile", "libcufile.so.*[0-9]"),
]

def ahead():
    ctypes.CDLL(os.path.join(lib, "libtorch_global_deps.so"), mode=ctypes.RTLD_GLOBAL)
    if variant == "libtorch_cpu":
        ctypes.CDLL(os.path.join(lib, "libtorch_cpu.so")); return
    if variant in ("cuda_wheels", "libtorch") and "libcudart.so" in open("/proc/self/maps").read():
        for folder, name in WHEELS:
            for entry in sys.path:
                found = glob.glob(os.path.join(entry, "nvidia", folder, "lib", name))
                found += glob.glob(os.path.join(entry, "nvidia", "cu13", "lib", name))
                if found:
                    ctypes.CDLL(found[0]); break
    if variant == "libtorch":
        ctypes.CDLL(os.path.join(lib, "libtorch.so"))

turns, stop = [0], [False]
def spin():
    while not stop[0]:
        turns[0] += 1
spinner = threading.Thread(target=spin); spinner.start()
t = time.perf_counter(); before = turns[0]; time.sleep(0.1); alone = (turns[0] - before) / (time.perf_counter() - t)
out = {}
if variant != "plain":
    t, before = time.perf_counter(), turns[0]
    ahead()
    out["ahead_s"] = time.perf_counter() - t
    out["gil_free_share"] = (turns[0] - before) / alone / out["ahead_s"]
stop[0] = True; spinner.join()
t = time.perf_counter(); import torch; out["import_torch_s"] = time.perf_counter() - t
if importlib.util.find_spec("triton") is not None:
    t = time.perf_counter(); import triton; out["import_triton_s"] = time.perf_counter() - t
if torch.cuda.is_available():
    t = time.perf_counter(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
    out["cuda_init_s"] = time.perf_counter() - t
if inventory:
    paths = sorted({f[5] for f in (l.split() for l in open("/proc/self/maps")) if len(f) >= 6 and ".so" in f[5]})
    names = [os.path.basename(p) for p in paths]
    out["mapped"] = {p: round(os.path.getsize(p) / 1e6) for p in paths if os.path.exists(p)}
    out["mapped_twice"] = sorted({n for n in names if names.count(n) > 1})
    out["LD_LIBRARY_PATH"] = os.environ.get("LD_LIBRARY_PATH")
print(json.dumps(out))
"""


def run_variant(variant: str, inventory: bool = False) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, variant, "1" if inventory else "0"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--rounds", type=int, default=4, help="rounds of every variant in turn")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + " ".join(VARIANTS))
    ap.add_argument("--out", type=Path, help="write the JSON here")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants: {', '.join(unknown)}")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for i in range(args.rounds):
        for v in variants:
            runs[v].append(run_variant(v))
            print(f"[bench_torch_libraries] round {i + 1} {v}: {json.dumps(runs[v][-1])}", flush=True)
    medians = {
        v: {k: _median(rs, k) for k in rs[0] if isinstance(rs[0][k], float)}
        for v, rs in runs.items()
        if rs and "error" not in rs[0]
    }
    res = {
        "bench": "torch_libraries",
        "commit": os.environ.get("MEMSVC_COMMIT") or _git_commit(),
        **_device(),
        "python": sys.version.split()[0],
        "runs": runs,
        "medians": medians,
        "inventory": run_variant("plain", inventory=True),
    }
    for v, m in medians.items():
        print(f"{v:14s} " + "  ".join(f"{k} {x:.3f}" for k, x in m.items() if x is not None))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
