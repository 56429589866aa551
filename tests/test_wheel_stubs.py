"""The stub-only install other services use: the memsvc-api wheel (api/: the stubs generated from
protos/memsvc/v1, nothing else), ``pip install``-ed with its dependencies resolved into a fresh venv.
There it must bring grpcio, protobuf and googleapis-common-protos (with what those require
themselves: typing-extensions) and nothing more — no torch, no rich, no worker package, nothing
compiled of its own — every ``memsvc.v1`` module must import, and client code using the stubs must
pass ``mypy --strict`` once its ``typing`` extra is installed (and fail without it: grpcio and
protobuf ship no types).

The memsvc wheel depends on memsvc-api of its version and leaves memsvc/v1 to it: installed
together, the two share no file and ``pip check`` is content.

The wheels are dist/memsvc_api-*.whl and dist/memsvc-*.whl (``make test`` runs ``make wheel`` first, as
the Dockerfile's build stage does); where one is missing it is built into tmp_path from a copy of the
sources. Dependencies come from the index or pip's cache, pinned to the versions this environment
runs, so the check is about the wheels rather than a new release; the tests that install them are
skipped, saying so, only when the index is unreachable.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import venv
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from upproc import REPO_ROOT, run

import memsvc

DIST = REPO_ROOT / "dist"
PROTOS = REPO_ROOT / "protos" / "memsvc" / "v1"
API_RUNTIME = ["grpcio", "protobuf", "googleapis-common-protos"]
"""All a stub-only install may bring besides memsvc-api, with what these require themselves."""
API_TYPING = ["types-grpcio", "types-protobuf"]
"""What memsvc-api's ``typing`` extra must bring for ``mypy --strict``."""
INSTALL_TIMEOUT = 600

PROBE = textwrap.dedent(
    """
    import importlib, importlib.util, json, os, pkgutil, sys
    import memsvc.v1
    names = sorted(mi.name for mi in pkgutil.iter_modules(memsvc.v1.__path__, "memsvc.v1."))
    failed = {}
    for name in [*names, *json.loads(sys.argv[1]), "google.rpc.status_pb2", "google.rpc.error_details_pb2"]:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    memsvc = sys.modules["memsvc"]
    print(json.dumps({
        "modules": names,
        "failed": failed,
        "memsvc_file": memsvc.__file__,
        "memsvc_path": list(memsvc.__path__),
        "v1_dir": os.path.dirname(memsvc.v1.__file__),
        "torch_loaded": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
        "worker_loaded": sorted(m for m in sys.modules if m == "worker" or m.startswith("worker.")),
        "torch_installed": importlib.util.find_spec("torch") is not None,
        "worker_installed": importlib.util.find_spec("worker") is not None,
    }))
    """
)

CLIENT = textwrap.dedent(
    """
    from __future__ import annotations

    import grpc
    from memsvc.v1 import common_pb2
    from memsvc.v1 import memory_manager_service_pb2 as manager_pb
    from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc


    def acquire(address: str, name: str) -> str:
        with grpc.insecure_channel(address) as channel:
            stub = manager_grpc.MemoryManagerServiceStub(channel)
            request = manager_pb.AcquireWorkerRequest(name=name, holder="client")
            request.ttl.FromSeconds(60)
            response: manager_pb.AcquireWorkerResponse = stub.AcquireWorker(request, timeout=30.0)
            level: common_pb2.SleepLevel.ValueType = common_pb2.SLEEP_LEVEL_1
            stub.SleepWorker(manager_pb.SleepWorkerRequest(name=name, level=level), timeout=30.0)
            return response.lease.lease_id


    async def acquire_async(address: str, name: str) -> str:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = manager_grpc.MemoryManagerServiceAsyncStub(channel)
            response = await stub.AcquireWorker(manager_pb.AcquireWorkerRequest(name=name), timeout=30.0)
            return response.lease.lease_id
    """
)

WRONG = textwrap.dedent(
    """
    import grpc
    from memsvc.v1 import memory_manager_service_pb2 as manager_pb
    from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc

    stub = manager_grpc.MemoryManagerServiceStub(grpc.insecure_channel("127.0.0.1:50051"))
    lease_id: int = stub.AcquireWorker(manager_pb.AcquireWorkerRequest(name="workers/w")).lease.lease_id
    manager_pb.AcquireWorkerRequest(nmae="workers/w")
    """
)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return canonical(re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0])


def closure(names: Sequence[str]) -> list[str]:
    """``names`` and what they themselves require (extras aside), as installed here: grpcio, for one,
    needs typing-extensions."""
    seen: dict[str, None] = {}
    todo = list(names)
    while todo:
        name = canonical(todo.pop(0))
        if name in seen:
            continue
        seen[name] = None
        for req in importlib.metadata.requires(name) or []:
            if "extra ==" not in req:
                todo.append(requirement_name(req))
    return list(seen)


def pins(names: Sequence[str]) -> list[str]:
    return [f"{name}=={importlib.metadata.version(name)}" for name in closure(names)]


def expected_stub_modules() -> set[str]:
    """What the build generates from protos/memsvc/v1: X_pb2 per file, X_pb2_grpc per file with a service."""
    out = set()
    for proto in PROTOS.glob("*.proto"):
        out.add(f"memsvc.v1.{proto.stem}_pb2")
        if any(line.startswith("service ") for line in proto.read_text().splitlines()):
            out.add(f"memsvc.v1.{proto.stem}_pb2_grpc")
    return out


def pyproject(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        return tomllib.load(f)


# ---- the wheels ----
@functools.cache
def source_copy(root: Path) -> Path:
    """The sources (tracked files and new ones git does not ignore) copied under ``root``, so a build (which
    writes build/ and egg-info, and for memsvc regenerates memsvc/v1) never writes into the tree other
    tests import from."""
    src = root / "src"
    files = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
    if files.returncode != 0:
        pytest.skip(f"dist/ lacks a wheel and git cannot list the sources to build one: {files.stderr}")
    for rel in filter(None, files.stdout.split("\0")):
        if (REPO_ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / rel, src / rel)
    return src


def find_wheel(where: Path, distribution: str) -> Path | None:
    wheels = sorted(where.glob(f"{distribution}-{memsvc.__version__}-*.whl"), key=lambda p: p.stat().st_mtime)
    return wheels[-1] if wheels else None


def wheel_of(distribution: str, project: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    found = find_wheel(DIST, distribution)
    if found is not None:
        return found
    out = tmp_path_factory.mktemp(distribution)
    src = source_copy(tmp_path_factory.getbasetemp() / "sources") / project
    r = run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(src),
        ],
        timeout=INSTALL_TIMEOUT,
        cwd=out,
    )
    built = find_wheel(out, distribution)
    if r.returncode != 0 or built is None:
        pytest.skip(
            f"dist/ has no {distribution} wheel and building one failed (run `make wheel`):\n{r.stderr[-2000:]}"
        )
    return built


@pytest.fixture(scope="module")
def api_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wheel_of("memsvc_api", "api", tmp_path_factory)


@pytest.fixture(scope="module")
def main_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wheel_of("memsvc", ".", tmp_path_factory)


# ---- fresh venvs ----
@dataclass
class Venv:
    root: Path
    python: Path
    installed: set[str]
    """What ``pip list`` showed right after the first install (later tests may add to the venv)."""


def pip(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """This environment's pip (and its cache) working on the venv of ``python``."""
    return run(
        [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check", *args],
        timeout=INSTALL_TIMEOUT,
        cwd=cwd,
    )


def pip_install(python: Path, requirements: Sequence[str], pinned: Sequence[str], *, cwd: Path) -> None:
    """``pip install`` with dependencies resolved, each pinned by a constraints file to this environment's version."""
    constraints = cwd / "constraints.txt"
    constraints.write_text("".join(f"{p}\n" for p in pinned))
    r = pip(python, "install", "--quiet", "-c", str(constraints), *requirements, cwd=cwd)
    if r.returncode == 0:
        return
    probe = run([sys.executable, "-m", "pip", "index", "versions", "grpcio"], timeout=120, cwd=cwd)
    if probe.returncode != 0:
        pytest.skip(
            f"the package index is unreachable (pip index versions grpcio: {probe.stderr.strip()[-500:]}); "
            "the stub-only install resolves its dependencies from it"
        )
    pytest.fail(f"pip install {' '.join(requirements)} failed:\n{r.stdout}\n{r.stderr}")


def fresh_venv(where: Path) -> Path:
    venv.EnvBuilder(with_pip=False, clear=True).create(where)
    return where / "bin" / "python"


def listed(python: Path, cwd: Path) -> set[str]:
    r = pip(python, "list", "--format=json", cwd=cwd)
    assert r.returncode == 0, r.stderr
    return {canonical(d["name"]) for d in json.loads(r.stdout)}


def probe(python: Path, cwd: Path, extra_modules: Sequence[str] = ()) -> dict[str, Any]:
    # -I: no PYTHONPATH, no user site, no current directory: only what the venv holds
    r = run([str(python), "-I", "-c", PROBE, json.dumps(list(extra_modules))], cwd=cwd, timeout=120)
    assert r.returncode == 0, r.stderr
    got: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return got


@pytest.fixture(scope="module")
def api_venv(api_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A fresh venv and ``pip install <memsvc-api wheel>``, nothing else asked for."""
    root = tmp_path_factory.mktemp("api-venv")
    python = fresh_venv(root / "venv")
    pip_install(python, [str(api_wheel)], pins([*API_RUNTIME, *API_TYPING]), cwd=root)
    return Venv(root, python, listed(python, root))


# ---- memsvc-api alone ----
def test_the_api_wheel_is_the_stubs_alone(api_wheel: Path) -> None:
    assert api_wheel.name.endswith("-py3-none-any.whl"), f"{api_wheel.name}: not pure Python"
    names = set(zipfile.ZipFile(api_wheel).namelist())
    files = {n for n in names if ".dist-info/" not in n}
    expected = {
        "memsvc/v1/__init__.py",
        "memsvc/v1/py.typed",
        "google-stubs/rpc/__init__.pyi",
        "google-stubs/rpc/status_pb2.pyi",
        "google-stubs/rpc/error_details_pb2.pyi",
    }
    for mod in expected_stub_modules():
        base = mod.replace(".", "/")
        expected |= {f"{base}.py", f"{base}.pyi"}
    assert files == expected, f"{api_wheel.name}: missing {sorted(expected - files)}, extra {sorted(files - expected)}"
    assert "memsvc/__init__.py" not in names, "memsvc/ must stay a namespace (memsvc's wheel has __init__.py)"
    assert not any(n.endswith((".so", ".pyd", ".dylib")) for n in names)


def test_the_api_wheel_requires_only_the_stub_runtime(api_wheel: Path) -> None:
    """Exactly pyproject.toml's [tool.memsvc] api-dependencies, and the typing extra with the dev extra's bounds."""
    requires = {Requirement(r) for r in wheel_requires(api_wheel)}
    runtime = {r for r in requires if r.marker is None}
    typing = {r for r in requires if r.marker is not None and r.marker.evaluate({"extra": "typing"})}
    assert requires == runtime | typing, requires
    main = pyproject(REPO_ROOT / "pyproject.toml")
    assert sorted(canonical(r.name) for r in runtime) == sorted(API_RUNTIME), runtime
    assert bounds(runtime) == bounds(Requirement(r) for r in main["tool"]["memsvc"]["api-dependencies"])
    assert sorted(canonical(r.name) for r in typing) == sorted(API_TYPING), typing
    dev = [Requirement(r) for r in main["project"]["optional-dependencies"]["dev"]]
    assert bounds(typing) == bounds(r for r in dev if canonical(r.name) in API_TYPING)


def wheel_requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(meta).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def bounds(requirements: Iterable[Requirement]) -> dict[str, SpecifierSet]:
    return {canonical(r.name): r.specifier for r in requirements}


def test_stub_only_install_has_nothing_else(api_venv: Venv) -> None:
    expected = {"memsvc-api", *closure(API_RUNTIME)}
    assert api_venv.installed == expected, (
        f"not exactly memsvc-api and the stubs' runtime: extra {sorted(api_venv.installed - expected)}, "
        f"missing {sorted(expected - api_venv.installed)}"
    )
    site = api_venv.root / "venv" / "lib"
    assert not [p for p in site.rglob("memsvc/**/*") if p.suffix in (".so", ".pyd")], "compiled code in memsvc/"


def test_stub_only_install_imports_every_stub_module(api_venv: Venv) -> None:
    got = probe(api_venv.python, api_venv.root)
    assert not got["failed"], got["failed"]
    assert expected_stub_modules() <= set(got["modules"]), got["modules"]
    assert got["memsvc_file"] is None, f"memsvc is not a namespace package here: {got['memsvc_file']}"
    assert Path(str(got["v1_dir"])).is_relative_to(api_venv.root), f"memsvc.v1 came from {got['v1_dir']}"
    assert not got["worker_installed"], "the worker package is in the stub-only venv"
    assert not got["torch_installed"], "torch is in the stub-only venv"
    assert got["torch_loaded"] == [] and got["worker_loaded"] == []


def test_client_code_passes_mypy_strict_with_the_typing_extra(api_venv: Venv, api_wheel: Path) -> None:
    """mypy (this environment's) checks against what the venv holds (--python-executable): first
    without the ``typing`` extra (errors: grpcio and protobuf have no types), then with it: the
    client type-checks, and a wrong one fails on its mistakes, so the stubs' types are real."""
    work = api_venv.root / "mypy"
    work.mkdir(exist_ok=True)
    (work / "client.py").write_text(CLIENT)
    (work / "readme_errors.py").write_text(readme_error_decoding())
    (work / "wrong.py").write_text(WRONG)
    (work / "mypy.ini").write_text("[mypy]\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}

    def mypy(*files: str) -> subprocess.CompletedProcess[str]:
        return run(
            [
                sys.executable,
                "-m",
                "mypy",
                "--strict",
                "--config-file",
                "mypy.ini",
                "--cache-dir",
                ".cache",
                "--python-executable",
                str(api_venv.python),
                "--no-error-summary",
                "--hide-error-context",
                *files,
            ],
            env=env,
            cwd=work,
            timeout=300,
        )

    if not ({canonical(n) for n in API_TYPING} & listed(api_venv.python, api_venv.root)):
        r = mypy("client.py")
        assert r.returncode != 0 and re.search(r"grpc|google\.protobuf", r.stdout), (
            f"mypy --strict passed without types for grpcio and protobuf:\n{r.stdout}{r.stderr}"
        )

    pip_install(api_venv.python, [f"{api_wheel}[typing]"], pins([*API_RUNTIME, *API_TYPING]), cwd=api_venv.root)
    r = mypy("client.py", "readme_errors.py", "wrong.py")
    errors = [line for line in r.stdout.splitlines() if ": error:" in line]
    assert not [e for e in errors if e.startswith("client.py")], r.stdout + r.stderr
    # google.rpc typed too (memsvc-api's google-stubs/rpc): the README's error decoding was refused
    # ("missing library stubs or py.typed marker") and its ErrorInfo was Any
    assert not [e for e in errors if e.startswith("readme_errors.py")], r.stdout + r.stderr
    wrong = [e for e in errors if e.startswith("wrong.py")]
    assert any("Incompatible types in assignment" in e and '"str"' in e for e in wrong), r.stdout + r.stderr
    assert any("nmae" in e for e in wrong), r.stdout + r.stderr
    assert r.returncode == 1, r.stdout + r.stderr


def readme_error_decoding() -> str:
    """The README's Python block that decodes a refused call's ErrorInfo (its only one that does)."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)
    (block,) = [b for b in blocks if "grpc-status-details-bin" in b]
    return str(block)


def test_the_readme_error_decoding_prints_what_a_real_manager_sends(tmp_path: Path) -> None:
    """The README's snippet, run against a real manager's refusal, prints the ErrorInfo it sent."""
    from managerproc import Cluster

    cl = Cluster(tmp_path)
    try:
        mp = cl.manager()
        call = f"sleep_worker(manager_grpc.MemoryManagerServiceStub(grpc.insecure_channel({mp.address!r})), 'nobody')"
        script = f"{readme_error_decoding()}\ntry:\n    {call}\nexcept grpc.RpcError:\n    pass\n"
        r = run([sys.executable, "-c", script], timeout=120, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "NOT_FOUND NOT_FOUND {'name': 'workers/nobody'}", r.stdout
    finally:
        cl.close()


# ---- memsvc-api next to memsvc ----
def test_the_memsvc_wheel_leaves_the_stubs_to_memsvc_api(main_wheel: Path, api_wheel: Path) -> None:
    main_names = set(zipfile.ZipFile(main_wheel).namelist())
    api_names = set(zipfile.ZipFile(api_wheel).namelist())
    assert not [n for n in main_names if n.startswith("memsvc/v1/")], "the memsvc wheel ships memsvc/v1 itself"
    assert not (main_names & api_names), f"files in both wheels: {sorted(main_names & api_names)}"
    assert {"memsvc/__init__.py", "memsvc/py.typed"} <= main_names
    requires = wheel_requires(main_wheel)
    assert f"memsvc-api=={memsvc.__version__}" in requires, requires


def test_memsvc_and_memsvc_api_install_together(main_wheel: Path, api_wheel: Path, tmp_path: Path) -> None:
    """Both wheels in one ``pip install``, dependencies resolved (no extras: no torch): pip takes memsvc's
    memsvc-api requirement from the given wheel, ``pip check`` is content, memsvc is the regular package
    with memsvc.v1 inside it, and the client modules import."""
    python = fresh_venv(tmp_path / "venv")
    tables = pyproject(REPO_ROOT / "pyproject.toml")["tool"]["memsvc"]
    runtime = [requirement_name(r) for r in [*tables["api-dependencies"], *tables["dependencies"]]]
    pip_install(python, [str(api_wheel), str(main_wheel)], pins(runtime), cwd=tmp_path)
    r = pip(python, "check", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    installed = listed(python, tmp_path)
    assert {"memsvc", "memsvc-api"} <= installed and "torch" not in installed, sorted(installed)
    got = probe(python, tmp_path, ["memsvc.client", "memsvc.errors", "memsvc.runtime.rpc_errors"])
    assert not got["failed"], got["failed"]
    site_memsvc = Path(str(got["memsvc_file"])).parent
    assert site_memsvc.is_relative_to(tmp_path / "venv"), f"memsvc came from {site_memsvc}, not the wheel"
    assert got["memsvc_path"] == [str(site_memsvc)] and Path(str(got["v1_dir"])) == site_memsvc / "v1"
    assert got["torch_loaded"] == [] and got["worker_loaded"] == [], "the client modules loaded torch or the worker"


# ---- how the two are built ----
def test_api_build_pins_the_same_generators() -> None:
    def pinned(path: Path) -> dict[str, str]:
        requires = pyproject(path)["build-system"]["requires"]
        return {requirement_name(r): r for r in requires if requirement_name(r) in ("grpcio-tools", "mypy-protobuf")}

    main, api = pinned(REPO_ROOT / "pyproject.toml"), pinned(REPO_ROOT / "api" / "pyproject.toml")
    assert main == api and len(main) == 2, (main, api)


def test_pip_is_new_enough_for_python_flag() -> None:
    """``pip --python`` (pip >= 22.3) installs into the fresh venv without bootstrapping pip there."""
    r = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True, check=True)
    major, minor = (int(x) for x in r.stdout.split()[1].split(".")[:2])
    assert (major, minor) >= (22, 3)
