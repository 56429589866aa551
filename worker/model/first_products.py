"""cuBLAS's first products of a model's shapes, made on a thread while the model layer still imports.

A process's first matrix product of each shape is slow: cuBLAS starts (its handle, its heuristics),
then picks a kernel for the shape and the device loads it, lazily, on its first launch (10-13 ms for
each new row count of an 8B model's projections, 90-110 ms for the very first; an H100 host,
2026-12-06). The warm-up (worker/model/runner.py) runs a short generation and one step of every
graph bucket, and cuBLAS's part of that was about a third of it on the device thread, after the
imports, where everything else of the start waits behind it.

This thread makes the same products earlier: once ``import torch`` is done, while the rest of the
model layer imports, for the decode step's projections (q/k/v and gate/up as one matrix each, as the
runner fuses them, o and down) at every row count the graph buckets use. Loading a kernel happens
without the GIL, beside the imports. The device's context, the cuBLAS kernels loaded into it and
the handle (torch keeps a pool: a thread's handle goes back to it when the thread ends) are the
process's, so the warm-up then finds them loaded. The kernels are those the warm-up picks: the
same shapes, data type, layout and workspace.

The operands are uninitialised scratch of the largest projection (an 8B model: 0.3 GB, from torch's
own allocator), given back to the device before the weights are allocated: the load waits for this
thread first (:func:`settle`). A model whose config cannot be read here (synthetic, not yet
downloaded) gets nothing ahead; an error here is logged and changes nothing, the warm-up then does
all of it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("memsvc.worker")

_thread: threading.Thread | None = None
"""This process's products thread while it runs (one start per process)."""
_lock = threading.Lock()


def projection_shapes(hf: dict[str, object]) -> list[tuple[int, int]]:
    """The (out, in) features of a decode step's projections, from a checkpoint's ``config.json``: q,
    k and v as one matrix, o, and, unless every layer's MLP is a mixture of experts, gate and up as
    one matrix and down."""
    from worker.model.config import ModelConfig

    config = ModelConfig.from_hf(hf)
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
        hf = json.loads((model_dir / "config.json").read_text())
        shapes = projection_shapes(hf)
        from worker.model.config import ModelConfig

        dtype = ModelConfig.from_hf(hf).torch_dtype
    except Exception as exc:  # noqa: BLE001 - the load reads the config again and says what is wrong
        log.debug("no first products ahead: %s", exc)
        return False
    with _lock:
        if _thread is not None:
            return False
        _thread = threading.Thread(
            target=_products, args=(shapes, dtype, device, tuple(rows)), name="memsvc-first-products", daemon=True
        )
        _thread.start()
    return True


def settle() -> None:
    """Wait for the products thread, if one runs: before the weights are allocated, so that its scratch
    is back with the device by then."""
    with _lock:
        thread = _thread
    if thread is not None:
        thread.join()


def _products(shapes: list[tuple[int, int]], dtype: object, device: int, rows: tuple[int, ...]) -> None:
    import torch
    import torch.nn.functional as F

    t0 = time.perf_counter()
    made = 0
    try:
        assert isinstance(dtype, torch.dtype)
        with torch.cuda.device(device), torch.no_grad():
            torch.cuda.synchronize()  # a runtime call first: the device's context is then this thread's (cuBLAS)
            weight = torch.empty(max(n * k for n, k in shapes), dtype=dtype, device="cuda")
            x = torch.empty(max(rows) * max(k for _, k in shapes), dtype=dtype, device="cuda")
            for m in rows:
                for n, k in shapes:
                    F.linear(x[: m * k].view(m, k), weight[: n * k].view(n, k))
                    made += 1
            torch.cuda.synchronize()
            del weight, x
            torch.cuda.empty_cache()
        log.info("cuda: %d first products made ahead in %.2f s", made, time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - the warm-up makes them, as it did before
        log.info("cuda: first products ahead stopped after %d: %s", made, exc)


__all__ = ["projection_shapes", "settle", "start"]
