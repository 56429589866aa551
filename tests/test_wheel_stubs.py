"""The stub-only install other services use: the built wheel, installed with ``--no-deps`` into a fresh
venv next to nothing but grpcio, protobuf and the gRPC health/reflection/status packages (with what
those require themselves: googleapis-common-protos, typing-extensions) — no torch. There every ``memsvc.v1`` module and
``memsvc.client`` must import, without torch and without the native extension being loaded.

The wheel is dist/memsvc-*.whl (``make test`` runs ``make wheel`` first, as the Dockerfile's build
stage does); where there is none, one is built into tmp_path. The test is skipped, saying so, only
when there is no wheel and building one fails. Dependencies come from the index or pip's cache, pinned
to the versions this environment runs, so the check is about the wheel rather than a new release.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest
from upproc import REPO_ROOT, run

import memsvc

DIST = REPO_ROOT / "dist"
PROTOS = REPO_ROOT / "protos" / "memsvc" / "v1"
STUB_DEPENDENCIES = [
    "grpcio", "protobuf", "grpcio-health-checking", "grpcio-reflection", "grpcio-status", "googleapis-common-protos",
]  # fmt: skip

PROBE = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    import memsvc, memsvc.v1
    names = sorted(mi.name for mi in pkgutil.iter_modules(memsvc.v1.__path__, "memsvc.v1."))
    failed = {}
    for name in [*names, "memsvc.client", "memsvc.errors", "memsvc._rpc_errors"]:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    import importlib.util
    print(json.dumps({
        "modules": names,
        "failed": failed,
        "memsvc_file": memsvc.__file__,
        "torch_loaded": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
        "worker_loaded": sorted(m for m in sys.modules if m == "worker" or m.startswith("worker.")),
        "torch_installed": importlib.util.find_spec("torch") is not None,
    }))
    """
)


def find_wheel(where: Path) -> Path | None:
    wheels = sorted(where.glob(f"memsvc-{memsvc.__version__}-*.whl"), key=lambda p: p.stat().st_mtime)
    return wheels[-1] if wheels else None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    found = find_wheel(DIST)
    if found is not None:
        return found
    # Build from a copy of the tracked files, so the build (which regenerates memsvc/v1) never writes
    # into the tree other tests import from.
    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"
    files = run(["git", "ls-files", "-z"])
    if files.returncode != 0:
        pytest.skip(f"dist/ has no memsvc wheel and git cannot list the sources to build one: {files.stderr}")
    for rel in filter(None, files.stdout.split("\0")):
        if (REPO_ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / rel, src / rel)
    r = run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out),
             str(src)], timeout=600)  # fmt: skip
    built = find_wheel(out)
    if r.returncode != 0 or built is None:
        pytest.skip(f"dist/ has no memsvc wheel and building one failed (run `make wheel`):\n{r.stderr[-2000:]}")
    return built


def closure(names: list[str]) -> list[str]:
    """``names`` and what they themselves require (extras aside), as installed here: grpcio, for one,
    needs typing-extensions. memsvc's own requirements are not followed: its wheel goes in --no-deps."""
    seen: dict[str, None] = {}
    todo = list(names)
    while todo:
        name = canonical(todo.pop(0))
        if name in seen:
            continue
        seen[name] = None
        for req in importlib.metadata.requires(name) or []:
            if "extra ==" not in req:
                todo.append(re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0])
    return list(seen)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def expected_stub_modules() -> set[str]:
    """What the build generates from protos/memsvc/v1: X_pb2 per file, X_pb2_grpc per file with a service."""
    out = set()
    for proto in PROTOS.glob("*.proto"):
        out.add(f"memsvc.v1.{proto.stem}_pb2")
        if any(line.startswith("service ") for line in proto.read_text().splitlines()):
            out.add(f"memsvc.v1.{proto.stem}_pb2_grpc")
    return out


def test_stub_only_install_imports_without_torch(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "stubs-venv"
    venv.EnvBuilder(with_pip=False, clear=True).create(env_dir)
    py = env_dir / "bin" / "python"
    deps = closure(STUB_DEPENDENCIES)
    assert "torch" not in deps
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in deps]
    r = run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps",
             "--disable-pip-version-check", str(wheel), *pins], timeout=600, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, f"pip install failed:\n{r.stdout}\n{r.stderr}"

    installed = run([sys.executable, "-m", "pip", "--python", str(py), "list", "--format=json"], cwd=tmp_path)
    names = {canonical(d["name"]) for d in json.loads(installed.stdout)}
    assert names == {"memsvc", *deps}, f"not exactly the wheel and the stubs' dependencies: {sorted(names)}"

    # -I: no PYTHONPATH, no user site, no current directory: only what the venv holds
    r = run([str(py), "-I", "-c", PROBE], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(got["memsvc_file"]).is_relative_to(env_dir), f"memsvc came from {got['memsvc_file']}, not the wheel"
    assert not got["failed"], got["failed"]
    assert expected_stub_modules() <= set(got["modules"]), got["modules"]
    assert not got["torch_installed"], "torch is in the stub-only venv"
    assert got["torch_loaded"] == []
    assert got["worker_loaded"] == [], "importing the stubs and the client loaded the worker package"


def test_the_wheel_ships_typed_stubs(wheel: Path) -> None:
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    for mod in expected_stub_modules():
        base = mod.replace(".", "/")
        assert {f"{base}.py", f"{base}.pyi"} <= names, f"{base}.py/.pyi missing from {wheel.name}"
    assert "memsvc/py.typed" in names


def test_pip_is_new_enough_for_python_flag() -> None:
    """``pip --python`` (pip >= 22.3) installs into the fresh venv without bootstrapping pip there."""
    r = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True, check=True)
    major, minor = (int(x) for x in r.stdout.split()[1].split(".")[:2])
    assert (major, minor) >= (22, 3)
