"""The first request with stop strings, and the streams running beside it: how long they pause.

Why: the worker's engine matches stop strings on its own thread, at the token that completes one, so
it needs the model's decoding; with the text in the RPC front's process, the worker read its own copy
of the whole tokenizer the first time a request had stop strings, holding the GIL meanwhile, and
every stream paused for that read (0.4 s at Llama 3's size on an H100 host). Now the front writes the
decoding alone and the worker reads it while its engine idles (worker/model/text_source.py).

Per case, a fresh ``memsvc worker --model <dir>`` (no other flags but ``--kv-blocks`` and
``--worker-args``):

- ``idle``: the streams start once the worker has served a request and idled for ``--idle`` seconds
  (its graphs captured), as a worker that came up before its traffic;
- ``busy``: the streams start at ``SERVING``, so the engine never idles before the stop strings come.

``--streams`` GenerateStreams (token ids, ``ignore_eos``, ``--tokens`` each) run on threads; when
the first has ``--after`` tokens, a unary Generate with a stop string that never matches is sent.
Each stream's messages are stamped as they arrive. Reported: the median gap between a stream's
messages, the longest gap of any stream while the stop-string request ran (its pause), that
request's own time, and the worker's line saying what it read for stop strings and in how long.
JSON out (``--out``), with date, device and commit.

    python -m bench.bench_stop_stall --model /tmp/ck8b --out stall.json
    python -m bench.bench_stop_stall --model /tmp/tiny --backend host --streams 2 --tokens 40 --after 5 --out s.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shlex
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from bench.bench_startup import _LISTENING, MEMSVC, START_TIMEOUT_S, Spawned, _device, _git_commit, serving_at
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

CASES = ("idle", "busy")
NEVER = "\u2063never-matches\u2063"
"""The stop string: invisible separators around a word, which no generated text here holds."""
READ_LINE = re.compile(r"model text: (?P<what>.+) for stop strings in (?P<s>[\d.]+) s")


class Stream:
    """One GenerateStream on a thread: each message's arrival (perf_counter) and token count."""

    def __init__(self, stub: worker_grpc.ModelWorkerServiceStub, prompt: list[int], tokens: int) -> None:
        self.arrivals: list[tuple[float, int]] = []
        self.error: BaseException | None = None
        self._request = worker_pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=tokens, ignore_eos=True)
        self._stub = stub
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            request = worker_pb.GenerateStreamRequest(request=self._request)
            for msg in self._stub.GenerateStream(request, timeout=START_TIMEOUT_S):
                if msg.token_ids:
                    self.arrivals.append((time.perf_counter(), len(msg.token_ids)))
        except BaseException as exc:  # noqa: BLE001 - reported by the case
            self.error = exc

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    def gaps(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        """Gaps between consecutive messages, for the messages that arrived in [start, end]."""
        times = [t for t, _ in self.arrivals]
        return [b - a for a, b in zip(times, times[1:], strict=False) if start <= b <= end]


def _wait(cond: Any, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.002)


def run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--model", str(args.model), "--listen", "127.0.0.1:0", "--kv-blocks", str(args.kv_blocks)]
    if args.backend != "cuda":
        flags += ["--backend", args.backend]
    proc = Spawned([*MEMSVC, "worker", *flags, *shlex.split(args.worker_args)])
    rng = random.Random(0)
    out: dict[str, Any] = {"case": case}
    try:
        _, mt = proc.wait_for(_LISTENING, START_TIMEOUT_S)
        with grpc.insecure_channel(mt.group(1)) as channel:
            out["serving_s"] = serving_at(channel, proc.t0)
            if out["serving_s"] is None:
                raise RuntimeError("the health watch ended before SERVING")
            stub = worker_grpc.ModelWorkerServiceStub(channel)
            vocab = stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=30).status.model.vocab_size
            vocab = min(vocab or 256, 32_000)
            if case == "idle":  # a request first (the first products, the graphs' capture), then quiet
                warm = worker_pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=8, ignore_eos=True)
                stub.Generate(warm, timeout=START_TIMEOUT_S)
                time.sleep(args.idle)
            streams = [
                Stream(stub, [rng.randrange(vocab) for _ in range(args.prompt)], args.tokens)
                for _ in range(args.streams)
            ]
            _wait(lambda: streams[0].tokens >= args.after or streams[0].error, "the first stream's tokens", 300)
            stop = worker_pb.GenerateRequest(
                prompt_token_ids=[rng.randrange(vocab) for _ in range(args.prompt)],
                max_new_tokens=8,
                ignore_eos=True,
                stop=[NEVER],
            )
            sent = time.perf_counter()
            answer = stub.Generate(stop, timeout=START_TIMEOUT_S)
            done = time.perf_counter()
            for s in streams:
                s.thread.join(timeout=START_TIMEOUT_S)
            errors = [repr(s.error) for s in streams if s.error is not None]
            if errors or any(s.tokens != args.tokens for s in streams):
                raise RuntimeError(f"streams failed: {errors or [s.tokens for s in streams]}")
            out["stop_request_s"] = done - sent
            out["stop_request_tokens"] = len(answer.token_ids)
            out["median_gap_s"] = statistics.median(g for s in streams for g in s.gaps())
            during = [g for s in streams for g in s.gaps(sent, done + 0.05)]
            out["longest_gap_during_s"] = max(during) if during else None
            before = [g for s in streams for g in s.gaps(0.0, sent)]
            out["longest_gap_before_s"] = max(before[1:]) if len(before) > 1 else None  # the first is the prompt's
        hit = proc.found(READ_LINE)
        out["worker_read"] = None if hit is None else {"what": hit[1]["what"], "seconds": float(hit[1]["s"])}
    finally:
        out["exit_code"] = proc.stop()
    return out


def format_table(res: dict[str, Any]) -> str:
    rows = [
        "| case | median gap | longest gap while it ran | longest gap before | stop-string request | worker read |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["runs"]:
        read = r.get("worker_read")
        said = f"{read['what']} in {read['seconds']:.2f} s" if read else "(no line)"
        rows.append(
            f"| {r['case']} | {r['median_gap_s'] * 1e3:.1f} ms | {(r['longest_gap_during_s'] or 0) * 1e3:.1f} ms "
            f"| {(r['longest_gap_before_s'] or 0) * 1e3:.1f} ms | {r['stop_request_s']:.3f} s | {said} |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a checkpoint directory with a tokenizer")
    ap.add_argument("--backend", default="cuda", choices=["cuda", "host"])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--repeats", type=int, default=2, help="fresh workers per case")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens of each request")
    ap.add_argument("--tokens", type=int, default=300, help="tokens each stream generates")
    ap.add_argument("--after", type=int, default=60, help="the first stream's tokens before the stop strings come")
    ap.add_argument("--idle", type=float, default=3.0, help="seconds the 'idle' case waits before its streams")
    ap.add_argument("--kv-blocks", type=int, default=1024)
    ap.add_argument("--worker-args", default="", help="extra flags for the worker, one string")
    ap.add_argument("--out", default="stop_stall.json")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    if not cases or any(c not in CASES for c in cases):
        ap.error(f"--cases takes {', '.join(CASES)}")
    if args.after >= args.tokens:
        ap.error("--after must be less than --tokens")
    res: dict[str, Any] = {
        "bench": "stop_stall",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": os.environ.get("MEMSVC_COMMIT") or _git_commit(),
        "device": _device() if args.backend == "cuda" else {"backend": args.backend},
        "args": {k: str(v) for k, v in vars(args).items()},
        "runs": [run_case(case, args) for _ in range(args.repeats) for case in cases],
    }
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(format_table(res))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
