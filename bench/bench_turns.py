"""Time-sharing benchmark: busy models on one GPU whose device budget fits one, taking turns
(memsvc/manager/turns.py), against one model alone under the same total load, in one run.

Why: before turns, a model under steady traffic kept its device for as long as the traffic lasted,
and a request for another model there waited out the gateway's queue timeout (503). Issue 27's
targets: no request fails; each request's wait for its model is at most the time slice plus two
swaps; the aggregate output tokens/s is at least 80 % of one model alone under the same total load;
paused requests are not read again; with three models under skewed load, the least popular one's
TTFT p99 is at most 2 s.

A. bench_gateway's checkpoint (an 8B-shaped Llama 3 in bf16, a word-level tokenizer), a manager, three
   workers serving it as ``alpha``, ``beta`` and ``gamma`` on the same GPU, and a gateway. The policy:
   a device budget of 1.5 x one worker's mapped bytes (one awake at a time), ``--time-slice``, and a
   swap headroom of one worker (each eviction overlaps the wake it makes room for).
B. alone: ``alpha`` alone under the whole load; C. two busy models: ``alpha`` and ``beta`` under half
   of it each, at once. Per model and in all: output tok/s, TTFT (its wait for the model included)
   p50/p99/max, failures; the turns each gave up and the tokens each read again (the workers'
   ``recomputed_tokens``). B and C run twice: closed loop (``--slots`` streams in flight per busy
   model, each sent as one ends) and open loop (``--rate`` requests a second per slot, sent whatever
   is in flight). Closed loop halves the streams a model has while it holds the device, so its
   ratio to one model alone is bounded near 1/2 by the batch, not by the turns; the open loop's
   offered load is the same in both, so its ratio is what the swaps and the waits cost.
D. three models, skewed: ``--skew`` slots for alpha, beta, gamma (5,2,1 by default); TTFT per model.

Requests are streamed completions through the gateway with the OpenAI SDK, random prompts of a fixed
length and a fixed number of output tokens (``ignore_eos``), as bench_serving sends them.

    python -m bench.bench_turns --out turns.json                                          # 8B on the GPU
    python -m bench.bench_turns --shape tiny --backend host --requests 8 --out t.json     # a smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import shlex
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.bench_serving import START_S, Record, Shape, run_records, summarize

MODELS = ("alpha", "beta", "gamma")


def _load(
    gateway: str,
    slots: dict[str, int],
    shape: Shape,
    requests: int,
    clients: int,
    vocab: int,
    start_delay: float,
    rate: float = 0.0,
) -> dict[str, list[Record]]:
    """Each model's ``requests`` x ``slots[model]`` requests, all models at once: ``slots[model]`` in
    flight at a time, or with ``rate``, ``rate`` x ``slots[model]`` sent a second (open loop)."""
    procs = {name: max(min(n, clients // len(slots)), 1) for name, n in slots.items()}
    with concurrent.futures.ThreadPoolExecutor(len(slots)) as pool:
        runs = {
            name: pool.submit(
                run_records,
                "gateway",
                gateway,
                name,
                shape,
                n,
                requests * n,
                procs[name],
                vocab,
                100 + i,
                start_delay,
                rate * n,
            )
            for i, (name, n) in enumerate(slots.items())
        }
        return {name: run.result() for name, run in runs.items()}


def _phase(records: dict[str, list[Record]], shape: Shape, slots: dict[str, int]) -> dict[str, Any]:
    every = [r for rs in records.values() for r in rs]
    out: dict[str, Any] = {"all": summarize(every, shape, sum(slots.values()))}
    for name, rs in records.items():
        out[name] = summarize(rs, shape, slots[name])
    return out


def main(argv: Sequence[str] | None = None) -> int:  # noqa: PLR0915 - one run, phase by phase
    import grpc
    from google.protobuf.duration_pb2 import Duration
    from google.protobuf.field_mask_pb2 import FieldMask

    from bench.bench_allocator import _device_info, _git_commit
    from bench.bench_gateway import MEMSVC, Service, mapped_bytes, wait_state, write_checkpoint
    from bench.bench_serving import _model_facts, _wait_model
    from memsvc.v1 import common_pb2 as common_pb
    from memsvc.v1 import memory_manager_service_pb2 as manager_pb
    from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc
    from memsvc.v1 import model_worker_service_pb2 as worker_pb
    from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8b", help="bench_gateway's checkpoint shape (8b, tiny)")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--io", default="40x128", help="input x output tokens of every request")
    ap.add_argument("--slots", type=int, default=4, help="streams in flight per busy model")
    ap.add_argument("--skew", default="5,2,1", help="streams in flight for alpha, beta, gamma in the skewed case")
    ap.add_argument("--requests", type=int, default=12, help="requests per stream slot and phase")
    ap.add_argument("--clients", type=int, default=8, help="client processes per phase, shared by the models")
    ap.add_argument(
        "--rate", type=float, default=0.5, help="open loop: requests a second per stream slot (0: closed loop only)"
    )
    ap.add_argument("--time-slice", type=float, default=2.0, help="the policy's time_slice, seconds")
    ap.add_argument("--kv-blocks", type=int, default=1024)
    ap.add_argument("--worker-args", default="--host-prepin weights", help="more worker flags")
    ap.add_argument("--start-delay", type=float, default=START_S, help="seconds client processes get to start")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    shape = Shape.parse(args.io)
    skew = dict(zip(MODELS, (int(x) for x in args.skew.split(",")), strict=True))
    result: dict[str, Any] = {
        "bench": "turns",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "device": _device_info() if args.backend == "cuda" else "host",
        "io": shape.name,
        "time_slice_s": args.time_slice,
    }

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoint = root / "ckpt"
        result["checkpoint"] = write_checkpoint(checkpoint, args.shape, "cuda" if args.backend == "cuda" else "cpu")
        vocab = _model_facts(checkpoint)["vocab"]
        services: list[Service] = []
        workers: dict[str, Service] = {}
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
            stub = manager_grpc.MemoryManagerServiceStub(grpc.insecure_channel(mgr.address))
            for name in MODELS:
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
                    mgr.address,
                    "--listen",
                    "127.0.0.1:0",
                    "--kv-blocks",
                    str(args.kv_blocks),
                    *shlex.split(args.worker_args),
                ]
                workers[name] = Service(argv, r" listening on (\S+)", f"worker {name}")
                services.append(workers[name])
                wait_state(stub, name, common_pb.WORKER_STATE_AWAKE)
            one = mapped_bytes(wait_state(stub, "alpha", common_pb.WORKER_STATE_AWAKE))
            for name in MODELS[1:]:
                stub.SleepWorker(manager_pb.SleepWorkerRequest(name=f"workers/{name}"), timeout=600)
            policy = manager_pb.Policy(
                device_budget_bytes=int(1.5 * one),
                device_swap_headroom_bytes=one,
                time_slice=Duration(nanos=int(args.time_slice * 1e9)),
            )
            mask = FieldMask(paths=["device_budget_bytes", "device_swap_headroom_bytes", "time_slice"])
            stub.UpdatePolicy(manager_pb.UpdatePolicyRequest(policy=policy, update_mask=mask), timeout=10)
            result["worker_mapped_bytes"] = one
            gw = Service(
                [
                    *MEMSVC,
                    "gateway",
                    "--listen",
                    "127.0.0.1:0",
                    "--manager",
                    mgr.address,
                    "--processes",
                    "4",
                    "--queue-timeout",
                    "600",
                ],
                r"gateway listening on (\S+)",
                "gateway",
            )
            services.append(gw)
            for name in MODELS:
                _wait_model("gateway", gw.address, model=name)

            def counters() -> dict[str, dict[str, int]]:
                out = {}
                for name in MODELS:
                    wk = stub.GetWorker(manager_pb.GetWorkerRequest(name=f"workers/{name}"), timeout=10).worker
                    st = (
                        worker_grpc.ModelWorkerServiceStub(grpc.insecure_channel(workers[name].address))
                        .GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10)
                        .status
                    )
                    out[name] = {"turns_yielded": wk.turns_yielded, "recomputed_tokens": st.kv_cache.recomputed_tokens}
                return out

            def phase(label: str, slots: dict[str, int], rate: float = 0.0) -> None:
                before = counters()
                records = _load(gw.address, slots, shape, args.requests, args.clients, vocab, args.start_delay, rate)
                after = counters()
                row = _phase(records, shape, slots)
                row["counters"] = {n: {k: after[n][k] - before[n][k] for k in after[n]} for n in after}
                result[label] = row
                print(f"[bench_turns] {label}: {json.dumps({k: v for k, v in row.items()})}", flush=True)
                save()

            # warm: every model's graphs and kernels, and the gateway's first requests
            _load(gw.address, {"alpha": 2, "beta": 2}, shape, 2, 2, vocab, args.start_delay)
            for loop, rate in (("closed", 0.0), ("open", args.rate)):
                if loop == "open" and not rate:
                    continue
                phase(f"alone_{loop}", {"alpha": 2 * args.slots}, rate)
                phase(f"two_busy_{loop}", {"alpha": args.slots, "beta": args.slots}, rate)
                alone, two = (result[f"{p}_{loop}"]["all"]["output_tok_s"] for p in ("alone", "two_busy"))
                result[f"two_busy_vs_alone_{loop}"] = round(two / alone, 3) if alone else None
            phase("skewed", skew)
        finally:
            for s in reversed(services):
                s.stop()
    save()
    for loop in ("closed", "open"):
        print(
            f"[bench_turns] {loop} loop, two busy models / one alone, output tok/s: "
            f"{result.get(f'two_busy_vs_alone_{loop}')}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
