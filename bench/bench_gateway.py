"""Gateway benchmark: two models on one GPU whose device budget fits one, driven through ``memsvc gateway``
by the OpenAI SDK, against the same swap done by restarting a worker process, in one run.

Why: the gateway's promise is that a request for a sleeping model costs a wake (a third of a second
for 16 GB), where the systems that multiplex models by reloading (Ollama, llama-swap, LocalAI) pay a
process start and a checkpoint load. This measures what a client sees: the time from sending a
streamed completion to its first token.

A. An 8B-shaped Llama 3 checkpoint in bfloat16 (transformers ``save_pretrained``, random weights
   drawn on the GPU; 16 GB in 4 shards), with a word-level tokenizer over its whole vocabulary so
   every token streams as text. It stays in the page cache (the reload baseline's best case).
B. A manager, two ``memsvc worker`` processes serving that checkpoint as the models ``alpha`` and
   ``beta`` on the same GPU (``--worker-args``, default ``--host-prepin weights``: sleeps at line rate
   from the first), and a gateway. Both load awake; ``alpha`` is put to sleep, then the policy's
   device budget is set to 1.5 x one worker's mapped bytes, so that waking one must put the other to
   sleep first (the manager's LRU eviction, then the wake).
C. OpenAI SDK, ``stream=True``, 16 tokens after a 40-token prompt, greedy, ``ignore_eos``:
   1. awake: requests for the awake model (TTFT, median);
   2. swap: requests alternating between the models, each finding its model asleep and the other
      awake: TTFT client side, split by the gateway's own histograms (queue, wake incl. the eviction,
      prefill) and the two workers' transition times (the victim's sleep, the wake); once with the
      eviction ending before the wake (``device_swap_headroom_bytes`` 0, the default) and once with
      the two overlapping (headroom: one worker's mapped bytes);
   3. restart baseline: the same alternation done as a reload-based system does it. The request's
      clock starts, the serving worker process is stopped (SIGTERM, waited for), a new worker process
      is started for the other model from the checkpoint, and the request is retried through the
      gateway (404/503 while the new worker registers and loads) until its first token.
D. metadata (UTC date, device, driver, commit, flags), the table, and a pass/fail against the target
   (TTFT of a request that must wake its model, eviction included, <= 0.5 s).

    python -m bench.bench_gateway --out gateway.json                                   # 8B on the GPU
    python -m bench.bench_gateway --shape tiny --backend host --out g.json --reps 2    # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
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
import traceback
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import torch
from google.protobuf.field_mask_pb2 import FieldMask

from bench import processes
from bench.bench_allocator import _device_info, _git_commit
from bench.reference_8b import init_on_gpu
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc

PROMPT_TOKENS = 40
NEW_TOKENS = 16
TARGET_WAKE_TTFT_S = 0.5
START_TIMEOUT_S = 300.0
RETRY_S = 0.02
"""How often the restart baseline's client asks again while the new worker is not serving yet."""

SHAPES: dict[str, dict[str, Any]] = {
    "8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
}


def write_checkpoint(root: Path, shape: str, device: str) -> dict[str, Any]:
    """A bf16 Llama checkpoint of ``shape`` with random weights (scaled so greedy tokens vary) and a
    word-level tokenizer covering its vocabulary (token i is the word ``t<i>``)."""
    transformers: Any = importlib.import_module("transformers")  # untyped: used as Any
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    t0 = time.perf_counter()
    config = transformers.LlamaConfig(**SHAPES[shape], eos_token_id=None, bos_token_id=None, tie_word_embeddings=False)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    init_on_gpu(model, seed=0, device=device)
    model.save_pretrained(root)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))
    size = sum(f.stat().st_size for f in root.glob("*.safetensors"))
    return {"write_s": time.perf_counter() - t0, "bytes": size, "shards": len(list(root.glob("*.safetensors")))}


class Service:
    """A memsvc process; its address from its ``listening on`` line (stdout read to the end in a thread)."""

    def __init__(self, argv: list[str], pattern: str, name: str) -> None:
        self.name = name
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - a file: a full pipe would stall the process
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.address = ""
        self._found = threading.Event()
        self._pattern = re.compile(pattern)
        threading.Thread(target=self._read, daemon=True).start()
        if not self._found.wait(START_TIMEOUT_S) or not self.address:
            self.stop()
            raise RuntimeError(f"{name} did not start: {shlex.join(argv)}\n{self.tail()}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            mt = self._pattern.search(line)
            if mt and not self.address:
                self.address = mt.group(1)
                self._found.set()
        self._found.set()

    def tail(self, n: int = 20) -> str:
        self.log.flush()
        self.log.seek(0)
        lines = self.log.read().splitlines()[-n:]
        self.log.seek(0, 2)
        return "\n".join(lines)

    def stop(self, timeout: float = 60.0) -> int | None:
        return processes.stop(self.proc, timeout)


MEMSVC = [sys.executable, "-m", "memsvc.cli"]


def start_worker(name: str, checkpoint: Path, manager: str, args: argparse.Namespace) -> Service:
    argv = [
        *MEMSVC,
        "worker",
        "--backend",
        args.backend,
        "--model",
        str(checkpoint),
        "--served-model-name",
        name,
        "--worker-id",
        name,
        "--manager",
        manager,
        "--listen",
        "127.0.0.1:0",
        "--kv-blocks",
        str(args.kv_blocks),
        *shlex.split(args.worker_args),
    ]
    return Service(argv, r" listening on (\S+)", f"worker {name}")


def wait_state(
    stub: manager_grpc.MemoryManagerServiceStub, name: str, state: int, timeout: float = START_TIMEOUT_S
) -> Any:
    end = time.monotonic() + timeout
    while True:
        try:
            wk = stub.GetWorker(manager_pb.GetWorkerRequest(name=f"workers/{name}"), timeout=10).worker
            if wk.state == state and not wk.status.transition_in_progress:
                return wk
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
        if time.monotonic() > end:
            raise RuntimeError(f"{name} did not reach state {state}")
        time.sleep(0.02)


def mapped_bytes(wk: Any) -> int:
    return sum(t.mapped_bytes for t in wk.status.tags)


def scrape(gateway: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{gateway}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def stream_ttft(client: Any, model: str, prompt: list[int]) -> tuple[float, float, int]:
    """(time to the first streamed text, to the end, tokens) of one streamed completion."""
    t0 = time.perf_counter()
    first = None
    n = 0
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    total = time.perf_counter() - t0
    if first is None or n != NEW_TOKENS:
        raise RuntimeError(f"{model}: {n} tokens, first text at {first}")
    return first, total, n


def _stats(xs: Sequence[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "runs_s": list(xs)} if xs else {}


def _hist(before: dict[str, float], after: dict[str, float], name: str, model: str) -> float:
    key = f'memsvc_gateway_{name}_seconds_sum{{model="{model}"}}'
    return after.get(key, 0.0) - before.get(key, 0.0)


def _transition(wk: Any) -> dict[str, Any]:
    t = wk.status.last_transition
    return {
        "kind": t.kind,
        "seconds": t.duration.ToNanoseconds() / 1e9,
        "bytes": t.moved_bytes,
        "gb_per_s": t.gigabytes_per_second,
    }


def main() -> int:  # noqa: PLR0915 - one run, phase by phase
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--backend", default="cuda", choices=["cuda", "host"])
    ap.add_argument("--kv-blocks", type=int, default=1024)
    ap.add_argument("--worker-args", default="--host-prepin weights", help="extra flags for both workers")
    ap.add_argument("--reps", type=int, default=6, help="requests per phase")
    ap.add_argument("--restart-reps", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)")
    ap.add_argument("--out", default="gateway.json")
    args = ap.parse_args()
    import openai

    root = args.dir or Path(tempfile.mkdtemp(prefix="gwbench-"))
    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": os.environ.get("MEMSVC_COMMIT") or _git_commit() or "unknown",
        **_device_info(),
        "flags": {k: str(v) for k, v in vars(args).items()},
        "openai": openai.__version__,
        "errors": {},
    }
    services: list[Service] = []
    workers: dict[str, Service] = {}
    rng = random.Random(0)
    vocab = SHAPES[args.shape]["vocab_size"]

    def prompt() -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(PROMPT_TOKENS)]

    try:
        ckpt = root / f"llama3-{args.shape}-bf16"
        res["checkpoint"] = write_checkpoint(ckpt, args.shape, "cuda" if args.backend == "cuda" else "cpu")
        print(f"[bench_gateway] checkpoint: {res['checkpoint']}", flush=True)
        db = root / "manager.db"
        mgr = Service(
            [
                *MEMSVC,
                "manager",
                "--listen",
                "127.0.0.1:0",
                "--db",
                str(db),
                "--idle-sleep-timeout",
                "0",
                "--idle-deep-sleep-timeout",
                "0",
            ],
            r"manager listening on (\S+)",
            "manager",
        )
        services.append(mgr)
        channel = grpc.insecure_channel(mgr.address)
        stub = manager_grpc.MemoryManagerServiceStub(channel)
        for name in ("alpha", "beta"):
            t0 = time.perf_counter()
            workers[name] = start_worker(name, ckpt, mgr.address, args)
            wait_state(stub, name, common_pb.WORKER_STATE_AWAKE)
            res[f"start_{name}_s"] = time.perf_counter() - t0
        one = mapped_bytes(wait_state(stub, "beta", common_pb.WORKER_STATE_AWAKE))
        stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/alpha"), timeout=120)
        budget = int(1.5 * one)
        mask = FieldMask(paths=["device_budget_bytes"])
        stub.UpdatePolicy(
            manager_pb.UpdatePolicyRequest(policy=manager_pb.Policy(device_budget_bytes=budget), update_mask=mask),
            timeout=10,
        )
        res["worker_mapped_bytes"], res["device_budget_bytes"] = one, budget
        gw = Service(
            [*MEMSVC, "gateway", "--listen", "127.0.0.1:0", "--manager", mgr.address],
            r"gateway listening on (\S+)",
            "gateway",
        )
        services.append(gw)
        client = openai.OpenAI(base_url=f"http://{gw.address}/v1", api_key="unused", max_retries=0, timeout=300)
        stream_ttft(client, "beta", prompt())  # warm: the gateway's first request, the worker's first stream

        print("[bench_gateway] awake ...", flush=True)
        awake = [stream_ttft(client, "beta", prompt()) for _ in range(args.reps)]
        res["awake"] = {"ttft": _stats([a[0] for a in awake]), "total": _stats([a[1] for a in awake])}

        def alternate(phase: str, headroom: int, first_model: str) -> dict[str, Any]:
            policy = manager_pb.Policy(device_budget_bytes=budget, device_swap_headroom_bytes=headroom)
            mask = FieldMask(paths=["device_budget_bytes", "device_swap_headroom_bytes"])
            stub.UpdatePolicy(manager_pb.UpdatePolicyRequest(policy=policy, update_mask=mask), timeout=10)
            print(f"[bench_gateway] {phase} (headroom {headroom} bytes) ...", flush=True)
            runs: list[dict[str, Any]] = []
            for i in range(args.reps):
                model = first_model if i % 2 == 0 else ("beta" if first_model == "alpha" else "alpha")
                other = "beta" if model == "alpha" else "alpha"
                before = scrape(gw.address)
                first, total, _ = stream_ttft(client, model, prompt())
                after = scrape(gw.address)
                mine = wait_state(stub, model, common_pb.WORKER_STATE_AWAKE)
                theirs = wait_state(stub, other, common_pb.WORKER_STATE_ASLEEP)
                runs.append(
                    {
                        "model": model,
                        "ttft_s": first,
                        "total_s": total,
                        "gateway_queue_s": _hist(before, after, "queue", model),
                        "gateway_wake_s": _hist(before, after, "wake", model),
                        "gateway_prefill_s": _hist(before, after, "prefill", model),
                        "wake": _transition(mine),
                        "eviction_sleep": _transition(theirs),
                    }
                )
                print(f"[bench_gateway]   {json.dumps(runs[-1])}", flush=True)
            return {
                "device_swap_headroom_bytes": headroom,
                "runs": runs,
                "ttft": _stats([r["ttft_s"] for r in runs]),
                "gateway_wake": _stats([r["gateway_wake_s"] for r in runs]),
                "gateway_prefill": _stats([r["gateway_prefill_s"] for r in runs]),
                "worker_wake": _stats([r["wake"]["seconds"] for r in runs]),
                "worker_eviction_sleep": _stats([r["eviction_sleep"]["seconds"] for r in runs]),
            }

        res["swap"] = alternate("swap", 0, "alpha")  # alpha asleep, beta awake
        awake_now = "alpha" if args.reps % 2 else "beta"
        res["swap_overlapped"] = alternate("swap_overlapped", one, "beta" if awake_now == "alpha" else "alpha")

        print("[bench_gateway] restart baseline ...", flush=True)
        states = {
            n: stub.GetWorker(manager_pb.GetWorkerRequest(name=f"workers/{n}"), timeout=10).worker.state
            for n in ("alpha", "beta")
        }
        serving = "alpha" if states["alpha"] == common_pb.WORKER_STATE_AWAKE else "beta"  # what the swaps left awake
        asleep = "beta" if serving == "alpha" else "alpha"
        workers.pop(asleep).stop()
        restarts: list[dict[str, Any]] = []
        for _ in range(args.restart_reps):
            model = asleep
            t0 = time.perf_counter()
            workers.pop(serving).stop()
            stopped = time.perf_counter() - t0
            workers[model] = start_worker(model, ckpt, mgr.address, args)
            spawned = time.perf_counter() - t0
            tries = 0
            while True:
                tries += 1
                try:
                    first, total, _ = stream_ttft(client, model, prompt())
                    break
                except (openai.NotFoundError, openai.InternalServerError, openai.APIStatusError) as exc:
                    if time.perf_counter() - t0 > START_TIMEOUT_S:
                        raise RuntimeError(f"{model} never served after its restart: {exc}") from exc
                    time.sleep(RETRY_S)
            ttft = time.perf_counter() - t0 - (total - first)
            restarts.append({"model": model, "ttft_s": ttft, "stop_s": stopped, "listening_s": spawned, "tries": tries})
            print(f"[bench_gateway]   {json.dumps(restarts[-1])}", flush=True)
            serving, asleep = model, serving
        res["restart"] = {"runs": restarts, "ttft": _stats([r["ttft_s"] for r in restarts])}
    except Exception as exc:  # noqa: BLE001 - the run's JSON says what failed
        res["errors"]["run"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()
        print(res["traceback"], file=sys.stderr, flush=True)
        res["logs"] = {s.name: s.tail() for s in [*services, *workers.values()]}
    finally:
        for s in [*workers.values(), *reversed(services)]:
            s.stop()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    res["targets"] = []
    for key, what in (("swap", "eviction first"), ("swap_overlapped", "eviction beside the wake")):
        got = res.get(key, {}).get("ttft", {}).get("median_s")
        passed = None if got is None else got <= TARGET_WAKE_TTFT_S
        res["targets"].append(
            {
                "target": f"TTFT when the request wakes its model ({what})",
                "value_s": got,
                "goal_s": TARGET_WAKE_TTFT_S,
                "passed": passed,
            }
        )
    Path(args.out).write_text(json.dumps(res, indent=2, default=str) + "\n")
    rows = (
        ("awake", "awake"),
        ("wake, evict first", "swap"),
        ("wake beside evict", "swap_overlapped"),
        ("process restart", "restart"),
    )
    for label, key in rows:
        t = res.get(key, {}).get("ttft", {})
        if t:
            print(
                f"{label:18s} TTFT median {t['median_s'] * 1e3:8.1f} ms  (min {t['min_s'] * 1e3:.1f}, "
                f"max {t['max_s'] * 1e3:.1f})"
            )
    print(json.dumps(res["targets"]))
    print(f"wrote {args.out}")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
