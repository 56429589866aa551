"""The manager's calls that change a worker: each through the worker's link, bounded by the
caller's deadline, and each answer applied to the worker's record at once (the answer's status is
newer than any telemetry still on its way).

A call that ends without an answer (the caller's deadline passed, it was cancelled, the connection
broke) leaves the worker's state unknown: the worker may still run it, queued behind a Generate or
halfway through a sleep. Before the caller lets go of the worker's lock, the manager asks the worker
until it says no transition is in progress, and applies what it says; only then may a lease be
granted on the worker's state. A worker that does not answer is UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from memsvc.errors import Cancelled, MemsvcError, RelayedError, Unavailable
from memsvc.manager.links import WorkerLink
from memsvc.manager.records import WorkerRecord
from memsvc.manager.registry import Registry
from memsvc.manager.reports import SleepCall, Transition, WakeCall
from memsvc.manager.settings import ManagerSettings
from memsvc.manager.telemetry import TelemetryIngest
from memsvc.runtime.deadline import Deadline
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.vocabulary import Action, SleepLevel

log = logging.getLogger("memsvc.manager")
R = TypeVar("R")


def _in_doubt(exc: BaseException) -> bool:
    """The call ended without saying whether the worker ran it: no answer (the deadline passed, the
    connection broke, the caller left), CANCELLED, or UNKNOWN. Any other error is the worker's answer:
    it refused, and nothing changed."""
    if isinstance(exc, RelayedError):
        return exc.status_name == "UNKNOWN"
    return isinstance(exc, asyncio.CancelledError | Unavailable | Cancelled)


def _may_resend(exc: BaseException) -> bool:
    """Sending the call again may succeed: it got no answer in time, or did not start before its first
    caller's deadline. (A cancellation is never swallowed: its callers all left.)"""
    return isinstance(exc, Unavailable | Cancelled)


class WorkerCalls:
    STATUS_CALL_S = 5.0
    """Deadline of one status call while settling."""
    STATUS_PAUSE_FIRST_S = 0.02
    STATUS_PAUSE_MAX_S = 1.0
    """Pauses between status calls while the worker still reports a transition: doubling, at most this."""
    RESEND_MIN_S = 5.0
    """A call without an answer is sent again only with at least this much of its deadline left."""
    RESEND_PAUSE_S = 0.1
    """The pause before sending it again (the worker, or the path to it, just failed)."""

    def __init__(self, registry: Registry, ingest: TelemetryIngest, settings: ManagerSettings) -> None:
        self._registry = registry
        self._ingest = ingest
        self._settings = settings
        self.closing = False
        """Set when the manager shuts down: settling stops at once instead of polling a worker."""

    def timeout(self, deadline: Deadline) -> float:
        """Seconds this call may take: the manager's limit, or less if the caller's deadline is near."""
        t = self._settings.rpc_timeout
        left = deadline.remaining()
        if left is not None:
            t = min(t, left)
            if t <= 0:
                raise Unavailable("deadline exceeded before the worker could be called")
        return t

    async def sleep(
        self,
        rec: WorkerRecord,
        level: SleepLevel | None,
        actions: Mapping[str, Action],
        request_id: str,
        deadline: Deadline,
        why: str,
        pause: bool = False,
    ) -> Transition:
        call = SleepCall(level, dict(actions), request_id, pause)
        rec.sleeping = True
        try:
            with rec.caused_by(why):
                resp = await self._answered(rec, request_id, deadline, lambda link, timeout: link.sleep(call, timeout))
                await self._ingest.set_status(rec, resp.status, True, why)
        finally:
            rec.sleeping = False
        return resp.transition

    async def wake(
        self, rec: WorkerRecord, tags: list[str], request_id: str, deadline: Deadline, why: str
    ) -> Transition:
        call = WakeCall(tuple(tags), request_id)
        with rec.caused_by(why):
            resp = await self._answered(rec, request_id, deadline, lambda link, timeout: link.wake_up(call, timeout))
            await self._ingest.set_status(rec, resp.status, True, why)
        return resp.transition

    async def swap_blocks(
        self, rec: WorkerRecord, request: worker_pb.SwapBlocksRequest, deadline: Deadline
    ) -> worker_pb.SwapBlocksResponse:
        """Forwarded as the worker's message (see WorkerLink.swap_blocks)."""
        return await self._registry.link(rec).swap_blocks(request, self.timeout(deadline))

    async def _answered(
        self, rec: WorkerRecord, request_id: str, deadline: Deadline, call: Callable[[WorkerLink, float], Awaitable[R]]
    ) -> R:
        """``call``'s answer; without one, the worker's real state first (see the module).

        A call shared by several callers (one request_id) works to the latest of their deadlines,
        which may have moved out since the call was sent with the first caller's: when it ends without
        an answer and there is time left, it is sent again with the same request_id, which the worker
        answers with the first attempt's result if that ran (its replay cache), or runs now if not.
        """
        while True:
            link = self._registry.link(rec)
            timeout = self.timeout(deadline)  # a deadline already passed: nothing was sent
            try:
                return await self._counted(rec, call(link, timeout))
            except BaseException as exc:
                if not _in_doubt(exc):
                    raise
                await asyncio.shield(self._wait_transition_end(rec, link))
                left = deadline.remaining()
                resend = request_id and rec.reachable and left is not None and left > self.RESEND_MIN_S
                if self.closing or not resend or not _may_resend(exc):
                    raise
                log.info("worker %s: sending request %s again (%.0f s left)", rec.worker_id, request_id, left)
            await asyncio.sleep(self.RESEND_PAUSE_S)

    async def _counted(self, rec: WorkerRecord, call: Awaitable[R]) -> R:
        """``call``, counted in ``memsvc_worker_calls_in_flight`` while it has no answer."""
        in_flight = self._ingest.metrics.calls.labels(rec.worker_id)
        in_flight.inc()
        try:
            return await call
        finally:
            in_flight.dec()

    async def _wait_transition_end(self, rec: WorkerRecord, link: WorkerLink) -> None:
        """Ask the worker until no transition is in progress there, applying each answer."""
        limit = self._settings.rpc_timeout
        give_up = time.monotonic() + limit
        pause = self.STATUS_PAUSE_FIRST_S
        while not self.closing:
            try:
                status = await link.status(self.STATUS_CALL_S)
            except MemsvcError as exc:
                await self._ingest.set_status(rec, None, False, f"no answer after a call without one: {exc}")
                return
            await self._ingest.set_status(rec, status, True, rec.cause or "status after a call without an answer")
            if not status.transition_in_progress:
                return
            if time.monotonic() > give_up:
                log.error("worker %s still reports a transition after %.0f s", rec.worker_id, limit)
                await self._ingest.set_status(rec, None, False, "a transition that does not end")
                return
            await asyncio.sleep(pause)
            pause = min(pause * 2, self.STATUS_PAUSE_MAX_S)


__all__ = ["WorkerCalls"]
