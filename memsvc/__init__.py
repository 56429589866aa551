"""memsvc: put idle LLM model workers to sleep and wake them fast.

The public Python API is what this package exports (docs/python-api.md lists it) plus the generated
stubs in :mod:`memsvc.v1`:

- :class:`ManagerClient` and :class:`Security`: call a manager, with TLS and a token if needed;
- the exception tree (:class:`MemsvcError` and its subclasses), :func:`error_info`, which
  reads the ``google.rpc.ErrorInfo`` detail (domain :data:`DOMAIN`) of a failed call, and
  :func:`retry_delay`, its ``google.rpc.RetryInfo`` (a loading worker's, say);
- the vocabulary: :class:`Action`, :class:`SleepLevel`, :class:`WorkerState`, :class:`TagState`,
  :class:`CopyMethod`, and the tag names :data:`WEIGHTS` and :data:`KV_CACHE`.

The allocator API for embedding is :mod:`worker.allocator`. Everything else (modules whose name
starts with ``_``, ``memsvc.manager``, ``memsvc.cli`` and the rest of ``worker``) is the services'
own code, with no compatibility promise.

Importing this package loads neither torch nor the native extension, and loads grpc only when a
name that needs it is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from memsvc.client import ManagerClient
    from memsvc.errors import (
        BackendError,
        Cancelled,
        IntegrityError,
        InvalidArgument,
        Loading,
        MemsvcError,
        NoLeader,
        NotFound,
        OutOfMemory,
        Overloaded,
        PermissionDenied,
        RelayedError,
        TransitionInProgress,
        Unauthenticated,
        Unavailable,
        WrongState,
    )
    from memsvc.runtime.auth import Security
    from memsvc.runtime.rpc_errors import DOMAIN, error_info, retry_delay
    from memsvc.vocabulary import KV_CACHE, WEIGHTS, Action, CopyMethod, SleepLevel, TagState, WorkerState

_EXPORTS = {
    "ManagerClient": "memsvc.client",
    "Security": "memsvc.runtime.auth",
    "DOMAIN": "memsvc.runtime.rpc_errors",
    "error_info": "memsvc.runtime.rpc_errors",
    "retry_delay": "memsvc.runtime.rpc_errors",
    **dict.fromkeys(
        [
            "BackendError",
            "Cancelled",
            "IntegrityError",
            "InvalidArgument",
            "Loading",
            "MemsvcError",
            "NoLeader",
            "NotFound",
            "OutOfMemory",
            "Overloaded",
            "PermissionDenied",
            "RelayedError",
            "TransitionInProgress",
            "Unauthenticated",
            "Unavailable",
            "WrongState",
        ],
        "memsvc.errors",
    ),
    **dict.fromkeys(
        ["KV_CACHE", "WEIGHTS", "Action", "CopyMethod", "SleepLevel", "TagState", "WorkerState"], "memsvc.vocabulary"
    ),
}


def __getattr__(name: str) -> Any:
    """Load an exported name's module on first use (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'memsvc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "DOMAIN",
    "KV_CACHE",
    "WEIGHTS",
    "Action",
    "BackendError",
    "Cancelled",
    "CopyMethod",
    "IntegrityError",
    "InvalidArgument",
    "Loading",
    "ManagerClient",
    "MemsvcError",
    "NoLeader",
    "NotFound",
    "OutOfMemory",
    "Overloaded",
    "PermissionDenied",
    "RelayedError",
    "Security",
    "SleepLevel",
    "TagState",
    "TransitionInProgress",
    "Unauthenticated",
    "Unavailable",
    "WorkerState",
    "WrongState",
    "__version__",
    "error_info",
    "retry_delay",
]
