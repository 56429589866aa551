"""What the two distributions built from this repository share at build time.

- ``memsvc`` (setup.py at the root): the services, the client library and the native extension;
- ``memsvc-api`` (api/): the gRPC stubs generated from protos/memsvc/v1 alone, a pure-Python wheel
  that depends on grpcio, protobuf and googleapis-common-protos and nothing else.

Both take their version and requirements from the root pyproject.toml and generate the stubs with
:func:`generate_stubs`. This module is also memsvc's PEP 517 build backend (pyproject.toml's
``backend-path``): setuptools', telling setup.py whether the build is an editable one, since the two
install memsvc.v1 differently (see setup.py).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import sys
import tomllib
from pathlib import Path
from typing import Any

from setuptools import build_meta as _setuptools

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
API_DISTRIBUTION = "memsvc-api"
API_TYPING = ("types-grpcio", "types-protobuf")
"""What ``mypy --strict`` needs for code using the stubs (grpcio and protobuf ship no types): the
``typing`` extra of memsvc-api, with the bounds memsvc's own ``dev`` extra gives them."""


def pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def version() -> str:
    return str(pyproject()["project"]["version"])


def requirement_name(requirement: str) -> str:
    name = re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def api_dependencies() -> list[str]:
    """memsvc-api's requirements: the stubs' runtime and google.rpc (every memsvc install has them)."""
    return list(pyproject()["tool"]["memsvc"]["api-dependencies"])


def service_dependencies() -> list[str]:
    """memsvc's own requirements besides memsvc-api's."""
    return list(pyproject()["tool"]["memsvc"]["dependencies"])


def api_typing() -> list[str]:
    dev = pyproject()["project"]["optional-dependencies"]["dev"]
    found = [req for req in dev if requirement_name(req) in API_TYPING]
    if sorted(requirement_name(r) for r in found) != sorted(API_TYPING):
        raise RuntimeError(f"pyproject.toml's dev extra must name {', '.join(API_TYPING)}")
    return found


def generate_stubs(out: Path) -> None:
    """protos/memsvc/v1/*.proto -> out/memsvc/v1/*_pb2.py(i), *_pb2_grpc.py(i).

    The proto tree mirrors the package (-Iprotos), so generated imports are absolute
    (``from memsvc.v1 import common_pb2``) with no rewriting. Needs grpcio-tools and mypy-protobuf
    (build requirements of both distributions).
    """
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p) for p in (PROTOS / "memsvc" / "v1").glob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {PROTOS / 'memsvc' / 'v1'}")
    (out / "memsvc" / "v1").mkdir(parents=True, exist_ok=True)
    wkt = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTOS}", f"-I{wkt}", f"--python_out={out}", f"--grpc_python_out={out}"]
    # Typed stubs from mypy-protobuf: enums as typed ValueTypes, messages and both the sync and the
    # asyncio service stubs, so users' code and ours type-check against them.
    for name, option in (("protoc-gen-mypy", "mypy_out"), ("protoc-gen-mypy_grpc", "mypy_grpc_out")):
        plugin = shutil.which(name) or str(Path(sys.executable).parent / name)
        if not os.access(plugin, os.X_OK):
            raise RuntimeError(f"{name} not found: install mypy-protobuf (a build requirement)")
        args += [f"--plugin={name}={plugin}", f"--{option}={out}"]
    if protoc.main([*args, *protos]) != 0:
        raise RuntimeError("protoc failed on " + " ".join(protos))
    for stub in (out / "memsvc" / "v1").glob("*_pb2_grpc.py*"):  # files without services get empty gRPC modules
        if "service" not in stub.name:
            stub.unlink()


GOOGLE_RPC_TYPED = ("status", "error_details")
"""The google.rpc modules a client decoding memsvc's error details imports (README, "From your own
service"): googleapis-common-protos has .pyi files but no py.typed, so ``mypy --strict`` refuses to read
them; memsvc-api ships stubs for these two."""


def generate_rpc_type_stubs(out: Path) -> None:
    """protos/google/rpc/{status,error_details}.proto -> out/google-stubs/rpc/*_pb2.pyi (mypy-protobuf).

    A PEP 561 stub package beside types-protobuf's (which fills google-stubs/protobuf, no file in
    common): with memsvc-api's typing extra, code that decodes a google.rpc.Status and its ErrorInfo
    type-checks. Types only: the runtime modules stay googleapis-common-protos' own.
    """
    import tempfile

    import grpc_tools
    from grpc_tools import protoc

    plugin = shutil.which("protoc-gen-mypy") or str(Path(sys.executable).parent / "protoc-gen-mypy")
    if not os.access(plugin, os.X_OK):
        raise RuntimeError("protoc-gen-mypy not found: install mypy-protobuf (a build requirement)")
    wkt = str(Path(grpc_tools.__file__).parent / "_proto")
    protos = [str(PROTOS / "google" / "rpc" / f"{name}.proto") for name in GOOGLE_RPC_TYPED]
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTOS}", f"-I{wkt}", f"--plugin=protoc-gen-mypy={plugin}", f"--mypy_out={tmp}"]
        if protoc.main([*args, *protos]) != 0:
            raise RuntimeError("protoc failed on " + " ".join(protos))
        stubs = out / "google-stubs" / "rpc"
        stubs.mkdir(parents=True, exist_ok=True)
        for name in GOOGLE_RPC_TYPED:
            shutil.copyfile(Path(tmp) / "google" / "rpc" / f"{name}_pb2.pyi", stubs / f"{name}_pb2.pyi")
        (stubs / "__init__.pyi").write_text("")


# ---- the PEP 517 backend: setuptools.build_meta, flagging the editable hooks ----
EDITABLE = False
"""True while an editable hook runs; setup.py reads it (the hook runs setup.py in this process)."""


def _flagging_editable(hook: Any) -> Any:
    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        global EDITABLE
        EDITABLE = True
        try:
            return hook(*args, **kwargs)
        finally:
            EDITABLE = False

    return run


get_requires_for_build_wheel = _setuptools.get_requires_for_build_wheel
prepare_metadata_for_build_wheel = _setuptools.prepare_metadata_for_build_wheel
build_wheel = _setuptools.build_wheel
get_requires_for_build_sdist = _setuptools.get_requires_for_build_sdist
build_sdist = _setuptools.build_sdist
get_requires_for_build_editable = _flagging_editable(_setuptools.get_requires_for_build_editable)
prepare_metadata_for_build_editable = _flagging_editable(_setuptools.prepare_metadata_for_build_editable)
build_editable = _flagging_editable(_setuptools.build_editable)
