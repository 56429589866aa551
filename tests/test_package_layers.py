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
    """Every absolute module path ``path`` imports (``from a import b`` counts ``a`` and ``a.b``); a
    relative import fails the test (the layers are read from absolute names: ours use none)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module, f"{path}:{node.lineno}: a relative import"
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found


def _sources(package: str) -> list[Path]:
    """The package's modules, the generated stubs left out; never none (a wrong path would pass)."""
    paths = [p for p in sorted((REPO_ROOT / package).rglob("*.py")) if "v1" not in p.relative_to(REPO_ROOT).parts]
    assert paths, f"no modules under {package}"
    return paths


def _imported_by(package: str) -> dict[str, set[str]]:
    """Our packages that ``package``'s modules import (itself left out), each with who imports it."""
    out: dict[str, set[str]] = {}
    for path in _sources(package):
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
        for path in _sources("memsvc")
    }
    reaching = {path: modules for path, modules in reaching.items() if modules}
    assert reaching == {
        "memsvc/cli.py": ["worker", "worker.command"],  # ``from worker import command``: the worker's command
        "memsvc/_up.py": ["worker._native", "worker._native.cuda_device_count"],  # is there a GPU for its default
    }


def test_the_lazy_exports_of_memsvc_come_from_the_shared_layer() -> None:
    """``memsvc``'s names are imported by a string table on first use, which the walk above cannot
    see: each comes from the shared layer or the client, never from a service."""
    import memsvc

    assert {_ours(module) for module in memsvc._EXPORTS.values()} <= SHARED | {"memsvc.client"}


@pytest.mark.parametrize(
    ("service", "importers"),
    [
        ("memsvc.manager", {"memsvc/cli.py", "memsvc/_host.py"}),
        ("memsvc.gateway", {"memsvc/cli.py"}),
    ],
)
def test_a_service_is_imported_only_by_the_command_line(service: str, importers: set[str]) -> None:
    """What the manager's and the gateway's docstrings say: outside the service itself, only these."""
    found = {
        str(path.relative_to(REPO_ROOT))
        for root in ("memsvc", "worker")
        for path in _sources(root)
        if not str(path.relative_to(REPO_ROOT)).startswith(service.replace(".", "/") + "/")
        and any(_ours(module) == service for module in _imports(path))
    }
    assert found == importers
