"""cuBLAS's first products of a model's shapes, made on a thread from the moment torch is imported.

A process's first matrix product of each shape is slow: cuBLAS starts (its handle, its heuristics),
then picks a kernel for the shape and the device loads it, lazily, on its first launch (10-13 ms for
each new row count of an 8B model's projections, 90-110 ms for the very first; an H100 host,
2026-12-06). The warm-up (worker/model/runner.py) runs a short generation and one step of every
graph bucket, and cuBLAS's part of that was about a third of it on the device thread, after the
imports, where everything else of the start waits behind it.

This thread makes the same products earlier: from the moment ``import torch`` is done, for the
decode step's projections (q/k/v and gate/up as one matrix each, as the runner fuses them, o and
down) at every row count the graph buckets use. ``import torch`` is nearly the whole model layer's
import, so in practice this runs beside the kernels' hashes (worker/model/kernels.py's
``hash_ahead``) and torch's own CUDA start, which the load would otherwise pay; loading a kernel
happens without the GIL. The device's context, the cuBLAS kernels loaded into it and the handle
(torch keeps a pool: a thread's handle goes back to it when the thread ends) are the process's, so
the warm-up then finds them loaded: the same shapes, data type, layout and workspace pick the same
kernels. On an H100 host this took 0.09 s (median) off a warm spawn's first token
(docs/benchmarks.md, "Start-up: Triton's key kept").

The operands are uninitialised scratch of the largest projection (an 8B model: 0.3 GB, from torch's
own allocator), given back to the device before the load reckons the weights' room: the load waits
for this thread first (:func:`settle`). A model whose config cannot be read here (synthetic, not yet
downloaded) gets nothing ahead, nor a device with less than 2 GiB free beside the scratch; an error
here is logged and changes nothing, the warm-up then does all of it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from worker.model.config import ModelConfig

log = logging.getLogger("memsvc.worker")

SPARE_BYTES = 2 << 30
"""Free device memory left beside the scratch, or no products ahead."""
_thread: threading.Thread | None = None
"""This process's products thread while it runs (one start per process)."""
_lock = threading.Lock()


def projection_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """The (out, in) features of a decode step's projections: q, k and v as one matrix, o, and, unless
    every layer's MLP is a mixture of experts, gate and up as one matrix and down."""
    hidden, heads, kv_heads, head_dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    shapes = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim)]
    if not all(config.moe_layer(i) for i in range(config.num_layers)):
        inter = config.intermediate_size
        shapes += [(2 * inter, hidden), (hidden, inter)]
    return list(dict.fromkeys(shapes))


def start(model_dir: Path | None, device: int, rows: Sequence[int]) -> bool:
    """Make the products of the model in ``model_dir`` (its ``config.json``) on CUDA ``device`` at each
    row count of ``rows``, on a thread. Whether one started (not for no directory or config)."""
    global _thread
    if model_dir is None:
        return False
    try:
        from worker.model.config import ModelConfig

        config = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
        shapes, dtype = projection_shapes(config), config.torch_dtype
    except Exception as exc:  # noqa: BLE001 - the load reads the config again and says what is wrong
        log.debug("no first products ahead: %s", exc)
        return False
    with _lock:
        if _thread is not None:
            return False
        _thread = threading.Thread(
            target=_products,
            args=(shapes, dtype, device, tuple(rows)),
            name="memsvc-first-products",
            daemon=True,
        )
        _thread.start()
    return True


def settle() -> None:
    """Wait for the products thread, if one runs: before the load reckons the weights' room (the
    staging's ``make_room``) and allocates them, so that its scratch is back with the device by then."""
    with _lock:
        thread = _thread
    if thread is not None:
        thread.join()


def _products(shapes: list[tuple[int, int]], dtype: torch.dtype, device: int, rows: tuple[int, ...]) -> None:
    """The thread: each shape at each row count once, on scratch it gives back to the device whatever
    happens (torch's caching allocator would keep it, outside every tag), unless the device lacks
    the room (2 GiB beside the scratch: the load's weights must find theirs)."""
    import torch

    t0 = time.perf_counter()
    made: list[int] = []
    try:
        with torch.cuda.device(device), torch.no_grad():
            sizes = (max(n * k for n, k in shapes), max(rows) * max(k for _, k in shapes))
            need = sum(sizes) * dtype.itemsize
            # the first runtime call on this thread: it makes the device's context this thread's (as
            # cuBLAS wants), without waiting for anything queued on the device (the staging's copies)
            free, _ = torch.cuda.mem_get_info(device)
            if free < need + SPARE_BYTES:
                log.info("cuda: no first products ahead: %.2f GB free", free / 1e9)
                return
            _run(shapes, dtype, rows, sizes, made)
        log.info("cuda: %d first products made ahead in %.2f s", len(made), time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - the warm-up makes them, as it did before
        log.info("cuda: first products ahead stopped after %d: %s", len(made), exc)
    # here, not in a finally: until the handler above is done, its traceback holds _run's scratch
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()  # the scratch back to the device (cudaFree waits for the products)


def _run(
    shapes: list[tuple[int, int]],
    dtype: torch.dtype,
    rows: tuple[int, ...],
    sizes: tuple[int, int],
    made: list[int],
) -> None:
    """The products, on scratch that lives in this frame only: ``sizes`` elements for the weight
    operand of the largest shape and the input of the most rows; what they hold is whatever the memory
    held (only the kernels matter). ``made`` counts them."""
    import torch
    import torch.nn.functional as F

    weight = torch.empty(sizes[0], dtype=dtype, device="cuda")
    x = torch.empty(sizes[1], dtype=dtype, device="cuda")
    for m in rows:
        for n, k in shapes:
            F.linear(x[: m * k].view(m, k), weight[: n * k].view(n, k))
            made.append(m)


__all__ = ["SPARE_BYTES", "projection_shapes", "settle", "start"]
