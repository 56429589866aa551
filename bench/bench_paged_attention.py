"""The paged attention kernels on the steps the engine runs: a prompt chunk's rows read in tiles of
rows (worker/model/paged_kernel.py's ``paged_tile_kernel`` beside the per-row kernel) against every
row read alone (the per-row kernel only, as before tiles).

Why: in a step that mixes 64 decodes with a 448-row prompt chunk (the 512/128 shape while prompts
arrive) the per-row kernel took 136 us a layer, 28 % of the step, because each of the chunk's rows
walked its whole prefix alone. This bench times both ways on an 8B Llama 3's shapes (32 query heads,
8 KV heads, head_dim 128, 16-token blocks, bf16), each launched 32 times (the layers) in a CUDA graph,
and checks the tiled result against the torch path in float32. "Rows alone" is the same step with one
block table per row (the chunk's table repeated), which the per-row kernel reads as it read every
step before tiles.

    python -m bench.bench_paged_attention --out paged_attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.bench_allocator import _device_info, _git_commit
from bench.bench_products import seconds

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCKS, LAYERS = 32, 8, 128, 16, 8192, 32
STEPS: dict[str, list[tuple[str, int, int]]] = {
    # (kind, start, rows): a decode of a sequence of `start` tokens, or a chunk of `rows` rows at start..
    "1 decode, 100 tokens": [("d", 100, 1)],
    "64 decodes, 500-563 tokens": [("d", 500 + i, 1) for i in range(64)],
    "256 decodes, 41-104 tokens": [("d", 41 + i % 64, 1) for i in range(256)],
    "64 decodes + a 448-row chunk at 0": [("d", 500 + i, 1) for i in range(64)] + [("p", 0, 448)],
    "64 decodes + a 448-row chunk at 448": [("d", 500 + i, 1) for i in range(64)] + [("p", 448, 448)],
    "two 256-row chunks at 0": [("p", 0, 256), ("p", 0, 256)],
}


def measure(name: str, layout: Sequence[tuple[str, int, int]]) -> dict[str, Any]:
    import torch

    from worker.model.decoder import DecodeRows
    from worker.model.paged_attention import torch_paged_decode, triton_paged_decode

    g = torch.Generator(device="cuda").manual_seed(0)
    layer = torch.randn(BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", generator=g).to(torch.bfloat16)
    tables, row_tables, lengths = [], [], []
    for kind, start, n in layout:
        tables.append(torch.randint(0, BLOCKS, (64,), device="cuda", generator=g))
        row_tables += [len(tables) - 1] * n
        lengths += [start if kind == "d" else start + j + 1 for j in range(n)]
    table_rows = torch.tensor(row_tables, device="cuda")
    shared = DecodeRows(len(lengths), torch.stack(tables), torch.tensor(lengths, device="cuda"), table_rows)
    alone = DecodeRows(shared.count, shared.tables[table_rows], shared.lengths)
    q = torch.randn(shared.count, HEADS, HEAD_DIM, device="cuda", generator=g).to(torch.bfloat16)
    want = torch_paged_decode(q.float(), layer.float(), shared, None)
    err = (triton_paged_decode(q, layer, shared, None).float() - want).abs().max().item()

    def layers(rows: DecodeRows) -> float:
        return seconds(lambda: [triton_paged_decode(q, layer, rows, None) for _ in range(LAYERS)], 20, graph=True)

    tiled, per_row = layers(shared) / LAYERS * 1e6, layers(alone) / LAYERS * 1e6
    return {
        "step": name,
        "rows": shared.count,
        "tiles_us": round(tiled, 2),
        "rows_alone_us": round(per_row, 2),
        "speedup": round(per_row / tiled, 2),
        "max_abs_err_vs_torch": err,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_paged_attention.json")
    args = ap.parse_args(argv)
    results = []
    for name, layout in STEPS.items():
        results.append(measure(name, layout))
        r = results[-1]
        print(
            f"{name:40s} tiles {r['tiles_us']:8.2f} us  rows alone {r['rows_alone_us']:8.2f} us  "
            f"x{r['speedup']:.2f}  max |err| {r['max_abs_err_vs_torch']:.1e}",
            flush=True,
        )
    out = {
        "bench": "paged_attention",
        "date": time.strftime("%Y-%m-%d"),
        "commit": os.environ.get("MEMSVC_COMMIT") or _git_commit(),
        "device": _device_info(),
        "per_layer": results,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
