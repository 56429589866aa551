"""Several manager replicas on one shared store (PostgreSQL): one leads, the others forward to it.

Why this shape: the manager's decisions (leases, budgets, idle timers, the order of transitions on
a worker) are made in one process's memory, under per-worker locks. Two replicas deciding at once
would race on every worker, so exactly one decides, and the others are warm spares that a client
may reach at any address.

- **Election.** Every replica asks the store for the leader lock (:meth:`LeaderLock.try_lead`) every
  ``poll`` seconds until it gets it; the store's lock is held by the leader's database session, so a
  leader that dies frees it (memsvc/manager/store_postgres.py says how soon). The new leader then
  starts as a restarted manager does: registrations, leases and policies from the store, every
  worker's state re-learned from its telemetry.
- **Followers forward.** A follower serves MemoryManagerService by passing each call, as bytes, to
  the leader's advertised address with the caller's deadline and metadata, and its answer or error
  (status, message, details) back; a caller who leaves cancels the forwarded call. It learns the
  leader's address from the store at each poll, and at once after a call found none or the last
  did not answer. A follower that knows no reachable leader answers ``UNAVAILABLE`` with reason
  ``NO_LEADER`` and a retry delay. The store is asked from a thread, never on the calls' path.
  Its health says ``NOT_SERVING`` for the service until it leads (``SERVING`` for the server), so a
  Kubernetes readiness probe on the service name routes a Service's traffic to the leader alone.
- **Stepping down.** The leader checks its session every ``poll`` seconds; once it is lost (a cut,
  the server's restart, ``pg_terminate_backend``) the store refuses every write, and the replica
  stops with exit status 1 so that its supervisor restarts it as a follower. Nothing is written
  by a replica that does not hold the lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol, runtime_checkable

import grpc

from memsvc.errors import MemsvcError, NoLeader
from memsvc.runtime.auth import Security, aio_channel
from memsvc.runtime.rpc_errors import Context, Continuation, Handler

log = logging.getLogger("memsvc.manager")


_NOT_FORWARDED = ("authorization", "user-agent", "content-type", "te", "grpc-", ":")
"""Call metadata that is the hop's, not the caller's: the follower sends its own token and headers."""


@runtime_checkable
class LeaderLock(Protocol):
    """What a store that several replicas share offers for leading (memsvc/manager/store_postgres.py)."""

    lost: str

    def try_lead(self, address: str) -> bool: ...

    def leader(self) -> str: ...

    def check(self) -> None: ...


class Replica:
    """This process's part among the replicas: following, then leading until its session is lost."""

    def __init__(self, lock: LeaderLock, advertise: str, service: str, poll: float, security: Security) -> None:
        self._lock = lock
        self.advertise = advertise
        self._prefix = f"/{service}/"
        self.poll = poll
        self._security = security
        self.leading = False
        self.leader = ""
        """The leader's address as last read from the store ("" when none holds the lock)."""
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._said = ""
        self._ask = asyncio.Event()
        """Set by a call that found no leader: the election loop asks the store at once."""

    # ---- election ----
    async def follow_until_leading(self, stop: asyncio.Event) -> bool:
        """Try for the lead every ``poll`` seconds, or at once when a forwarded call found no leader,
        until this replica leads (True) or ``stop`` is set. The store's calls run in a thread: a slow
        or unreachable database holds this loop's forwarding up for nobody."""
        while not stop.is_set():
            try:
                if await asyncio.to_thread(self._lock.try_lead, self.advertise):
                    self.leader = self.advertise  # calls wait in NO_LEADER until lead()
                    return True
                self._learn(await asyncio.to_thread(self._lock.leader))
            except MemsvcError as exc:
                self._learn("")
                self._say(f"manager replica {self.advertise}: cannot reach the store to lead or follow: {exc}")
            await self._pause(stop)
        return False

    async def _pause(self, stop: asyncio.Event) -> None:
        """``poll`` seconds, or less: until ``stop`` or a call that found no leader (:meth:`_channel`)."""
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._ask.wait())]
        try:
            await asyncio.wait(waits, timeout=self.poll, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            self._ask.clear()

    def lead(self) -> None:
        """Serve the calls from here on: the manager is built and started."""
        self.leading = True
        log.info("manager replica %s leads", self.advertise)

    def _learn(self, leader: str) -> None:
        if leader != self.leader:
            log.info("manager replica %s follows %s", self.advertise, leader or "no leader (none holds the lock)")
            self.leader = leader

    async def hold(self, stop: asyncio.Event) -> str:
        """While leading: check the session every ``poll`` seconds until ``stop`` is set (""), or until
        the session is lost (why; ``stop`` is set then too)."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.poll)
            if stop.is_set():
                break
            try:
                await asyncio.to_thread(self._lock.check)
            except MemsvcError as exc:
                if self._lock.lost:
                    log.error("manager replica %s stops leading: %s", self.advertise, self._lock.lost)
                    stop.set()
                    return self._lock.lost
                self._say(f"manager replica {self.advertise}: the store did not answer its check: {exc}")
        return ""

    def _say(self, line: str) -> None:
        if line != self._said:
            log.warning("%s", line)
            self._said = line

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    # ---- forwarding ----
    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """The server interceptor that sends the service's calls to the leader while this one follows."""
        return _Forward(self)

    def _channel(self) -> tuple[str, grpc.aio.Channel]:
        leader = self.leader
        if not leader or leader == self.advertise:  # none known, or this one about to lead
            self._ask.set()  # the election loop asks the store now, not at its next poll
            raise NoLeader(
                "no manager replica leads right now (a replica takes over within seconds): try again",
                retry_after_s=self.poll * 2,
            )
        if leader not in self._channels:
            self._channels[leader] = aio_channel(leader, self._security)
        return leader, self._channels[leader]

    def _unreachable(self, leader: str, exc: grpc.aio.AioRpcError) -> NoLeader:
        return NoLeader(
            f"the leading manager replica {leader} did not answer ({exc.code().name}: {exc.details()}): try again",
            metadata={"leader": leader},
            retry_after_s=self.poll * 2,
        )

    async def forward_unary(self, method: str, request: bytes, context: Context) -> bytes:
        leader, ch = self._channel()
        send: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary(method)  # no serializers: bytes
        call = send(request, timeout=context.time_remaining(), metadata=_metadata(context))
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            await self._relay(leader, exc, context)
            raise

    async def forward_stream(self, method: str, request: bytes, context: Context) -> AsyncIterator[bytes]:
        leader, ch = self._channel()
        open_stream: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = ch.unary_stream(method)
        call = open_stream(request, timeout=context.time_remaining(), metadata=_metadata(context))
        try:
            async for message in call:
                yield message
        except grpc.aio.AioRpcError as exc:
            await self._relay(leader, exc, context)
            raise
        finally:
            call.cancel()  # the caller left: so does the leader's stream

    async def _relay(self, leader: str, exc: grpc.aio.AioRpcError, context: Context) -> None:
        """The leader's own answer goes back as it came; no answer at all is this replica's NO_LEADER."""
        if _answered(exc):
            trailing = tuple((k, v) for k, v in exc.trailing_metadata() or ())
            await context.abort(exc.code(), exc.details() or "", trailing)
        if self.leader == leader:
            self.leader = ""
            self._ask.set()  # the election loop asks the store who leads now, rather than at its next poll
        raise self._unreachable(leader, exc) from exc


def _answered(exc: grpc.aio.AioRpcError) -> bool:
    """The leader answered with a status of its own (every memsvc error carries details), as
    opposed to the transport failing on the way."""
    if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return True
    return any(k == "grpc-status-details-bin" for k, _ in exc.trailing_metadata() or ())


def _metadata(context: Context) -> tuple[tuple[str, str | bytes], ...]:
    return tuple((k, v) for k, v in (context.invocation_metadata() or ()) if not k.lower().startswith(_NOT_FORWARDED))


class _Forward(grpc.aio.ServerInterceptor):
    """Swaps the service's handlers for forwarding ones while the replica follows. Installed inside
    the error mapping (memsvc/runtime/serving.py), so this replica's own refusals map like any handler's."""

    def __init__(self, replica: Replica) -> None:
        self._replica = replica

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler | None:
        handler = await continuation(details)
        replica = self._replica
        if handler is None or replica.leading or not details.method.startswith(replica._prefix):
            return handler
        method = details.method
        if handler.unary_unary is not None:

            async def unary(request: bytes, context: Context) -> bytes:
                return await replica.forward_unary(method, request, context)

            return grpc.unary_unary_rpc_method_handler(unary)
        if handler.unary_stream is not None:

            async def stream(request: bytes, context: Context) -> AsyncIterator[bytes]:
                async for message in replica.forward_stream(method, request, context):
                    yield message

            return grpc.unary_stream_rpc_method_handler(stream)
        return handler


def advertised(listen: str, advertise: str, hostname: Callable[[], str]) -> str:
    """The address other replicas dial this one at: ``advertise``, else the listen address with a
    wildcard host replaced by this host's name."""
    if advertise:
        return advertise
    host, _, port = listen.rpartition(":")
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = hostname()
    return f"{host}:{port}"


__all__ = ["LeaderLock", "Replica", "advertised"]
