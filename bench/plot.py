"""Plots for docs/benchmarks.md from the benchmarks' JSON: GB/s against block size per copy method,
sleep/wake GB/s per cycle, and 4 KiB swaps along the SwapBlocks path.

    python -m bench.plot docs/results/line_rate-<date>.json docs/results/bench_allocator-<date>.json docs/img [PLOT ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def copy_plot(line_rate: dict[str, Any], out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, direction in zip(axes, ("d2h", "h2d"), strict=True):
        for method, style in (("loop", "o:"), ("batch", "s--"), ("kernel", "^-"), ("auto", "x-"), ("ids", "d-.")):
            rows = sorted(
                (r for r in line_rate["swaps"] if r["direction"] == direction and r["method"] == method),
                key=lambda r: r["block_bytes"],
            )
            ax.plot([r["block_bytes"] / 1024 for r in rows], [r["GBps"] for r in rows], style, label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (KiB)")
        ax.set_title(f"{direction}: random blocks (8192; 1024 at >= 1 MiB)", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend()
    fig.suptitle(f"{line_rate['device']}, driver {line_rate.get('driver')}, commit {line_rate['commit']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def cycles_plot(line_rate: dict[str, Any], alloc: dict[str, Any], out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    series = {
        "memsvc, host reserve on": alloc["weights_reserve"]["cycles"],
        "memsvc, prepinned (--host-prepin)": alloc["weights_prepinned"]["cycles"],
        "memsvc, no reserve": alloc["weights_no_reserve"]["cycles"],
        "vLLM-style (pin per tensor, sync copy)": line_rate["vllm_style"]["cycles"],
    }
    for ax, key in zip(axes, ("sleep_GBps", "wake_GBps"), strict=True):
        for label, rows in series.items():
            ax.plot([r["cycle"] for r in rows], [r[key] for r in rows], "o-", label=label)
        ax.set_xlabel("cycle")
        ax.set_xticks(range(1, 1 + max(len(rows) for rows in series.values())))
        ax.set_title(key.split("_")[0] + " of 15 GiB Llama-3-8B-shaped bf16 weights")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{alloc['device']}, driver {alloc.get('driver')}, commit {alloc['commit']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def swap_path_plot(line_rate: dict[str, Any], out: Path) -> None:
    """4 KiB swaps along the SwapBlocks path, device -> host: the bare copy, the KV cache in process
    (one swap at a time, and begun back to back), the RPC from one client (one call at a time, 4 and
    8 in flight) and one client process sending encoded requests, 8 in flight (8192 only); the raw
    u32le request form where the run has it; 8192 and 32768 blocks per call."""
    rpc, kv = line_rate["rpc_swap"], line_rate["kv_swap"]
    labels = [
        "copy_block_ids",
        "KvCache\nswap_ids",
        "begin_swap\nback to back",
        "RPC\n1 call",
        "RPC\n4 in flight",
        "RPC\n8 in flight",
        "RPC, encoded\nrequests, 8 in flight",
    ]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.38
    for k, n in enumerate((8192, 32768)):
        r, q = rpc[f"u32le_{n}_d2h" if f"u32le_{n}_d2h" in rpc else f"packed_{n}_d2h"], kv[f"{n}_out"]
        values = [
            q["GBps_copy_block_ids"],
            q["GBps_swap_ids"],
            q["GBps_pipelined"],
            r["GBps_client"],
            r["GBps_in_flight"]["4"],
            r["GBps_in_flight"]["8"],
            r["GBps_raw_clients"].get("1x8", float("nan")),
        ]
        bars = ax.bar([i + (k - 0.5) * width for i in range(len(labels))], values, width, label=f"{n} blocks per call")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.axhline(40, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title("4 KiB blocks, device -> host, along the SwapBlocks path (dashed: the 40 GB/s target)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{line_rate['device']}, driver {line_rate.get('driver')}, commit {line_rate['commit']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


PLOTS = ("copy", "cycles", "swap_path")


def main() -> None:
    """``plot.py LINE_RATE ALLOC OUTDIR [PLOT ...]``: every plot, or the ones named (of PLOTS)."""
    line_rate = json.loads(Path(sys.argv[1]).read_text())
    alloc = json.loads(Path(sys.argv[2]).read_text())
    out = Path(sys.argv[3])
    wanted = sys.argv[4:] or PLOTS
    unknown = set(wanted) - set(PLOTS)
    if unknown:
        sys.exit(f"unknown plots {sorted(unknown)}; choose from {PLOTS}")
    out.mkdir(parents=True, exist_ok=True)
    if "copy" in wanted:
        copy_plot(line_rate, out / "copy_gbps_by_block_size.png")
    if "cycles" in wanted:
        cycles_plot(line_rate, alloc, out / "sleep_wake_by_cycle.png")
    if "swap_path" in wanted:
        swap_path_plot(line_rate, out / "swap_path.png")


if __name__ == "__main__":
    main()
