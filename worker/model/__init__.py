"""The worker's model layer: config, pool-resident weights, paged KV cache, decoder and runner.

Everything here allocates through :class:`worker.allocator.MemoryAllocator` (weights in the
``weights`` tag, KV blocks in ``kv_cache``), so the model sleeps and wakes with the pools.
"""

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
