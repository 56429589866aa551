"""``memsvc worker --standby``: a worker process started before its model is known, that has done
what every start pays before its flags come.

Why: before anything of its own, a worker's start imports the model layer (torch, Triton,
safetensors, tokenizers: 3.5 s of a 6.3 s warm start on the H200 machine) and makes its device's CUDA
context. A standby has done both, started cuBLAS and started its RPC front's process (half a second
more) when it is handed a worker to be, so that start pays only its own part: listening, the
weights, the KV cache and the kernels' warm-up. ``memsvc up`` keeps one per device where its file
asks (``[workers] standby = true``) and hands it the next worker that starts there: the second model
of a device, a model added by a reload, a worker restarted after it died (docs/operations.md,
"Start-up").

The hand-off is one line on standard input: the JSON list of the ``memsvc worker`` flags that the
start would have had on its command line. They must name the standby's backend and device (its
context is there); the process then is that worker, as if started with those flags. The end of its
input before a line, SIGTERM or SIGINT: exit 0, not needed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from memsvc.errors import InvalidArgument
from memsvc.runtime.logs import announce

MAX_FLAGS_BYTES = 64 * 1024
"""The most a hand-off line may hold (a worker's flags are a few hundred bytes)."""


def prepare(backend: str, device: int) -> str:
    """Import what a worker's start imports and, on CUDA, make ``device``'s context and start cuBLAS:
    the backend that ``backend`` resolves to (``auto``: cuda where a device is present)."""
    import worker.main  # the server's side: grpc, the servicer, the core
    from worker import rpc_front
    from worker.allocator import resolve_backend

    rpc_front.start_ahead()  # the RPC front's process, its imports done beside these
    with worker.main.collector_paused():
        for name in worker.main.MODEL_LAYER:
            importlib.import_module(name)
    import torch

    resolved = resolve_backend(backend)
    if resolved == "cuda":
        if importlib.util.find_spec("triton") is not None:
            from worker.model.kernels import hash_ahead

            hash_ahead()  # Triton imported, and what its first launch of each kernel would hash
        torch.cuda.set_device(device)
        x = torch.ones(64, 64, device=f"cuda:{device}", dtype=torch.bfloat16)
        float((x @ x).sum())  # the primary context (the allocator's too), cuBLAS's handle, a first kernel
        del x
        torch.cuda.empty_cache()  # the worker's memory is the allocator's: none held here
    return resolved


def read_flags(stream: TextIO) -> list[str] | None:
    """The worker's flags from one line of ``stream``; None at the end of the input (not needed)."""
    line = stream.readline(MAX_FLAGS_BYTES + 1)
    if not line:
        return None
    if len(line) > MAX_FLAGS_BYTES:
        raise InvalidArgument(f"the standby's flags line is longer than {MAX_FLAGS_BYTES} bytes")
    try:
        flags = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"the standby's flags line is not JSON: {exc}") from None
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise InvalidArgument("the standby's flags line must be a JSON list of strings (memsvc worker flags)")
    if "--standby" in flags:
        raise InvalidArgument("a standby's flags cannot ask for another standby (--standby)")
    return flags


@contextmanager
def _exit_on_stop() -> Iterator[None]:
    """SIGTERM and SIGINT end the wait with exit 0 (the worker's own handlers come after it)."""

    def stop(_signum: int, _frame: object) -> None:
        raise SystemExit(0)

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def wait_for_flags(backend: str, device: int, stream: TextIO = sys.stdin) -> list[str] | None:
    """Prepare (see :func:`prepare`), say so, and wait for the flags (see :func:`read_flags`)."""
    with _exit_on_stop():
        t0 = time.perf_counter()
        resolved = prepare(backend, device)
        where = f"cuda:{device}" if resolved == "cuda" else "host"
        announce(f"memsvc worker standby ready on {where} in {time.perf_counter() - t0:.2f} s; waiting for its flags")
        return read_flags(stream)


__all__ = ["MAX_FLAGS_BYTES", "prepare", "read_flags", "wait_for_flags"]
