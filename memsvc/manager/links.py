"""The manager's link to one worker: the calls it makes, and the telemetry it follows.

:class:`WorkerLink` is the interface the manager's decisions use; a :data:`LinkFactory` makes one per
worker address. :class:`GrpcWorkerLink` is the real link (a gRPC channel and a telemetry
subscription that tells the manager, within moments, when the worker stops answering);
:mod:`memsvc.manager.inmemory` has an honest in-memory worker behind the same interface, so
budget, lease and idle-timer decisions can be tested in process.

Every call either returns the worker's answer or raises a :class:`~memsvc.errors.MemsvcError`
with the worker's status code, so the manager relays errors the same way whatever the link.

A link speaks the manager's own types (memsvc/manager/reports.py): the gRPC link is where the
worker's messages become those types and back (memsvc/manager/wire.py), so nothing behind it sees a
proto. SwapBlocks is the one exception, see :meth:`WorkerLink.swap_blocks`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc

from memsvc.manager import wire
from memsvc.manager.reports import Answer, SleepCall, Telemetry, WakeCall, WorkerStatus
from memsvc.runtime.auth import Security, aio_channel
from memsvc.runtime.rpc_errors import from_rpc_error
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

log = logging.getLogger("memsvc.manager.links")

OnMessage = Callable[[Telemetry], Awaitable[None]]
"""Called with every telemetry message the worker sends."""
OnDown = Callable[[str], Awaitable[None]]
"""Called with a reason when the telemetry stream ends or fails."""


STREAM_ENDED = "it ended its telemetry stream (stopping)"
"""The reason a link goes down when the worker closed the stream itself, as a draining worker does:
a stop, not a failure (an error status or a broken connection is the other kind)."""


class WorkerLink(Protocol):
    """What the manager can do with one worker."""

    address: str

    def start(self) -> None:
        """Begin following the worker's telemetry."""

    def restart(self) -> None:
        """Drop the current telemetry stream and connect again (the worker went silent on it)."""

    def poke(self) -> None:
        """Reconnect now instead of after the backoff (the worker just registered)."""

    async def close(self) -> None: ...

    async def status(self, timeout: float) -> WorkerStatus: ...

    async def sleep(self, call: SleepCall, timeout: float) -> Answer: ...

    async def wake_up(self, call: WakeCall, timeout: float) -> Answer: ...

    async def swap_blocks(self, request: worker_pb.SwapBlocksRequest, timeout: float) -> worker_pb.SwapBlocksResponse:
        """The worker's own SwapBlocks message, both ways: the one place a proto passes a link.

        A swap's blocks are the caller's business between it and the worker: the manager checks
        the request's shape by its field lengths (memsvc/runtime/swap_forms.py), names the worker,
        and forwards it. A request may hold up to MAX_SWAP_PAIRS block ids, raw bytes among them;
        copying them into a type of the manager's and back would cost a pass over every block for
        nothing the manager reads, so the message goes through as the worker takes it."""
        ...


LinkFactory = Callable[[str, str, OnMessage, OnDown], WorkerLink]
"""Makes the link to a worker: (worker id, address, on_message, on_down)."""


class GrpcWorkerLink:
    """Owns one channel to a worker and the task that follows its telemetry."""

    INTERVAL_S = 1.0
    MAX_BACKOFF_S = 5.0

    def __init__(
        self, worker_id: str, address: str, on_message: OnMessage, on_down: OnDown, security: Security
    ) -> None:
        self.worker_id = worker_id
        self.address = address
        # keepalive pings find a dead peer whose TCP connection never closed
        self.channel = aio_channel(
            address, security, options=[("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000)]
        )
        self.stub = worker_grpc.ModelWorkerServiceStub(self.channel)
        self._on_message = on_message
        self._on_down = on_down
        self._retry_now = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name=f"telemetry {self.address}")

    def restart(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.start()

    def poke(self) -> None:
        self._retry_now.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.channel.close()

    # ---- calls ----
    async def status(self, timeout: float) -> WorkerStatus:
        try:
            resp = await self.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, self.worker_id) from None
        return wire.status_from_pb(resp.status)

    async def sleep(self, call: SleepCall, timeout: float) -> Answer:
        try:
            resp = await self.stub.Sleep(wire.sleep_request_pb(call), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, self.worker_id) from None
        return wire.answer_from_pb(resp)

    async def wake_up(self, call: WakeCall, timeout: float) -> Answer:
        try:
            resp = await self.stub.WakeUp(wire.wake_request_pb(call), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, self.worker_id) from None
        return wire.answer_from_pb(resp)

    async def swap_blocks(self, request: worker_pb.SwapBlocksRequest, timeout: float) -> worker_pb.SwapBlocksResponse:
        try:
            return await self.stub.SwapBlocks(request, timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, self.worker_id) from None

    # ---- telemetry ----
    async def _follow(self) -> None:
        backoff = 0.2
        while True:
            request = worker_pb.StreamTelemetryRequest()
            request.interval.FromNanoseconds(int(self.INTERVAL_S * 1e9))
            try:
                async for msg in self.stub.StreamTelemetry(request):
                    backoff = 0.2
                    await self._on_message(wire.telemetry_from_pb(msg))
                reason = STREAM_ENDED
            except grpc.aio.AioRpcError as err:
                reason = f"{err.code().name}: {err.details()}"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug in handling one message must not end the link silently
                log.exception("following the telemetry of %s failed", self.worker_id)
                reason = f"telemetry handling failed: {type(exc).__name__}: {exc}"
            await self._on_down(reason)
            self._retry_now.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._retry_now.wait(), timeout=backoff)
            backoff = min(backoff * 2, self.MAX_BACKOFF_S)


def grpc_links(security: Security | None = None) -> LinkFactory:
    """The real links: every worker dialled with this process's TLS identity and token."""
    sec = security or Security()

    def make(worker_id: str, address: str, on_message: OnMessage, on_down: OnDown) -> WorkerLink:
        return GrpcWorkerLink(worker_id, address, on_message, on_down, sec)

    return make


__all__ = ["STREAM_ENDED", "GrpcWorkerLink", "LinkFactory", "OnDown", "OnMessage", "WorkerLink", "grpc_links"]
