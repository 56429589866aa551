"""A service whose protobuf is the pure-Python implementation says so as it starts
(memsvc/runtime/serving.py's run_service, which every service runs through): its messages are about
ten times slower, and nothing else would say it. With protobuf's compiled implementation, no word."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# A real process: protobuf picks its implementation once, at its first import.
_SERVICE = textwrap.dedent(
    """
    import asyncio

    from memsvc.runtime.logs import configure
    from memsvc.runtime.serving import run_service

    configure("info", "text")
    run_service(asyncio.sleep(0))
    """
)


def _start(implementation: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
    if implementation is not None:
        env["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = implementation
    return subprocess.run([sys.executable, "-c", _SERVICE], capture_output=True, text=True, timeout=120, env=env)


def test_a_service_on_pure_python_protobuf_warns_naming_why() -> None:
    r = _start("python")
    assert r.returncode == 0, r.stderr
    said = "protobuf runs its pure-Python implementation (PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python)"
    assert said in r.stderr and "unset that variable" in r.stderr
    assert "WARNING" in r.stderr


def test_a_service_on_compiled_protobuf_says_nothing_of_it() -> None:
    from google.protobuf.internal import api_implementation

    if api_implementation.Type() == "python":
        pytest.skip("this interpreter's protobuf has no compiled implementation")
    r = _start(None)
    assert r.returncode == 0, r.stderr
    assert "protobuf" not in r.stderr
