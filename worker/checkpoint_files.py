"""Where a Hugging Face checkpoint directory keeps its tensors: the index of a sharded checkpoint
(``model.safetensors.index.json``), read and checked once for its readers, the loader
(worker/model/loader.py), the start-up read-ahead (worker/prefetch.py) and staging
(worker/staging.py), and how many threads read the shards. No torch here: the read-ahead and the
staging run while torch is being imported."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from memsvc.errors import InvalidArgument, NotFound

INDEX_FILE = "model.safetensors.index.json"
"""A sharded checkpoint's map of tensor name to file."""
CONFIG_FILE = "config.json"
SYNTHETIC_PREFIX = "synthetic:"
"""A model spec that names a synthetic preset (worker/model/weights.py's SyntheticSource), not a checkpoint."""
MAX_JSON_BYTES = 64 << 20
"""A checkpoint's JSON files (config, index, generation config) at most: an index of a 400B model is
a few MiB; more is not a checkpoint, and the whole file is read into memory."""
DEFAULT_THREADS = 16
"""Threads reading a checkpoint's shards at most (one per core below that), the loader's
(worker/model/loader.py) and the start-up staging's (worker/staging.py). The H200 host (16 cores),
16.06 GB from the page cache into the GPU: 1 thread 6.0 GB/s, 4 threads 16.8, 8 threads 26.7, 16
threads 36.3 GB/s, with 16 MiB chunks (64 MiB: within 3 %; 4 MiB: 14-16 GB/s); bench_loader --sweep,
2026-12-01. The loader's ring is then 32 chunks of 16 MiB: 512 MiB of page-locked host memory held
while the worker lives."""


def reader_threads() -> int:
    """:data:`DEFAULT_THREADS`, or one per core where there are fewer."""
    return min(DEFAULT_THREADS, os.cpu_count() or 1)


MAX_JSON_DEPTH = 32
"""Nesting of those files at most (a real config nests 3 deep): a file nested 100,000 deep made
``json.loads`` raise RecursionError, a traceback instead of a refusal."""


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path``, refused by name unless it is a regular file.

    A FIFO, a device or a socket in a checkpoint directory would block the first read for ever (a
    FIFO without a writer blocks the open itself); O_NONBLOCK makes the open return at once, and
    the type is taken from the descriptor opened, not the path, so a symlink cannot swap it in
    between. For a regular file O_NONBLOCK changes nothing and is cleared anyway."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise NotFound(f"{path} does not exist") from None
    except OSError as e:
        raise InvalidArgument(f"{path}: cannot open ({e.strerror or e})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a special file"
            raise InvalidArgument(f"{path} is not a regular file ({what}): a checkpoint's files must be")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _depth(value: Any) -> int:
    """How deep ``value`` nests, without recursion (its own depth is the bound)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_JSON_DEPTH:
                break
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def read_json(file: Path) -> Any:
    """One JSON file of a checkpoint, bounded: a regular file (:func:`open_regular`) of at most
    :data:`MAX_JSON_BYTES`, valid JSON nested at most :data:`MAX_JSON_DEPTH` deep; INVALID_ARGUMENT
    naming the file otherwise, NOT_FOUND when it is missing."""
    fd = open_regular(file)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except OSError as e:
        raise InvalidArgument(f"{file}: cannot read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_JSON_BYTES:
        raise InvalidArgument(f"{file}: larger than {MAX_JSON_BYTES} bytes, the most a checkpoint's JSON file may be")
    try:
        doc = json.loads(raw)
    except RecursionError:
        doc, deep = None, True
    except ValueError as e:  # UnicodeDecodeError too
        raise InvalidArgument(f"{file}: not valid JSON ({e})") from None
    else:
        deep = _depth(doc) > MAX_JSON_DEPTH
    if deep:
        raise InvalidArgument(
            f"{file}: JSON nested deeper than {MAX_JSON_DEPTH} levels, the most a checkpoint's may be"
        )
    return doc


def read_weight_map(root: Path, index: Path) -> dict[str, Path]:
    """The index's tensor -> file map, each file inside ``root``; INVALID_ARGUMENT for an index that
    is not one, or that names a file outside the directory (absolute, or through ``..``)."""
    try:
        doc = read_json(index)
    except InvalidArgument as e:
        raise InvalidArgument(f"not a safetensors index: {e}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise InvalidArgument(f"{index}: not a safetensors index (no 'weight_map' object)")
    where: dict[str, Path] = {}
    for name, file in weight_map.items():
        rel = Path(file) if isinstance(file, str) else None
        if rel is None or not file or rel.is_absolute() or ".." in rel.parts:
            raise InvalidArgument(f"{index}: tensor '{name}' maps to {file!r}, not a file in the checkpoint directory")
        where[str(name)] = root / rel
    return where


__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "open_regular",
    "read_json",
    "read_weight_map",
]
