"""What the H200 can read, and how close the decode step's matrix products come to it: the ceiling
issue 26's C=1 target (4.2 ms/token, 80 % of the 4.8 TB/s roofline) has to fit under.

Why: the replayed one-row step of an 8B model takes 4.85 ms, of which the products are ~3.9 ms; the
roofline at the card's 4.8 TB/s says 3.35 ms. Whether the products can get much closer (and which
ones to rewrite) needs two facts the profile does not give: the rate the card streams memory at in
practice (a plain sum and a copy of 8 GB), and each product's own rate, alone, at 1, 64 and 256
rows (``torch.nn.functional.linear``, bf16, cuBLAS: what the engine calls). Each product runs as
many times as the model has layers, cycling through 8 weight copies so no weight is read from L2,
captured in a CUDA graph as the engine's step is (``*_tb_s``), and launched one by one from the host
(``*_tb_s_launched``: what a profile outside a graph would see).

    python -m bench.bench_products --out products.json [--rows 1,64,256]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.bench_allocator import _device_info, _git_commit

LAYERS = 32
SHAPES = {  # (out, in) of an 8B Llama 3's products; qkv and gate_up as the engine fuses them
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
COPIES = 8


def seconds(fn: Callable[[], object], n: int, graph: bool = False) -> float:
    """Mean seconds of ``fn`` over ``n`` calls queued back to back (CUDA events), after a warm-up;
    with ``graph``, of ``fn`` captured once in a CUDA graph and replayed, as the engine's step runs
    its products (a small product's launch costs about what its read does, outside a graph)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        run = captured.replay
        run()
    torch.cuda.synchronize()
    begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    begin.record()
    for _ in range(n):
        run()
    end.record()
    torch.cuda.synchronize()
    return float(begin.elapsed_time(end)) / n / 1e3


def streaming() -> dict[str, float]:
    """TB/s of a sum over 8 GB (reads) and of a copy of 8 GB (reads and writes)."""
    import torch

    x = torch.ones(4_000_000_000, dtype=torch.bfloat16, device="cuda")
    out = {"sum_tb_s": round(x.numel() * 2 / seconds(x.sum, 10) / 1e12, 3)}
    y = torch.empty_like(x)
    out["copy_tb_s"] = round(2 * x.numel() * 2 / seconds(lambda: y.copy_(x), 10) / 1e12, 3)
    return out


def products(rows: int) -> dict[str, Any]:
    """Each product's TB/s (its weights' bytes over its time) and all of them, for ``rows`` rows."""
    import torch
    import torch.nn.functional as F

    row: dict[str, Any] = {"rows": rows}
    total_bytes = total_s = 0.0
    for name, (n, k) in SHAPES.items():
        reps = 1 if name == "lm_head" else LAYERS
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(min(reps, COPIES))]
        a = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")

        def run(weights: list[torch.Tensor] = weights, a: torch.Tensor = a, reps: int = reps) -> None:
            for i in range(reps):
                F.linear(a, weights[i % len(weights)])

        nbytes = reps * n * k * 2
        s = seconds(run, 20, graph=True)
        row[f"{name}_ms"] = round(s * 1e3, 3)
        row[f"{name}_tb_s"] = round(nbytes / s / 1e12, 3)
        row[f"{name}_tb_s_launched"] = round(nbytes / seconds(run, 20) / 1e12, 3)  # each launch from the host
        total_bytes += nbytes
        total_s += s
    row["all_ms"] = round(total_s * 1e3, 3)
    row["all_tb_s"] = round(total_bytes / total_s / 1e12, 3)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,64,256", help="row counts, comma-separated")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result: dict[str, Any] = {"bench": "products", "commit": _git_commit(), "device": _device_info()}
    result["streaming"] = streaming()
    print("streaming:", result["streaming"], flush=True)
    result["products"] = []
    for rows in (int(r) for r in args.rows.split(",")):
        result["products"].append(products(rows))
        print(result["products"][-1], flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
