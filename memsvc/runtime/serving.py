"""Server bootstrap shared by the manager and the worker: grpc.aio with health, reflection, the
error mapping, and an ordered graceful shutdown on SIGTERM/SIGINT.

Server reflection is served as ``grpc.reflection.v1.ServerReflection`` and as the older
``grpc.reflection.v1alpha.ServerReflection`` (older clients, such as the grpcurl 1.8.6 of the dev
extras, ask v1alpha only). grpcio-reflection implements v1alpha alone; v1 is the same protocol under
another package, with the same messages, field for field, so the v1alpha servicer answers both (see
:func:`enable_reflection`). Both describe only what this server serves, and the google.rpc error
model its errors carry: they answer from a descriptor pool of their own (:func:`reflection_pool`),
not from the process's default pool, which holds every proto module imported here (the manager
imports the worker's and the reverse).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf import descriptor, descriptor_pb2, descriptor_pool
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from memsvc.errors import InvalidArgument
from memsvc.runtime.auth import Security
from memsvc.runtime.rpc_errors import ErrorMappingInterceptor

log = logging.getLogger("memsvc.serving")

T = TypeVar("T")

SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # gRPC sets SO_REUSEPORT by default: a second server then binds a port one already serves, and
    # the kernel splits the connections between them; a taken port must be an error instead
    ("grpc.so_reuseport", 0),
]


REFLECTION_V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"  # its path in grpc-proto, as other servers name it


def _reflection_v1_file() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto, made from grpcio-reflection's v1alpha file.

    The two files differ only in their package and file options: every message, field, number and
    type is the same, so renaming the package gives the v1 file (and v1alpha's messages encode v1's).
    """
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    if proto.package != old.strip("."):
        raise RuntimeError(f"grpcio-reflection's reflection file has package {proto.package!r}")
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name.removeprefix(old)
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type.removeprefix(old)
            method.output_type = new + method.output_type.removeprefix(old)
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    proto.options.ClearField("deprecated")  # v1alpha is the deprecated one
    return proto


ERROR_MODEL = (status_pb2.DESCRIPTOR, error_details_pb2.DESCRIPTOR)
"""google/rpc/status.proto and error_details.proto: every error carries a google.rpc.ErrorInfo in its
google.rpc.Status (memsvc.runtime.rpc_errors), and reflection clients resolve that Any's type by name
(grpcurl prints the ErrorInfo as JSON only when reflection describes it)."""


def reflection_pool(
    service_names: Iterable[str], files: Iterable[descriptor.FileDescriptor] = ERROR_MODEL
) -> descriptor_pool.DescriptorPool:
    """A descriptor pool with the files of ``service_names``, ``files`` and their imports, and nothing else.

    The services come from the default pool (their generated modules are imported by then). A file
    pulled in only as an import (or in ``files``) keeps its messages and enums but loses the services
    not in ``service_names``: the manager's proto imports the worker's for its messages, and its
    reflection must still not describe ``ModelWorkerService``. Reflection's own v1 file is made here
    (see :func:`_reflection_v1_file`); every other name must be a service in the default pool.
    """
    served = set(service_names)
    default = descriptor_pool.Default()
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(proto: descriptor_pb2.FileDescriptorProto) -> None:
        keep = [s for s in proto.service if f"{proto.package}.{s.name}".lstrip(".") in served]
        del proto.service[:]
        proto.service.extend(keep)
        pool.AddSerializedFile(proto.SerializeToString())
        added.add(proto.name)

    def add_file(file: descriptor.FileDescriptor) -> None:
        if file.name in added:
            return
        for dep in file.dependencies:  # imports first: a pool refuses a file before what it imports
            add_file(dep)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        add(proto)

    for name in sorted(served):
        if name == REFLECTION_V1:
            add(_reflection_v1_file())
        else:
            add_file(default.FindServiceByName(name).file)
    for file in files:
        add_file(file)
    return pool


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha, listing ``service_names`` plus both reflection services.

    One grpcio-reflection servicer over :func:`reflection_pool` answers both: v1's request and
    response messages are v1alpha's under another package, so the same bytes decode as either.
    """
    names = sorted({*service_names, REFLECTION_V1ALPHA, REFLECTION_V1})
    servicer = reflection.aio.ReflectionServicer(names, pool=reflection_pool(names))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handlers = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, handlers),))
    server.add_registered_method_handlers(REFLECTION_V1, handlers)  # as generated code registers v1alpha


@dataclass
class Server:
    """A started server, its bound address and its health servicer."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    address: str

    async def set_serving(self, serving: bool, service: str = "") -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(service, status)

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


async def start_server(
    listen: str,
    register: Iterable[Callable[[grpc.aio.Server], None]],
    service_names: Iterable[str],
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    security: Security | None = None,
) -> Server:
    """Start a server on ``listen`` (``host:0`` picks a free port) with every service registered.

    ``security`` (memsvc.runtime.auth) adds the token / client-certificate checks in front of everything
    else and serves TLS or mTLS instead of plaintext. ``interceptors`` run inside the error mapping:
    a handler they return maps its MemsvcErrors like a servicer's.
    """
    sec = security or Security()
    sec.check_server()
    creds = sec.server_credentials()
    server = grpc.aio.server(
        interceptors=[*sec.interceptors(), ErrorMappingInterceptor(), *interceptors], options=SERVER_OPTIONS
    )
    for add in register:
        add(server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    enable_reflection([*service_names, health.SERVICE_NAME], server)
    try:
        port = server.add_secure_port(listen, creds) if creds else server.add_insecure_port(listen)
    except RuntimeError as exc:
        raise InvalidArgument(f"cannot listen on {listen!r}: {exc}") from exc
    if port == 0:
        raise InvalidArgument(f"cannot listen on {listen!r}")
    await server.start()
    host = listen.rsplit(":", 1)[0]
    return Server(server, hs, f"{host}:{port}")


def run_service(main: Coroutine[Any, Any, T]) -> T:
    """Run a service's ``main`` to its end on a new event loop (``asyncio.run``), then ignore stop
    signals for the rest of the exit (see :func:`ignore_stop_signals`).

    grpc.aio shuts its runtime down as soon as its last server or channel is freed, closing the
    socket through which its poller thread wakes the loop. When that happens while the loop still
    runs (a service that returns early, with its server stopped and dropped), a wake-up the loop has
    already queued reads the closed socket, and asyncio prints "Exception in callback
    PollerCompletionQueue._handle_events ... Bad file descriptor" on the way out of a clean exit.
    An idle channel, opened first and freed only once the loop has closed, holds the runtime open
    for the loop's whole life; it never connects.
    """
    warn_if_slow_protobuf()
    keep: list[grpc.aio.Channel] = []

    async def hold_grpc_open() -> T:
        keep.append(grpc.aio.insecure_channel("unix:memsvc-unused"))
        return await main

    try:
        return asyncio.run(hold_grpc_open())
    finally:
        keep.clear()  # the loop is closed: grpc's shutdown has no loop left to race
        ignore_stop_signals()


def warn_if_slow_protobuf() -> None:
    """A warning where protobuf runs its pure-Python implementation: every message each RPC carries
    (a stream's, one per token) is then parsed in 3.7 us instead of 0.2 us and built in 5.7 us
    instead of 0.7 us (a GenerateStreamResponse, the development machine), on the service's GIL, and
    nothing else says so. Seen on a lent GPU host, where another ``google.protobuf`` than the
    installed wheel's (one without the compiled module) was imported first."""
    import os

    from google.protobuf.internal import api_implementation

    if api_implementation.Type() != "python":
        return
    chosen = os.environ.get("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION")
    if chosen:
        why, fix = f"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION={chosen}", "unset that variable"
    else:
        why = f"the google.protobuf in {os.path.dirname(descriptor.__file__)} has no compiled one"
        fix = "install protobuf's binary wheel (pip install --force-reinstall protobuf) where it is imported from"
    log.warning(
        "protobuf runs its pure-Python implementation (%s): every message is parsed and built about ten times "
        "slower than by its compiled one; %s",
        why,
        fix,
    )


def install_signal_handlers(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set ``stop``; the caller then drains and exits."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def ignore_stop_signals() -> None:
    """After the event loop has closed (its handlers with it) the process is exiting anyway: a stop
    signal now, such as ``memsvc up``'s SIGTERM arriving after the terminal's SIGINT to the whole
    process group, must not kill it mid-teardown and turn a clean exit into "killed by SIGTERM"."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
