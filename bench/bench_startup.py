"""Start-up benchmark: ``memsvc worker`` spawned to serving and to its first token, beside
transformers' ``from_pretrained`` of the same checkpoint, in one run.

Why: a worker that is not running (a crash, a scale-up, a host reboot, a multiplexer that restarts
processes) costs its start-up before the first request is served, and the baseline a user knows is
transformers' ``from_pretrained`` onto the GPU. Issue 17's target: spawn to SERVING <= 2.5 s for an
8B-shaped bf16 Llama checkpoint in the page cache, and ahead of ``from_pretrained`` in the same run.

Per repeat, worker and transformers alternating (the same page cache for both):

A. ``memsvc worker --model <dir>``, timed from the spawn (every stdout and stderr line is stamped as
   it arrives): the ``listening on`` line (health answers NOT_SERVING, status LOADING from then on);
   SERVING, from a ``grpc.health.v1`` Watch opened at the listening line (GetWorkerStatus must then
   say AWAKE); the first token of a GenerateStream sent at SERVING (greedy, ``ignore_eos``); the
   worker's own log lines (the model layer's imports, the weights' load, each CUDA-graph bucket's
   capture, the last one); and once every graph is captured, the same request again, whose tokens
   must equal the first's (decoded eagerly then, replayed from graphs now). With ``--thread-states``,
   its threads are sampled from outside until the first token (bench/thread_states.py), and the run
   says what its import thread and its main thread were doing over the model layer's import: on a
   core, or waiting, and for which lock or call.
B. A subprocess ``import torch, transformers; AutoModelForCausalLM.from_pretrained(dir,
   dtype=torch.bfloat16, device_map="cuda")`` and one greedy token, timed from its spawn, with its own
   split (import torch, import transformers, from_pretrained, first token).
C. Once: a subprocess that only imports torch (and initialises CUDA), for the floor both pay; and
   (unless ``--no-breakdown``) the start's parts, each in a fresh process: the imports, CUDA's start,
   the allocator alone, a fork's, and the read of the checkpoint's tokenizer, which a worker holds the
   GIL for on its way to the first token (``--tokenizer bpe`` writes one of a real model's size:
   bench/bpe_tokenizer.py).
D. With ``--standby N``: N starts of a standby worker, timed from the hand-off of its flags.
E. With ``--on-demand N``: ``memsvc up --config`` serving the model with ``[workers] stop_after = 1``
   and a standby; N times, once memsvc up has stopped the worker (no process) and a standby is
   ready, a streamed completion through the gateway (token ids, ``ignore_eos``), timed from its send
   to its first token; then the same request again, the model awake, for comparison.

Then medians, the table, and pass/fail against the target. JSON out (``--out``), with date, device,
commit (``MEMSVC_COMMIT`` or git) and the flags.

    python -m bench.bench_startup --out startup.json                     # 8B on the GPU (writes the checkpoint)
    python -m bench.bench_startup --tokenizer bpe --out startup.json     # ... with a Llama 3-sized tokenizer
    python -m bench.bench_startup --model /ckpt/llama3-8b-bf16 --repeats 5 --out startup.json
    python -m bench.bench_startup --shape tiny --backend host --repeats 1 --out s.json   # a CPU smoke run
    python -m bench.bench_startup --repeats 0 --no-baseline --no-breakdown --on-demand 3 --out s.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import queue
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import processes
from bench.thread_states import ThreadSampler, by_cpu, summarize
from memsvc.runtime.bytecode import uncompiled
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc
from worker.main import MODEL_LAYER

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGET_SERVING_S = 2.5
PROMPT_TOKENS = 40
NEW_TOKENS = 16
START_TIMEOUT_S = 300.0
GRAPHS_TIMEOUT_S = 120.0
MEMSVC = [sys.executable, "-m", "memsvc.cli"]

_LISTENING = re.compile(r"^memsvc worker \S+ listening on (\S+)$")
LOG_LINES: dict[str, re.Pattern[str]] = {
    "allocator": re.compile(r"allocator: \w+ backend ready in (?P<s>[\d.]+) s"),
    "model_layer_imported": re.compile(r"model layer imported in (?P<s>[\d.]+) s"),
    "read_ahead": re.compile(
        r"checkpoint read-ahead: (?P<gb>[\d.]+) GB read of (?P<shards>\d+) shards in (?P<s>[\d.]+) s"
    ),
    "staged": re.compile(r"checkpoint staging: (?P<gb>[\d.]+) GB on the device in (?P<s>[\d.]+) s"),
    "triton_imported": re.compile(r"triton imported in (?P<s>[\d.]+) s"),
    "triton_own_hashed": re.compile(r"triton: its own hash (?:made|read back) in (?P<s>[\d.]+) s"),
    "triton_hashed": re.compile(
        r"triton: kernel hashes made in (?P<s>[\d.]+) s \((?P<own_waited>[\d.]+) s of it waiting for Triton's own\)"
    ),
    "kernels_ahead": re.compile(r"triton: (?P<n>\d+) kept kernels loaded ahead in (?P<s>[\d.]+) s"),
    "first_products": re.compile(r"cuda: (?P<n>\d+) first products made ahead in (?P<s>[\d.]+) s"),
    "weights_loaded": re.compile(r"weights: [\d.]+ GB from .* in (?P<s>[\d.]+) s"),
    "model_built": re.compile(r"model: built in (?P<s>[\d.]+) s"),
    "warm_up": re.compile(r"warm-up: kernels compiled.* in (?P<s>[\d.]+) s"),
    "text_waited": re.compile(r"model text: read by the RPC front; waited (?P<s>[\d.]+) s"),
    "warm_up_parts": re.compile(
        r"warm-up parts: hashes waited (?P<hashes>[\d.]+) s, generation (?P<generation>[\d.]+) s, "
        r"capture (?P<capture>[\d.]+) s, buckets warmed (?P<warmed>[\d.]+) s"
    ),
    "ready": re.compile(r"^memsvc worker \S+ ready: "),
    "first_graph": re.compile(r"cuda graphs: batch \d+ captured in (?P<s>[\d.]+) s \(1 of"),
    "graphs_done": re.compile(r"cuda graphs: \d+ of \d+ buckets captured in the background"),
}
"""The worker's lines whose arrival (since the spawn) and stated seconds the bench reports."""
_STANDBY_READY = re.compile(r"^memsvc worker standby ready on \S+ in [\d.]+ s")
_GRAPH = re.compile(r"cuda graphs: batch (?P<b>\d+) captured in (?P<s>[\d.]+) s")
_GRAPHS_END = re.compile(r"buckets captured in the background|CUDA graphs off")
"""The last capture, or the worker's warning that it decodes eagerly (a model the graphs do not suit)."""

KEEP_BYTECODE = "from memsvc.runtime.bytecode import default_dir, keep_bytecode; keep_bytecode(default_dir())\n"
"""Every other process the bench times keeps its compiled modules as ``memsvc worker`` does (memsvc/
runtime/bytecode.py): where the installed packages have none, transformers would otherwise pay the
compile of torch at every start and the worker would not, which is not the comparison asked for."""


def _python(code: str, *args: str) -> list[str]:
    """The argv of a child ``python -c`` that keeps its byte-code as :data:`KEEP_BYTECODE` says."""
    return [sys.executable, "-c", KEEP_BYTECODE + code, *args]


PRIME = KEEP_BYTECODE + (
    "import torch\ntry:\n    import transformers.models.llama.modeling_llama\nexcept ImportError:\n    pass\n"
)
"""Run once before anything is timed: the byte-code of what the probes and transformers' path import,
written where keeping it applies (the worker's uncounted warm-up start writes the rest of its own)."""

BASELINE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import transformers
t2 = time.perf_counter()
try:
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, device_map=sys.argv[2])
    how = "device_map"
except ValueError as exc:  # device_map needs accelerate: load, then move (what a user without it does)
    if "accelerate" not in str(exc):
        raise
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).to(sys.argv[2])
    how = "to(device), no accelerate"
if sys.argv[2] == "cuda":
    torch.cuda.synchronize()
t3 = time.perf_counter()
print("loaded", flush=True)
ids = torch.tensor([json.loads(sys.argv[3])], device=sys.argv[2])
with torch.no_grad():
    model.generate(ids, max_new_tokens=1, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
t4 = time.perf_counter()
print("first token", flush=True)
print(json.dumps({"import_torch_s": t1 - t0, "import_transformers_s": t2 - t1, "from_pretrained_s": t3 - t2,
                  "generate_one_s": t4 - t3, "transformers": transformers.__version__, "how": how}), flush=True)
"""
"""transformers' path, timed inside (its own split) and from outside (the spawn to each line)."""

IMPORT_TORCH = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
if sys.argv[1] == "cuda":
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
print(json.dumps({"import_torch_s": t1 - t0, "cuda_init_s": time.perf_counter() - t1, "torch": torch.__version__}))
"""

PROBE = r"""
import json, os, sys, time
mode, backend, layer, model = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4]
out = {}
t0 = time.perf_counter()
if mode == "native":  # the allocator's CUDA context and pools, made natively, torch not imported
    from worker.allocator import AllocatorConfig, MemoryAllocator
    t1 = time.perf_counter()
    MemoryAllocator(AllocatorConfig(backend=backend))
    out = {"import_allocator_s": t1 - t0, "allocator_s": time.perf_counter() - t1}
elif mode == "layers":  # what the worker imports, in order, then CUDA through torch
    import torch
    t1 = time.perf_counter()
    import importlib
    for name in layer:
        importlib.import_module(name)
    t2 = time.perf_counter()
    if backend == "cuda":
        import triton
    t3 = time.perf_counter()
    if backend == "cuda":
        torch.zeros(1, device="cuda"); torch.cuda.synchronize()
    out = {"import_torch_s": t1 - t0, "import_model_layer_s": t2 - t1, "import_triton_s": t3 - t2,
           "cuda_init_s": time.perf_counter() - t3}
elif mode == "tokenizer":  # the checkpoint's tokenizer read, as the worker's load reads it (GIL held)
    from tokenizers import Tokenizer
    t1 = time.perf_counter()
    path = os.path.join(model, "tokenizer.json")
    if os.path.exists(path):
        tokens = Tokenizer.from_file(path).get_vocab_size()
        out = {"import_tokenizers_s": t1 - t0, "tokenizer_read_s": time.perf_counter() - t1, "tokens": tokens}
elif mode == "fork":  # a fork server: everything imported, no CUDA; a child forked, CUDA made there
    import importlib, torch
    for name in layer:
        importlib.import_module(name)
    if backend == "cuda":
        import triton
    t1 = time.perf_counter()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        if backend == "cuda":
            torch.zeros(1, device="cuda"); torch.cuda.synchronize()
        os.write(w, b"x")
        os._exit(0)
    os.read(r, 1)
    os.waitpid(pid, 0)
    out = {"imports_s": t1 - t0, "fork_to_cuda_ready_s": time.perf_counter() - t1}
print(json.dumps(out), flush=True)
"""
"""The start-up's parts, each in a fresh process (issue 30's breakdown)."""


def probe_run(mode: str, args: argparse.Namespace, model: str) -> dict[str, Any]:
    proc = Spawned(_python(PROBE, mode, args.backend, ",".join(MODEL_LAYER), model))
    try:
        done, mt = proc.wait_for(re.compile(r"^\{.*\}$"), START_TIMEOUT_S)
        return {"process_s": done, **json.loads(mt.group(0))}
    finally:
        proc.stop()


def import_times(args: argparse.Namespace, top: int = 15) -> list[dict[str, Any]]:
    """``python -X importtime`` over the model layer's imports: each package by the cumulative time of
    its costliest import line (its first import, as the worker pays it; a package another imports is
    counted in both, e.g. numpy in torch)."""
    code = KEEP_BYTECODE + "import " + ", ".join(MODEL_LAYER)
    if args.backend == "cuda":
        code += "; import triton"
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=START_TIMEOUT_S,
    )
    totals: dict[str, int] = {}
    for line in done.stderr.splitlines():
        parts = line.split("|")
        if len(parts) != 3 or not line.startswith("import time:") or "cumulative" in line:
            continue
        root = parts[2].strip().split(".")[0]
        totals[root] = max(totals.get(root, 0), int(parts[1]))
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return [{"package": k, "cumulative_s": us / 1e6} for k, us in ranked]


class Spawned:
    """A child process whose stdout and stderr lines are stamped with their arrival, in seconds since
    the spawn (read on threads: a full pipe would stall the child)."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None, stdin: bool = False) -> None:
        self.argv = list(argv)
        self.lines: list[tuple[float, str, str]] = []
        """(seconds since the spawn, "out" or "err", line)."""
        self._new: queue.Queue[tuple[float, str, str] | None] = queue.Queue()
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, "out"), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, "err"), daemon=True),
        ]
        for t in self._readers:
            t.start()

    def _read(self, stream: Any, name: str) -> None:
        for line in stream:
            item = (time.perf_counter() - self.t0, name, line.rstrip("\n"))
            self.lines.append(item)
            self._new.put(item)
        self._new.put(None)

    def wait_for(self, pattern: re.Pattern[str], timeout: float) -> tuple[float, re.Match[str]]:
        """The arrival time and match of the first line (so far or to come) matching ``pattern``."""
        for at, _, line in list(self.lines):
            if mt := pattern.search(line):
                return at, mt
        deadline = time.monotonic() + timeout
        ended = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no line matching {pattern.pattern!r} within {timeout:.0f} s\n{self.tail()}")
            try:
                item = self._new.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if item is None:
                ended += 1
                if ended == len(self._readers):
                    rc = self.proc.wait()
                    raise RuntimeError(
                        f"exited with code {rc} before a line matching {pattern.pattern!r}\n{self.tail()}"
                    )
                continue
            if mt := pattern.search(item[2]):
                return item[0], mt

    def count(self, pattern: re.Pattern[str]) -> int:
        """Lines so far that match ``pattern``."""
        return sum(1 for _, _, line in list(self.lines) if pattern.search(line))

    def wait_count(self, pattern: re.Pattern[str], n: int, timeout: float) -> None:
        """Until ``n`` lines have matched ``pattern`` (RuntimeError after ``timeout``, or if it exits)."""
        deadline = time.monotonic() + timeout
        while self.count(pattern) < n:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"{self.count(pattern)} of {n} lines matching {pattern.pattern!r}\n{self.tail()}")
            time.sleep(0.05)

    def found(self, pattern: re.Pattern[str]) -> tuple[float, re.Match[str]] | None:
        for at, _, line in list(self.lines):
            if mt := pattern.search(line):
                return at, mt
        return None

    def tail(self, n: int = 30) -> str:
        return "\n".join(f"{at:8.3f} {name} {line}" for at, name, line in self.lines[-n:])

    def stop(self, timeout: float = 60.0) -> int:
        rc = processes.stop(self.proc, timeout)
        for t in self._readers:
            t.join(timeout=10)
        return rc


@dataclasses.dataclass
class Streamed:
    """One streamed greedy Generate: seconds since the spawn to its first token and to its end, its
    own duration (sent to end), and its tokens."""

    first_s: float
    end_s: float
    took_s: float
    tokens: list[int]


def _generate_stream(stub: worker_grpc.ModelWorkerServiceStub, prompt: list[int], t0: float) -> Streamed:
    sent = time.perf_counter()
    request = worker_pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    first = None
    tokens: list[int] = []
    for msg in stub.GenerateStream(worker_pb.GenerateStreamRequest(request=request), timeout=START_TIMEOUT_S):
        if msg.token_ids and first is None:
            first = time.perf_counter() - t0
        tokens.extend(msg.token_ids)
    if first is None or len(tokens) != NEW_TOKENS:
        raise RuntimeError(f"the stream made {len(tokens)} tokens, not {NEW_TOKENS}")
    end = time.perf_counter()
    return Streamed(first, end - t0, end - sent, tokens)


def serving_at(channel: grpc.Channel, t0: float) -> float | None:
    """Seconds since ``t0`` to the worker's health saying SERVING, from a Watch opened now (None: the
    watch ended first)."""
    health = health_pb2_grpc.HealthStub(channel)
    for answer in health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=START_TIMEOUT_S):
        if answer.status == health_pb2.HealthCheckResponse.SERVING:
            return time.perf_counter() - t0
    return None


def worker_run(model: str, args: argparse.Namespace, prompt: list[int], standby: bool = False) -> dict[str, Any]:
    """One ``memsvc worker`` start, timed from its spawn (see the module docstring, A); with
    ``standby``, from the moment a standby that said it is ready is handed the same flags (D)."""
    # a spawn on a GPU names no backend, as a user's start (auto: cuda here); a standby needs it named
    backend = ["--backend", args.backend] if standby or args.backend != "cuda" else []
    flags = [
        "--model",
        model,
        *backend,
        "--listen",
        "127.0.0.1:0",
        "--kv-blocks",
        str(args.kv_blocks),
        *shlex.split(args.worker_args),
    ]
    out: dict[str, Any] = {}
    if standby:
        proc = Spawned([*MEMSVC, "worker", "--standby", "--backend", args.backend], stdin=True)
        out["standby_ready_s"], _ = proc.wait_for(_STANDBY_READY, START_TIMEOUT_S)
        assert proc.proc.stdin is not None
        proc.t0 = time.perf_counter()  # the start is the hand-off: the standby was there before the request
        proc.proc.stdin.write(json.dumps(flags) + "\n")
        proc.proc.stdin.close()
    else:
        proc = Spawned([*MEMSVC, "worker", *flags])
    sampler = ThreadSampler(proc.proc.pid, origin=proc.t0).start() if args.thread_states and not standby else None
    try:
        out["listening_s"], mt = proc.wait_for(_LISTENING, START_TIMEOUT_S)
        with grpc.insecure_channel(mt.group(1)) as channel:
            if (serving := serving_at(channel, proc.t0)) is not None:
                out["serving_s"] = serving
            stub = worker_grpc.ModelWorkerServiceStub(channel)
            status = stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=30).status
            if status.state != common_pb.WORKER_STATE_AWAKE:
                raise RuntimeError(f"SERVING, but the worker is {common_pb.WorkerState.Name(status.state)}")
            first = _generate_stream(stub, prompt, proc.t0)
            out.update(first_token_s=first.first_s, generate_end_s=first.end_s, first_generate_s=first.took_s)
            if sampler is not None:
                sampler.stop()
                out.update(_import_states(proc, sampler))
            out["second_generate_s"] = _generate_stream(stub, prompt, proc.t0).took_s
            if args.backend == "cuda" and "--no-cuda-graphs" not in shlex.split(args.worker_args):
                _, end = proc.wait_for(_GRAPHS_END, GRAPHS_TIMEOUT_S)
                if "background" in end.group(0):
                    again = _generate_stream(stub, prompt, proc.t0)
                    out["tokens_equal_after_capture"] = again.tokens == first.tokens
                    out["after_capture_generate_s"] = again.took_s
            later = out.get("after_capture_generate_s", out["second_generate_s"])
            out["first_vs_later"] = first.took_s / later if later else None
        for name, pattern in LOG_LINES.items():
            hit = proc.found(pattern)
            if hit is not None:
                out[f"{name}_at_s"] = hit[0]
                for group in pattern.groupindex:
                    out[f"{name}_{group}"] = float(hit[1].group(group))
        captures = [(int(m["b"]), float(m["s"])) for _, _, line in proc.lines if (m := _GRAPH.search(line))]
        out["graph_captures"] = [{"batch": b, "seconds": s} for b, s in captures]
        out["graph_capture_s"] = sum(s for _, s in captures)
    finally:
        if sampler is not None:
            sampler.stop()
        out["exit_code"] = proc.stop()
    return out


def _import_states(proc: Spawned, sampler: ThreadSampler) -> dict[str, Any]:
    """What the import thread (the busiest over the model layer's import, from its log line), the main
    thread and the next busiest threads (the GIL's other takers among them) were doing over that import
    (bench/thread_states.py), for ``--thread-states``."""
    hit = proc.found(LOG_LINES["model_layer_imported"])
    if hit is None:
        return {}
    end = hit[0]
    start = end - float(hit[1].group("s"))
    ranked = [tid for tid in by_cpu(sampler.samples, start, end) if tid != proc.proc.pid]
    if not ranked:
        return {}
    return {
        "import_thread_states": summarize(sampler, ranked[0], start, end),
        "main_thread_states": summarize(sampler, proc.proc.pid, start, end),
        "other_busiest_threads": [summarize(sampler, tid, start, end) for tid in ranked[1:5]],
    }


def baseline_run(model: str, args: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    """transformers' ``from_pretrained`` and one token in a fresh process (see the module docstring, B)."""
    device = "cuda" if args.backend == "cuda" else "cpu"
    proc = Spawned(_python(BASELINE, model, device, json.dumps(prompt)))
    try:
        loaded, _ = proc.wait_for(re.compile(r"^loaded$"), START_TIMEOUT_S)
        first, _ = proc.wait_for(re.compile(r"^first token$"), START_TIMEOUT_S)
        _, mt = proc.wait_for(re.compile(r"^\{.*\}$"), START_TIMEOUT_S)
        return {"loaded_s": loaded, "first_token_s": first, **json.loads(mt.group(0))}
    finally:
        proc.stop()


def import_torch_run(args: argparse.Namespace) -> dict[str, Any]:
    proc = Spawned(_python(IMPORT_TORCH, args.backend))
    try:
        done, mt = proc.wait_for(re.compile(r"^\{.*\}$"), START_TIMEOUT_S)
        return {"process_s": done, **json.loads(mt.group(0))}
    finally:
        proc.stop()


def write_checkpoint(root: Path, shape: str, backend: str) -> dict[str, Any]:
    """bench/bench_gateway.py's checkpoint (random bf16 Llama weights, a word-level tokenizer), written
    by a subprocess, so this process holds no CUDA context and no memory while the workers start."""
    code = (
        "import json, sys; from pathlib import Path; from bench.bench_gateway import write_checkpoint; "
        "print(json.dumps(write_checkpoint(Path(sys.argv[1]), sys.argv[2], sys.argv[3])))"
    )
    device = "cuda" if backend == "cuda" else "cpu"
    done = subprocess.run(
        [sys.executable, "-c", code, str(root), shape, device],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"writing the checkpoint failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in runs if isinstance(r.get(key), int | float)]
    return statistics.median(xs) if xs else None


def _summary(runs: list[dict[str, Any]], *keys: str) -> dict[str, Any]:
    """The runs, and the median of each of ``keys`` over them (``<key>_median``)."""
    return {"runs": runs, **{f"{k}_median": _median(runs, k) for k in keys}}


def _git_commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT)
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


def _device() -> dict[str, Any]:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return {"device": "cpu"}
    return {"device": done.stdout.strip() or "cpu"}


_STOPPED = re.compile(r"memsvc up: worker \S+ stopped after [\d.]+ s asleep")
_ON_DEMAND = re.compile(r"memsvc up: worker \S+ started on demand")
_FROM_STANDBY = re.compile(r"memsvc up: worker \S+ started from the standby")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _first_token_through_the_gateway(gateway: str, prompt: list[int]) -> tuple[float, int]:
    """A streamed /v1/completions of NEW_TOKENS tokens (``ignore_eos``): seconds from its send to the
    first chunk that carries a token, and the tokens streamed."""
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"http://{gateway}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    sent = time.perf_counter()
    first, tokens = None, 0
    with urllib.request.urlopen(request, timeout=START_TIMEOUT_S) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if ids and first is None:
                first = time.perf_counter() - sent
            tokens += len(ids)
    if first is None or tokens != NEW_TOKENS:
        raise RuntimeError(f"the stream carried {tokens} tokens, not {NEW_TOKENS}")
    return first, tokens


def on_demand_runs(model: str, args: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    """E (see the module): a request for a model with no process, through memsvc up and its gateway."""
    root = Path(tempfile.mkdtemp(prefix="ondemand-"))
    gateway = f"127.0.0.1:{_free_port()}"
    flags = ["--kv-blocks", str(args.kv_blocks), *shlex.split(args.worker_args)]
    (root / "host.toml").write_text(
        f'[manager]\nlisten = "127.0.0.1:{_free_port()}"\nmetrics_listen = ""\nstate_dir = "{root / "state"}"\n\n'
        f'[gateway]\nlisten = "{gateway}"\n\n[workers]\nstandby = true\nstop_after = 1\n\n'
        f"[policy]\nidle_sleep_timeout = 1\n\n"
        f'[[models]]\nmodel = "{model}"\nname = "m"\nbackend = "{args.backend}"\nargs = {json.dumps(flags)}\n'
    )
    up = Spawned([*MEMSVC, "up", "--config", str(root / "host.toml")])
    runs: list[dict[str, Any]] = []
    try:
        for i in range(args.on_demand):
            up.wait_count(_STOPPED, i + 1, START_TIMEOUT_S)  # no process for the model
            up.wait_count(_STANDBY_READY, i + 1, START_TIMEOUT_S)  # and a standby waiting
            first_s, _ = _first_token_through_the_gateway(gateway, prompt)
            awake_s, _ = _first_token_through_the_gateway(gateway, prompt)
            started = {"from_standby": up.count(_FROM_STANDBY) == i + 1, "on_demand": up.count(_ON_DEMAND)}
            runs.append({"first_token_s": first_s, "awake_first_token_s": awake_s, **started})
            print(f"[bench_startup] on demand {i + 1}: {json.dumps(runs[-1])}", flush=True)
    finally:
        up.stop()
        shutil.rmtree(root, ignore_errors=True)
    return _summary(runs, "first_token_s", "awake_first_token_s")


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = args.dir or Path(tempfile.mkdtemp(prefix="startbench-"))
    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": os.environ.get("MEMSVC_COMMIT") or _git_commit(),
        **_device(),
        "flags": {k: str(v) for k, v in vars(args).items()},
        "bytecode": {  # whether the worker keeps its compiled modules (memsvc/runtime/bytecode.py) here
            "torch_installed_without": uncompiled("torch"),
            "dont_write_bytecode": bool(sys.flags.dont_write_bytecode),
            "pycache_prefix": os.environ.get("PYTHONPYCACHEPREFIX", ""),  # a caller's own: then left alone
            "bytecode_cache": os.environ.get("MEMSVC_BYTECODE_CACHE", ""),  # "off": not kept
        },
        "errors": {},
    }
    try:
        model = str(args.model) if args.model else ""
        if not model:
            ckpt = root / f"llama3-{args.shape}-bf16"
            res["checkpoint"] = write_checkpoint(ckpt, args.shape, args.backend)
            if args.tokenizer == "bpe":  # in place of the word-level one: a real checkpoint's read
                from bench.bpe_tokenizer import write_bpe_tokenizer

                vocab_size = json.loads((ckpt / "config.json").read_text())["vocab_size"]
                res["checkpoint"]["tokenizer"] = write_bpe_tokenizer(ckpt, vocab_size)
            model = str(ckpt)
            print(f"[bench_startup] checkpoint: {res['checkpoint']}", flush=True)
        res["model"] = model
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        prompt = [rng.randrange(1, vocab) for _ in range(PROMPT_TOKENS)]
        # warm means warm: a cold start before (or another bench's O_DIRECT reads) leaves pages out
        from bench.bench_loader import read_once

        read_once(sorted(Path(model).glob("*.safetensors")))
        subprocess.run([sys.executable, "-c", PRIME], cwd=REPO_ROOT, check=True, timeout=START_TIMEOUT_S)
        if not args.no_breakdown:
            res["import_torch"] = import_torch_run(args)
            print(f"[bench_startup] import torch: {json.dumps(res['import_torch'])}", flush=True)
            modes = ("layers", "native", "fork", "tokenizer")
            res["breakdown"] = {mode: probe_run(mode, args, model) for mode in modes}
            res["breakdown"]["import_times"] = import_times(args)
            print(f"[bench_startup] breakdown: {json.dumps(res['breakdown'])}", flush=True)
        for i in range(args.warmup):
            print(f"[bench_startup] warm-up {i + 1}/{args.warmup} (not counted) ...", flush=True)
            worker_run(model, args, prompt)
        workers: list[dict[str, Any]] = []
        baselines: list[dict[str, Any]] = []
        for i in range(args.repeats):
            workers.append(worker_run(model, args, prompt))
            print(f"[bench_startup] worker {i + 1}: {json.dumps(workers[-1])}", flush=True)
            if not args.no_baseline:
                baselines.append(baseline_run(model, args, prompt))
                print(f"[bench_startup] transformers {i + 1}: {json.dumps(baselines[-1])}", flush=True)
        res["worker"] = _summary(
            workers,
            "listening_s",
            "serving_s",
            "first_token_s",
            "weights_loaded_s",
            "model_layer_imported_at_s",
            "staged_at_s",
            "graphs_done_at_s",
            "graph_capture_s",
            "allocator_s",
            "allocator_at_s",
            "warm_up_s",
            "warm_up_parts_hashes",
            "warm_up_parts_generation",
            "warm_up_parts_capture",
            "warm_up_parts_warmed",
            "model_built_s",
            "ready_at_s",
            "first_generate_s",
            "second_generate_s",
            "after_capture_generate_s",
            "first_vs_later",
        )
        if args.standby:
            runs = []
            for i in range(args.standby):
                runs.append(worker_run(model, args, prompt, standby=True))
                print(f"[bench_startup] standby {i + 1}: {json.dumps(runs[-1])}", flush=True)
            res["standby"] = _summary(
                runs,
                "standby_ready_s",
                "listening_s",
                "serving_s",
                "first_token_s",
                "allocator_s",
                "warm_up_s",
                "weights_loaded_s",
                "first_generate_s",
                "first_vs_later",
            )
        if args.on_demand:
            res["on_demand"] = on_demand_runs(model, args, prompt)
        if args.cold:
            res["cold"] = cold_runs(model, args, prompt)
        res["transformers"] = _summary(
            baselines, "loaded_s", "first_token_s", "import_torch_s", "import_transformers_s", "from_pretrained_s"
        )
    except Exception as exc:  # noqa: BLE001 - the run's JSON says what failed
        res["errors"]["run"] = f"{type(exc).__name__}: {exc}"
        print(res["errors"]["run"], file=sys.stderr, flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    serving = res.get("worker", {}).get("serving_s_median")
    first = res.get("worker", {}).get("first_token_s_median")
    ratio = res.get("worker", {}).get("first_vs_later_median")
    handed = res.get("standby", {}).get("first_token_s_median")
    no_process = res.get("on_demand", {}).get("first_token_s_median")
    theirs = res.get("transformers", {}).get("loaded_s_median")
    res["targets"] = [
        {
            "target": f"warm: spawn to the first token <= {TARGET_SERVING_S} s",
            "value_s": first,
            "goal_s": TARGET_SERVING_S,
            "passed": None if first is None else first <= TARGET_SERVING_S,
        },
        {
            "target": f"a standby: flags handed to the first token <= {TARGET_SERVING_S} s",
            "value_s": handed,
            "goal_s": TARGET_SERVING_S,
            "passed": None if handed is None else handed <= TARGET_SERVING_S,
        },
        {
            "target": f"a request for a model with no process (a standby ready): first token <= {TARGET_SERVING_S} s",
            "value_s": no_process,
            "goal_s": TARGET_SERVING_S,
            "passed": None if no_process is None else no_process <= TARGET_SERVING_S,
        },
        {
            "target": "SERVING means full speed: the first Generate within 1.2x a later one",
            "value": ratio,
            "goal": 1.2,
            "passed": None if ratio is None else ratio <= 1.2,
        },
        {
            "target": f"spawn to SERVING <= {TARGET_SERVING_S} s",
            "value_s": serving,
            "goal_s": TARGET_SERVING_S,
            "passed": None if serving is None else serving <= TARGET_SERVING_S,
        },
        {
            "target": "spawn to SERVING before transformers' spawn to from_pretrained done",
            "value_s": serving,
            "goal_s": theirs,
            "passed": None if serving is None or theirs is None else serving < theirs,
        },
        {
            "target": "the same tokens before and after the graphs are captured",
            "passed": all(r.get("tokens_equal_after_capture", True) for r in res.get("worker", {}).get("runs", [])),
        },
        {
            "target": "cold: spawn to SERVING within 1.2x the shards' O_DIRECT read time",
            "value": res.get("cold", {}).get("serving_vs_read_floor"),
            "goal": 1.2,
            "passed": None
            if not res.get("cold", {}).get("serving_vs_read_floor")
            else res["cold"]["serving_vs_read_floor"] <= 1.2,
        },
    ]
    return res


def cold_runs(model: str, args: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    """One worker start and one transformers start, each with the checkpoint's pages dropped first,
    against the disk's O_DIRECT read time for the same files (bench/bench_tiers.py's probe)."""
    from bench.bench_loader import drop_page_cache
    from bench.bench_tiers import read_floor

    shards = sorted(Path(model).glob("*.safetensors"))
    floor = read_floor(shards)  # reads with O_DIRECT: the cache stays dropped
    drop_page_cache(shards, whole_cache=False)
    worker = worker_run(model, args, prompt)
    print(f"[bench_startup] worker, cold: {json.dumps(worker)}", flush=True)
    out: dict[str, Any] = {"read_floor": floor, "worker": worker}
    if not args.no_baseline:
        drop_page_cache(shards, whole_cache=False)
        out["transformers"] = baseline_run(model, args, prompt)
        print(f"[bench_startup] transformers, cold: {json.dumps(out['transformers'])}", flush=True)
    serving = worker.get("serving_s")
    out["serving_vs_read_floor"] = serving / floor["seconds"] if serving else None
    return out


def format_table(res: dict[str, Any]) -> str:
    def ms(x: Any) -> str:
        return f"{x * 1e3:8.0f} ms" if isinstance(x, int | float) else "       --"

    wk, tf, it = res.get("worker", {}), res.get("transformers", {}), res.get("import_torch", {})
    bd = res.get("breakdown", {})
    layers, native, fork = bd.get("layers", {}), bd.get("native", {}), bd.get("fork", {})
    rows = [
        ("worker: spawn -> listening", wk.get("listening_s_median")),
        ("worker: allocator (CUDA context, pools)", wk.get("allocator_s_median")),
        ("worker: spawn -> checkpoint staged on the device", wk.get("staged_at_s_median")),
        ("worker: spawn -> model layer imported", wk.get("model_layer_imported_at_s_median")),
        ("worker: weights load (its log)", wk.get("weights_loaded_s_median")),
        ("worker: model built (KV, weights, the rest)", wk.get("model_built_s_median")),
        ("worker: warm-up (kernels, one decode graph)", wk.get("warm_up_s_median")),
        ("  waiting for Triton's hashes", wk.get("warm_up_parts_hashes_median")),
        ("  a short generation", wk.get("warm_up_parts_generation_median")),
        ("  batch 1's capture", wk.get("warm_up_parts_capture_median")),
        ("  one eager step of every other bucket", wk.get("warm_up_parts_warmed_median")),
        ("worker: spawn -> ready line", wk.get("ready_at_s_median")),
        ("worker: spawn -> SERVING", wk.get("serving_s_median")),
        ("worker: spawn -> first token", wk.get("first_token_s_median")),
        ("worker: the first Generate (16 tokens)", wk.get("first_generate_s_median")),
        ("worker: the second Generate", wk.get("second_generate_s_median")),
        ("worker: a Generate after every capture", wk.get("after_capture_generate_s_median")),
        ("worker: the first Generate / a later one (x)", wk.get("first_vs_later_median")),
        ("worker: spawn -> all graphs captured", wk.get("graphs_done_at_s_median")),
        ("worker: graph capture (sum of buckets)", wk.get("graph_capture_s_median")),
        ("transformers: spawn -> from_pretrained done", tf.get("loaded_s_median")),
        ("transformers: spawn -> first token", tf.get("first_token_s_median")),
        ("transformers: import torch / transformers", None),
        ("  import torch", tf.get("import_torch_s_median")),
        ("  import transformers", tf.get("import_transformers_s_median")),
        ("  from_pretrained", tf.get("from_pretrained_s_median")),
        ("python -c 'import torch' (+ CUDA init)", it.get("process_s")),
        ("probe: import torch", layers.get("import_torch_s")),
        ("probe: import the model layer after torch", layers.get("import_model_layer_s")),
        ("probe: import triton after it", layers.get("import_triton_s")),
        ("probe: CUDA init through torch after them", layers.get("cuda_init_s")),
        ("probe: the allocator alone, no torch", native.get("allocator_s")),
        ("probe: fork of an imported process -> CUDA ready", fork.get("fork_to_cuda_ready_s")),
        ("probe: the tokenizer's read (tokenizer.json)", bd.get("tokenizer", {}).get("tokenizer_read_s")),
    ]
    rows += [(f"  import {r['package']}", r["cumulative_s"]) for r in bd.get("import_times", [])[:8]]
    sb = res.get("standby", {})
    if sb:
        rows += [
            ("standby: spawn -> ready (before the request)", sb.get("standby_ready_s_median")),
            ("standby: flags handed -> listening", sb.get("listening_s_median")),
            ("standby: allocator", sb.get("allocator_s_median")),
            ("standby: weights", sb.get("weights_loaded_s_median")),
            ("standby: warm-up", sb.get("warm_up_s_median")),
            ("standby: flags handed -> SERVING", sb.get("serving_s_median")),
            ("standby: flags handed -> first token", sb.get("first_token_s_median")),
            ("standby: the first Generate / a later one (x)", sb.get("first_vs_later_median")),
        ]
    od = res.get("on_demand", {})
    if od:
        rows += [
            ("no process: request -> first token (gateway)", od.get("first_token_s_median")),
            ("  the same request, the model awake", od.get("awake_first_token_s_median")),
        ]
    cold = res.get("cold", {})
    if cold:
        rows += [
            ("cold: the shards' O_DIRECT read time", cold.get("read_floor", {}).get("seconds")),
            ("cold: worker spawn -> SERVING", cold.get("worker", {}).get("serving_s")),
            ("cold: transformers spawn -> from_pretrained done", cold.get("transformers", {}).get("loaded_s")),
        ]

    def shown(label: str, value: Any) -> str:
        if label.endswith("(x)"):
            return f"{label:45s} {value:8.2f} x" if isinstance(value, int | float) else f"{label:45s}       --"
        return f"{label:45s} {ms(value)}"

    lines = [shown(label, value) for label, value in rows if value is not None or label.startswith("worker")]
    lines += [json.dumps(t) for t in res.get("targets", [])]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a checkpoint directory (default: write one, --shape)")
    ap.add_argument("--shape", default="8b", choices=["8b", "tiny"], help="the checkpoint to write without --model")
    ap.add_argument(
        "--tokenizer",
        default="words",
        choices=["words", "bpe"],
        help="the written checkpoint's tokenizer: word-level (one word a token), or a byte-level BPE of the "
        "model's vocabulary size and about 2.2 merges a token, as Llama 3's (bench/bpe_tokenizer.py)",
    )
    ap.add_argument("--backend", default="cuda", choices=["cuda", "host"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="worker starts before the measured ones (not counted)")
    ap.add_argument("--kv-blocks", type=int, default=1024)
    ap.add_argument(
        "--worker-args",
        default="",
        help="extra flags for the worker, one string (starting with a dash: --worker-args=--no-checkpoint-staging)",
    )
    ap.add_argument("--no-baseline", action="store_true", help="skip transformers' from_pretrained")
    ap.add_argument("--cold", action="store_true", help="also one start of each with the page cache dropped")
    ap.add_argument(
        "--standby",
        type=int,
        default=0,
        metavar="N",
        help="also N starts from a standby (memsvc worker --standby), timed from the hand-off",
    )
    ap.add_argument(
        "--on-demand",
        type=int,
        default=0,
        metavar="N",
        help="N requests for the model with no process, through memsvc up (stop_after, a standby)",
    )
    ap.add_argument("--no-breakdown", action="store_true", help="skip the parts measured in fresh processes")
    ap.add_argument(
        "--thread-states",
        action="store_true",
        help="sample each spawned worker's threads from outside (bench/thread_states.py) and report what its "
        "import thread and main thread were doing over the model layer's import",
    )
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)")
    ap.add_argument("--out", default="startup.json")
    args = ap.parse_args(argv)
    if args.repeats < 0 or args.warmup < 0:
        ap.error("--repeats and --warmup must be >= 0")
    if args.model is not None and args.tokenizer != "words":
        ap.error("--tokenizer is the tokenizer of the checkpoint the bench writes: not with --model")
    res = run(args)
    Path(args.out).write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(format_table(res))
    print(f"wrote {args.out}")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
