"""The manager's calls that change a worker: each through the worker's link, bounded by the
caller's deadline, and each answer applied to the worker's record at once (the answer's status is
newer than any telemetry still on its way)."""

from __future__ import annotations

import time
from collections.abc import Mapping

from memsvc.errors import Unavailable
from memsvc.manager.records import WorkerRecord
from memsvc.manager.registry import Registry
from memsvc.manager.settings import ManagerSettings
from memsvc.manager.telemetry import TelemetryIngest
from memsvc.v1 import common_pb2 as c
from memsvc.v1 import model_worker_service_pb2 as w
from memsvc.vocabulary import Action, SleepLevel


class WorkerCalls:
    def __init__(self, registry: Registry, ingest: TelemetryIngest, settings: ManagerSettings) -> None:
        self._registry = registry
        self._ingest = ingest
        self._settings = settings

    def timeout(self, deadline: float | None) -> float:
        """Seconds this call may take: the manager's limit, or less if the caller's deadline is near."""
        t = self._settings.rpc_timeout
        if deadline is not None:
            t = min(t, deadline - time.monotonic())
            if t <= 0:
                raise Unavailable("deadline exceeded before the worker could be called")
        return t

    async def sleep(
        self,
        rec: WorkerRecord,
        level: SleepLevel | None,
        actions: Mapping[str, Action],
        request_id: str,
        deadline: float | None,
        why: str,
    ) -> c.TransitionStats:
        req = w.SleepRequest(
            level=level.proto if level is not None else c.SLEEP_LEVEL_UNSPECIFIED,
            tag_actions={t: a.proto for t, a in actions.items()},
            request_id=request_id,
        )
        resp = await self._registry.link(rec).sleep(req, self.timeout(deadline))
        await self._ingest.set_status(rec, resp.status, True, why)
        return resp.transition

    async def wake(
        self, rec: WorkerRecord, tags: list[str], request_id: str, deadline: float | None
    ) -> c.TransitionStats:
        resp = await self._registry.link(rec).wake_up(
            w.WakeUpRequest(tags=tags, request_id=request_id), self.timeout(deadline)
        )
        await self._ingest.set_status(rec, resp.status, True, "wake")
        return resp.transition

    async def swap_blocks(
        self, rec: WorkerRecord, request: w.SwapBlocksRequest, deadline: float | None
    ) -> w.SwapBlocksResponse:
        return await self._registry.link(rec).swap_blocks(request, self.timeout(deadline))


__all__ = ["WorkerCalls"]
