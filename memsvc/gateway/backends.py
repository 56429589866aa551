"""Where the gateway's requests go: the manager for the models and their leases, each worker for tokens.

The gateway keeps no state a restart would lose. The models are whatever the manager's registered
workers serve (their ``served_model_name``), asked again on every request; a request holds a lease
on the worker it uses (which wakes it when it sleeps: the wait is part of its time to the first
token) and releases it when the response ends or the client leaves, so several gateways can run
against one manager. Control plane (the manager) and data plane (gateway to worker) stay apart.

While the manager does not answer (down, restarting, unreachable: a transport failure, not one of
its own refusals), the gateway serves from the last list of workers it got: a request for a model
whose worker was awake is served by it without a lease (there is nobody to hold one with, and so none
to leak or count twice when the manager is back); one that needs a wake, which only the manager
decides, is a 503 with Retry-After. The first answer from the manager ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

import grpc

from memsvc.errors import NoLeader
from memsvc.gateway import LEASE_TTL_S
from memsvc.runtime.auth import Security, aio_channel
from memsvc.runtime.rpc_errors import error_info
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

RENEWALS_PER_TTL = 3
"""Renewals per TTL: one that fails is tried again at the next, two more before the lease expires."""
RELEASE_RETRY_S = (0.5, 5.0)
"""A release the manager could not take is tried again after the first, doubling up to the second."""
RELEASE_TIMEOUT_S = 10.0
LAST_RELEASE_TIMEOUT_S = 2.0
"""A release still being retried when the gateway stops gets one last attempt this long."""
RETRY_RELEASE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,  # the manager down, restarting or unreachable
        grpc.StatusCode.DEADLINE_EXCEEDED,  # slow: should the attempt have landed, the next is NOT_FOUND
        grpc.StatusCode.CANCELLED,  # the manager stopping mid-call
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,  # its store failing, say
        grpc.StatusCode.UNKNOWN,
    }
)
"""Release failures worth another attempt. NOT_FOUND is done (the lease is gone: expired, released by
an operator, or released by an attempt whose answer was lost); the rest (INVALID_ARGUMENT,
PERMISSION_DENIED, UNAUTHENTICATED, ...) would fail again the same way: the lease is left to expire."""
MANAGER_RECONNECT_MAX_MS = 5000
"""The manager channel's longest pause between reconnects (gRPC's own is 120 s): a restarted manager
gets the releases it missed, and the requests, within seconds."""
LIST_PAGE = 1000
QUEUE_POLL_S = 0.25
"""How often a queued request asks the manager again for room."""


@dataclass(frozen=True)
class Granted:
    """A lease, and how long its request waited in the queue for room before the grant's own call
    (which then woke the worker, evicting a neighbour if it had to)."""

    response: manager_pb.AcquireWorkerResponse
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
    has_tokenizer: bool = True
    """Its answers carry text (without a tokenizer they carry token ids only)."""


log = logging.getLogger("memsvc.gateway")


def manager_away(exc: BaseException) -> bool:
    """The manager did not answer (no connection, or no answer in time; or a replica that knows no
    leader, reason NO_LEADER: memsvc/manager/replicas.py), as opposed to answering with an error of
    its own, which carries an ErrorInfo (an unreachable worker's UNAVAILABLE does)."""
    if not isinstance(exc, grpc.aio.AioRpcError):
        return False
    if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return False
    info = error_info(exc)
    return info is None or info.reason == NoLeader.reason


@dataclass
class _Held:
    """A lease the gateway took, and the loop time by which the manager drops it at the latest unless
    it is renewed (every renewal attempt moves it: one whose answer was lost may have landed)."""

    lease_id: str
    worker: str
    expires: float


class Backends:
    """gRPC channels to the manager and to the workers it names (one per address, kept)."""

    def __init__(
        self, manager_address: str, security: Security | None = None, lease_ttl_s: float | None = None
    ) -> None:
        self._security = security
        self.lease_ttl_s = LEASE_TTL_S if lease_ttl_s is None else lease_ttl_s
        """Renewed every RENEWALS_PER_TTL-th of it while the request runs: a gateway that dies holds its
        workers awake this long at most, a release the manager could not take is retried this long at
        most, and a manager down longer than this loses the lease (the response goes on, straight from
        the worker, but nothing then keeps the worker from idle sleep or eviction)."""
        options = [("grpc.max_reconnect_backoff_ms", MANAGER_RECONNECT_MAX_MS)]
        self._manager_channel = aio_channel(manager_address, security, options)
        self.manager: manager_grpc.MemoryManagerServiceAsyncStub = manager_grpc.MemoryManagerServiceStub(
            self._manager_channel
        )
        self._workers: dict[str, tuple[grpc.aio.Channel, worker_grpc.ModelWorkerServiceAsyncStub]] = {}
        self.unknown_unavailable = 0
        """Unavailable workers whose model the last :meth:`models` could not tell."""
        self._late: set[asyncio.Task[None]] = set()
        """Releases running in the background: those of leases granted to callers that left (see
        :meth:`acquire`) and those being retried (:meth:`_give_back`); at most one per lease the
        gateway took, each for the lease's TTL at most."""
        self._renewals: set[asyncio.Task[None]] = set()
        self._closing = asyncio.Event()
        self._last_models: dict[str, list[Served]] | None = None
        """The manager's last answer to :meth:`models`: what the gateway serves from while it is away."""
        self.manager_away = False
        """The manager's last call failed with no answer (see :func:`manager_away`)."""

    async def close(self) -> None:
        """Stop renewing; give the releases still being retried one last short attempt, and those in
        flight time to land (10 s at most)."""
        self._closing.set()
        for task in self._renewals:
            task.cancel()
        if self._late:
            await asyncio.wait(set(self._late), timeout=RELEASE_TIMEOUT_S)
        for task in self._late:
            task.cancel()
        for ch, _ in self._workers.values():
            await ch.close()
        await self._manager_channel.close()

    def worker(self, address: str) -> worker_grpc.ModelWorkerServiceAsyncStub:
        if address not in self._workers:
            ch = aio_channel(address, self._security)
            self._workers[address] = (ch, worker_grpc.ModelWorkerServiceStub(ch))
        return self._workers[address][1]

    def _away(self, exc: grpc.aio.AioRpcError) -> bool:
        """Note whether ``exc`` says the manager is away (logged once per absence); True if it does."""
        away = manager_away(exc)
        if away and not self.manager_away:
            log.warning(
                "the manager does not answer (%s): serving the models whose workers were awake from the "
                "last list, without leases; wakes wait for it",
                exc.code().name,
            )
        self.manager_away = self.manager_away or away
        return away

    def _back(self) -> None:
        if self.manager_away:
            log.info("the manager answers again: requests take leases again")
        self.manager_away = False

    async def models(self, timeout: float = 10.0) -> dict[str, list[Served]]:
        """Every served model name and its workers. Workers that report no model are left out, but
        the unavailable ones among them (registered, not heard from since the manager started) are
        counted in :attr:`unknown_unavailable`: one of them may serve any model asked for. While the
        manager is away, its last answer (if there was one; the error otherwise)."""
        try:
            models = await self._list_models(timeout)
        except grpc.aio.AioRpcError as exc:
            if self._away(exc) and self._last_models is not None:
                return self._last_models
            raise
        self._back()
        self._last_models = models
        return models

    async def _list_models(self, timeout: float) -> dict[str, list[Served]]:
        out: dict[str, list[Served]] = {}
        unknown = 0
        token = ""
        while True:
            page = manager_pb.ListWorkersRequest(page_size=LIST_PAGE, page_token=token)
            r = await self.manager.ListWorkers(page, timeout=timeout)
            for wk in r.workers:
                model = wk.status.model
                if not model.served_model_name:
                    unknown += wk.state == common_pb.WORKER_STATE_UNAVAILABLE
                    continue
                out.setdefault(model.served_model_name, []).append(
                    Served(
                        wk.name,
                        wk.address,
                        wk.state,
                        wk.lease_count,
                        model.vocab_size,
                        model.context_length,
                        model.has_tokenizer,
                    )
                )
            token = r.next_page_token
            if not token:
                self.unknown_unavailable = unknown
                return out

    async def start_timeout(self, worker: Served, timeout: float = 10.0) -> float:
        """``worker``'s effective policy's start_timeout, in seconds (grpc.RpcError if the manager
        does not answer)."""
        r = await self.manager.GetPolicy(manager_pb.GetPolicyRequest(name=worker.name), timeout=timeout)
        return float(r.policy.start_timeout.ToNanoseconds() / 1e9)

    @staticmethod
    def pick(workers: list[Served]) -> Served:
        """An awake worker first (the least leased), then a sleeping one: never wake a second copy
        while an awake one can serve."""
        usable = [s for s in workers if s.state != common_pb.WORKER_STATE_UNAVAILABLE] or workers
        return min(usable, key=lambda s: (s.state != common_pb.WORKER_STATE_AWAKE, s.leases, s.name))

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
        request = self._acquire_request(worker.name, holder, keep_alive_s)
        while True:
            asked = loop.time()
            call = asyncio.ensure_future(self.manager.AcquireWorker(request, timeout=timeout))
            try:
                r: manager_pb.AcquireWorkerResponse = await asyncio.shield(call)
                self._back()
                return Granted(r, asked - start)
            except asyncio.CancelledError:
                self._release_when_granted(call)
                raise
            except grpc.aio.AioRpcError as exc:
                if self._away(exc) and worker.state == common_pb.WORKER_STATE_AWAKE:
                    # awake when last seen: served by it, with no lease to hold or give back
                    return Granted(
                        manager_pb.AcquireWorkerResponse(
                            worker=manager_pb.Worker(name=worker.name, address=worker.address)
                        ),
                        asked - start,
                    )
                left = give_up - loop.time()
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or left <= 0:
                    raise
            await asyncio.sleep(min(QUEUE_POLL_S, left))

    def _acquire_request(
        self, name: str, holder: str, keep_alive_s: float | None, lease_id: str = ""
    ) -> manager_pb.AcquireWorkerRequest:
        """A grant (or, with ``lease_id``, a renewal) of a lease for :attr:`lease_ttl_s`. A renewal
        sends the grant's keep_alive again: the same value, which a restarted manager (which keeps
        keep_alive in memory only) gets back that way."""
        request = manager_pb.AcquireWorkerRequest(name=name, holder=holder, lease_id=lease_id)
        request.ttl.FromNanoseconds(round(self.lease_ttl_s * 1e9))
        if keep_alive_s is not None:
            request.keep_alive.FromNanoseconds(int(keep_alive_s * 1e9))
        return request

    def _held(self, lease_id: str, worker: str) -> _Held:
        """``lease_id``, granted or renewed just now (its expiry is counted from after the answer)."""
        return _Held(lease_id, worker, asyncio.get_running_loop().time() + self.lease_ttl_s)

    def _background(self, release: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(release)
        self._late.add(task)
        task.add_done_callback(self._late.discard)

    def _release_when_granted(self, call: asyncio.Future[manager_pb.AcquireWorkerResponse]) -> None:
        async def release() -> None:
            try:
                r = await call
            except grpc.RpcError:
                return  # nothing was granted
            await self._give_back(self._held(r.lease.lease_id, r.worker.name))

        self._background(release())

    async def _renew(self, held: _Held, request: manager_pb.AcquireWorkerRequest) -> None:
        """Renew ``held`` every RENEWALS_PER_TTL-th of its TTL until cancelled (when it is released).
        A renewal that fails is tried again at the next tick (logged once per run of failures). One
        answered NOT_FOUND means the lease is gone (it expired while the manager was down for longer
        than the TTL, or an operator released it): logged, and the request goes on without it; a new
        lease is not taken, since its response comes straight from the worker, and a grant could wait
        in the queue or wake a worker the manager has put to sleep meanwhile."""
        loop = asyncio.get_running_loop()
        every = self.lease_ttl_s / RENEWALS_PER_TTL
        failing = ""
        next_at = loop.time() + every
        while True:
            await asyncio.sleep(max(next_at - loop.time(), 0.0))
            next_at = loop.time() + every
            try:
                await self.manager.AcquireWorker(request, timeout=every)
            except grpc.aio.AioRpcError as exc:
                why = f"{exc.code().name}: {exc.details()}"
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning(
                        "lease %s on %s is gone (%s): its request goes on without one", held.lease_id, held.worker, why
                    )
                    return
                if not failing:
                    log.warning(
                        "renewing lease %s on %s failed (%s): trying again every %.3g s until it expires",
                        held.lease_id,
                        held.worker,
                        why,
                        every,
                    )
                failing = why
                continue
            finally:
                held.expires = loop.time() + self.lease_ttl_s
            if failing:
                log.info("lease %s on %s renewed again", held.lease_id, held.worker)
                failing = ""

    async def _release(self, held: _Held) -> None:
        """Give ``held`` back, waiting for the first attempt only (a plain response's lease goes back
        before its answer does). The attempts run in a task of their own (:meth:`_give_back`): a caller
        that left cancels its task, and the lease must still go back."""
        tried = asyncio.Event()
        self._background(self._give_back(held, tried))
        with contextlib.suppress(asyncio.CancelledError):
            await tried.wait()

    async def _give_back(self, held: _Held, tried: asyncio.Event | None = None) -> None:
        """ReleaseWorker for ``held`` until it lands. A failure in RETRY_RELEASE (the manager down or
        restarting) is tried again after RELEASE_RETRY_S, doubling, until the release lands, is
        answered NOT_FOUND, or the lease's expiry has passed (the manager drops it then anyway; a
        restarted one restores only the leases that have not expired); when the gateway stops, after
        one last short attempt. Logged when it first fails and once at the end, not per attempt: a
        lease the manager restored from its store would otherwise hold its worker awake for its TTL
        (no idle sleep, no eviction)."""
        loop = asyncio.get_running_loop()
        request = manager_pb.ReleaseWorkerRequest(lease_id=held.lease_id)
        pause, failed = RELEASE_RETRY_S[0], ""
        while True:
            last = self._closing.is_set()
            try:
                await self.manager.ReleaseWorker(request, timeout=LAST_RELEASE_TIMEOUT_S if last else RELEASE_TIMEOUT_S)
                code, why = grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as exc:
                code, why = exc.code(), f"{exc.code().name}: {exc.details()}"
            finally:
                if tried is not None:
                    tried.set()
            if code in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND):
                if failed:
                    log.info("lease %s on %s released, after %s", held.lease_id, held.worker, failed)
                return
            left = held.expires - loop.time()
            if code not in RETRY_RELEASE or last:
                log.warning(
                    "releasing lease %s on %s failed (%s): it holds the worker until it expires in %.0f s",
                    held.lease_id,
                    held.worker,
                    why,
                    max(left, 0.0),
                )
                return
            if not failed:
                log.warning(
                    "releasing lease %s on %s failed (%s): trying again until it lands or expires in %.0f s",
                    held.lease_id,
                    held.worker,
                    why,
                    max(left, 0.0),
                )
            failed = why
            with contextlib.suppress(TimeoutError):  # the gateway's close cuts the pause short
                await asyncio.wait_for(self._closing.wait(), max(min(pause, left), 0.0))
            pause = min(pause * 2, RELEASE_RETRY_S[1])
            if loop.time() >= held.expires and not self._closing.is_set():
                log.info(
                    "lease %s on %s expired before the manager took its release (%s)",
                    held.lease_id,
                    held.worker,
                    failed,
                )
                return

    @contextlib.asynccontextmanager
    async def lease(
        self, worker: Served, holder: str, timeout: float, queue_s: float = 0.0, keep_alive_s: float | None = None
    ) -> AsyncIterator[Granted]:
        """Hold a lease on ``worker`` (see :meth:`acquire`) for the block, renewed while it runs
        (:meth:`_renew`); released however it ends (:meth:`_release`)."""
        granted = await self.acquire(worker, holder, timeout, queue_s, keep_alive_s)
        if not granted.response.lease.lease_id:  # the manager away: nothing to renew or give back
            yield granted
            return
        held = self._held(granted.response.lease.lease_id, worker.name)
        renew = self._acquire_request(worker.name, holder, keep_alive_s, held.lease_id)
        renewing = asyncio.create_task(self._renew(held, renew))
        self._renewals.add(renewing)
        renewing.add_done_callback(self._renewals.discard)
        try:
            yield granted
        finally:
            renewing.cancel()
            await self._release(held)


__all__ = [
    "QUEUE_POLL_S",
    "RELEASE_RETRY_S",
    "RENEWALS_PER_TTL",
    "Backends",
    "Granted",
    "Served",
    "manager_away",
]
