"""The Triton kernels a start compiled, kept by their specialisations for the next start of the same
model, which loads them ahead.

Why: the first launch of each kernel specialisation in a process, even one Triton's disk cache holds,
runs Triton's cache lookup in Python (its key, the metadata, every IR file read back), makes the
launcher and loads the binary into the device. The warm-up (worker/model/runner.py) does that for
every kernel of a step at the row counts of the prompt chunk and of a decode, and for the graph
buckets, on the device thread, after the load, where everything else of the start waits for it. Until
then the load waits for cuBLAS's first products (worker/model/first_products.py), which run mostly
without the GIL: the import thread loads the kept kernels in that wait. For an 8B Llama on an H100
host that was 8 kernels in 0.03 s, inside the wait, and the warm-up took 0.21 s instead of 0.24 s in
each of four starts (docs/benchmarks.md, "Start-up: the kernels a start compiled, kept").

What is kept: Triton's own serialised specialisation of each launch compiled in this process (what
its ``jit_post_compile_hook`` is given; ``JITFunction.preload`` takes it back and puts the compiled
kernel where the launch looks for it), in Triton's cache directory beside the kernels, in a file
named for a digest of Triton's version, the device's compute capability, the kernels' own source
hashes and the model's key (its ``config.json``), so a change to any of them starts a new file. A
kernel preloaded from a kept specialisation is the same one the launch would have compiled: the
specialisation carries the key of Triton's in-process cache, and Triton compiles it from the same
source and options. A file that cannot be read, or holds what is not a list of specialisations, is
taken for none; a specialisation whose kernel is not ours, or whose preload raises, is skipped (the
launch compiles it as before).

Threads: :func:`preload` on the import thread (worker/main.py, through
worker/model/kernels.py's ``load_ahead``), :func:`keep` on the device thread after the warm-up; the
recorder is called on whichever thread compiles.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("memsvc.worker")

KEPT_PREFIX = "memsvc-kernels-"
"""The kept file's name, before the digest."""
MAX_KEPT = 256
"""Specialisations one file keeps at most (an 8B Llama's start compiles 8; a file gathers those of
starts with other flags): past it, those of the last start alone."""


@dataclass
class _Kept:
    """This process's kept file and what was recorded (one per process)."""

    path: Path | None = None
    kept: set[str] = field(default_factory=set)
    """What the file held when it was read, or last written."""
    recorded: set[str] = field(default_factory=set)
    """Specialisations compiled in this process, preloaded ones too."""
    compiled_after: int = 0
    """Kernels compiled for a launch (not a preload): after the preload, launches it did not cover."""
    lock: threading.Lock = field(default_factory=threading.Lock)


_state = _Kept()


def kernels_path(
    folder: Path, version: str, capability: tuple[int, int], kernel_keys: Iterable[str], model: bytes
) -> Path:
    """Where the kernels of a model (``model``: its key) are kept in ``folder``, for this Triton
    ``version``, a device of ``capability`` and our kernels' source hashes (``kernel_keys``)."""
    digest = hashlib.sha256()
    for part in (version, repr(tuple(capability)), *sorted(kernel_keys)):
        digest.update(part.encode() + b"\0")
    digest.update(hashlib.sha256(model).digest())
    return folder / f"{KEPT_PREFIX}{digest.hexdigest()[:40]}.json"


def read_specs(path: Path) -> list[str]:
    """The specialisations kept at ``path``: none where it is missing, unreadable or not a list of
    strings."""
    try:
        specs = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return []
    if not isinstance(specs, list) or not all(isinstance(s, str) for s in specs):
        return []
    return specs


def _write(path: Path, specs: list[str]) -> None:
    """``specs`` at ``path``, whole or not at all (another worker's start may read it meanwhile)."""
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(specs, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def recorder(ours: Iterable[Any], previous: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """A ``jit_post_compile_hook`` that records the specialisation of each compile of one of ``ours``
    (JITFunctions), then calls ``previous`` (a hook set before, whose answer it returns)."""
    ids = {id(k) for k in ours}

    def record(**kwargs: Any) -> Any:
        if id(kwargs["fn"].jit_function) in ids:
            with _state.lock:
                _state.recorded.add(kwargs["compile"]["specialization_data"])
                _state.compiled_after += not kwargs["is_manual_warmup"]
        return previous(**kwargs) if previous is not None else None

    return record


def preload(kernels: Mapping[str, Any], path: Path, hooks: Any = None) -> int:
    """Record from now on what ``kernels`` (JITFunctions by Triton's full name) compile, kept at
    ``path`` by :func:`keep`, and load on the current device what ``path`` keeps. How many were
    loaded. The current thread's device must be the one the model runs on. ``hooks``: where Triton
    looks for its ``jit_post_compile_hook`` (default: ``triton.knobs.runtime``)."""
    if hooks is None:
        from triton import knobs

        hooks = knobs.runtime
    t0 = time.perf_counter()
    with _state.lock:
        _state.path = path
    hooks.jit_post_compile_hook = recorder(kernels.values(), hooks.jit_post_compile_hook)
    specs = read_specs(path)
    with _state.lock:
        _state.kept = set(specs)
    loaded = 0
    for spec in specs:
        try:
            kernel = kernels.get(json.loads(spec)["name"])
            if kernel is None:
                continue
            kernel.preload(spec)._init_handles()  # compiled (from Triton's cache), then its binary loaded
            loaded += 1
        except Exception as exc:  # noqa: BLE001 - the launch compiles it as before
            log.info("triton: a kept kernel not loaded ahead: %s", exc)
    log.info("triton: %d kept kernels loaded ahead in %.2f s", loaded, time.perf_counter() - t0)
    return loaded


def keep() -> int:
    """Write what this process compiled, with what the file kept, where :func:`preload` was told; the
    number written (0: nothing new, or nowhere to keep it)."""
    with _state.lock:
        path, kept, recorded = _state.path, set(_state.kept), set(_state.recorded)
    if path is None or recorded <= kept:
        return 0
    specs = sorted(recorded | kept) if len(recorded | kept) <= MAX_KEPT else sorted(recorded)[:MAX_KEPT]
    try:
        _write(path, specs)
    except OSError as exc:
        log.info("triton: the compiled kernels not kept: %s", exc)
        return 0
    with _state.lock:
        _state.kept = set(specs)
    log.info("triton: %d kernels kept for the next start", len(specs))
    return len(specs)


def compiled_after() -> int:
    """Kernels of ours compiled for a launch in this process (after a preload: what it did not cover)."""
    with _state.lock:
        return _state.compiled_after


__all__ = ["KEPT_PREFIX", "MAX_KEPT", "compiled_after", "keep", "kernels_path", "preload", "read_specs", "recorder"]
