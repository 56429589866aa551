"""The worker's model layer: config, pool-resident weights, paged KV cache, decoder and runner.

Everything here allocates through :class:`worker.allocator.MemoryAllocator` (weights in the
``weights`` tag, KV blocks in ``kv_cache``), so the model sleeps and wakes with the pools.

The names below are imported on first use (PEP 562), not with the package: the worker's servicer
needs :mod:`worker.model.generation` to listen, and importing the package must not drag torch,
safetensors, tokenizers and jinja2 in with it, so the worker answers health checks (NOT_SERVING)
and GetWorkerStatus (LOADING) while they load.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.model.config import PRESETS, ModelConfig, RopeScaling
    from worker.model.kv_cache import KvCache, KvStats, Sequence
    from worker.model.runner import ModelInfo, ModelRunner
    from worker.model.weights import (
        CheckpointSource,
        ModelSource,
        SyntheticSource,
        allocate_weights,
        fill_synthetic,
        load_checkpoint,
        parse_model_spec,
        save_checkpoint,
    )

_HOMES = {
    **dict.fromkeys(("PRESETS", "ModelConfig", "RopeScaling"), "config"),
    **dict.fromkeys(("KvCache", "KvStats", "Sequence"), "kv_cache"),
    **dict.fromkeys(("ModelInfo", "ModelRunner"), "runner"),
    **dict.fromkeys(
        (
            "CheckpointSource",
            "ModelSource",
            "SyntheticSource",
            "allocate_weights",
            "fill_synthetic",
            "load_checkpoint",
            "parse_model_spec",
            "save_checkpoint",
        ),
        "weights",
    ),
}
"""Each exported name's module in this package."""


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


__all__ = [
    "PRESETS",
    "CheckpointSource",
    "KvCache",
    "KvStats",
    "ModelConfig",
    "ModelInfo",
    "ModelRunner",
    "ModelSource",
    "RopeScaling",
    "Sequence",
    "SyntheticSource",
    "allocate_weights",
    "fill_synthetic",
    "load_checkpoint",
    "parse_model_spec",
    "save_checkpoint",
]
