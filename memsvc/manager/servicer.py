"""MemoryManagerService: proto in, a call to the manager's parts, proto out (memsvc/manager/wire.py
translates both ways)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from memsvc.errors import InvalidArgument, NoLeader
from memsvc.manager import wire
from memsvc.manager.controller import Manager
from memsvc.manager.policy import check_clear
from memsvc.manager.records import worker_id_from_name
from memsvc.manager.watch import WatchEvent
from memsvc.runtime.deadline import caller_deadline
from memsvc.runtime.rpc_errors import Context
from memsvc.runtime.swap_forms import swap_block_count
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc
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
        m = self.manager
        rec = m.registry.register(request.worker_id, request.address, request.host)
        return wire.register_response_pb(rec.view(), m.settings.heartbeat_interval)

    async def DeregisterWorker(
        self, request: manager_pb.DeregisterWorkerRequest, context: Any
    ) -> manager_pb.DeregisterWorkerResponse:
        await self.manager.registry.deregister(request.name)
        return manager_pb.DeregisterWorkerResponse()

    async def ListWorkers(self, request: manager_pb.ListWorkersRequest, context: Any) -> manager_pb.ListWorkersResponse:
        page, token = self.manager.registry.page(request.page_size, request.page_token)
        return manager_pb.ListWorkersResponse(workers=[wire.view_pb(r.view()) for r in page], next_page_token=token)

    async def GetWorker(self, request: manager_pb.GetWorkerRequest, context: Any) -> manager_pb.GetWorkerResponse:
        return manager_pb.GetWorkerResponse(worker=wire.view_pb(self.manager.registry.get(request.name).view()))

    async def SleepWorker(self, request: manager_pb.SleepWorkerRequest, context: Any) -> manager_pb.SleepWorkerResponse:
        level = SleepLevel.parse(request.level)
        actions = actions_from_proto(request.tag_actions)
        deadline = caller_deadline(context)
        worker, t = await self.manager.transitions.sleep_worker(
            request.name, level, actions, request.request_id, deadline
        )
        return manager_pb.SleepWorkerResponse(worker=wire.view_pb(worker), transition=wire.transition_pb(t))

    async def WakeWorker(self, request: manager_pb.WakeWorkerRequest, context: Any) -> manager_pb.WakeWorkerResponse:
        worker, t = await self.manager.transitions.wake_worker(
            request.name, list(request.tags), request.request_id, caller_deadline(context)
        )
        return manager_pb.WakeWorkerResponse(worker=wire.view_pb(worker), transition=wire.transition_pb(t))

    async def SwapWorkerBlocks(
        self, request: manager_pb.SwapWorkerBlocksRequest, context: Any
    ) -> manager_pb.SwapWorkerBlocksResponse:
        # The shape first, by field lengths alone: an oversized request costs no pass over its blocks.
        # The worker checks the ids; the request is forwarded as the worker's message (WorkerLink.swap_blocks).
        swap_block_count(
            len(request.pairs),
            len(request.src_blocks),
            len(request.dst_blocks),
            len(request.src_blocks_u32le),
            len(request.dst_blocks_u32le),
        )
        m = self.manager
        m.registry.get(request.name)
        r = await m.transitions.swap_blocks(request.name, wire.swap_request_pb(request), caller_deadline(context))
        return wire.swap_response_pb(r)

    async def AcquireWorker(
        self, request: manager_pb.AcquireWorkerRequest, context: Any
    ) -> manager_pb.AcquireWorkerResponse:
        ttl, keep_alive = wire.acquire_times(request)
        lease, rec = await self.manager.leases.acquire(
            request.name,
            ttl,
            request.holder,
            request.lease_id,
            request.request_id,
            caller_deadline(context),
            keep_alive,
        )
        return manager_pb.AcquireWorkerResponse(lease=wire.lease_pb(lease), worker=wire.view_pb(rec.view()))

    async def ReleaseWorker(
        self, request: manager_pb.ReleaseWorkerRequest, context: Any
    ) -> manager_pb.ReleaseWorkerResponse:
        rec = self.manager.leases.release(request.lease_id)
        return manager_pb.ReleaseWorkerResponse(worker=wire.view_pb(rec.view()))

    async def ListLeases(self, request: manager_pb.ListLeasesRequest, context: Any) -> manager_pb.ListLeasesResponse:
        page, token = self.manager.leases.page(request.name, request.page_size, request.page_token)
        return manager_pb.ListLeasesResponse(leases=[wire.lease_pb(x) for x in page], next_page_token=token)

    async def GetPolicy(self, request: manager_pb.GetPolicyRequest, context: Any) -> manager_pb.GetPolicyResponse:
        m = self.manager
        scope = m.registry.get(request.name).name if request.name else None
        return manager_pb.GetPolicyResponse(policy=wire.policy_pb(m.policies.effective(scope)))

    async def UpdatePolicy(
        self, request: manager_pb.UpdatePolicyRequest, context: Any
    ) -> manager_pb.UpdatePolicyResponse:
        clear = list(request.clear_fields)
        if not request.HasField("policy") and not clear:
            raise InvalidArgument("policy is required (or clear_fields, to remove a worker's overrides)")
        m = self.manager
        check_clear(clear, for_worker=bool(request.name))  # before the fields, as it always was
        paths = list(request.update_mask.paths)
        fields = wire.policy_fields(request.policy, paths) if request.HasField("policy") else {}
        return manager_pb.UpdatePolicyResponse(policy=wire.policy_pb(m.update_policy(request.name, fields, clear)))

    async def WatchWorkers(
        self, request: manager_pb.WatchWorkersRequest, context: Context
    ) -> AsyncIterator[manager_pb.WatchWorkersResponse]:
        registry, hub = self.manager.registry, self.manager.hub
        ids = {worker_id_from_name(n) for n in request.names}
        for wid in ids:
            registry.get(wid)  # NOT_FOUND before the stream starts
        queue = hub.subscribe()
        try:
            for rec in registry:
                if not ids or rec.worker_id in ids:
                    yield wire.watch_pb(WatchEvent(rec.view()))
            while True:
                event = await queue.get()
                if not isinstance(event, WatchEvent):  # CLOSED: the manager is stopping
                    return
                if not ids or event.worker_id in ids:
                    yield wire.watch_pb(event)
        finally:
            hub.unsubscribe(queue)


__all__ = ["MemoryManagerServicer"]
