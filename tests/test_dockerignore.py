"""The image's build context (issue: what operators trip over): ``COPY . .`` must not send the
virtual environments, build output, models, runtime state or private keys, and must keep every
source the build stage's ``make wheel`` reads."""

from __future__ import annotations

import fnmatch
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(path: str) -> bool:
    """Docker's rule for these patterns: a pattern matches the path or one of its parent folders."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(
        fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.removeprefix("**/")) for pat in patterns() for p in prefixes
    )


def test_heavy_and_private_paths_stay_out() -> None:
    for path in (
        ".venv/bin/python",
        ".venv-build/lib/x",
        "models/llama/model.safetensors",
        "certs/manager.key",
        ".memsvc/manager.db",
        "build/lib/x",
        "dist/memsvc.whl",
        ".git/HEAD",
        "worker/_native.abi3.so",
        "api/build/lib/memsvc/v1/common_pb2.py",
        "api/memsvc_api.egg-info/PKG-INFO",
    ):
        assert ignored(path), f"{path} would be sent to the build"


def test_every_source_the_build_reads_is_sent() -> None:
    for path in (
        "Makefile",
        "pyproject.toml",
        "setup.py",
        "README.md",
        "native/allocator.c",
        "protos/memsvc/v1/common.proto",
        "memsvc/cli.py",
        "worker/core.py",
        "memsvc/gateway/app.py",
        "build_support/memsvc_build.py",
        "api/pyproject.toml",
        "api/setup.py",
        "memsvc/v1/py.typed",
    ):
        assert (REPO / path).exists() and not ignored(path), f"{path} is needed by the build"
