"""``import torch`` for a worker's start, with torch's Python meta registrations left until asked for.

Why: ``import torch`` runs ``torch._meta_registrations``, which registers Python "meta" kernels (the
shape rules of meta and fake tensors, which torch.compile's and torch.export's tracing run on) and
imports torch's decompositions, primitives and references for them: a tenth of the import and more
(torch 2.13 on the development machine: 1.53 s against 1.72 s; on the H100 hosts, torch 2.11, the
model layer's import 0.12-0.15 s shorter: docs/benchmarks.md, "Start-up: torch's meta registrations").
On a worker's start that import is the critical path: everything after it (the weights, the
warm-up) waits, and beside it every other thread competes for the same interpreter lock. A worker
traces nothing: its steps run torch's C++ (CUDA, CPU) kernels and Triton's, eagerly or replayed from
CUDA graphs, none of which reads a Python meta kernel.

How: while torch imports, ``sys.modules`` holds a stand-in for ``torch._meta_registrations``, so
torch's ``from torch import _meta_registrations`` binds it instead of running the module; after the
import the stand-in is taken out of both places, as though the module had never been imported. What
needs the registrations imports them: torch.compile, torch.export and fake tensors import
``torch._decomp``, which imports them at its top. Imported first, though, the decompositions meet
their own half-made module through the references (torch's own order starts at the registrations),
so a finder stays on ``sys.meta_path``: the first import of any module the registrations would have
brought imports the registrations first, in torch's order, and that module is then already there. A
torch that reads an attribute of the stand-in during its own import (none does, up to 2.13) makes it
import the real module there: nothing saved, nothing lost.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import types
from collections.abc import Sequence
from typing import Any

DEFERRED = "torch._meta_registrations"
"""The module left out of the import (see the module's docstring)."""
VERIFIED = ("2.11.", "2.13.")
"""The torch versions whose worker was run with :data:`DEFERRED` left out: every CPU test (2.13, the
development and CI machines) and every GPU test (2.11, the GPU machine). Any other imports torch
whole: a torch may come to need the registrations' side effects in eager code (2.13's Generator
does, see :func:`import_torch`), and only a run of the tests shows it."""
BROUGHT = frozenset(
    {
        DEFERRED,
        "torch._decomp",
        "torch._prims",
        "torch._prims_common.wrappers",
        "torch._refs",
        "torch.testing._internal.common_dtype",
        "torch.utils._content_store",
    }
)
"""The packages and modules that :data:`DEFERRED` imports and a plain ``import torch`` then has (torch
2.13; their submodules come with them): imported first, each makes :class:`_RegistrationsFirst` import
:data:`DEFERRED` before it."""


class _StandIn(types.ModuleType):
    """In ``sys.modules`` while torch imports; the real module, imported, at the first attribute read."""

    real: types.ModuleType | None = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):  # the import system's own look-ups
            raise AttributeError(name)
        if self.real is None:
            if sys.modules.get(DEFERRED) is self:
                del sys.modules[DEFERRED]
            self.real = importlib.import_module(DEFERRED)
        return getattr(self.real, name)


class _Loaded(importlib.abc.Loader):
    """The loader of a module that finding it imported: the module as it is, its own spec kept."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        self.spec = module.__spec__  # before find_spec replaces it

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self.spec  # the import system set it to the one found here


class _RegistrationsFirst(importlib.abc.MetaPathFinder):
    """On ``sys.meta_path`` once torch is in without :data:`DEFERRED`: the first import of a module of
    :data:`BROUGHT` imports :data:`DEFERRED` first (which brings it, in torch's order), then hands the
    import system what that made. Off the path after."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.done = False

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if self.done or name not in BROUGHT:
            return None
        with self._lock:  # the import system holds its global lock here too; this is for the flag
            if self.done:
                return None
            self.done = True
        sys.meta_path = [f for f in sys.meta_path if f is not self]  # a new list: the one iterated stays whole
        if name == DEFERRED:
            return None  # torch's own order: the import system imports it now
        importlib.import_module(DEFERRED)
        module = sys.modules.get(name)
        if module is None or module.__spec__ is None:  # a torch whose registrations do not bring it
            return None
        # The import system, finding the module in sys.modules now, takes the spec the module holds
        # rather than the one returned: both are this one until _Loaded puts the module's own back.
        module.__spec__ = spec = importlib.machinery.ModuleSpec(name, _Loaded(module))
        return spec


def import_torch() -> bool:
    """Import torch with :data:`DEFERRED` left out (the module's docstring says why and how), where
    its version is one of :data:`VERIFIED`; whether it was (not where torch was imported already, or
    where torch asked for the module meanwhile)."""
    if "torch" in sys.modules:
        return False
    if not _installed_torch().startswith(VERIFIED):
        importlib.import_module("torch")
        return False
    stand_in = _StandIn(DEFERRED, "worker/torch_import.py's stand-in: torch's Python meta registrations, deferred")
    if sys.modules.setdefault(DEFERRED, stand_in) is not stand_in:
        importlib.import_module("torch")
        return False
    try:
        importlib.import_module("torch")
    finally:
        if sys.modules.get(DEFERRED) is stand_in:
            del sys.modules[DEFERRED]
        torch = sys.modules.get("torch")
        if torch is not None and getattr(torch, "_meta_registrations", None) is stand_in:
            if stand_in.real is None:
                del torch._meta_registrations
            else:
                torch._meta_registrations = stand_in.real  # type: ignore[attr-defined]
    if stand_in.real is not None:
        return False
    if hasattr(sys.modules["torch"]._C, "_set_generator_metaclass"):
        # torch 2.13 binds torch.Generator's metaclass in torch._prims.rng_prims, which the
        # registrations bring, and refuses to make a Generator before (sampling with a seed makes
        # one): imported on its own here, without the rest (torch._prims imports alone)
        importlib.import_module("torch._prims.rng_prims")
    sys.meta_path.insert(0, _RegistrationsFirst())
    return True


def _installed_torch() -> str:
    """The installed torch's version, from its metadata (importing torch is what is being decided)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:  # a torch on the path without its metadata: not one of those verified
        return ""


__all__ = ["DEFERRED", "import_torch"]
