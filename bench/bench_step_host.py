"""The engine's host time per step, without the model: what a step costs the device loop in Python
and numpy (planning, the KV blocks, picking and handing out the tokens) at 1, 64 and 256 rows.

Why: issue 26 item 3 asks for host cost per step that does not grow with per-sequence Python. On the
GPU that cost sits between two steps of the device (the device idles through it) and is hard to see
apart from the device's own time; here the engine runs on the host backend with its forward replaced
by a constant logits tensor, so every millisecond measured is the engine's host work, the same code
the GPU worker runs. The model is ``synthetic:tiny`` (its vocabulary of 512 keeps the argmax small);
torch runs one thread, so the numbers do not depend on how busy the other cores are.

Each row count: that many 40-token prompts decoding 200 tokens with ``ignore_eos``; the steps after
every prompt was read are timed (median and p90, ms per step, and per row).

    python -m bench.bench_step_host --out step_host.json [--rows 1,64,256] [--steps 150]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.bench_allocator import _git_commit

if TYPE_CHECKING:
    from worker.model.engine import Engine

PROMPT = 40


@contextlib.contextmanager
def decoding(engine: Engine, prompts: Sequence[list[int]], new: int) -> Iterator[None]:
    """Inside: one request per prompt (``new`` tokens, ``ignore_eos``), every prompt read, so that each
    step from here decodes one row per request; on the way out the requests end (the step benches')."""
    from worker.model.generation import GenerationRequest

    futures = [engine.submit(GenerationRequest(list(p), new, ignore_eos=True)) for p in prompts]
    try:
        while any(r.pending > 1 for r in engine._running) or engine.queued:
            engine.step()
        yield
    finally:
        for f in futures:
            f.cancel()
        engine.fail_all(RuntimeError("bench over"))


def timed_steps(engine: Engine, steps: int) -> list[float]:
    """Seconds of each of ``steps`` engine steps, in order."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def p90(values: Sequence[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def measure(rows: int, steps: int) -> dict[str, Any]:
    import torch

    from worker.allocator import AllocatorConfig, MemoryAllocator
    from worker.model.decoder import HostStep
    from worker.model.runner import ModelRunner

    alloc = MemoryAllocator(AllocatorConfig(backend="host", host_capacity_bytes=1 << 30))
    try:
        blocks = rows * ((PROMPT + steps + 16) // 16 + 1)
        runner = ModelRunner(
            alloc, "synthetic:tiny", blocks, 4, block_size=16, max_batch=rows, max_step_tokens=max(2048, rows * PROMPT)
        )
        engine = runner.engine
        logits = torch.zeros(rows, runner.config.vocab_size)

        def no_model(step: HostStep) -> torch.Tensor:
            return logits[: len(step.last_rows)]

        engine._run_step = no_model  # the forward out of the picture: only host work is left
        prompts = [[(7 * i + j) % 500 + 1 for j in range(PROMPT)] for i in range(rows)]
        with decoding(engine, prompts, steps + 8):
            times = timed_steps(engine, steps)
        median = statistics.median(times)
        return {
            "rows": rows,
            "steps": steps,
            "step_ms_median": round(median * 1e3, 4),
            "step_ms_p90": round(p90(times) * 1e3, 4),
            "per_row_us_median": round(median * 1e6 / rows, 3),
        }
    finally:
        alloc.close()


def run(rows: Sequence[int], steps: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    return {
        "what": "engine host time per step, forward replaced by constant logits (bench/bench_step_host.py)",
        "date": time.strftime("%Y-%m-%d"),
        "commit": os.environ.get("MEMSVC_COMMIT") or _git_commit(),
        "host": {"machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__},
        "levels": [measure(n, steps) for n in rows],
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_step_host.json")
    ap.add_argument("--rows", default="1,64,256", help="row counts, comma-separated")
    ap.add_argument("--steps", type=int, default=150, help="decode steps timed per row count")
    args = ap.parse_args(argv)
    result = run([int(x) for x in args.rows.split(",")], args.steps)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for level in result["levels"]:
        print(
            f"{level['rows']:>4} rows: {level['step_ms_median']:.3f} ms per step (p90 {level['step_ms_p90']:.3f}), "
            f"{level['per_row_us_median']:.2f} us per row"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
