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

from memsvc.v1 import memory_manager_service_pb2 as manager_pb

PROTOS = REPO_ROOT / "protos"
GOOGLE_RPC = ["google/rpc/status.proto", "google/rpc/error_details.proto"]
HEALTH = "grpc/health/v1/health.proto"
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
    protoc("--include_imports", f"--descriptor_set_out={out}", f"--python_out={tmp_path}", *MEMSVC, *GOOGLE_RPC, HEALTH)
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    files = {f.name: f for f in fds.file}
    assert set(MEMSVC) | set(GOOGLE_RPC) | {HEALTH} <= set(files), sorted(files)
    assert {"Status"} <= {d.name for d in files["google/rpc/status.proto"].message_type}
    assert {"ErrorInfo"} <= {d.name for d in files["google/rpc/error_details.proto"].message_type}
    services = {f"{f.package}.{s.name}" for f in fds.file for s in f.service}
    assert services == {"memsvc.v1.MemoryManagerService", "memsvc.v1.ModelWorkerService", "grpc.health.v1.Health"}


def test_the_shipped_health_proto_is_the_protocol_the_services_serve(tmp_path: Path) -> None:
    """A client of another language builds its health checker from protos/ as it builds the rest: the
    shipped file compiles to the descriptor grpcio-health-checking (what the servers run) carries,
    message for message, field for field, method for method, option for option."""
    from grpc_health.v1 import health_pb2

    head = (PROTOS / HEALTH).read_text().splitlines()[:3]
    assert head[0] == "// Copyright 2015 The gRPC Authors" and "Apache License" in head[2], head
    out = tmp_path / "health.binpb"
    protoc(f"--descriptor_set_out={out}", HEALTH)
    (shipped,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    served = descriptor_pb2.FileDescriptorProto()
    health_pb2.DESCRIPTOR.CopyToProto(served)
    for fd in (shipped, served):
        fd.ClearField("name")  # where each lives: protos/grpc/health/v1, grpc_health/v1 in the package
        for msg in [*fd.message_type, *(n for t in fd.message_type for n in t.nested_type)]:
            for fld in msg.field:
                fld.ClearField("json_name")  # protoc writes the default lowerCamel name, CopyToProto does not
    assert shipped == served


def test_a_health_check_with_the_shipped_health_proto(manager: ManagerProcess, tmp_path: Path) -> None:
    """Classes generated from protos/grpc/health (in a child interpreter, away from grpc_health's)
    ask the real manager, as a probe in another language would."""
    gen = tmp_path / "gen"
    gen.mkdir()
    protoc(f"--python_out={gen}", HEALTH)
    check = (
        "import importlib.util, sys; import grpc\n"  # the module by its path: grpc is grpcio's package
        "spec = importlib.util.spec_from_file_location('shipped_health', sys.argv[1])\n"
        "h = importlib.util.module_from_spec(spec); spec.loader.exec_module(h)\n"
        "assert h.__file__ == sys.argv[1], h.__file__\n"
        "call = grpc.insecure_channel(sys.argv[2]).unary_unary('/grpc.health.v1.Health/Check',\n"
        "    request_serializer=h.HealthCheckRequest.SerializeToString,\n"
        "    response_deserializer=h.HealthCheckResponse.FromString)\n"
        "r = call(h.HealthCheckRequest(service='memsvc.v1.MemoryManagerService'), timeout=30)\n"
        "print(h.HealthCheckResponse.ServingStatus.Name(r.status))\n"
    )
    module = gen / "grpc" / "health" / "v1" / "health_pb2.py"
    r = subprocess.run(
        [sys.executable, "-c", check, str(module), manager.address],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "SERVING"


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
        manager.stub.GetWorker(manager_pb.GetWorkerRequest(name="workers/missing"), timeout=30)
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
