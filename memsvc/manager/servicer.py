"""MemoryManagerService: proto in, Manager call, proto out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from memsvc.errors import InvalidArgument, NoLeader
from memsvc.manager.controller import Manager
from memsvc.manager.records import worker_id_from_name
from memsvc.manager.watch import CLOSED
from memsvc.runtime.deadline import caller_deadline
from memsvc.runtime.rpc_errors import Context
from memsvc.runtime.swap_forms import swap_block_count
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.vocabulary import SleepLevel, actions_from_proto


class MemoryManagerServicer(manager_grpc.MemoryManagerServiceServicer):
    """Serves once it leads: at once for one manager, on taking the lead for a replica (until then a
    replica forwards every call, memsvc/manager/replicas.py, and none reaches this)."""

    def __init__(self, manager: Manager | None = None) -> None:
        self._manager = manager

    def lead(self, manager: Manager) -> None:
        self._manager = manager

    @property
    def manager(self) -> Manager:
        if self._manager is None:
            raise NoLeader("this manager replica is taking the lead: try again", retry_after_s=1.0)
        return self._manager

    async def RegisterWorker(
        self, request: manager_pb.RegisterWorkerRequest, context: Any
    ) -> manager_pb.RegisterWorkerResponse:
        rec = await self.manager.register(request.worker_id, request.address, request.host)
        resp = manager_pb.RegisterWorkerResponse(worker=rec.to_proto())
        resp.heartbeat_interval.FromNanoseconds(int(self.manager.settings.heartbeat_interval * 1e9))
        return resp

    async def DeregisterWorker(
        self, request: manager_pb.DeregisterWorkerRequest, context: Any
    ) -> manager_pb.DeregisterWorkerResponse:
        await self.manager.deregister(request.name)
        return manager_pb.DeregisterWorkerResponse()

    async def ListWorkers(self, request: manager_pb.ListWorkersRequest, context: Any) -> manager_pb.ListWorkersResponse:
        page, token = self.manager.list_workers(request.page_size, request.page_token)
        return manager_pb.ListWorkersResponse(workers=[r.to_proto() for r in page], next_page_token=token)

    async def GetWorker(self, request: manager_pb.GetWorkerRequest, context: Any) -> manager_pb.GetWorkerResponse:
        return manager_pb.GetWorkerResponse(worker=self.manager.get(request.name).to_proto())

    async def SleepWorker(self, request: manager_pb.SleepWorkerRequest, context: Any) -> manager_pb.SleepWorkerResponse:
        level = SleepLevel.parse(request.level)
        actions = actions_from_proto(request.tag_actions)
        deadline = caller_deadline(context)
        worker, t = await self.manager.sleep_worker(request.name, level, actions, request.request_id, deadline)
        return manager_pb.SleepWorkerResponse(worker=worker, transition=t)

    async def WakeWorker(self, request: manager_pb.WakeWorkerRequest, context: Any) -> manager_pb.WakeWorkerResponse:
        worker, t = await self.manager.wake_worker(
            request.name, list(request.tags), request.request_id, caller_deadline(context)
        )
        return manager_pb.WakeWorkerResponse(worker=worker, transition=t)

    async def SwapWorkerBlocks(
        self, request: manager_pb.SwapWorkerBlocksRequest, context: Any
    ) -> manager_pb.SwapWorkerBlocksResponse:
        # The shape first, by field lengths alone: an oversized request costs no pass over its blocks.
        # The worker checks the ids; the raw form passes through as two byte strings.
        swap_block_count(
            len(request.pairs),
            len(request.src_blocks),
            len(request.dst_blocks),
            len(request.src_blocks_u32le),
            len(request.dst_blocks_u32le),
        )
        self.manager.get(request.name)
        req = worker_pb.SwapBlocksRequest(
            direction=request.direction,
            pairs=request.pairs,
            method=request.method,
            src_blocks=request.src_blocks,
            dst_blocks=request.dst_blocks,
            src_blocks_u32le=request.src_blocks_u32le,
            dst_blocks_u32le=request.dst_blocks_u32le,
        )
        r = await self.manager.swap_blocks(request.name, req, caller_deadline(context))
        return manager_pb.SwapWorkerBlocksResponse(
            moved_bytes=r.moved_bytes,
            duration=r.duration,
            gigabytes_per_second=r.gigabytes_per_second,
            kv_cache=r.kv_cache,
        )

    async def AcquireWorker(
        self, request: manager_pb.AcquireWorkerRequest, context: Any
    ) -> manager_pb.AcquireWorkerResponse:
        if request.ttl.seconds < 0 or request.ttl.nanos < 0:
            raise InvalidArgument("ttl must not be negative", metadata={"field": "ttl"})
        if request.HasField("ttl") and request.ttl.ToNanoseconds() == 0:
            raise InvalidArgument(
                "ttl 0 s would expire at once: leave ttl unset for the default, or give a positive one",
                metadata={"field": "ttl"},
            )
        keep_alive = request.keep_alive.ToNanoseconds() / 1e9 if request.HasField("keep_alive") else None
        lease, rec = await self.manager.acquire(
            request.name,
            request.ttl.ToNanoseconds() / 1e9,
            request.holder,
            request.lease_id,
            request.request_id,
            caller_deadline(context),
            keep_alive,
        )
        return manager_pb.AcquireWorkerResponse(lease=lease.to_proto(), worker=rec.to_proto())

    async def ReleaseWorker(
        self, request: manager_pb.ReleaseWorkerRequest, context: Any
    ) -> manager_pb.ReleaseWorkerResponse:
        return manager_pb.ReleaseWorkerResponse(worker=self.manager.release(request.lease_id).to_proto())

    async def ListLeases(self, request: manager_pb.ListLeasesRequest, context: Any) -> manager_pb.ListLeasesResponse:
        page, token = self.manager.leases.page(request.name, request.page_size, request.page_token)
        return manager_pb.ListLeasesResponse(leases=[x.to_proto() for x in page], next_page_token=token)

    async def GetPolicy(self, request: manager_pb.GetPolicyRequest, context: Any) -> manager_pb.GetPolicyResponse:
        rec = self.manager.get(request.name) if request.name else None
        return manager_pb.GetPolicyResponse(policy=self.manager.policy(rec).to_proto())

    async def UpdatePolicy(
        self, request: manager_pb.UpdatePolicyRequest, context: Any
    ) -> manager_pb.UpdatePolicyResponse:
        clear = list(request.clear_fields)
        if not request.HasField("policy") and not clear:
            raise InvalidArgument("policy is required (or clear_fields, to remove a worker's overrides)")
        policy = request.policy if request.HasField("policy") else None
        p = self.manager.update_policy(request.name, policy, list(request.update_mask.paths), clear)
        return manager_pb.UpdatePolicyResponse(policy=p.to_proto())

    async def WatchWorkers(
        self, request: manager_pb.WatchWorkersRequest, context: Context
    ) -> AsyncIterator[manager_pb.WatchWorkersResponse]:
        ids = {worker_id_from_name(n) for n in request.names}
        for wid in ids:
            self.manager.get(wid)  # NOT_FOUND before the stream starts
        queue = self.manager.hub.subscribe()
        try:
            for rec in list(self.manager.workers.values()):
                if not ids or rec.worker_id in ids:
                    msg = manager_pb.WatchWorkersResponse(worker=rec.to_proto(), snapshot=rec.to_proto())
                    msg.time.GetCurrentTime()
                    yield msg
            while True:
                event = await queue.get()
                if event is CLOSED:
                    return
                if not ids or event.worker_id in ids:
                    yield event.message
        finally:
            self.manager.hub.unsubscribe(queue)


__all__ = ["MemoryManagerServicer"]
