"""Compiled modules kept between starts, where the installation keeps none.

Why: a service's start is mostly imports (``import torch`` alone is over two thousand modules), and
Python imports a module fast only from its byte-code, which it keeps in a ``__pycache__`` beside the
source: written by the installer (pip compiles by default) or by the first import. Where neither
happens, every start compiles every module again. That is the case when the packages were installed
without compiling (uv's default, an image built with ``--no-compile``) and this interpreter may not
write beside them: ``PYTHONDONTWRITEBYTECODE``, which many container images set, or a read-only
site-packages. On an H100 host so configured, ``import torch`` took 1.9 s instead of 0.9 s and a
worker's spawn to its first token 3.6 s instead of 2.35 s (docs/benchmarks.md, "Start-up: compiled
modules kept").

:func:`keep_bytecode` then points Python's own byte-code cache (``sys.pycache_prefix``, the
``PYTHONPYCACHEPREFIX`` of Python 3.8+) at a directory of ours: the first start writes each module
there, later starts read it back (every module's: the standard library's too, compiled there once,
since Python then looks for byte-code nowhere else). Python checks each file against its source
(modification time and size) as it does in ``__pycache__``, writes it atomically (several processes
may start at once) and skips a write that fails (a read-only home). An installation that has its
byte-code, or whose interpreter writes it beside the sources, is left alone: redirecting would
compile it all once more.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence

OFF = "off"
"""The ``--bytecode-cache`` value that leaves Python's own choice alone."""

PROBES = ("torch", "grpc")
"""The packages whose byte-code decides: the largest a service imports (a gateway has no torch)."""


def default_dir() -> str:
    """Beside the other per-user caches: ``$XDG_CACHE_HOME/memsvc/bytecode``, else under ``~/.cache``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "memsvc", "bytecode")


def uncompiled(package: str) -> bool:
    """Whether ``package`` is installed with no byte-code beside its source, which this interpreter will
    not write there either. Its ``__init__`` stands for the installation: installers compile all or none."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return False
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return False
    cached = importlib.util.cache_from_source(spec.origin)
    if os.path.exists(cached):
        return False
    if sys.dont_write_bytecode:
        return True
    folder = os.path.dirname(cached)
    return not os.access(folder if os.path.isdir(folder) else os.path.dirname(folder), os.W_OK)


def keep_bytecode(directory: str, probes: Sequence[str] = PROBES) -> str | None:
    """Before the heavy imports: when one of ``probes`` is :func:`uncompiled`, write and read byte-code
    under ``directory``, for this process and (through the environment) the processes it starts.
    Returns that directory, or None where nothing changed: ``directory`` is ``off`` or empty, the
    caller set a cache of their own (``PYTHONPYCACHEPREFIX``), the byte-code is there, or the
    directory cannot be made and written (then Python would look for byte-code only where none can be
    kept, and compile even the standard library's at every start: slower than leaving it alone)."""
    if directory in ("", OFF) or sys.pycache_prefix is not None:
        return None
    if not any(uncompiled(p) for p in probes):
        return None
    expanded = os.path.expanduser(directory)
    if expanded.startswith("~"):  # no home to put it in (a user id without a passwd entry, no $HOME)
        return None
    prefix = os.path.abspath(expanded)
    try:
        os.makedirs(prefix, exist_ok=True)
    except OSError:
        return None
    if not os.access(prefix, os.W_OK | os.X_OK):
        return None
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return prefix
