"""Triton's key of its own files, kept on disk between starts.

Before a process launches its first Triton kernel, Triton hashes its own files (``triton_key``: the
sources of its compiler, backends and language, and its shared library of over 400 MB): the first
part of every compiled kernel's cache key. Alone that is about 0.3 s of reading and hashing on an
H100 host. Beside the model layer's imports, taking the GIL back twice per MB, it took 1.8-1.9 s
there and ended after them: the warm-up waited up to 0.35 s for it (docs/benchmarks.md, "Start-up:
Triton's key kept").

The key changes only when Triton's files do. So the first start keeps it in Triton's cache directory,
beside the kernels compiled under it, in a file named for a fingerprint of those files: the path,
size, modification time and inode of every file in Triton's package, which a reinstall, an upgrade
or an edit changes. Later starts read it back and put it in place of Triton's function
(``triton.runtime.cache.triton_key``, the name its cache-key function calls at every compile). A key
that cannot be read is made as before, and one that cannot be written is made again next time.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("memsvc.worker")

KEPT_PREFIX = "memsvc-triton-key-"
"""The kept key's file name, before the fingerprint's digest."""

_lock = threading.Lock()
"""One caller at a time: the import thread's hash and the device thread's first launch may both ask."""


def keep_triton_key() -> bool:
    """Triton's key of its own files, read where kept under the files' fingerprint, else made by Triton
    and kept; from now on Triton's cache-key function gets it from here. Whether it was read back (not
    made; False too where this Triton has no such function). What importing Triton raises, this
    raises."""
    import triton
    from triton.runtime import cache

    with _lock:
        made: Callable[[], str] | None = getattr(cache, "triton_key", None)
        if made is None:  # moved: Triton makes it where it now lives
            return False
        if hasattr(made, "memsvc_read"):  # kept by an earlier call in this process (a standby's)
            return bool(made.memsvc_read)
        path = kept_path(cache_dir(triton), triton.__version__, Path(triton.__file__).parent)
        key = _read(path, triton.__version__) if path is not None else None
        read = key is not None
        if key is None:
            key = made()
            if path is not None:
                _write(path, key)

        @functools.lru_cache  # as Triton's own is: its callers may ask for cache_info or cache_clear
        def triton_key() -> str:
            return key

        triton_key.memsvc_read = read  # type: ignore[attr-defined]
        triton_key.memsvc_made = made  # type: ignore[attr-defined]  # Triton's own, which made it or would have
        cache.triton_key = triton_key
        return read


def kept_path(directory: Path | None, version: str, root: Path) -> Path | None:
    """Where the key of the Triton installed at ``root`` is kept in ``directory``: named for a digest of
    its version and of every file under ``root`` (path, size, modification time, inode), linked
    folders followed (a development install links its backends in, and Triton's own key reads them).
    None when there is no directory, or ``root`` cannot be walked."""
    if directory is None:
        return None
    digest = hashlib.sha256(version.encode())
    seen: set[str] = set()
    try:
        for folder, dirs, files in os.walk(root, onerror=_raise, followlinks=True):
            real = os.path.realpath(folder)
            if real in seen or os.path.basename(folder) == "__pycache__":
                dirs.clear()  # a link back into the tree, or the byte-code Python writes as Triton imports
                continue
            seen.add(real)
            dirs.sort()
            for name in sorted(files):
                st = os.stat(os.path.join(folder, name))
                rel = os.path.relpath(os.path.join(folder, name), root)
                digest.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
    except OSError:
        return None
    return directory / f"{KEPT_PREFIX}{digest.hexdigest()[:40]}"


def _raise(exc: OSError) -> None:
    """``os.walk`` skips what it cannot read unless told otherwise: a fingerprint must not."""
    raise exc


def cache_dir(triton: Any) -> Path | None:
    """Triton's cache directory (``TRITON_CACHE_DIR``, else under ``TRITON_HOME`` or the home): where
    its compiled kernels are kept. None where this Triton does not say (its knobs moved)."""
    try:
        return Path(triton.knobs.cache.dir)
    except AttributeError:
        return None


def _read(path: Path, version: str) -> str | None:
    """The key kept at ``path``, if there is one and it is one: Triton's begins with its version."""
    try:
        key = path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    return key if key.startswith(version) else None


def _write(path: Path, key: str) -> None:
    """Atomically (workers may start at once, each writing the same key); a failure only means no key
    kept."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    except OSError as exc:
        log.debug("triton's key was not kept in %s: %s", path.parent, exc)
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(key)
        os.replace(tmp, path)
    except OSError as exc:
        log.debug("triton's key was not kept in %s: %s", path.parent, exc)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


__all__ = ["KEPT_PREFIX", "cache_dir", "keep_triton_key", "kept_path"]
