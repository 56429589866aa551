"""The manager's connection to one worker: its stub, and a telemetry subscription that keeps the
latest status and tells the manager, within moments, when the worker stops answering."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import grpc

from memsvc.auth import Security, aio_channel
from memsvc.v1 import model_worker_service_pb2 as w
from memsvc.v1 import model_worker_service_pb2_grpc as w_grpc

log = logging.getLogger("memsvc.manager.links")

OnMessage = Callable[[w.StreamTelemetryResponse], Awaitable[None]]
OnDown = Callable[[str], Awaitable[None]]


class WorkerLink:
    """Owns one channel to a worker and the task that follows its telemetry."""

    INTERVAL_S = 1.0
    MAX_BACKOFF_S = 5.0
    security = Security()
    """How the manager dials its workers (TLS, client certificate, token); ``memsvc manager`` sets it once
    at start from its own flags, so every link the controller creates uses it."""

    def __init__(self, address: str, on_message: OnMessage, on_down: OnDown, security: Security | None = None) -> None:
        self.address = address
        # keepalive pings find a dead peer whose TCP connection never closed
        self.channel = aio_channel(
            address,
            security or self.security,
            options=[("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000)],
        )
        self.stub = w_grpc.ModelWorkerServiceStub(self.channel)
        self._on_message = on_message
        self._on_down = on_down
        self._retry_now = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name=f"telemetry {self.address}")

    def restart(self) -> None:
        """Drop the current stream and connect again (the worker went silent on it)."""
        if self._task is not None:
            self._task.cancel()
        self.start()

    def poke(self) -> None:
        """Reconnect now instead of after the backoff (the worker just registered)."""
        self._retry_now.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.channel.close()

    async def _follow(self) -> None:
        backoff = 0.2
        while True:
            request = w.StreamTelemetryRequest()
            request.interval.FromNanoseconds(int(self.INTERVAL_S * 1e9))
            try:
                async for msg in self.stub.StreamTelemetry(request):
                    backoff = 0.2
                    await self._on_message(msg)
                reason = "telemetry stream ended"
            except grpc.aio.AioRpcError as err:
                reason = f"{err.code().name}: {err.details()}"
            await self._on_down(reason)
            self._retry_now.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._retry_now.wait(), timeout=backoff)
            backoff = min(backoff * 2, self.MAX_BACKOFF_S)
