"""Serving benchmark shaped like ``vllm bench serve``: how many output tokens per second a worker serves
under load, and the latency its clients see, through the worker's ``GenerateStream`` and through
``memsvc gateway`` with the OpenAI SDK, against the hardware's limit for each shape.

Why: the engine's own benchmark (bench_engine) asks one round of calls from one client process; a
server is loaded by many clients at once, streamed. Here every request is a random prompt of a fixed
length (fresh ids for every request, so no cache can help) with a fixed number of output tokens
(``ignore_eos``); at most C requests are in flight (C = ``--concurrency``), sent by ``--clients``
processes (each an asyncio loop with its share of the C slots), so the client is not what is
measured. A first pass at the largest C warms every shape (graphs, kernels) before anything counts.

Paths: ``worker`` (GenerateStream), ``unary`` (Generate: TTFT is the whole answer's latency) and
``gateway`` (streamed completions through the OpenAI SDK; the gateway runs ``--gateway-processes``
processes, 4 by default: one writes about 10,000 streamed tokens a second). Per (path, shape, C): output tok/s
(output tokens over the wall time from the first request sent to the last one ended), TTFT, ITL (the
gap between two streamed messages, as vllm's bench counts it), TPOT ((latency - TTFT) / (output
tokens - 1)), p50 and p99, and the requests refused or failed.

The limit of the hardware for a shape (cuda only), as docs/benchmarks.md derives it: the requests
run in waves of C; a wave costs its prefill (2 x parameters x C x input tokens at ``--tflops``) and
``output`` decode steps, each the larger of (weights + the wave's KV cache bytes) / ``--hbm`` and
2 x parameters x C at ``--tflops``; the limit is C x output over that. On the host backend there is
no such limit: the figure that matters there is how tok/s grows with C (the host's cost per step).

The model: a Llama checkpoint of ``--shape`` written by bench/bench_gateway.py (random bf16 weights,
a word-level tokenizer so every token streams as text), or ``--model`` (a directory).

    python -m bench.bench_serving --out serving.json                                         # 8B on the GPU
    python -m bench.bench_serving --shape tiny --backend host --concurrency 1,16,64 --out s.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.bench_gateway import Service

TFLOPS = 790e12
"""bf16 dense matrix rate measured on the H200 (docs/benchmarks.md)."""
HBM = 4.8e12
"""HBM bandwidth of the H200, bytes/s."""
START_S = 6.0
"""Client processes start this long after they are spawned (each imports and connects first)."""


@dataclass(frozen=True)
class Shape:
    input_tokens: int
    output_tokens: int

    @property
    def name(self) -> str:
        return f"{self.input_tokens}/{self.output_tokens}"

    @classmethod
    def parse(cls, text: str) -> Shape:
        a, _, b = text.partition("x")
        return cls(int(a), int(b))


@dataclass
class Record:
    """One request as its client saw it (seconds, wall clock of the client process)."""

    sent: float
    first: float = 0.0
    end: float = 0.0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str = ""

    def arrived(self, last: float) -> float:
        """A streamed message came: the first token's time, or one more gap since ``last``; now."""
        now = time.time()
        if not self.first:
            self.first = now
        else:
            self.gaps.append(now - last)
        return now


# ---- the clients (each in a process of its own) ----
async def _worker_request(stub: Any, worker_pb: Any, prompt: list[int], shape: Shape) -> Record:
    req = worker_pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=shape.output_tokens, ignore_eos=True)
    rec = Record(sent=time.time())
    last = 0.0
    try:
        async for msg in stub.GenerateStream(worker_pb.GenerateStreamRequest(request=req), timeout=600):
            if not msg.token_ids:
                continue
            last = rec.arrived(last)
            rec.tokens += len(msg.token_ids)
    except Exception as exc:  # noqa: BLE001 - counted, the run goes on
        rec.error = type(exc).__name__ + ": " + str(exc)[:200]
    rec.end = time.time()
    return rec


async def _unary_request(stub: Any, worker_pb: Any, prompt: list[int], shape: Shape) -> Record:
    """A unary Generate: its first token is its whole answer (TTFT = latency, no ITL)."""
    req = worker_pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=shape.output_tokens, ignore_eos=True)
    rec = Record(sent=time.time())
    try:
        r = await stub.Generate(req, timeout=600)
        rec.tokens = len(r.token_ids)
    except Exception as exc:  # noqa: BLE001 - counted, the run goes on
        rec.error = type(exc).__name__ + ": " + str(exc)[:200]
    rec.end = rec.first = time.time()
    return rec


async def _gateway_request(client: Any, model: str, prompt: list[int], shape: Shape) -> Record:
    rec = Record(sent=time.time())
    last = 0.0
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=shape.output_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                rec.tokens = chunk.usage.completion_tokens
            if not (chunk.choices and chunk.choices[0].text):
                continue
            last = rec.arrived(last)
    except Exception as exc:  # noqa: BLE001 - counted, the run goes on
        rec.error = type(exc).__name__ + ": " + str(exc)[:200]
    rec.end = time.time()
    return rec


async def _client_loop(
    path: str,
    target: str,
    model: str,
    prompts: list[list[int]],
    shape: Shape,
    slots: int,
    start: float,
    rate: float = 0.0,
) -> list[Record]:
    """The requests of ``prompts``: ``slots`` at a time, each sent as one ends (closed loop), or with
    ``rate`` (requests a second), sent at random (Poisson) times whatever is in flight (open loop)."""
    if path in ("worker", "unary"):
        import grpc

        from memsvc.v1 import model_worker_service_pb2 as worker_pb
        from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

        channel = grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)])
        stub = worker_grpc.ModelWorkerServiceStub(channel)
        request = _worker_request if path == "worker" else _unary_request

        async def one(p: list[int]) -> Record:
            return await request(stub, worker_pb, p, shape)
    else:
        import openai

        client = openai.AsyncOpenAI(base_url=f"http://{target}/v1", api_key="unused", max_retries=0, timeout=600)

        async def one(p: list[int]) -> Record:
            return await _gateway_request(client, model, p, shape)

    todo = list(reversed(prompts))
    out: list[Record] = []

    async def slot() -> None:
        while todo:
            out.append(await one(todo.pop()))

    async def arrivals() -> None:
        rng = random.Random(start)
        sent: list[asyncio.Task[Record]] = []
        due = time.time()
        while todo:
            sent.append(asyncio.create_task(one(todo.pop())))
            due += rng.expovariate(rate)
            await asyncio.sleep(max(due - time.time(), 0))
        out.extend(await asyncio.gather(*sent))

    await asyncio.sleep(max(start - time.time(), 0))
    await (arrivals() if rate > 0 else asyncio.gather(*(slot() for _ in range(slots))))
    if path == "gateway":
        await client.close()
    else:
        await channel.close()
    return out


def _client(args: tuple[str, str, str, list[list[int]], Shape, int, float, float]) -> list[dict[str, Any]]:
    return [asdict(r) for r in asyncio.run(_client_loop(*args))]


def run_level(
    path: str,
    target: str,
    model: str,
    shape: Shape,
    concurrency: int,
    requests: int,
    clients: int,
    vocab: int,
    seed: int,
    start_delay: float = START_S,
) -> dict[str, Any]:
    """``requests`` requests of ``shape`` at most ``concurrency`` at a time, from ``clients`` processes."""
    records = run_records(path, target, model, shape, concurrency, requests, clients, vocab, seed, start_delay)
    return summarize(records, shape, concurrency)


def run_records(
    path: str,
    target: str,
    model: str,
    shape: Shape,
    concurrency: int,
    requests: int,
    clients: int,
    vocab: int,
    seed: int,
    start_delay: float = START_S,
    rate: float = 0.0,
) -> list[Record]:
    """:func:`run_level`'s requests as each client saw them; with ``rate`` (requests a second, all the
    processes together), sent at that rate whatever is in flight instead of ``concurrency`` at a time."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(shape.input_tokens)] for _ in range(requests)]
    procs = max(min(clients, concurrency), 1)
    slots = [concurrency // procs + (1 if k < concurrency % procs else 0) for k in range(procs)]
    share = [prompts[k::procs] for k in range(procs)]
    start = time.time() + start_delay
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(procs) as pool:
        jobs = [(path, target, model, share[k], shape, slots[k], start, rate / procs) for k in range(procs)]
        return [Record(**r) for part in pool.map(_client, jobs) for r in part]


def _pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(int(round(q * (len(s) - 1))), len(s) - 1)]


def summarize(records: list[Record], shape: Shape, concurrency: int) -> dict[str, Any]:
    ok = [r for r in records if not r.error and r.tokens == shape.output_tokens]
    failed = [r for r in records if r not in ok]
    wall = max(r.end for r in records) - min(r.sent for r in records) if records else 0.0
    ttft = [r.first - r.sent for r in ok]
    itl = [g for r in ok for g in r.gaps]
    tpot = [(r.end - r.first) / (r.tokens - 1) for r in ok if r.tokens > 1 and r.end > r.first]
    out = sum(r.tokens for r in ok)

    def ms(xs: Sequence[float], q: float) -> float | None:
        v = _pct(xs, q)
        return None if v is None else round(v * 1e3, 2)

    return {
        "concurrency": concurrency,
        "requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "errors": sorted({r.error or f"{r.tokens} tokens" for r in failed})[:5],
        "wall_s": round(wall, 3),
        "output_tok_s": round(out / wall, 1) if wall else 0.0,
        "ttft_p50_ms": ms(ttft, 0.5),
        "ttft_p99_ms": ms(ttft, 0.99),
        "ttft_max_ms": ms(ttft, 1.0),
        "itl_p50_ms": ms(itl, 0.5),
        "itl_p99_ms": ms(itl, 0.99),
        "tpot_p50_ms": ms(tpot, 0.5),
        "tpot_p99_ms": ms(tpot, 0.99),
    }


def hardware_limit(
    params: int,
    weight_bytes: int,
    kv_bytes_per_token: int,
    shape: Shape,
    concurrency: int,
    tflops: float = TFLOPS,
    hbm: float = HBM,
) -> dict[str, float]:
    """Output tok/s and decode ms/step at best for the shape (see the module docstring)."""
    n = concurrency
    prefill = 2 * params * n * shape.input_tokens / tflops
    decode = 0.0
    for step in range(shape.output_tokens):
        kv = n * (shape.input_tokens + step) * kv_bytes_per_token
        decode += max((weight_bytes + kv) / hbm, 2 * params * n / tflops)
    return {
        "output_tok_s": round(n * shape.output_tokens / (prefill + decode), 1),
        "decode_step_ms": round(decode / shape.output_tokens * 1e3, 3),
    }


def _model_facts(checkpoint: Path) -> dict[str, int]:
    """Parameters, weight bytes (bf16) and KV bytes per token of the checkpoint's config."""
    from worker.model.weights import read_config

    config = read_config(checkpoint)
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    return {
        "params": config.param_count(),
        "weight_bytes": config.param_bytes(),
        "kv_bytes_per_token": kv,
        "vocab": config.vocab_size,
    }


def main(argv: Sequence[str] | None = None) -> int:
    # here, not at the top: the client processes import this module and need none of it (torch)
    from bench.bench_allocator import _device_info, _git_commit
    from bench.bench_gateway import MEMSVC, Service, write_checkpoint

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8b", help="bench_gateway's checkpoint shape (8b, tiny)")
    ap.add_argument("--model", default="", help="a checkpoint directory instead of a written one")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--shapes", default="40x64,512x128", help="input x output tokens, comma-separated")
    ap.add_argument("--concurrency", default="1,16,64,128,256")
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default: max(waves x C, 16))")
    ap.add_argument("--waves", type=int, default=4, help="requests per level in units of C (unless --requests)")
    ap.add_argument("--clients", type=int, default=8, help="client processes")
    ap.add_argument(
        "--paths", default="worker,unary,gateway", help="worker (GenerateStream), unary (Generate), gateway"
    )
    ap.add_argument("--kv-blocks", type=int, default=8192)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--worker-args", default="", help="more worker flags")
    ap.add_argument("--gateway-processes", type=int, default=4, help="the gateway's --processes")
    ap.add_argument("--start-delay", type=float, default=START_S, help="seconds client processes get to start")
    ap.add_argument("--tflops", type=float, default=TFLOPS)
    ap.add_argument("--hbm", type=float, default=HBM)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    shapes = [Shape.parse(s) for s in args.shapes.split(",")]
    levels = [int(level) for level in args.concurrency.split(",")]
    paths = args.paths.split(",")
    result: dict[str, Any] = {
        "bench": "serving",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "argv": sys.argv[1:],
        "device": _device_info() if args.backend == "cuda" else "host",
        "gateway_processes": args.gateway_processes,
        "results": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoint = Path(args.model) if args.model else root / "ckpt"
        if not args.model:
            result["checkpoint"] = write_checkpoint(checkpoint, args.shape, "cuda" if args.backend == "cuda" else "cpu")
        facts = _model_facts(checkpoint)
        result["model"] = facts
        services: list[Service] = []
        try:
            mgr = Service(
                [
                    *MEMSVC,
                    "manager",
                    "--listen",
                    "127.0.0.1:0",
                    "--db",
                    str(root / "m.db"),
                    "--idle-sleep-timeout",
                    "0",
                    "--idle-deep-sleep-timeout",
                    "0",
                ],
                r"manager listening on (\S+)",
                "manager",
            )
            services.append(mgr)
            wk = Service(
                [
                    *MEMSVC,
                    "worker",
                    "--backend",
                    args.backend,
                    "--model",
                    str(checkpoint),
                    "--served-model-name",
                    "bench",
                    "--worker-id",
                    "bench",
                    "--manager",
                    mgr.address,
                    "--listen",
                    "127.0.0.1:0",
                    "--kv-blocks",
                    str(args.kv_blocks),
                    "--max-batch",
                    str(args.max_batch),
                    *shlex.split(args.worker_args),
                ],
                r" listening on (\S+)",
                "worker",
            )
            services.append(wk)
            targets = {"worker": wk.address, "unary": wk.address}
            if "gateway" in paths:
                gw = Service(
                    [
                        *MEMSVC,
                        "gateway",
                        "--listen",
                        "127.0.0.1:0",
                        "--manager",
                        mgr.address,
                        "--processes",
                        str(args.gateway_processes),
                    ],
                    r"gateway listening on (\S+)",
                    "gateway",
                )
                services.append(gw)
                targets["gateway"] = gw.address
            _wait_ready(wk.address)
            result["first_request"] = first_requests(wk.address, facts["vocab"])
            print(f"first request after ready: {result['first_request']}", flush=True)
            for path in paths:
                _wait_model(path, targets[path])
            top = max(levels)
            for shape in shapes:  # warm every shape: graphs and kernels of each batch size
                for path in paths[:1]:
                    run_level(
                        path, targets[path], "bench", shape, top, top, args.clients, facts["vocab"], 1, args.start_delay
                    )
            for shape in shapes:
                for path in paths:
                    for level in levels:
                        n = args.requests or max(args.waves * level, 16)
                        row = run_level(
                            path,
                            targets[path],
                            "bench",
                            shape,
                            level,
                            n,
                            args.clients,
                            facts["vocab"],
                            level,
                            args.start_delay,
                        )
                        row.update(path=path, shape=shape.name)
                        if args.backend == "cuda":
                            lim = hardware_limit(
                                facts["params"],
                                facts["weight_bytes"],
                                facts["kv_bytes_per_token"],
                                shape,
                                level,
                                args.tflops,
                                args.hbm,
                            )
                            row["limit_output_tok_s"] = lim["output_tok_s"]
                            row["limit_decode_step_ms"] = lim["decode_step_ms"]
                            row["fraction_of_limit"] = round(row["output_tok_s"] / lim["output_tok_s"], 3)
                        result["results"].append(row)
                        print(_line(row), flush=True)
                        if args.out:  # each row as it comes: a run cut short by its time limit keeps them
                            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        finally:
            for s in reversed(services):
                s.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def first_requests(address: str, vocab: int, n: int = 3) -> dict[str, Any]:
    """The worker's first Generate after it reports AWAKE against the ones after it (40 prompt tokens,
    16 new, one at a time): what the first user pays for what the worker still builds."""
    import grpc

    from memsvc.v1 import model_worker_service_pb2 as worker_pb
    from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

    rng = random.Random(99)
    times = []
    with grpc.insecure_channel(address) as ch:
        stub = worker_grpc.ModelWorkerServiceStub(ch)
        for _ in range(n):
            req = worker_pb.GenerateRequest(
                prompt_token_ids=[rng.randrange(1, vocab) for _ in range(40)], max_new_tokens=16, ignore_eos=True
            )
            t0 = time.perf_counter()
            stub.Generate(req, timeout=600)
            times.append(time.perf_counter() - t0)
    later = min(times[1:])
    return {"first_s": round(times[0], 4), "later_s": round(later, 4), "ratio": round(times[0] / later, 2)}


def _wait_ready(address: str, timeout: float = 600.0) -> None:
    import grpc

    from memsvc.v1 import common_pb2 as common_pb
    from memsvc.v1 import model_worker_service_pb2 as worker_pb
    from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

    end = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        stub = worker_grpc.ModelWorkerServiceStub(ch)
        while (
            stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status.state
            != common_pb.WORKER_STATE_AWAKE
        ):
            if time.monotonic() > end:
                raise RuntimeError("the worker did not load")
            time.sleep(0.1)


def _wait_model(path: str, target: str, timeout: float = 120.0, model: str = "bench") -> None:
    """Until the gateway at ``target`` lists ``model`` (nothing to wait for on the other paths)."""
    if path != "gateway":
        return
    import urllib.request

    end = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{target}/v1/models", timeout=10) as resp:
                if f'"{model}"' in resp.read().decode():
                    return
        except OSError:
            pass
        if time.monotonic() > end:
            raise RuntimeError("the gateway does not list the model")
        time.sleep(0.1)


def _line(row: dict[str, Any]) -> str:
    limit = ""
    if "limit_output_tok_s" in row:
        limit = f"  limit {row['limit_output_tok_s']:>9.1f} ({row['fraction_of_limit']:.0%})"
    return (
        f"{row['path']:>7} {row['shape']:>8} C={row['concurrency']:<4} {row['output_tok_s']:>9.1f} tok/s"
        f"  TTFT p50/p99 {row['ttft_p50_ms']}/{row['ttft_p99_ms']} ms  ITL p50/p99 {row['itl_p50_ms']}/"
        f"{row['itl_p99_ms']} ms  TPOT p50 {row['tpot_p50_ms']} ms  failed {row['failed']}{limit}"
    )


if __name__ == "__main__":
    sys.exit(main())
