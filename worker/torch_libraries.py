"""torch's shared libraries loaded ahead of ``import torch``, on a thread that does not hold the GIL.

Why: from spawn to the first token a worker's start is bound by the GIL: ``import torch``, the CLI's
and the server's imports, Triton's, the tokenizer's load and the warm-up's Python take it in turn
(docs/benchmarks.md, "Where the interpreter lock goes"). Part of ``import torch`` is loading its shared
libraries (libtorch_cpu and libtorch_cuda with their static registrations, cuBLAS, cuFFT, NCCL and the
rest: 2.5 GB), and both ways torch loads them hold the GIL: ctypes' own ``dlopen``
(torch/__init__.py's ``_load_global_deps``, the CUDA libraries of the pip wheels) and the import of
the extension ``torch._C`` (the rest). On an H100 host, loaded ahead, they took 0.35 s off the import
that followed (medians of four: 3.54 s against 3.88 s; docs/benchmarks.md, "torch's shared libraries
loaded ahead"). ``dlopen`` called as a foreign function through ctypes releases the GIL, so on a
thread started as soon as the command line is read, the loading runs beside the CLI's imports and
the server's start, and the import then finds its libraries loaded.

What is loaded, and how, is what torch's import loads first anyway: ``libtorch_global_deps`` with
``RTLD_GLOBAL`` as torch does, then ``libtorch`` with ``RTLD_LOCAL``, as an extension's dependencies are,
whose own dependencies their RPATH or RUNPATH finds (torch's ``lib`` and the ``nvidia/*/lib`` folders
beside it).
Nothing Python-facing is loaded (``libtorch_python``, ``torch._C``): their initialisers are the import's.
Nothing is preloaded where it could differ from what the import would load:

- where the first ``sys.path`` entry with an ``nvidia`` folder is not the one torch is in: torch loads
  the CUDA libraries from there itself (``_preload_cuda_deps``), so they could be other files than
  those the RPATH finds, two copies of cuBLAS in one process;
- where a folder of ``LD_LIBRARY_PATH`` holds a library named as one of those CUDA libraries: a
  RUNPATH, searched after it, would find that folder's;
- where ``TORCH_USE_RTLD_GLOBAL`` asks torch to load its libraries into the global scope;
- where torch is imported already, or not installed.

A load that fails is logged (debug) and ends the preload: the import then loads, or reports, it.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import logging
import os
import sys
import threading
import time

log = logging.getLogger("memsvc.worker")
_started: threading.Thread | None = None


def libraries() -> tuple[tuple[str, int], ...]:
    """The libraries to load ahead, in order, with their ``dlopen`` modes; none where the module's
    docstring says."""
    if "torch" in sys.modules or os.environ.get("TORCH_USE_RTLD_GLOBAL"):
        return ()
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return ()
    if spec is None or spec.origin is None:
        return ()
    package = os.path.dirname(os.path.abspath(spec.origin))
    site = os.path.realpath(os.path.dirname(package))
    for entry in sys.path:
        if os.path.isdir(os.path.join(entry or os.curdir, "nvidia")):
            if os.path.realpath(entry or os.curdir) != site:
                return ()
            break
    if _shadowed(site):
        return ()
    lib = os.path.join(package, "lib")
    wanted = (
        (os.path.join(lib, "libtorch_global_deps.so"), os.RTLD_NOW | os.RTLD_GLOBAL),
        (os.path.join(lib, "libtorch.so"), os.RTLD_NOW | os.RTLD_LOCAL),
    )
    return wanted if all(os.path.isfile(path) for path, _ in wanted) else ()


def _shadowed(site: str) -> bool:
    """Whether a folder of ``LD_LIBRARY_PATH`` holds a library named as one of the CUDA wheels' beside
    torch (``nvidia/*/lib``): a dependency found through a RUNPATH (torch 2.13's wheels have one;
    2.11's an RPATH, which comes first) would then be that folder's file, where torch loads the wheel's
    by its path first."""
    folders = [folder for folder in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if folder]
    if not folders:
        return False
    names = {os.path.basename(path) for path in glob.glob(os.path.join(site, "nvidia", "*", "lib", "*.so*"))}
    return any(os.path.exists(os.path.join(folder, name)) for folder in folders for name in names)


def start() -> None:
    """Begin loading torch's libraries on a thread of their own, once per process; nothing where
    :func:`libraries` names none."""
    global _started
    if _started is not None:
        return
    wanted = libraries()
    if not wanted:
        return
    _started = threading.Thread(target=_load, args=(wanted,), name="memsvc-torch-libraries", daemon=True)
    _started.start()


def wait() -> None:
    """Until the loading :func:`start` began has ended (at once where none did); the GIL is free
    meanwhile. Called before ``import torch``, whose loading would otherwise wait for glibc's loader
    lock while holding the GIL."""
    if _started is not None:
        _started.join()


def _load(wanted: tuple[tuple[str, int], ...]) -> None:
    t0 = time.perf_counter()
    try:
        process = ctypes.CDLL(None)  # the process's global scope, where the C library's dlopen is
        dlopen = process.dlopen
        dlopen.argtypes = [ctypes.c_char_p, ctypes.c_int]
        dlopen.restype = ctypes.c_void_p
        dlerror = process.dlerror
        dlerror.argtypes = []
        dlerror.restype = ctypes.c_char_p
    except (OSError, AttributeError):
        log.debug("torch's libraries not loaded ahead: no dlopen in this process", exc_info=True)
        return
    for path, mode in wanted:
        # a foreign call: ctypes releases the GIL for it. The handle stays open for the process's life.
        if not dlopen(os.fsencode(path), mode):
            err = dlerror()
            reason = err.decode(errors="replace") if err else "unknown"
            log.debug("torch's libraries: loading %s ahead failed (%s); the import loads it", path, reason)
            return
    log.info("torch's shared libraries loaded ahead in %.2f s", time.perf_counter() - t0)


__all__ = ["libraries", "start", "wait"]
