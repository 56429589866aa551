"""Where a model's weights come from: a seeded synthetic preset or a checkpoint directory.

The runner keeps its source for the worker's whole life because a level-2 wake (weights discarded)
must refill the same pool tensors from the same place; a source is therefore cheap to hold and
re-reads its data on every :meth:`ModelSource.load_into`.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from memsvc.errors import InvalidArgument
from worker.model.config import PRESETS, ModelConfig
from worker.model.weights import fill_synthetic, load_checkpoint, read_config

SYNTHETIC_PREFIX = "synthetic:"


class ModelSource(abc.ABC):
    """A model's config plus a way to (re)write its weights into existing tensors."""

    name: str
    """How the model was named (``synthetic:tiny``, a checkpoint path): for info and telemetry."""
    config: ModelConfig

    @abc.abstractmethod
    def load_into(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Write every weight in place; tensors keep their addresses."""


class SyntheticSource(ModelSource):
    """Seeded random weights in a preset's shapes (:data:`PRESETS`), for tests and benchmarks."""

    def __init__(self, preset: str, seed: int = 0) -> None:
        if preset not in PRESETS:
            raise InvalidArgument(f"unknown synthetic preset {preset!r}: expected one of {sorted(PRESETS)}")
        self.name = SYNTHETIC_PREFIX + preset
        self.config = PRESETS[preset]
        self.seed = seed

    def load_into(self, weights: Mapping[str, torch.Tensor]) -> None:
        fill_synthetic(weights, self.config, self.seed)


class CheckpointSource(ModelSource):
    """A local Hugging Face checkpoint directory: ``config.json`` and ``*.safetensors``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.name = str(self.path)
        self.config = read_config(self.path)

    def load_into(self, weights: Mapping[str, torch.Tensor]) -> None:
        load_checkpoint(self.path, weights, self.config)


def parse_model_spec(spec: str, seed: int = 0) -> ModelSource:
    """``synthetic:<preset>`` or a checkpoint directory path."""
    if not isinstance(spec, str) or not spec:
        raise InvalidArgument("model spec must be 'synthetic:<preset>' or a checkpoint directory")
    if spec.startswith(SYNTHETIC_PREFIX):
        return SyntheticSource(spec[len(SYNTHETIC_PREFIX) :], seed)
    return CheckpointSource(spec)


__all__ = ["CheckpointSource", "ModelSource", "SyntheticSource", "parse_model_spec"]
