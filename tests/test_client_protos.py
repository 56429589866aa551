"""The proto files a client in another language loads (README, "Clients in other languages").

protos/google/rpc/{status,error_details}.proto are shipped copies of googleapis' files: they compile
with protoc (grpc_tools) together with protos/memsvc/v1 from the one include path ``protos/``, keep
their license header, and decode what a real memsvc error sends. For that last part a real manager
answers GetWorker for a worker it does not know, and classes generated from the shipped files (into
tmp_path, imported in a child interpreter so they never meet the installed google.rpc modules) decode
its ``grpc-status-details-bin`` trailer into a google.rpc.Status holding a google.rpc.ErrorInfo.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from managerproc import Cluster, ManagerProcess
from workerproc import REPO_ROOT

from memsvc.v1 import memory_manager_service_pb2 as m

PROTOS = REPO_ROOT / "protos"
GOOGLE_RPC = ["google/rpc/status.proto", "google/rpc/error_details.proto"]
MEMSVC = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / "memsvc" / "v1").glob("*.proto"))


def protoc(*args: str) -> None:
    import grpc_tools
    from grpc_tools import protoc as _protoc

    wkt = Path(grpc_tools.__file__).parent / "_proto"  # protobuf's well-known types, as any protoc has
    rc = _protoc.main(["protoc", f"-I{PROTOS}", f"-I{wkt}", *args])
    assert rc == 0, f"protoc {' '.join(args)} failed"


def test_shipped_google_rpc_protos_keep_their_license() -> None:
    for name in GOOGLE_RPC:
        head = (PROTOS / name).read_text().splitlines()[:13]
        assert head[0].startswith("// Copyright ") and "Google LLC" in head[0], (name, head[0])
        assert '// Licensed under the Apache License, Version 2.0 (the "License");' in head, name
        assert "package google.rpc;" in (PROTOS / name).read_text(), name


def test_the_protos_compile_together(tmp_path: Path) -> None:
    out = tmp_path / "all.binpb"
    protoc("--include_imports", f"--descriptor_set_out={out}", f"--python_out={tmp_path}", *MEMSVC, *GOOGLE_RPC)
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    files = {f.name: f for f in fds.file}
    assert set(MEMSVC) | set(GOOGLE_RPC) <= set(files), sorted(files)
    assert {"Status"} <= {d.name for d in files["google/rpc/status.proto"].message_type}
    assert {"ErrorInfo"} <= {d.name for d in files["google/rpc/error_details.proto"].message_type}
    services = {f"{f.package}.{s.name}" for f in fds.file for s in f.service}
    assert services == {"memsvc.v1.MemoryManagerService", "memsvc.v1.ModelWorkerService"}, services


@pytest.fixture(scope="module")
def manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagerProcess]:
    cl = Cluster(tmp_path_factory.mktemp("client-protos"))
    try:
        yield cl.manager()
    finally:
        cl.close()


DECODE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from google.rpc import error_details_pb2, status_pb2
for mod in (error_details_pb2, status_pb2):
    assert mod.__file__.startswith(sys.argv[1]), mod.__file__  # the classes made from protos/, not the installed ones
status = status_pb2.Status.FromString(bytes.fromhex(sys.stdin.read()))
out = {"code": status.code, "message": status.message, "details": []}
for detail in status.details:
    info = error_details_pb2.ErrorInfo()
    out["details"].append({"type_url": detail.type_url, "is_error_info": detail.Unpack(info),
                           "reason": info.reason, "domain": info.domain, "metadata": dict(info.metadata)})
print(json.dumps(out))
"""


def test_a_real_error_decodes_with_the_shipped_protos(manager: ManagerProcess, tmp_path: Path) -> None:
    with pytest.raises(grpc.RpcError) as err:
        manager.stub.GetWorker(m.GetWorkerRequest(name="workers/missing"), timeout=30)
    call = err.value
    assert call.code() == grpc.StatusCode.NOT_FOUND, call
    (blob,) = [md.value for md in call.trailing_metadata() if md.key == "grpc-status-details-bin"]
    assert isinstance(blob, bytes)

    gen = tmp_path / "gen"
    gen.mkdir()
    protoc(f"--python_out={gen}", *GOOGLE_RPC)
    r = subprocess.run(
        [sys.executable, "-c", DECODE, str(gen)],
        input=blob.hex(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert got["message"] == call.details()
    assert got["details"] == [
        {
            "type_url": "type.googleapis.com/google.rpc.ErrorInfo",
            "is_error_info": True,
            "reason": "NOT_FOUND",
            "domain": "memsvc.dev",
            "metadata": {"name": "workers/missing"},
        }
    ]
