"""Server bootstrap shared by the manager and the worker: grpc.aio with health, reflection, the
error mapping, and an ordered graceful shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from memsvc._auth import Security
from memsvc._rpc_errors import ErrorMappingInterceptor
from memsvc.errors import InvalidArgument

log = logging.getLogger("memsvc.serving")

SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


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

    ``security`` (memsvc._auth) adds the token / client-certificate checks in front of everything
    else and serves TLS or mTLS instead of plaintext.
    """
    sec = security or Security()
    sec.check_server()
    creds = sec.server_credentials()
    server = grpc.aio.server(
        interceptors=[*sec.interceptors(), *interceptors, ErrorMappingInterceptor()], options=SERVER_OPTIONS
    )
    for add in register:
        add(server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    try:
        port = server.add_secure_port(listen, creds) if creds else server.add_insecure_port(listen)
    except RuntimeError as exc:
        raise InvalidArgument(f"cannot listen on {listen!r}: {exc}") from exc
    if port == 0:
        raise InvalidArgument(f"cannot listen on {listen!r}")
    await server.start()
    host = listen.rsplit(":", 1)[0]
    return Server(server, hs, f"{host}:{port}")


def install_signal_handlers(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set ``stop``; the caller then drains and exits."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
