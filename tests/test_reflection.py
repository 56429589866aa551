"""Server reflection on real processes: v1 and v1alpha, and each server describes only what it serves.

A manager and a worker registered with it (so each process has imported the other's proto module)
run on loopback. grpcurl (v1.8.6 speaks reflection v1alpha) lists and describes them as an operator
would; a v1 client built here from its own copy of the v1 schema (``V1_SCHEMA``, compiled with
grpc_tools.protoc, not the server's code) asks the same over ``grpc.reflection.v1.ServerReflection``.

- ``list`` is exactly the served service, grpc.health.v1.Health and both reflection services;
- ``describe`` of the served service works over v1alpha (grpcurl) and v1, and the files a v1 client
  gets build a descriptor of the whole service;
- the other memsvc service is NOT_FOUND over both, though its proto module is loaded in that process;
  the manager's proto imports the worker's for its messages, so that file is served (its messages
  describe) but without ``ModelWorkerService``;
- google.rpc's Status and ErrorInfo describe too: grpcurl resolves the error detail's type by
  reflection, and prints the ErrorInfo only when it can;
- reflection, both versions, is behind the bearer token like every method but health.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from managerproc import Cluster, ManagerProcess
from upproc import grpcurl_binary
from workerproc import WorkerProcess

from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb

MANAGER = "memsvc.v1.MemoryManagerService"
WORKER = "memsvc.v1.ModelWorkerService"
HEALTH = "grpc.health.v1.Health"
V1 = "grpc.reflection.v1.ServerReflection"
V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
TOKEN = "reflection-test-token"
TIMEOUT = 30.0
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]

V1_SCHEMA = """
syntax = "proto3";
package grpc.reflection.v1;

service ServerReflection {
  rpc ServerReflectionInfo(stream ServerReflectionRequest) returns (stream ServerReflectionResponse);
}
message ServerReflectionRequest {
  string host = 1;
  oneof message_request {
    string file_by_filename = 3;
    string file_containing_symbol = 4;
    ExtensionRequest file_containing_extension = 5;
    string all_extension_numbers_of_type = 6;
    string list_services = 7;
  }
}
message ExtensionRequest {
  string containing_type = 1;
  int32 extension_number = 2;
}
message ServerReflectionResponse {
  string valid_host = 1;
  ServerReflectionRequest original_request = 2;
  oneof message_response {
    FileDescriptorResponse file_descriptor_response = 4;
    ExtensionNumberResponse all_extension_numbers_response = 5;
    ListServiceResponse list_services_response = 6;
    ErrorResponse error_response = 7;
  }
}
message FileDescriptorResponse { repeated bytes file_descriptor_proto = 1; }
message ExtensionNumberResponse {
  string base_type_name = 1;
  repeated int32 extension_number = 2;
}
message ListServiceResponse { repeated ServiceResponse service = 1; }
message ServiceResponse { string name = 1; }
message ErrorResponse {
  int32 error_code = 1;
  string error_message = 2;
}
"""
"""grpc.reflection.v1 as its spec (grpc-proto's grpc/reflection/v1/reflection.proto) defines it, comments left out."""


Servers = dict[str, tuple[str, str, str]]
"""kind ("manager", "worker") -> (its address, the service it serves, the memsvc service it does not)."""


# ---- the v1 client ----
def compile_v1_schema(directory: Path) -> descriptor_pb2.FileDescriptorProto:
    from grpc_tools import protoc

    (directory / "v1_reflection.proto").write_text(V1_SCHEMA)
    out = directory / "v1_reflection.binpb"
    rc = protoc.main(["protoc", f"-I{directory}", f"--descriptor_set_out={out}", "v1_reflection.proto"])
    assert rc == 0, "protoc failed on the v1 reflection schema"
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (file,) = fds.file
    return file


class Reflection:
    """One reflection version's request/response classes and method path."""

    def __init__(self, service: str, request: Any, response: Any) -> None:
        self.service, self.request, self.response = service, request, response

    def ask(
        self, address: str, requests: Sequence[dict[str, Any]], metadata: Sequence[tuple[str, str]] = ()
    ) -> list[Any]:
        """Send ``requests`` (field -> value) on one ServerReflectionInfo stream; the answers, in order."""
        with grpc.insecure_channel(address) as ch:
            call: grpc.StreamStreamMultiCallable[Any, Any] = ch.stream_stream(
                f"/{self.service}/ServerReflectionInfo",
                request_serializer=lambda r: r.SerializeToString(),
                response_deserializer=self.response.FromString,
            )
            stream = call(
                iter([self.request(**r) for r in requests]), metadata=tuple(metadata) or None, timeout=TIMEOUT
            )
            return list(stream)

    def services(self, address: str, metadata: Sequence[tuple[str, str]] = ()) -> set[str]:
        (resp,) = self.ask(address, [{"list_services": ""}], metadata)
        assert resp.WhichOneof("message_response") == "list_services_response", resp
        return {s.name for s in resp.list_services_response.service}

    def files(self, address: str, **request: str) -> list[descriptor_pb2.FileDescriptorProto]:
        """The files of one file_by_filename / file_containing_symbol answer; [] for NOT_FOUND."""
        (resp,) = self.ask(address, [request])
        if resp.WhichOneof("message_response") == "error_response":
            assert resp.error_response.error_code == NOT_FOUND, resp
            return []
        assert resp.WhichOneof("message_response") == "file_descriptor_response", resp
        return [
            descriptor_pb2.FileDescriptorProto.FromString(b)
            for b in resp.file_descriptor_response.file_descriptor_proto
        ]


@pytest.fixture(scope="module")
def v1_schema(tmp_path_factory: pytest.TempPathFactory) -> descriptor_pb2.FileDescriptorProto:
    return compile_v1_schema(tmp_path_factory.mktemp("v1schema"))


@pytest.fixture(scope="module")
def versions(v1_schema: descriptor_pb2.FileDescriptorProto) -> dict[str, Reflection]:
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(v1_schema.SerializeToString())
    v1 = {
        n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"grpc.reflection.v1.{n}"))
        for n in ("ServerReflectionRequest", "ServerReflectionResponse")
    }
    return {
        "v1": Reflection(V1, v1["ServerReflectionRequest"], v1["ServerReflectionResponse"]),
        "v1alpha": Reflection(V1ALPHA, v1alpha_pb2.ServerReflectionRequest, v1alpha_pb2.ServerReflectionResponse),
    }


def service_from_files(files: list[descriptor_pb2.FileDescriptorProto], name: str) -> Any:
    """What a reflection client does with an answer: a pool of its files, then the service."""
    pool, todo, added = descriptor_pool.DescriptorPool(), {f.name: f for f in files}, set[str]()

    def add(f: descriptor_pb2.FileDescriptorProto) -> None:
        if f.name in added:
            return
        for dep in f.dependency:
            add(todo[dep])  # every import must be in the same answer
        pool.AddSerializedFile(f.SerializeToString())
        added.add(f.name)

    for f in files:
        add(f)
    return pool.FindServiceByName(name)


# ---- the servers ----
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ManagerProcess, WorkerProcess]]:
    cl = Cluster(tmp_path_factory.mktemp("reflection"))
    try:
        mp = cl.manager()
        (wp,) = cl.workers_up(mp, ["local0"])  # registered: the worker process has the manager's stubs too
        yield mp, wp
    finally:
        cl.close()


@pytest.fixture(scope="module")
def servers(cluster: tuple[ManagerProcess, WorkerProcess]) -> Servers:
    mp, wp = cluster
    return {"manager": (mp.address, MANAGER, WORKER), "worker": (wp.address, WORKER, MANAGER)}


def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [grpcurl_binary(), "-plaintext", "-max-time", "20", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        stdin=subprocess.DEVNULL,
    )


KINDS = ["manager", "worker"]
VERSIONS = ["v1", "v1alpha"]
SERVICES = {
    MANAGER: manager_pb.DESCRIPTOR.services_by_name["MemoryManagerService"],
    WORKER: worker_pb.DESCRIPTOR.services_by_name["ModelWorkerService"],
}


@pytest.mark.parametrize("kind", KINDS)
def test_grpcurl_list_is_exactly_what_is_served(servers: Servers, kind: str) -> None:
    address, served, _ = servers[kind]
    r = grpcurl(address, "list")
    assert r.returncode == 0, r.stderr
    assert set(r.stdout.split()) == {served, HEALTH, V1ALPHA, V1}, r.stdout


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_list_services_over_both_versions(
    servers: Servers, versions: dict[str, Reflection], kind: str, version: str
) -> None:
    address, served, _ = servers[kind]
    assert versions[version].services(address) == {served, HEALTH, V1ALPHA, V1}


@pytest.mark.parametrize("kind", KINDS)
def test_grpcurl_describes_the_served_service(servers: Servers, kind: str) -> None:
    address, served, _ = servers[kind]
    r = grpcurl(address, "describe", served)
    assert r.returncode == 0, r.stderr
    assert f"{served} is a service" in r.stdout, r.stdout
    for method in SERVICES[served].methods:
        assert f"rpc {method.name} (" in r.stdout, method.name


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_the_served_service_resolves_whole(
    servers: Servers, versions: dict[str, Reflection], kind: str, version: str
) -> None:
    """The answer to file_containing_symbol carries every import: a client builds the service from it."""
    address, served, _ = servers[kind]
    files = versions[version].files(address, file_containing_symbol=served)
    service = service_from_files(files, served)
    want = SERVICES[served]
    assert [(x.name, x.input_type.full_name, x.output_type.full_name, x.server_streaming) for x in service.methods] == [
        (x.name, x.input_type.full_name, x.output_type.full_name, x.server_streaming) for x in want.methods
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_grpcurl_cannot_describe_the_other_service(servers: Servers, kind: str) -> None:
    address, _, other = servers[kind]
    r = grpcurl(address, "describe", other)
    assert r.returncode != 0, r.stdout
    assert other in r.stderr and "not found" in r.stderr.lower(), r.stderr
    r = grpcurl(address, "list", other)
    assert r.returncode != 0, r.stdout


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_the_other_service_is_not_found(
    servers: Servers, versions: dict[str, Reflection], kind: str, version: str
) -> None:
    address, _, other = servers[kind]
    r = versions[version]
    assert r.files(address, file_containing_symbol=other) == []
    assert r.files(address, file_containing_symbol=f"{other}.{SERVICES[other].methods[0].name}") == []
    # whatever file the server does answer, none of them declares the other service
    for symbol in (MANAGER, WORKER, "memsvc.v1.WorkerStatus"):
        for f in r.files(address, file_containing_symbol=symbol):
            assert other not in {f"{f.package}.{s.name}" for s in f.service}, (symbol, f.name)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_manager_serves_the_worker_file_without_its_service(
    servers: Servers, versions: dict[str, Reflection], version: str
) -> None:
    """memory_manager_service.proto imports model_worker_service.proto (for its messages)."""
    address = servers["manager"][0]
    files = {f.name: f for f in versions[version].files(address, file_by_filename=worker_pb.DESCRIPTOR.name)}
    worker_file = files[worker_pb.DESCRIPTOR.name]
    assert not worker_file.service
    assert {msg.name for msg in worker_file.message_type} == set(worker_pb.DESCRIPTOR.message_types_by_name)
    r = grpcurl(address, "describe", "memsvc.v1.SleepRequest")  # its messages still describe
    assert r.returncode == 0 and "message SleepRequest" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_grpcurl_describes_both_reflection_services(servers: Servers, kind: str) -> None:
    address = servers[kind][0]
    for service in (V1, V1ALPHA):
        r = grpcurl(address, "describe", service)
        assert r.returncode == 0 and f"{service} is a service" in r.stdout, r.stdout + r.stderr
        assert "rpc ServerReflectionInfo ( stream" in r.stdout, r.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_the_error_model_describes(servers: Servers, kind: str) -> None:
    address = servers[kind][0]
    for message in ("google.rpc.Status", "google.rpc.ErrorInfo"):
        r = grpcurl(address, "describe", message)
        assert r.returncode == 0 and f"{message} is a message" in r.stdout, r.stdout + r.stderr


def test_grpcurl_prints_the_error_info(servers: Servers) -> None:
    r = grpcurl("-d", '{"name": "workers/missing"}', servers["manager"][0], f"{MANAGER}/GetWorker")
    assert r.returncode == 64 + NOT_FOUND, r.stdout + r.stderr
    out = "".join((r.stdout + r.stderr).split())
    assert '"@type":"type.googleapis.com/google.rpc.ErrorInfo"' in out, r.stderr
    assert '"reason":"NOT_FOUND"' in out and '"domain":"memsvc.dev"' in out, r.stderr


def _fields(d: descriptor_pb2.DescriptorProto) -> tuple[Any, ...]:
    return tuple(sorted((x.name, x.number, x.type, x.label, x.type_name, x.oneof_index) for x in d.field))


def _shape(f: descriptor_pb2.FileDescriptorProto) -> Any:
    """A file's messages and services as the wire sees them (names, numbers, types; no options)."""
    return (
        f.package,
        sorted((d.name, _fields(d), tuple(o.name for o in d.oneof_decl)) for d in f.message_type),
        sorted(
            (
                s.name,
                tuple((x.name, x.input_type, x.output_type, x.client_streaming, x.server_streaming) for x in s.method),
            )
            for s in f.service
        ),
    )


def test_the_served_v1_file_is_the_v1_spec(
    servers: Servers, versions: dict[str, Reflection], v1_schema: descriptor_pb2.FileDescriptorProto
) -> None:
    """What reflection says grpc.reflection.v1 is matches the spec, message for message, field for field."""
    (served,) = versions["v1"].files(servers["manager"][0], file_containing_symbol=V1)
    assert served.name == "grpc/reflection/v1/reflection.proto"
    assert _shape(served) == _shape(v1_schema)
    assert not served.options.deprecated


# ---- behind the token ----
@pytest.fixture(scope="module")
def tokened(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagerProcess]:
    base = tmp_path_factory.mktemp("reflection-token")
    (base / "token").write_text(TOKEN + "\n")
    cl = Cluster(base)
    try:
        yield cl.manager(["--token-file", str(base / "token")])
    finally:
        cl.close()


@pytest.mark.parametrize("version", VERSIONS)
def test_reflection_needs_the_token(tokened: ManagerProcess, versions: dict[str, Reflection], version: str) -> None:
    r = versions[version]
    for md in ((), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as err:
            r.services(tokened.address, md)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
    assert r.services(tokened.address, (("authorization", f"Bearer {TOKEN}"),)) == {MANAGER, HEALTH, V1ALPHA, V1}
