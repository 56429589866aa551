"""Where a decode step's time goes on the GPU: the device's own time for the step, the host's time
around it, and the step as the engine runs it, at 1, 64 and 256 rows; no RPC, no device loop.

Why: issue 26's C=1 decode is 5.7 ms/token through the worker where the weights' read takes 3.35 ms,
and a 64-row step ~7.3 ms. Whether the gap is the device (kernels short of the bandwidth) or the host
(planning, copying the inputs, picking the tokens while the device idles) decides what to build. So,
in one process, on the engine the worker runs (``ModelRunner``, CUDA graphs, ``synthetic:<preset>``):

- ``step_ms``: wall time of ``Engine.step`` (plan, replay, pick, hand out), every row decoding;
- ``device_ms``: CUDA-event time from just before the step's inputs are copied to just after its
  graph replay (the device's time for the forward, plus any wait for the host within it);
- ``replay_ms``: the same step's graph replayed back to back, the host never waited on: the device's
  time alone (the floor ``step_ms`` could reach if host work overlapped the device's);
- ``weights_ms``: the bandwidth floor, the weights' bytes at ``--bandwidth`` GB/s;
- a torch-profiler table of a few steps at each row count of ``--profile-rows`` (64 by default): the
  kernels' device time, the host's calls;
- the serving bench's 40/64 shape as a closed loop on the engine alone (``--concurrency``): C
  requests in flight, a new one submitted as one ends, output tokens per second, and the steps split
  into graph replays and eager steps (steps that read prompt chunks) with the time each kind took.
  Set beside bench_serving's figure at the same C, it says how much the RPC path costs.

    python -m bench.bench_step_device --out step_device.json [--rows 1,64,256] [--steps 60] [--concurrency 64,256]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.bench_allocator import _git_commit
from bench.bench_step_host import decoding, p90, timed_steps

if TYPE_CHECKING:
    import torch

    from worker.model.runner import ModelRunner

PROMPT = 40


def _event() -> torch.cuda.Event:
    import torch

    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch leaves it unannotated


def measure(runner: ModelRunner, rows: int, steps: int, bandwidth: float, profile: bool) -> dict[str, Any]:
    import torch

    from worker.model.decoder import HostStep

    engine = runner.engine
    run_step = engine._run_step
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    last: list[HostStep] = []

    def timed(step: HostStep) -> torch.Tensor:
        begin, end = _event(), _event()
        begin.record()
        out = run_step(step)
        end.record()
        marks.append((begin, end))
        last[:] = [step]
        return out

    engine._run_step = timed
    vocab = runner.config.vocab_size
    prompts = [[(7919 * i + 13 * j) % vocab for j in range(PROMPT)] for i in range(rows)]
    try:
        with decoding(engine, prompts, steps * 2 + 32):
            timed_steps(engine, 5)  # a bucket's first replays
            torch.cuda.synchronize()
            marks.clear()
            times = timed_steps(engine, steps)
            torch.cuda.synchronize()
            device = [b.elapsed_time(e) for b, e in marks]
            step = last[0]
            graphs = runner.graphs
            assert graphs is not None and graphs.bucket_for(step.decodes) in graphs.captured, "not a replayed step"
            begin, end = _event(), _event()
            begin.record()
            for _ in range(steps):
                graphs.run(step)
            end.record()
            torch.cuda.synchronize()
            replay = begin.elapsed_time(end) / steps
            table = ""
            if profile:
                from torch.profiler import ProfilerActivity
                from torch.profiler import profile as torch_profile

                with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    timed_steps(engine, 5)
                    torch.cuda.synchronize()
                averages = prof.key_averages()
                table = (
                    averages.table(sort_by="self_device_time_total", row_limit=20)
                    + "\n"
                    + averages.table(sort_by="self_cpu_time_total", row_limit=14)
                )
    finally:
        engine._run_step = run_step
    weights_ms = runner.config.param_bytes() / (bandwidth * 1e9) * 1e3
    return {
        "rows": rows,
        "steps": steps,
        "step_ms_median": round(statistics.median(times) * 1e3, 3),
        "step_ms_p90": round(p90(times) * 1e3, 3),
        "device_ms_median": round(statistics.median(device), 3),
        "replay_ms": round(replay, 3),
        "weights_ms": round(weights_ms, 3),
        "profile": table,
    }


def closed_loop(runner: ModelRunner, concurrency: int, output: int = 64, waves: int = 4) -> dict[str, Any]:
    """``waves x concurrency`` requests of a PROMPT-token prompt and ``output`` tokens (``ignore_eos``),
    ``concurrency`` of them in flight, stepped on this thread as the worker's device loop steps."""
    from worker.model.generation import GenerationRequest, GenerationResult

    engine, graphs = runner.engine, runner.graphs
    assert graphs is not None
    vocab = runner.config.vocab_size
    total, submitted, done = waves * concurrency, 0, [0]
    kinds: dict[str, list[float]] = {"replay": [], "eager": []}

    errors: list[BaseException] = []

    def ended(future: concurrent.futures.Future[GenerationResult]) -> None:
        done[0] += 1
        if (exc := future.exception()) is not None:
            errors.append(exc)

    t0 = time.perf_counter()
    while done[0] < total:
        while submitted < total and submitted - done[0] < concurrency:
            prompt = [(7919 * submitted + 13 * j) % vocab for j in range(PROMPT)]
            engine.submit(GenerationRequest(prompt, output, ignore_eos=True)).add_done_callback(ended)
            submitted += 1
        replays, s0 = graphs.replays, time.perf_counter()
        engine.step()
        kinds["replay" if graphs.replays > replays else "eager"].append(time.perf_counter() - s0)
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed; the first: {errors[0]!r}")
    return {
        "concurrency": concurrency,
        "requests": total,
        "output_tok_s": round(total * output / wall, 1),
        "steps": sum(len(v) for v in kinds.values()),
        **{f"{k}_steps": len(v) for k, v in kinds.items()},
        **{f"{k}_ms_mean": round(statistics.mean(v) * 1e3, 3) if v else None for k, v in kinds.items()},
        **{f"{k}_s_total": round(sum(v), 3) for k, v in kinds.items()},
        "wall_s": round(wall, 3),
    }


def run(
    preset: str,
    rows: Sequence[int],
    steps: int,
    bandwidth: float,
    loops: Sequence[int],
    profiled: Sequence[int] = (64,),
) -> dict[str, Any]:
    import torch

    from worker.allocator import AllocatorConfig, MemoryAllocator
    from worker.model.runner import ModelRunner

    alloc = MemoryAllocator(AllocatorConfig(backend="cuda", host_chunk_bytes=64 << 20))
    try:
        blocks = max([*rows, *loops]) * ((PROMPT + 2 * steps + 64) // 16 + 2) + 64
        batch = max([*rows, *loops])
        runner = ModelRunner(alloc, f"synthetic:{preset}", blocks, 0, max_batch=batch, cuda_graphs=True)
        levels = [measure(runner, n, steps, bandwidth, profile=n in profiled) for n in rows]
        if loops:
            closed_loop(runner, max(loops), waves=1)  # warm: every prompt-chunk shape compiled
        serving = [closed_loop(runner, c) for c in loops]
    finally:
        alloc.close()
    return {
        "what": "a decode step's time on the device and around it (bench/bench_step_device.py)",
        "date": time.strftime("%Y-%m-%d"),
        "commit": os.environ.get("MEMSVC_COMMIT") or _git_commit(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "preset": preset,
        "graph_buckets": list(runner.graphs.captured) if runner.graphs is not None else [],
        "graph_capture_s": round(runner.graphs.capture_seconds, 3) if runner.graphs is not None else None,
        "levels": levels,
        "closed_loop_40x64": serving,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_step_device.json")
    ap.add_argument("--preset", default="8b")
    ap.add_argument("--rows", default="1,64,256", help="row counts, comma-separated")
    ap.add_argument("--steps", type=int, default=60, help="decode steps timed per row count")
    ap.add_argument("--concurrency", default="64,256", help="closed-loop concurrencies (empty: none)")
    ap.add_argument("--profile-rows", default="64", help="row counts profiled (torch's profiler), comma-separated")
    ap.add_argument("--bandwidth", type=float, default=4800.0, help="the card's memory bandwidth, GB/s (H200: 4800)")
    args = ap.parse_args(argv)
    loops = [int(x) for x in args.concurrency.split(",") if x]
    profiled = [int(x) for x in args.profile_rows.split(",") if x]
    result = run(args.preset, [int(x) for x in args.rows.split(",") if x], args.steps, args.bandwidth, loops, profiled)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"graphs: buckets {result['graph_buckets']} captured in {result['graph_capture_s']} s")
    for level in result["levels"]:
        print(
            f"{level['rows']:>4} rows: step {level['step_ms_median']:.3f} ms (p90 {level['step_ms_p90']:.3f}), "
            f"device {level['device_ms_median']:.3f} ms, replay alone {level['replay_ms']:.3f} ms, "
            f"weights {level['weights_ms']:.3f} ms"
        )
        if level["profile"]:
            print(level["profile"])
    for loop in result["closed_loop_40x64"]:
        print(f"closed loop 40/64 C={loop['concurrency']}: {loop['output_tok_s']} tok/s; " + json.dumps(loop))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
