"""Self-registration: a worker started with ``--manager`` registers and then heartbeats by
registering again every interval the manager asks for. A manager that is down is retried with
backoff; the worker keeps serving meanwhile."""

from __future__ import annotations

import asyncio
import logging
import socket

import grpc

from memsvc.runtime.auth import Security, aio_channel
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc
from worker.core import WorkerCore
from worker.servicer import status_pb

log = logging.getLogger("memsvc.worker.registration")


def advertised(address: str) -> str:
    """An address others can dial: a wildcard listen address becomes this host's name."""
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


async def keep_registered(core: WorkerCore, address: str, manager: str, security: Security | None = None) -> None:
    backoff = 0.5
    async with aio_channel(manager, security) as channel:
        stub = manager_grpc.MemoryManagerServiceStub(channel)
        while True:
            request = manager_pb.RegisterWorkerRequest(
                worker_id=core.worker_id,
                address=advertised(address),
                host=core.config.host_name or socket.gethostname(),
                status=status_pb(core.status()),
            )
            try:
                reply = await stub.RegisterWorker(request, timeout=5.0)
                backoff = 0.5
                interval = reply.heartbeat_interval.ToNanoseconds() / 1e9 or 2.0
                await asyncio.sleep(min(max(interval, 0.1), 60.0))
            except grpc.aio.AioRpcError as err:
                log.warning(
                    "registering with %s failed: %s (%s); retrying in %.1f s",
                    manager,
                    err.code().name,
                    err.details(),
                    backoff,
                )
            except Exception:  # a bug must show in the log, and must not end the heartbeat for good
                log.exception("registering with %s failed; retrying in %.1f s", manager, backoff)
            else:
                continue
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)
