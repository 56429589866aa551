"""Who imports whom, as each package's docstring says: the services (``memsvc.manager``,
``memsvc.gateway``, ``worker``) build on the shared layer (``memsvc.errors``, ``memsvc.vocabulary``,
``memsvc.runtime``, the stubs) and never on each other; the shared layer imports no service; and in
``memsvc`` only the command line reaches into the worker, each through one module. Every import is
counted, those inside functions too, read from the sources."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from childproc import REPO_ROOT

SHARED = {"memsvc.errors", "memsvc.vocabulary", "memsvc.runtime", "memsvc.v1"}
"""What every service may import of memsvc (and ``memsvc`` itself, the package: its lazy exports)."""


def _ours(module: str) -> str | None:
    """The package-level name of one of our modules (``memsvc.runtime``, ``worker``, ...), else None."""
    parts = module.split(".")
    if parts[0] == "worker":
        return "worker"
    if parts[0] == "memsvc":
        return ".".join(parts[:2]) if len(parts) > 1 else "memsvc"
    return None


def _imports(path: Path) -> set[str]:
    """Every absolute module path ``path`` imports (``from a import b`` counts ``a`` and ``a.b``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found


def _imported_by(package: str) -> dict[str, set[str]]:
    """Our packages that ``package``'s modules import (itself left out), each with who imports it."""
    out: dict[str, set[str]] = {}
    for path in sorted((REPO_ROOT / package).rglob("*.py")):
        for module in _imports(path):
            ours = _ours(module)
            if ours is not None and not ours.startswith(package.replace("/", ".")):
                out.setdefault(ours, set()).add(str(path.relative_to(REPO_ROOT)))
    return out


@pytest.mark.parametrize("package", ["memsvc/manager", "memsvc/gateway", "worker"])
def test_a_service_builds_on_the_shared_layer_alone(package: str) -> None:
    imported = _imported_by(package)
    assert set(imported) <= SHARED | {"memsvc"}, {k: v for k, v in imported.items() if k not in SHARED}


def test_the_shared_layer_imports_no_service() -> None:
    imported = _imported_by("memsvc/runtime")
    assert set(imported) <= SHARED, imported
    for module in ("errors", "vocabulary"):
        ours = {_ours(m) for m in _imports(REPO_ROOT / "memsvc" / f"{module}.py")} - {None}
        assert ours <= {"memsvc.errors", "memsvc.v1"}, (module, ours)


def test_only_the_command_line_reaches_into_the_worker_each_through_one_module() -> None:
    reaching = {
        str(path.relative_to(REPO_ROOT)): sorted(m for m in _imports(path) if _ours(m) == "worker")
        for path in sorted((REPO_ROOT / "memsvc").rglob("*.py"))
        if "v1" not in path.relative_to(REPO_ROOT).parts
    }
    reaching = {path: modules for path, modules in reaching.items() if modules}
    assert reaching == {
        "memsvc/cli.py": ["worker", "worker.command"],  # ``from worker import command``: the worker's command
        "memsvc/_up.py": ["worker._native", "worker._native.cuda_device_count"],  # is there a GPU for its default
    }
