"""A gateway request whose client leaves while its AcquireWorker is in flight must not leak the
lease. The manager may already have granted it, with the answer still on its way: a gateway that
cancelled the call then lost the lease id, and the lease held the model awake for its whole TTL
(no idle sleep, no eviction for the other models on its device).

The manager here is a gRPC server whose AcquireWorker grants at once and answers late, so the
client's leaving falls into exactly that window; the gateway's side (memsvc.gateway.backends) is
the real one, over a real channel."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from gatewayproc import LeaseManagerDouble

from memsvc.gateway.backends import Backends, Served
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb

ANSWER_DELAY_S = 0.5


class LateAnswers(LeaseManagerDouble):
    """Grants every AcquireWorker at once and answers ANSWER_DELAY_S later; records releases."""

    def __init__(self) -> None:
        self.granted: list[str] = []
        self.released: list[str] = []
        self.grant = asyncio.Event()

    async def acquire(
        self, request: manager_pb.AcquireWorkerRequest, context: object
    ) -> manager_pb.AcquireWorkerResponse:
        lease_id = f"lease-{len(self.granted)}"
        self.granted.append(lease_id)
        self.grant.set()
        with contextlib.suppress(asyncio.CancelledError):  # the grant stands: its answer is lost
            await asyncio.sleep(ANSWER_DELAY_S)
        r = manager_pb.AcquireWorkerResponse()
        r.lease.lease_id = lease_id
        return r

    async def release(
        self, request: manager_pb.ReleaseWorkerRequest, context: object
    ) -> manager_pb.ReleaseWorkerResponse:
        self.released.append(request.lease_id)
        return manager_pb.ReleaseWorkerResponse()


@pytest.mark.asyncio
async def test_a_caller_that_leaves_mid_acquire_leaks_no_lease() -> None:
    manager = LateAnswers()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((manager.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    backends = Backends(f"127.0.0.1:{port}")
    try:
        served = Served("workers/w0", "127.0.0.1:1", common_pb.WORKER_STATE_ASLEEP, 0)
        stack = contextlib.AsyncExitStack()
        leasing = asyncio.ensure_future(stack.enter_async_context(backends.lease(served, "gateway req-1", 10.0)))
        await asyncio.wait_for(manager.grant.wait(), 5)
        leasing.cancel()  # the client left: granted, the answer not yet here
        with pytest.raises(asyncio.CancelledError):
            await leasing
        await stack.aclose()
        for _ in range(200):
            if manager.released:
                break
            await asyncio.sleep(0.02)
        assert manager.granted == ["lease-0"]
        assert manager.released == ["lease-0"], "the lease granted to a caller that left was not released"
    finally:
        await backends.close()
        await server.stop(0)
