"""Safetensors checkpoints written as Hugging Face shards them, and what ``safetensors.torch`` reads
back from them (the reference the loader's tests compare against), and destinations to load them
into. Import ``sharded_checkpoints``
(the loader's and the staging's suites do)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from worker.allocator import MemoryAllocator
from worker.model.loader import INDEX_FILE

PATTERN = -3
"""What :func:`destinations` are filled with: a load that writes nothing, or too much, shows."""


def save_sharded(root: Path, tensors: Mapping[str, torch.Tensor], shards: int = 3) -> list[Path]:
    """Shards of every ``shards``-th tensor with an index, as Hugging Face writes them."""
    root.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    files, weight_map = [], {}
    for s in range(shards):
        part = names[s::shards]
        file = root / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file.name))
        files.append(file)
    (root / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


def reference(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``root``'s shards as ``safetensors.torch.load_file`` reads it."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(root.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


CONVERSIONS = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)]
"""(the file's dtype, the destinations' dtype): a load's conversions, both ways."""


def to_convert(file_dtype: torch.dtype, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Two tensors of ``file_dtype`` drawn from ``g`` that a load into another dtype converts: one of
    a few bytes, one across many pages."""
    return {
        "a": torch.randn(7, 13, generator=g).to(file_dtype),
        "b": torch.randn(300, 301, generator=g).to(file_dtype),
    }


def destinations(
    alloc: MemoryAllocator, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """A pool tensor in the ``weights`` tag for each of ``tensors`` (of ``dtype``, else its own),
    filled with :data:`PATTERN`."""
    out = {}
    for name, ref in tensors.items():
        t = alloc.empty(tuple(ref.shape), dtype or ref.dtype, tag="weights")
        t.fill_(PATTERN)
        out[name] = t
    return out
