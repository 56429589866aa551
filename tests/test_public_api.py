"""The curated public API (docs/python-api.md): what ``memsvc`` exports, that every export resolves,
and that importing the package stays light (no torch, no native extension, no grpc until used)."""

from __future__ import annotations

import subprocess
import sys

import memsvc
from memsvc.errors import MemsvcError

DOCS_NAMES = {
    "ManagerClient",
    "Security",
    "DOMAIN",
    "error_info",
    "MemsvcError",
    "Action",
    "SleepLevel",
    "WorkerState",
    "TagState",
    "CopyMethod",
    "WEIGHTS",
    "KV_CACHE",
}


def test_all_lists_exactly_the_lazy_exports_and_each_resolves() -> None:
    assert sorted(memsvc.__all__) == sorted(["__version__", *memsvc._EXPORTS])
    for name in memsvc.__all__:
        assert getattr(memsvc, name) is not None, name
    assert set(memsvc.__all__) >= DOCS_NAMES


def test_every_exception_of_the_tree_is_exported() -> None:
    from memsvc import errors

    tree = {name for name in errors.__all__ if isinstance(getattr(errors, name), type)}
    classes, level = {"MemsvcError"}, MemsvcError.__subclasses__()
    while level:
        classes |= {c.__name__ for c in level}
        level = [sub for c in level for sub in c.__subclasses__()]
    assert classes == tree
    assert tree <= set(memsvc.__all__)


def test_importing_memsvc_loads_neither_torch_nor_grpc_until_a_name_needs_it() -> None:
    code = (
        "import sys, memsvc; "
        "assert not {'torch', 'grpc', 'worker._native'} & set(sys.modules), sorted(sys.modules); "
        "memsvc.WorkerState; assert 'torch' not in sys.modules; "
        "memsvc.ManagerClient; assert 'grpc' in sys.modules and 'torch' not in sys.modules"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
