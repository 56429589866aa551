"""Where the gateway's requests go: the manager for the models and their leases, each worker for tokens.

The gateway keeps no state a restart would lose. The models are whatever the manager's registered
workers serve (their ``served_model_name``), asked again on every request; a request holds a lease
on the worker it uses (which wakes it when it sleeps: the wait is part of its time to the first
token) and releases it when the response ends or the client leaves, so several gateways can run
against one manager. Control plane (the manager) and data plane (gateway to worker) stay apart.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from google.protobuf import duration_pb2

from memsvc._auth import Security, aio_channel
from memsvc.v1 import common_pb2 as c
from memsvc.v1 import memory_manager_service_pb2 as m
from memsvc.v1 import memory_manager_service_pb2_grpc as m_grpc
from memsvc.v1 import model_worker_service_pb2_grpc as w_grpc

LEASE_TTL_S = 300
"""A request's lease: renewed by nobody, so it must outlast the longest response (the gateway
releases it at the end; the TTL only matters when the gateway itself dies)."""
LIST_PAGE = 1000
QUEUE_POLL_S = 0.25
"""How often a queued request asks the manager again for room."""


@dataclass(frozen=True)
class Granted:
    """A lease, and how long its request waited in the queue for room before the grant's own call
    (which then woke the worker, evicting a neighbour if it had to)."""

    response: m.AcquireWorkerResponse
    queued_s: float


@dataclass(frozen=True)
class Served:
    """One worker serving a model, as the manager last saw it."""

    name: str
    address: str
    state: int
    leases: int
    vocab_size: int = 0
    """The model's, for the gateway's own check of token-id prompts (0: not reported)."""
    context_length: int = 0


STATE_LABEL: dict[int, str] = {
    c.WORKER_STATE_AWAKE: "awake",
    c.WORKER_STATE_PARTIALLY_AWAKE: "partially awake",
    c.WORKER_STATE_ASLEEP: "asleep",
    c.WORKER_STATE_SLEEPING: "sleeping",
    c.WORKER_STATE_WAKING: "waking",
    c.WORKER_STATE_LOADING: "loading",
    c.WORKER_STATE_UNAVAILABLE: "unavailable",
}


class Backends:
    """gRPC channels to the manager and to the workers it names (one per address, kept)."""

    def __init__(self, manager_address: str, security: Security | None = None) -> None:
        self._security = security
        self._manager_channel = aio_channel(manager_address, security)
        self.manager: m_grpc.MemoryManagerServiceAsyncStub = m_grpc.MemoryManagerServiceStub(self._manager_channel)
        self._workers: dict[str, tuple[grpc.aio.Channel, w_grpc.ModelWorkerServiceAsyncStub]] = {}
        self.unknown_unavailable = 0
        """Unavailable workers whose model the last :meth:`models` could not tell."""
        self._late: set[asyncio.Task[None]] = set()
        """Releases of leases granted to callers that left (see :meth:`acquire`); at most one per
        request the gateway serves."""

    async def close(self) -> None:
        if self._late:
            await asyncio.wait(set(self._late), timeout=10)
        for ch, _ in self._workers.values():
            await ch.close()
        await self._manager_channel.close()

    def worker(self, address: str) -> w_grpc.ModelWorkerServiceAsyncStub:
        if address not in self._workers:
            ch = aio_channel(address, self._security)
            self._workers[address] = (ch, w_grpc.ModelWorkerServiceStub(ch))
        return self._workers[address][1]

    async def models(self, timeout: float = 10.0) -> dict[str, list[Served]]:
        """Every served model name and its workers. Workers that report no model are left out, but
        the unavailable ones among them (registered, not heard from since the manager started) are
        counted in :attr:`unknown_unavailable`: one of them may serve any model asked for."""
        out: dict[str, list[Served]] = {}
        unknown = 0
        token = ""
        while True:
            page = m.ListWorkersRequest(page_size=LIST_PAGE, page_token=token)
            r = await self.manager.ListWorkers(page, timeout=timeout)
            for wk in r.workers:
                model = wk.status.model
                if not model.served_model_name:
                    unknown += wk.state == c.WORKER_STATE_UNAVAILABLE
                    continue
                out.setdefault(model.served_model_name, []).append(
                    Served(wk.name, wk.address, wk.state, wk.lease_count, model.vocab_size, model.context_length)
                )
            token = r.next_page_token
            if not token:
                self.unknown_unavailable = unknown
                return out

    @staticmethod
    def pick(workers: list[Served]) -> Served:
        """An awake worker first (the least leased), then a sleeping one: never wake a second copy
        while an awake one can serve."""
        usable = [s for s in workers if s.state != c.WORKER_STATE_UNAVAILABLE] or workers
        return min(usable, key=lambda s: (s.state != c.WORKER_STATE_AWAKE, s.leases, s.name))

    async def acquire(
        self, worker: Served, holder: str, timeout: float, queue_s: float, keep_alive_s: float | None = None
    ) -> Granted:
        """A lease on ``worker``, which the manager wakes (making room on its device first). While the
        manager cannot make room (every other worker there is leased: RESOURCE_EXHAUSTED) the request
        waits its turn, asking again, for up to ``queue_s``; then the refusal is the answer.
        ``keep_alive_s``: the lease's keep_alive (see AcquireWorkerRequest).

        A caller that leaves (this coroutine cancelled) stops the queueing at once, but never an
        AcquireWorker in flight: the manager may have granted it already, with its answer on the
        wire, and a cancelled call would lose the lease id and leave the lease to its TTL, holding
        the model awake. The call finishes in the background and what it grants goes back."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        give_up = start + queue_s
        ttl = duration_pb2.Duration(seconds=LEASE_TTL_S)
        request = m.AcquireWorkerRequest(name=worker.name, ttl=ttl, holder=holder)
        if keep_alive_s is not None:
            request.keep_alive.FromNanoseconds(int(keep_alive_s * 1e9))
        while True:
            asked = loop.time()
            call = asyncio.ensure_future(self.manager.AcquireWorker(request, timeout=timeout))
            try:
                r: m.AcquireWorkerResponse = await asyncio.shield(call)
                return Granted(r, asked - start)
            except asyncio.CancelledError:
                self._release_when_granted(call)
                raise
            except grpc.aio.AioRpcError as exc:
                left = give_up - loop.time()
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or left <= 0:
                    raise
            await asyncio.sleep(min(QUEUE_POLL_S, left))

    def _release_when_granted(self, call: asyncio.Future[m.AcquireWorkerResponse]) -> None:
        async def release() -> None:
            try:
                r = await call
            except grpc.RpcError:
                return  # nothing was granted
            await self._release(r.lease.lease_id)

        task = asyncio.create_task(release())
        self._late.add(task)
        task.add_done_callback(self._late.discard)

    async def _release(self, lease_id: str) -> None:
        """Give ``lease_id`` back; shielded: a caller that left cancels its task, and the lease must
        still go back now (a failure leaves it to its TTL)."""
        release = self.manager.ReleaseWorker(m.ReleaseWorkerRequest(lease_id=lease_id), timeout=10)
        with contextlib.suppress(grpc.RpcError, asyncio.CancelledError):
            await asyncio.shield(release)

    @contextlib.asynccontextmanager
    async def lease(
        self, worker: Served, holder: str, timeout: float, queue_s: float = 0.0, keep_alive_s: float | None = None
    ) -> AsyncIterator[Granted]:
        """Hold a lease on ``worker`` (see :meth:`acquire`) for the block; released however it ends."""
        granted = await self.acquire(worker, holder, timeout, queue_s, keep_alive_s)
        try:
            yield granted
        finally:
            await self._release(granted.response.lease.lease_id)


__all__ = ["LEASE_TTL_S", "QUEUE_POLL_S", "STATE_LABEL", "Backends", "Granted", "Served"]
