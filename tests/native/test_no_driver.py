"""What works without a GPU driver, checked in fresh interpreters with a clean environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import CUDA_DEVICES

import memsvc

no_device = pytest.mark.skipif(CUDA_DEVICES > 0, reason="a CUDA device is present")


ROOT = Path(memsvc.__file__).resolve().parents[1]
"""The tree under test: children import the same code as this process, installed or not."""


def run_clean(code: str, cwd: Path) -> Any:
    """Run ``code`` in a new interpreter with a minimal environment; it prints one JSON value last.

    Only PATH, LANG, PYTHONPATH (this tree) and the loader path (where the driver may live) pass.
    """
    env = {"PATH": os.defpath, "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    if "LD_LIBRARY_PATH" in os.environ:
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    r = subprocess.run(
        [sys.executable, "-s", "-c", textwrap.dedent(code)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, f"child failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_memsvc_imports_neither_torch_nor_the_extension(tmp_path: Path) -> None:
    out = run_clean(
        """
        import json, sys
        import memsvc, memsvc.errors
        after_memsvc = sorted(m for m in ("torch", "worker._native", "worker") if m in sys.modules)
        import worker
        after_worker = sorted(m for m in ("torch", "worker._native") if m in sys.modules)
        print(json.dumps({"memsvc": after_memsvc, "worker": after_worker, "file": memsvc.__file__}))
        """,
        tmp_path,
    )
    assert out["memsvc"] == []
    assert out["worker"] == []
    assert Path(out["file"]).resolve().parent == ROOT / "memsvc"


def test_native_extension_loads_without_torch(tmp_path: Path) -> None:
    out = run_clean(
        """
        import json, sys
        import worker._native as n
        print(json.dumps({
            "count": n.cuda_device_count(),
            "reason": n.cuda_unavailable_reason(),
            "torch": "torch" in sys.modules,
            "sum": n.checksum(b"memsvc"),
        }))
        """,
        tmp_path,
    )
    assert out["torch"] is False
    assert out["count"] == CUDA_DEVICES
    assert isinstance(out["sum"], int)
    if CUDA_DEVICES == 0:
        assert isinstance(out["reason"], str) and out["reason"].strip()
    else:
        assert out["reason"] is None


@no_device
def test_auto_backend_is_host_and_cuda_is_unavailable(tmp_path: Path) -> None:
    out = run_clean(
        """
        import json
        from memsvc.errors import Unavailable
        from worker.allocator import AllocatorConfig, MemoryAllocator
        a = MemoryAllocator(AllocatorConfig(backend="auto", host_capacity_bytes=64 << 20))
        auto = [a.backend, a.stats().backend, a.stats().device_total_bytes]
        a.close()
        try:
            MemoryAllocator(AllocatorConfig(backend="cuda"))
            cuda = "constructed"
        except Unavailable as e:
            cuda = "Unavailable: " + str(e)
        except Exception as e:
            cuda = type(e).__name__ + ": " + str(e)
        print(json.dumps({"auto": auto, "cuda": cuda}))
        """,
        tmp_path,
    )
    assert out["auto"] == ["host", "host", 64 << 20]
    assert out["cuda"].startswith("Unavailable: ") and len(out["cuda"]) > len("Unavailable: ")
