"""Serving-engine benchmark: our worker's decode, batching, prefill and wake-to-first-token through its
gRPC API, side by side with transformers' eager ``generate`` on the same weights, in one run.

Why: the allocator benchmarks (bench_allocator, bench_line_rate) show that weights and KV blocks move
at line rate; this one asks what a client of the worker sees while it serves: milliseconds per decoded
token, tokens per second under concurrency, the first token of a long prompt, and how soon after a
level-1 wake the first token comes. transformers' eager generate (no compilation, no CUDA graphs; its
default attention) on the same GPU, the same shapes and the very same seeded weights is the baseline
any engine must beat by a wide margin.

A. transformers baseline: ``LlamaForCausalLM`` from the LlamaConfig equivalent to the preset (built on
   the ``meta`` device, then ``to_empty`` on the device), its parameters filled with our synthetic
   weights (``fill_synthetic``, HF names checked against ``weight_shapes``). Greedy, every token
   generated (no EOS): one stream's decode ms/token = (t(64 new) - t(1 new)) / 63 after a 40-token
   prompt, 16 streams in one generate call x 64 new tokens (aggregate tok/s), the first token of a
   2000-token prompt and of a 40-token one (the t(1 new) calls). ``--skip-transformers`` skips it.
B. a ``memsvc worker`` process (``--backend``, ``synthetic:<preset>``), through gRPC, with random
   prompts from a seeded ``random.Random`` (a fresh prompt for every call, so a prefix cache cannot
   make repeated calls look fast) and ``ignore_eos``:
   1. GenerateStream of 128 tokens after a 40-token prompt: the gap between tokens after the first
      (median, p90) and the stream's TTFT; Generate of 1 token (TTFT awake, median of 5);
   2. C concurrent Generate calls (threads) of 64 tokens each, for C in ``--concurrency``: aggregate
      tok/s = C*64 / wall, per-request latency; calls refused as OVERLOADED (RESOURCE_EXHAUSTED) are
      retried and counted;
   3. TTFT of a 2000-token prompt (shorter when the model's context is), median of 3;
   4. Sleep(level 1), WakeUp, Generate(1 token) at once, then a second one; again with 3 s between
      WakeUp and the Generate (what the worker still does in the background after a wake, as against
      what the Generate itself does); wake time client and server side. The target: the first token
      after a wake (WakeUp sent -> first Generate answered, medians) within the wake plus 1.2x the awake
      TTFT, i.e. the first Generate after a wake costs at most 1.2x an awake one;
   5. one GenerateStream decode of 128 tokens alone and while another thread keeps SwapBlocks moving
      free blocks (the top of both pools) device -> host and back: ms/token both ways, the slowdown,
      the swap GB/s achieved.
C. metadata (UTC date, device, driver, commit, preset, flags) and a pass/fail per target.

    python -m bench.bench_engine --out engine.json                      # 8b on the GPU
    python -m bench.bench_engine --preset small --backend host --out be.json --concurrency 1,4 --quick
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import itertools
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import torch

from bench import processes
from bench.bench_allocator import _device_info, _git_commit
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc
from worker.model.config import PRESETS, ModelConfig
from worker.model.weights import fill_synthetic, weight_shapes

GB = 1e9
PROMPT_TOKENS = 40
HF_NEW_TOKENS = 64
HF_STREAMS = 16
STREAM_NEW_TOKENS = 128
CONCURRENT_NEW_TOKENS = 64
LONG_PROMPT_TOKENS = 2000
REFERENCE_NEW_TOKENS = 16
"""Greedy tokens compared between transformers and the worker (a check that both serve the same weights)."""

DECODE_TARGET_MS = 6.7
SPEEDUP_TARGET = 10.0
THROUGHPUT_TARGETS = {16: 1500.0, 64: 4000.0}
"""Streams -> aggregate tok/s the worker must reach."""
LONG_TTFT_TARGET_S = 0.100
WAKE_TTFT_SLACK = 1.2
"""First token after a wake: at most the wake plus this times the awake TTFT."""

STATUS_TIMEOUT_S = 10.0
GENERATE_TIMEOUT_S = 300.0
TRANSITION_TIMEOUT_S = 180.0
SWAP_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 120.0


# ---- small helpers ----
def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _pct(xs: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) with linear interpolation; None for no data."""
    s = sorted(xs)
    if not s:
        return None
    k = (len(s) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _ms(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x * 1e3:.{digits}f} ms"


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


class Prompts:
    """Random token ids in [0, vocab) from one seeded generator: the same run, the same prompts."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab = vocab
        self.rng = random.Random(seed)

    def make(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]


def _seconds(d: Any) -> float:
    """A google.protobuf.Duration in seconds."""
    return float(d.ToNanoseconds()) / 1e9


def _summary(e: BaseException) -> str:
    """One line for an error: a gRPC status code and its details, else the exception."""
    if isinstance(e, grpc.RpcError):
        return f"{e.code().name}: {e.details()}"
    return f"{type(e).__name__}: {e}"


# ---- A. transformers baseline ----
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_transformers(config: ModelConfig, device: torch.device, seed: int) -> Any:
    """transformers' LlamaForCausalLM for ``config``, on ``device``, holding our synthetic weights."""
    transformers: Any = importlib.import_module("transformers")  # untyped: used as Any
    if config.family != "llama":
        raise SystemExit(f"the transformers baseline builds a Llama; the preset is {config.family}")
    hf = {**config.to_hf(), "eos_token_id": None, "bos_token_id": None, "pad_token_id": None}
    hf_config = transformers.LlamaConfig.from_dict(hf)
    if ModelConfig.from_hf(hf_config.to_dict()) != config:
        raise SystemExit(f"transformers' LlamaConfig does not read back to the preset: {hf_config.to_dict()}")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_config)
    model = model.to(dtype=config.torch_dtype)
    model.to_empty(device=device)
    params: dict[str, torch.Tensor] = dict(model.named_parameters())  # a tied lm_head is listed once, as embed
    expected = weight_shapes(config)
    if set(params) != set(expected):
        raise SystemExit(
            "transformers' parameter names differ from weight_shapes: only in transformers "
            f"{sorted(set(params) - set(expected))[:10]}, only ours {sorted(set(expected) - set(params))[:10]}"
        )
    wrong = {n: (tuple(p.shape), expected[n]) for n, p in params.items() if tuple(p.shape) != expected[n]}
    if wrong:
        raise SystemExit(f"transformers' parameter shapes differ from weight_shapes: {dict(list(wrong.items())[:5])}")
    if config.tie_word_embeddings and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise SystemExit("tie_word_embeddings, but transformers' lm_head is not embed_tokens")
    fill_synthetic(params, config, seed)
    # to_empty left the RoPE buffers (computed at init, on meta) uninitialised: compute them again
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config).to(device)
    others = [n for n, _ in model.named_buffers() if not n.startswith("model.rotary_emb.")]
    if others:
        raise SystemExit(f"buffers other than RoPE's that to_empty left uninitialised: {others}")
    return model.eval()


def _hf_generate(model: Any, device: torch.device, prompts: list[list[int]], new: int) -> tuple[float, torch.Tensor]:
    """Wall seconds of one greedy generate of exactly ``new`` tokens per prompt (all one length)."""
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    _sync(device)
    t0 = time.perf_counter()
    out: torch.Tensor = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        eos_token_id=None,
        pad_token_id=0,
    )
    _sync(device)
    dt = time.perf_counter() - t0
    if tuple(out.shape) != (len(prompts), len(prompts[0]) + new):
        raise RuntimeError(
            f"transformers generated {tuple(out.shape)}, expected {(len(prompts), len(prompts[0]) + new)}"
        )
    return dt, out


def transformers_baseline(
    config: ModelConfig, device: torch.device, seed: int, long_tokens: int, reps: int, reference: list[int]
) -> dict[str, Any]:
    transformers: Any = importlib.import_module("transformers")
    t0 = time.perf_counter()
    model = build_transformers(config, device, seed)
    _sync(device)
    build_s = time.perf_counter() - t0
    prompts = Prompts(config.vocab_size, seed + 100)
    try:
        # warm-up once, every shape timed below
        _hf_generate(model, device, [prompts.make(PROMPT_TOKENS)], 8)
        _hf_generate(model, device, [prompts.make(PROMPT_TOKENS) for _ in range(HF_STREAMS)], 2)
        _hf_generate(model, device, [prompts.make(long_tokens)], 1)
        t1 = [_hf_generate(model, device, [prompts.make(PROMPT_TOKENS)], 1)[0] for _ in range(reps)]
        tn = [_hf_generate(model, device, [prompts.make(PROMPT_TOKENS)], HF_NEW_TOKENS)[0] for _ in range(reps)]
        batch = [
            _hf_generate(model, device, [prompts.make(PROMPT_TOKENS) for _ in range(HF_STREAMS)], HF_NEW_TOKENS)[0]
            for _ in range(reps)
        ]
        long = [_hf_generate(model, device, [prompts.make(long_tokens)], 1)[0] for _ in range(max(reps, 3))]
        _, ref_out = _hf_generate(model, device, [reference], REFERENCE_NEW_TOKENS)
        ref_tokens = [int(t) for t in ref_out[0, len(reference) :].tolist()]
    finally:
        attn = str(getattr(model.config, "_attn_implementation", None))
        del model
        gc.collect()  # transformers' modules hold reference cycles: free the weights before the worker starts
        if device.type == "cuda":
            torch.cuda.empty_cache()
    m1, mn, mb = statistics.median(t1), statistics.median(tn), statistics.median(batch)
    return {
        "transformers": transformers.__version__,
        "device": str(device),
        "dtype": config.dtype,
        "attn_implementation": attn,
        "build_s": build_s,
        "one_stream": {
            "prompt_tokens": PROMPT_TOKENS,
            "new_tokens": HF_NEW_TOKENS,
            "t_1_new_s": t1,
            f"t_{HF_NEW_TOKENS}_new_s": tn,
            "decode_ms_per_token": (mn - m1) / (HF_NEW_TOKENS - 1) * 1e3,
        },
        "batched": {
            "streams": HF_STREAMS,
            "prompt_tokens": PROMPT_TOKENS,
            "new_tokens": HF_NEW_TOKENS,
            "wall_s": batch,
            "tok_per_s": HF_STREAMS * HF_NEW_TOKENS / mb,
        },
        "ttft_long": {"prompt_tokens": long_tokens, "s": long, "median_s": statistics.median(long)},
        "ttft_short": {"prompt_tokens": PROMPT_TOKENS, "s": t1, "median_s": m1, "note": "the t(1 new) calls"},
        "reference_tokens": ref_tokens,
    }


# ---- B. the worker through gRPC ----
class WorkerProcess:
    """``memsvc worker`` as a subprocess: its address from the "listening on" line; ready at "ready:"."""

    def __init__(self, cmd: list[str]) -> None:
        self.cmd = cmd
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - a file, not a pipe: a full pipe stalls the worker
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.address = ""
        self.stdout: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        t0 = time.perf_counter()
        if not self._ready.wait(READY_TIMEOUT_S) or self.proc.poll() is not None or not self.address:
            self.stop()
            raise RuntimeError(f"the worker did not become ready: {shlex.join(cmd)}\n" + "\n".join(self.log_tail()))
        self.ready_s = time.perf_counter() - t0
        self.channel = grpc.insecure_channel(self.address)
        self.stub = worker_grpc.ModelWorkerServiceStub(self.channel)

    def _read(self) -> None:
        """Reads stdout to its end (so the pipe never fills), noting the address and readiness."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout.append(line.rstrip())
            if " listening on " in line:
                self.address = line.split(" listening on ")[1].strip()
            if " ready: " in line:
                self._ready.set()
        self._ready.set()  # exited before ready: wake the waiter

    def wait_awake(self) -> worker_pb.GetWorkerStatusResponse:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            st = self.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=STATUS_TIMEOUT_S)
            if st.status.state == common_pb.WORKER_STATE_AWAKE and not st.status.transition_in_progress:
                return st
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"the worker is {common_pb.WorkerState.Name(st.status.state)}, not AWAKE")
            time.sleep(0.1)

    def log_tail(self, n: int = 30) -> list[str]:
        self.log.flush()
        self.log.seek(0)
        lines = self.log.read().splitlines()
        self.log.seek(0, 2)
        return lines[-n:]

    def stop(self) -> int | None:
        """SIGTERM, then wait (the worker drains its calls); kill only when it does not end."""
        rc = processes.stop(self.proc, STOP_TIMEOUT_S)
        if hasattr(self, "channel"):
            self.channel.close()
        return rc


def _request(prompt: list[int], new: int) -> worker_pb.GenerateRequest:
    return worker_pb.GenerateRequest(
        prompt_token_ids=prompt, max_new_tokens=new, ignore_eos=True, sampling=worker_pb.SamplingParams(temperature=0.0)
    )


def _generate(
    stub: worker_grpc.ModelWorkerServiceStub, req: worker_pb.GenerateRequest
) -> tuple[worker_pb.GenerateResponse, int]:
    """Generate, retrying calls refused as OVERLOADED (RESOURCE_EXHAUSTED); the answer and the refusals."""
    deadline = time.monotonic() + GENERATE_TIMEOUT_S
    refused = 0
    while True:
        try:
            resp = stub.Generate(req, timeout=max(1.0, deadline - time.monotonic()))
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            refused += 1
            time.sleep(random.uniform(0.5, 1.0) * min(0.05, 0.001 * 2**refused))  # no storm of refused calls
            continue
        if resp.completion_token_count != req.max_new_tokens:
            raise RuntimeError(f"asked for {req.max_new_tokens} tokens, got {resp.completion_token_count}")
        return resp, refused


def _timed_generate(stub: worker_grpc.ModelWorkerServiceStub, req: worker_pb.GenerateRequest) -> tuple[float, float]:
    """(client wall s, server duration s) of one Generate."""
    t0 = time.perf_counter()
    resp, _ = _generate(stub, req)
    return time.perf_counter() - t0, _seconds(resp.duration)


def stream_decode(stub: worker_grpc.ModelWorkerServiceStub, prompt: list[int], new: int) -> dict[str, Any]:
    """One GenerateStream: TTFT and the per-token gaps after the first token (a message carrying k
    tokens counts as k gaps of a k-th of its wait each)."""
    arrivals: list[tuple[float, int]] = []
    done: worker_pb.GenerateResponse | None = None
    t0 = time.perf_counter()
    call = stub.GenerateStream(
        worker_pb.GenerateStreamRequest(request=_request(prompt, new)), timeout=GENERATE_TIMEOUT_S
    )
    for msg in call:
        now = time.perf_counter()
        if msg.token_ids:
            arrivals.append((now, len(msg.token_ids)))
        if msg.HasField("done"):
            done = msg.done
    tokens = sum(k for _, k in arrivals)
    if done is None or tokens != new or done.completion_token_count != new:
        raise RuntimeError(f"GenerateStream: asked for {new} tokens, streamed {tokens}")
    gaps = [(t - p) / k for (p, _), (t, k) in itertools.pairwise(arrivals) for _ in range(k)]
    first_t, first_k = arrivals[0]
    return {
        "ttft_s": first_t - t0,
        "messages": len(arrivals),
        "tokens_in_first_message": first_k,
        "gap_ms_median": statistics.median(gaps) * 1e3 if gaps else None,
        "gap_ms_p90": _pct([g * 1e3 for g in gaps], 0.9),
        "ms_per_token_mean": (arrivals[-1][0] - first_t) / max(1, tokens - first_k) * 1e3,
        "total_s": time.perf_counter() - t0,
        "server_s": _seconds(done.duration),
        "gaps_ms": [g * 1e3 for g in gaps],
    }


def _decode_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    gaps = [g for r in runs for g in r["gaps_ms"]]
    return {
        "streams": len(runs),
        "ms_per_token_median": _median(gaps),
        "ms_per_token_p90": _pct(gaps, 0.9),
        "ms_per_token_mean": statistics.mean(r["ms_per_token_mean"] for r in runs),
        "ttft_s_median": statistics.median(r["ttft_s"] for r in runs),
        "runs": [{k: v for k, v in r.items() if k != "gaps_ms"} for r in runs],
    }


def one_stream(stub: worker_grpc.ModelWorkerServiceStub, prompts: Prompts, reps: int, ttft_reps: int) -> dict[str, Any]:
    runs = [stream_decode(stub, prompts.make(PROMPT_TOKENS), STREAM_NEW_TOKENS) for _ in range(reps)]
    ttft = [_timed_generate(stub, _request(prompts.make(PROMPT_TOKENS), 1)) for _ in range(ttft_reps)]
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": STREAM_NEW_TOKENS,
        "decode": _decode_summary(runs),
        "ttft_awake": {
            "prompt_tokens": PROMPT_TOKENS,
            "client_s": [a for a, _ in ttft],
            "server_s": [b for _, b in ttft],
            "median_s": statistics.median(a for a, _ in ttft),
        },
    }


def _round(stub: worker_grpc.ModelWorkerServiceStub, reqs: list[worker_pb.GenerateRequest]) -> dict[str, Any]:
    """All ``reqs`` at once, one thread each, released together; wall from release to the last answer."""
    gate = threading.Barrier(len(reqs) + 1)

    def one(req: worker_pb.GenerateRequest) -> tuple[float, int, int]:
        gate.wait()
        t0 = time.perf_counter()
        resp, refused = _generate(stub, req)
        return time.perf_counter() - t0, refused, resp.completion_token_count

    with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
        futures = [pool.submit(one, r) for r in reqs]
        gate.wait(timeout=60)
        t0 = time.perf_counter()
        results = [f.result() for f in futures]
        wall = time.perf_counter() - t0
    latencies = [r[0] for r in results]
    tokens = sum(r[2] for r in results)
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_per_s": tokens / wall,
        "latency_s_median": statistics.median(latencies),
        "latency_s_max": max(latencies),
        "overloaded_retries": sum(r[1] for r in results),
    }


def concurrency(
    stub: worker_grpc.ModelWorkerServiceStub, prompts: Prompts, levels: list[int], warm: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in levels:
        if warm:
            _round(stub, [_request(prompts.make(PROMPT_TOKENS), CONCURRENT_NEW_TOKENS) for _ in range(n)])
        row = _round(stub, [_request(prompts.make(PROMPT_TOKENS), CONCURRENT_NEW_TOKENS) for _ in range(n)])
        out[str(n)] = {"streams": n, "prompt_tokens": PROMPT_TOKENS, "new_tokens": CONCURRENT_NEW_TOKENS, **row}
    return out


def long_prompt(
    stub: worker_grpc.ModelWorkerServiceStub, prompts: Prompts, tokens: int, reps: int, warm: bool
) -> dict[str, Any]:
    if warm:
        _timed_generate(stub, _request(prompts.make(tokens), 1))
    rows = [_timed_generate(stub, _request(prompts.make(tokens), 1)) for _ in range(reps)]
    return {
        "prompt_tokens": tokens,
        "client_s": [a for a, _ in rows],
        "server_s": [b for _, b in rows],
        "median_s": statistics.median(a for a, _ in rows),
        "server_median_s": statistics.median(b for _, b in rows),
    }


def wake_cycles(
    stub: worker_grpc.ModelWorkerServiceStub, prompts: Prompts, cycles: int, delay_s: float, ttft_awake_s: float | None
) -> dict[str, Any]:
    """Sleep(level 1), WakeUp, Generate(1 token) twice: at once, and ``delay_s`` after the wake."""
    out: dict[str, Any] = {"delay_s": delay_s, "prompt_tokens": PROMPT_TOKENS}
    for name, delay in (("immediate", 0.0), ("delayed", delay_s)):
        rows = []
        for i in range(cycles):
            s = stub.Sleep(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1), timeout=TRANSITION_TIMEOUT_S)
            t0 = time.perf_counter()
            k = stub.WakeUp(worker_pb.WakeUpRequest(), timeout=TRANSITION_TIMEOUT_S)
            t1 = time.perf_counter()
            if delay:
                time.sleep(delay)
            t2 = time.perf_counter()
            _generate(stub, _request(prompts.make(PROMPT_TOKENS), 1))
            t3 = time.perf_counter()
            _generate(stub, _request(prompts.make(PROMPT_TOKENS), 1))
            t4 = time.perf_counter()
            rows.append(
                {
                    "cycle": i + 1,
                    "sleep_server_s": _seconds(s.transition.duration),
                    "wake_bytes": k.transition.moved_bytes,
                    "wake_client_s": t1 - t0,
                    "wake_server_s": _seconds(k.transition.duration),
                    "wake_GBps_server": k.transition.gigabytes_per_second,
                    "first_generate_s": t3 - t2,
                    "second_generate_s": t4 - t3,
                    "wake_to_first_token_s": t3 - t0 - delay,
                }
            )
        keys = ("wake_client_s", "wake_server_s", "first_generate_s", "second_generate_s", "wake_to_first_token_s")
        out[name] = {"cycles": rows, "median": {key: statistics.median(r[key] for r in rows) for key in keys}}
    med = out["immediate"]["median"]
    if ttft_awake_s is not None:
        bound = med["wake_client_s"] + WAKE_TTFT_SLACK * ttft_awake_s
        out["check"] = {
            "ttft_awake_s": ttft_awake_s,
            "bound_s": bound,
            "wake_to_first_token_s": med["wake_to_first_token_s"],
            "passed": med["wake_to_first_token_s"] <= bound,
            "first_generate_s": med["first_generate_s"],
            "first_generate_le_bound": med["first_generate_s"] <= bound,
        }
    return out


def beside_swap(
    stub: worker_grpc.ModelWorkerServiceStub, prompts: Prompts, blocks: int, reps: int, alone_s: float
) -> dict[str, Any]:
    """Decode alone vs. while a thread loops SwapBlocks of ``blocks`` free blocks out and back in."""
    kv = stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=STATUS_TIMEOUT_S).status.kv_cache
    n = min(blocks, kv.device_block_count // 4, kv.host_block_count)
    room = (PROMPT_TOKENS + STREAM_NEW_TOKENS) // max(1, kv.block_size_tokens) + 2  # the decode's own blocks
    if n <= 0 or kv.device_free_block_count < n + room or kv.host_free_block_count < n:
        raise RuntimeError(f"too few free blocks to swap {n}: {kv}")
    dev = list(range(kv.device_block_count - n, kv.device_block_count))  # the top: sequences take the lowest ids
    host = list(range(kv.host_block_count - n, kv.host_block_count))
    out_req = worker_pb.SwapBlocksRequest(
        direction=common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, src_blocks=dev, dst_blocks=host
    )
    in_req = worker_pb.SwapBlocksRequest(
        direction=common_pb.SWAP_DIRECTION_HOST_TO_DEVICE, src_blocks=host, dst_blocks=dev
    )
    for req in (out_req, in_req):
        stub.SwapBlocks(req, timeout=SWAP_TIMEOUT_S)

    stop = threading.Event()
    moved = [0, 0]  # bytes, calls
    server_gbps: list[float] = []
    errors: list[str] = []

    def swapper() -> None:
        try:
            while not stop.is_set():
                for req in (out_req, in_req):  # in after out's answer: it reads what out wrote
                    r = stub.SwapBlocks(req, timeout=SWAP_TIMEOUT_S)
                    moved[0] += r.moved_bytes
                    moved[1] += 1
                    server_gbps.append(r.gigabytes_per_second)
        except Exception as e:  # the decode's numbers would mean nothing: report it
            errors.append(repr(e))

    def swapping(body: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
        stop.clear()
        moved[0] = moved[1] = 0
        server_gbps.clear()
        th = threading.Thread(target=swapper, daemon=True)
        t0 = time.perf_counter()
        th.start()
        result = body()
        stop.set()
        th.join(timeout=SWAP_TIMEOUT_S * 2)
        dt = time.perf_counter() - t0
        if errors:
            raise RuntimeError(f"SwapBlocks failed: {errors[0]}")
        return result, {
            "calls": moved[1],
            "bytes": moved[0],
            "seconds": dt,
            "GBps": moved[0] / dt / GB,
            "GBps_server_median": _median(server_gbps),
        }

    alone = _decode_summary([stream_decode(stub, prompts.make(PROMPT_TOKENS), STREAM_NEW_TOKENS) for _ in range(reps)])
    _, swap_alone = swapping(lambda: time.sleep(alone_s))
    runs, swap_during = swapping(
        lambda: [stream_decode(stub, prompts.make(PROMPT_TOKENS), STREAM_NEW_TOKENS) for _ in range(reps)]
    )
    beside = _decode_summary(runs)
    a, b = alone["ms_per_token_median"], beside["ms_per_token_median"]
    a_mean, b_mean = alone["ms_per_token_mean"], beside["ms_per_token_mean"]
    return {
        "blocks_per_call": n,
        "block_bytes": kv.block_bytes,
        "device_blocks": dev[:1] + dev[-1:],
        "host_blocks": host[:1] + host[-1:],
        "new_tokens": STREAM_NEW_TOKENS,
        "alone": alone,
        "beside_swap": beside,
        "slowdown_median": b / a if a and b else None,
        "slowdown_mean": b_mean / a_mean,
        "swap_alone": swap_alone,
        "swap_during_decode": swap_during,
    }


def compare_reference(
    stub: worker_grpc.ModelWorkerServiceStub, reference: list[int], theirs: list[int]
) -> dict[str, Any]:
    """The worker's greedy tokens for transformers' reference prompt (same weights: the same tokens in
    float32; in bfloat16 they may part after a few)."""
    resp, _ = _generate(stub, _request(reference, REFERENCE_NEW_TOKENS))
    ours = list(resp.token_ids)
    prefix = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), len(ours))
    return {"ours": ours, "transformers": theirs, "equal": ours == theirs, "matching_prefix": prefix}


# ---- C. targets, table ----
def _get(res: dict[str, Any], *path: str) -> Any:
    cur: Any = res
    for key in path:
        if not isinstance(cur, dict) or key not in cur:
            return None
        cur = cur[key]
    return cur


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    def row(name: str, value: float | None, unit: str, target: str, ok: bool | None) -> dict[str, Any]:
        return {"target": name, "value": value, "unit": unit, "goal": target, "passed": ok}

    ours_ms = _get(res, "worker", "one_stream", "decode", "ms_per_token_median")
    theirs_ms = _get(res, "transformers", "one_stream", "decode_ms_per_token")
    speedup = theirs_ms / ours_ms if ours_ms and theirs_ms else None
    rows = [
        row(
            "decode, one stream",
            ours_ms,
            "ms/token",
            f"<= {DECODE_TARGET_MS}",
            None if ours_ms is None else ours_ms <= DECODE_TARGET_MS,
        ),
        row(
            "decode vs transformers eager",
            speedup,
            "x",
            f">= {SPEEDUP_TARGET:g}x",
            None if speedup is None else speedup >= SPEEDUP_TARGET,
        ),
    ]
    for n, goal in THROUGHPUT_TARGETS.items():
        tps = _get(res, "worker", "concurrency", str(n), "tok_per_s")
        rows.append(row(f"{n} streams", tps, "tok/s", f">= {goal:g}", None if tps is None else tps >= goal))
    long_s = _get(res, "worker", "ttft_long", "median_s")
    tokens = _get(res, "worker", "ttft_long", "prompt_tokens")
    rows.append(
        row(
            f"TTFT {tokens or LONG_PROMPT_TOKENS}-token prompt",
            None if long_s is None else long_s * 1e3,
            "ms",
            f"<= {LONG_TTFT_TARGET_S * 1e3:g}",
            None if long_s is None else long_s <= LONG_TTFT_TARGET_S,
        )
    )
    check = _get(res, "worker", "wake", "check")
    rows.append(
        row(
            "first token after wake",
            None if check is None else check["wake_to_first_token_s"] * 1e3,
            "ms",
            f"<= wake + {WAKE_TTFT_SLACK}x awake TTFT" + ("" if check is None else f" = {check['bound_s'] * 1e3:.1f}"),
            None if check is None else bool(check["passed"]),
        )
    )
    return rows


def table(res: dict[str, Any]) -> list[str]:
    lines = [
        f"{res['date']}  {res['device']} driver {res.get('driver', '-')}  commit {res['commit']}  "
        f"preset {res['preset']}  backend {res['flags']['backend']}"
    ]
    hf = res.get("transformers")
    if isinstance(hf, dict) and "one_stream" in hf:
        lines += [
            f"transformers {hf['transformers']} eager ({hf['attn_implementation']}) on {hf['device']}, {hf['dtype']}",
            f"  decode, one stream           {hf['one_stream']['decode_ms_per_token']:9.2f} ms/token",
            f"  {HF_STREAMS} streams x {HF_NEW_TOKENS} in one call   {hf['batched']['tok_per_s']:9.1f} tok/s",
            f"  TTFT {hf['ttft_long']['prompt_tokens']}-token prompt      {_ms(hf['ttft_long']['median_s']):>12}",
            f"  TTFT {PROMPT_TOKENS}-token prompt        {_ms(hf['ttft_short']['median_s']):>12}",
        ]
    wk = res.get("worker", {})
    if wk:
        lines.append(f"memsvc worker ({res['flags']['backend']}), ready after {_num(wk.get('ready_s'), '.1f')} s")
    one = wk.get("one_stream")
    if isinstance(one, dict):
        d = one["decode"]
        lines += [
            f"  decode, one stream (GenerateStream {STREAM_NEW_TOKENS}): median {_num(d['ms_per_token_median'], '.2f')}"
            f" p90 {_num(d['ms_per_token_p90'], '.2f')} mean {d['ms_per_token_mean']:.2f} ms/token;"
            f" stream TTFT {_ms(d['ttft_s_median'])}",
            f"  TTFT awake ({PROMPT_TOKENS}-token prompt, Generate 1 token): {_ms(one['ttft_awake']['median_s'])}",
        ]
    ref = wk.get("reference")
    if isinstance(ref, dict):
        lines.append(
            f"  same weights as transformers: first {REFERENCE_NEW_TOKENS} greedy tokens "
            + ("equal" if ref["equal"] else f"agree for {ref['matching_prefix']}")
        )
    conc = wk.get("concurrency")
    if isinstance(conc, dict):
        for n, r in conc.items():
            if isinstance(r, dict) and "tok_per_s" in r:
                lines.append(
                    f"  {n:>3} concurrent x {CONCURRENT_NEW_TOKENS}: {r['tok_per_s']:9.1f} tok/s, latency median "
                    f"{r['latency_s_median'] * 1e3:.1f} ms, max {r['latency_s_max'] * 1e3:.1f} ms, "
                    f"OVERLOADED retries {r['overloaded_retries']}"
                )
    lp = wk.get("ttft_long")
    if isinstance(lp, dict) and "median_s" in lp:
        lines.append(
            f"  TTFT {lp['prompt_tokens']}-token prompt: {_ms(lp['median_s'])} (worker {_ms(lp['server_median_s'])})"
        )
    wake = wk.get("wake")
    if isinstance(wake, dict) and "immediate" in wake:
        for name in ("immediate", "delayed"):
            for r in wake[name]["cycles"]:
                lines.append(
                    f"  wake {name:9s} cycle {r['cycle']}: wake {_ms(r['wake_client_s'], 1)} (server "
                    f"{_ms(r['wake_server_s'], 1)}, {r['wake_GBps_server']:.1f} GB/s), 1st Generate "
                    f"{_ms(r['first_generate_s'], 1)}, 2nd {_ms(r['second_generate_s'], 1)}"
                )
        if "check" in wake:
            ch = wake["check"]
            lines.append(
                f"  first token after wake {_ms(ch['wake_to_first_token_s'], 1)} vs bound {_ms(ch['bound_s'], 1)} "
                f"(wake + {WAKE_TTFT_SLACK} x TTFT awake {_ms(ch['ttft_awake_s'], 1)})"
            )
    sw = wk.get("swap")
    if isinstance(sw, dict) and "alone" in sw:
        lines.append(
            f"  decode beside SwapBlocks ({sw['blocks_per_call']} x {sw['block_bytes']} B per call), ms/token "
            f"median/mean: alone {_num(sw['alone']['ms_per_token_median'], '.2f')}/"
            f"{sw['alone']['ms_per_token_mean']:.2f}, beside {_num(sw['beside_swap']['ms_per_token_median'], '.2f')}/"
            f"{sw['beside_swap']['ms_per_token_mean']:.2f} (x{_num(sw['slowdown_median'], '.2f')}/"
            f"x{sw['slowdown_mean']:.2f})"
        )
        lines.append(
            f"  SwapBlocks during the decode: {sw['swap_during_decode']['calls']} calls, "
            f"{sw['swap_during_decode']['GBps']:.2f} GB/s; alone {sw['swap_alone']['calls']} calls, "
            f"{sw['swap_alone']['GBps']:.2f} GB/s"
        )
    for phase, err in res.get("errors", {}).items():
        lines.append(f"  ERROR in {phase}: {err.splitlines()[0] if err else ''}")
    lines.append("targets:")
    for t in res.get("targets", []):
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t["passed"]]
        value = "-" if t["value"] is None else f"{t['value']:.2f} {t['unit']}"
        lines.append(f"  {verdict:4s}  {t['target']:32s} {value:>18}   goal {t['goal']}")
    return lines


# ---- main ----
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="8b", choices=sorted(PRESETS))
    ap.add_argument("--backend", default="cuda", choices=["cuda", "host", "auto"])
    ap.add_argument(
        "--kv-blocks",
        type=int,
        default=8192,
        help="device KV blocks (default: 64 streams x (40+64) tokens and a 2000-token prompt at 16 tokens/block, "
        "with room to spare)",
    )
    ap.add_argument("--host-kv-blocks", type=int, default=512, help="host KV blocks (SwapBlocks destination)")
    ap.add_argument("--swap-blocks", type=int, default=256, help="blocks per SwapBlocks call beside the decode")
    ap.add_argument("--out", default="engine.json")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--worker-args", default="", help='extra worker flags, e.g. "--host-prepin weights"')
    ap.add_argument("--concurrency", default="1,16,64", help="comma-separated concurrent Generate calls")
    ap.add_argument("--wake-cycles", type=int, default=3)
    ap.add_argument("--wake-delay", type=float, default=3.0, help="seconds between WakeUp and Generate (2nd set)")
    ap.add_argument("--seed", type=int, default=0, help="synthetic weights' seed (both sides) and prompts'")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke runs)")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        ap.error("--concurrency: positive integers, comma-separated")
    config = PRESETS[args.preset]
    cuda = args.backend == "cuda" or (args.backend == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    long_tokens = min(LONG_PROMPT_TOKENS, config.max_position_embeddings - 1)
    reps = 1 if args.quick else 3
    cycles = min(args.wake_cycles, 2) if args.quick else args.wake_cycles

    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": os.environ.get("MEMSVC_COMMIT") or _git_commit() or "unknown",  # a copy without .git: set it
        **_device_info(),
        "preset": args.preset,
        "model": {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "num_layers", "dtype")}
        | {"parameter_bytes": config.param_bytes(), "context": config.max_position_embeddings},
        "flags": vars(args),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "errors": {},
    }
    errors: dict[str, str] = res["errors"]
    tracebacks: dict[str, str] = {}
    res["tracebacks"] = tracebacks
    stuck: list[str] = []  # a worker call that timed out or found the worker gone: later phases would only wait

    def phase(name: str, fn: Callable[[], Any], into: dict[str, Any]) -> Any:
        if stuck:
            errors[name] = f"skipped: {stuck[0]}"
            return None
        print(f"[bench_engine] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            into[name] = fn()
        except Exception as e:
            errors[name] = _summary(e)
            tracebacks[name] = traceback.format_exc()
            print(tracebacks[name], file=sys.stderr, flush=True)
            if isinstance(e, grpc.RpcError) and e.code() in (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNAVAILABLE,
            ):
                stuck.append(f"{name} failed with {e.code().name}")
        print(f"[bench_engine] {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        return into.get(name)

    reference = Prompts(config.vocab_size, args.seed + 1).make(PROMPT_TOKENS)
    if not args.skip_transformers:
        phase(
            "transformers",
            lambda: transformers_baseline(config, device, args.seed, long_tokens, reps, reference),
            res,
        )

    cmd = [
        sys.executable,
        "-m",
        "memsvc.cli",
        "worker",
        "--backend",
        args.backend,
        "--model",
        f"synthetic:{args.preset}",
        "--listen",
        "127.0.0.1:0",
        "--kv-blocks",
        str(args.kv_blocks),
        "--host-kv-blocks",
        str(args.host_kv_blocks),
        "--seed",
        str(args.seed),
        *shlex.split(args.worker_args),
    ]
    wk: dict[str, Any] = {"command": shlex.join(cmd[1:])}
    res["worker"] = wk
    worker: WorkerProcess | None = None
    try:
        worker = WorkerProcess(cmd)
        wk["ready_s"] = worker.ready_s
        status = worker.wait_awake().status
        wk["status"] = {
            "device": status.device.name,
            "backend": status.device.backend,
            "context_length": status.model.context_length,
            "weights_bytes": status.model.weights_bytes,
            "block_bytes": status.kv_cache.block_bytes,
            "block_size_tokens": status.kv_cache.block_size_tokens,
            "device_blocks": status.kv_cache.device_block_count,
            "host_blocks": status.kv_cache.host_block_count,
        }
        stub = worker.stub
        prompts = Prompts(status.model.vocab_size or config.vocab_size, args.seed)
        worker_long = min(long_tokens, status.model.context_length - 1)
        phase("warmup", lambda: _timed_generate(stub, _request(prompts.make(PROMPT_TOKENS), 8)), wk)
        one = phase("one_stream", lambda: one_stream(stub, prompts, reps, 3 if args.quick else 5), wk)
        theirs = _get(res, "transformers", "reference_tokens")
        if theirs is not None:
            phase("reference", lambda: compare_reference(stub, reference, theirs), wk)
        phase("concurrency", lambda: concurrency(stub, prompts, levels, warm=not args.quick), wk)
        phase("ttft_long", lambda: long_prompt(stub, prompts, worker_long, 2 if args.quick else 3, not args.quick), wk)
        ttft_awake = None if one is None else one["ttft_awake"]["median_s"]
        phase("wake", lambda: wake_cycles(stub, prompts, cycles, args.wake_delay, ttft_awake), wk)
        phase("swap", lambda: beside_swap(stub, prompts, args.swap_blocks, reps, 0.5 if args.quick else 2.0), wk)
    except Exception as e:
        errors["worker"] = _summary(e)
        tracebacks["worker"] = traceback.format_exc()
        print(tracebacks["worker"], file=sys.stderr, flush=True)
    finally:
        if worker is not None:
            wk["exit_code"] = worker.stop()
            if errors:
                wk["log_tail"] = worker.log_tail()

    res["targets"] = targets(res)
    Path(args.out).write_text(json.dumps(res, indent=2, default=str) + "\n")  # never lose a run to one odd value
    print()
    print("\n".join(table(res)))
    print(f"\nwrote {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
