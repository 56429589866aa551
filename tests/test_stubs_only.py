"""``pip install memsvc`` without extras: the generated stubs and the client-side modules import
with grpcio and protobuf alone. Checked in a fresh interpreter where any ``import torch`` fails."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

from workerproc import REPO_ROOT

STUB_DIR = REPO_ROOT / "memsvc" / "v1"
CLIENT_MODULES = [
    "memsvc",
    "memsvc.v1",
    "memsvc.errors",
    "memsvc.runtime.rpc_errors",
    "memsvc.runtime.serving",
    "memsvc.cli",
]
"""Modules a client without the worker extra uses (memsvc.cli imports the worker only to run one)."""

PROBE = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # from here on, any "import torch" raises ImportError
    import importlib, json
    names = json.loads(sys.argv[1])
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # report every failure, not just the first
            failed[name] = f"{type(e).__name__}: {e}"
    loaded = sorted(
        m for m in sys.modules
        if m == "worker" or m.startswith("worker.") or (m.startswith("torch") and sys.modules[m] is not None)
    )
    print(json.dumps({"failed": failed, "loaded": loaded, "torch": repr(sys.modules.get("torch"))}))
    """
)


def stub_modules() -> list[str]:
    return sorted(f"memsvc.v1.{p.stem}" for p in STUB_DIR.glob("*_pb2*.py"))


def test_generated_stubs_exist() -> None:
    names = set(stub_modules())
    for proto in ("common", "model_worker_service", "memory_manager_service"):
        assert f"memsvc.v1.{proto}_pb2" in names, names
    for service in ("model_worker_service", "memory_manager_service"):
        assert f"memsvc.v1.{service}_pb2_grpc" in names, names


def run_probe(names: list[str]) -> dict[str, Any]:
    """PROBE in a fresh interpreter over ``names``: its JSON verdict."""
    r = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(names)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    verdict: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return verdict


def test_stubs_and_client_modules_import_without_torch() -> None:
    result = run_probe(stub_modules() + CLIENT_MODULES)
    assert result["failed"] == {}, result["failed"]
    assert result["torch"] == "None", "something replaced the blocked torch module"
    assert result["loaded"] == [], f"imported without need: {result['loaded']}"
    assert "worker._native" not in result["loaded"]


def test_probe_detects_a_torch_import() -> None:
    """The probe itself can fail: a module that imports torch is reported."""
    result = run_probe(["worker.model.kv_cache"])
    assert "worker.model.kv_cache" in result["failed"]
    assert "import of torch halted" in result["failed"]["worker.model.kv_cache"]
    assert "worker" in result["loaded"]  # and the loaded-module check sees the worker package
