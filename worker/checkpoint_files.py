"""Where a Hugging Face checkpoint directory keeps its tensors: the index of a sharded checkpoint
(``model.safetensors.index.json``), read and checked once for both of its readers, the loader
(worker/model/loader.py) and the start-up read-ahead (worker/prefetch.py). No torch here: the
read-ahead runs while torch is being imported."""

from __future__ import annotations

import json
from pathlib import Path

from memsvc.errors import InvalidArgument

INDEX_FILE = "model.safetensors.index.json"
"""A sharded checkpoint's map of tensor name to file."""


def read_weight_map(root: Path, index: Path) -> dict[str, Path]:
    """The index's tensor -> file map, each file inside ``root``; INVALID_ARGUMENT for an index that
    is not one, or that names a file outside the directory (absolute, or through ``..``)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise InvalidArgument(f"{index}: not a safetensors index ({e})") from None
    where: dict[str, Path] = {}
    for name, file in weight_map.items():
        rel = Path(file) if isinstance(file, str) else None
        if rel is None or not file or rel.is_absolute() or ".." in rel.parts:
            raise InvalidArgument(f"{index}: tensor '{name}' maps to {file!r}, not a file in the checkpoint directory")
        where[str(name)] = root / rel
    return where


__all__ = ["INDEX_FILE", "read_weight_map"]
