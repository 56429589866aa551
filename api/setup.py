"""Build of memsvc-api (see pyproject.toml here): the stubs are generated from ../protos into the
build directory, never into the work tree, with the same generator memsvc's own setup.py uses."""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent.parent
if not (ROOT / "build_support" / "memsvc_build.py").is_file():
    sys.exit("memsvc-api builds from a checkout of the memsvc repository: python -m build --wheel api")
sys.path.insert(0, str(ROOT / "build_support"))
import memsvc_build  # noqa: E402


class BuildPy(build_py):  # type: ignore[misc]  # setuptools has no type information here
    def run(self) -> None:
        if self.editable_mode:
            raise SystemExit(
                "memsvc-api has no editable install: `pip install -e .` in the repository root generates "
                "memsvc/v1 in the tree and serves it"
            )
        super().run()  # memsvc/v1/__init__.py and py.typed from the tree
        out = Path(self.build_lib)
        for stale in (out / "memsvc" / "v1").glob("*_pb2*"):  # copied from the tree or left by an earlier build
            stale.unlink()
        memsvc_build.generate_stubs(out)
        memsvc_build.generate_rpc_type_stubs(out)  # google-stubs/rpc: typed google.rpc for error decoding


setup(
    version=memsvc_build.version(),
    install_requires=memsvc_build.api_dependencies(),
    extras_require={"typing": memsvc_build.api_typing()},
    cmdclass={"build_py": BuildPy},
)
