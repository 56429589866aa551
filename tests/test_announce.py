"""The lines the services print on stdout (``listening on …``, ``ready: …``) are what scripts,
``memsvc up``'s users and the tests wait for. ``memsvc up`` runs three services that share one stdout
and start at the same moment; with ``PYTHONUNBUFFERED=1`` a ``print`` writes a line's text and its
newline separately, so two services could splice their lines (CI once saw ``…listening on
127.0.0.1:47239memsvc gateway listening on …``). Each line must reach the pipe whole."""

from __future__ import annotations

import os
import subprocess
import sys

LINES = 3000

CHILD = """
import sys
from memsvc.runtime.logs import announce
name = sys.argv[1]
for i in range(int(sys.argv[2])):
    announce(f"memsvc {name} listening on 127.0.0.1:{i}")
"""


def test_lines_of_processes_sharing_stdout_never_interleave() -> None:
    read_end, write_end = os.pipe()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    children = [
        subprocess.Popen([sys.executable, "-c", CHILD, name, str(LINES)], stdout=write_end, env=env)
        for name in ("manager", "worker", "gateway")
    ]
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        out = pipe.read().decode()
    assert all(child.wait(60) == 0 for child in children)
    lines = out.splitlines()
    expected = {
        f"memsvc {name} listening on 127.0.0.1:{i}" for name in ("manager", "worker", "gateway") for i in range(LINES)
    }
    spliced = [line for line in lines if line not in expected]
    assert not spliced, f"{len(spliced)} spliced lines, e.g. {spliced[:3]}"
    assert sorted(lines) == sorted(expected)
