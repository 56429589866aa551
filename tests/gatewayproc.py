"""A real ``memsvc gateway`` process for the gateway tests: started on port 0, its bound address read
from its "listening on" line, stopped with SIGTERM (or killed, whatever happened in the test)."""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Sequence
from typing import Any

import grpc
from childproc import Proc, ProcError

from memsvc.v1 import memory_manager_service_pb2 as manager_pb

_LISTENING = re.compile(r"^memsvc gateway listening on (?P<address>\S+)$")
READY_TIMEOUT = 60.0


class GatewayStartError(ProcError):
    """The gateway exited or did not report its address in time."""


class GatewayProcess(Proc):
    stop_timeout = 30.0

    def __init__(self, manager: str, args: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        argv = [sys.executable, "-m", "memsvc.cli", "gateway", "--listen", "127.0.0.1:0", "--manager", manager, *args]
        super().__init__(argv, name="gateway", new_session=False, env=env)
        self.url = ""

    def start(self) -> GatewayProcess:
        super().start()
        try:
            found = self.wait_lines([_LISTENING], READY_TIMEOUT, GatewayStartError, "listening")
            self.url = f"http://{found[0]['address']}"
        except BaseException:
            self.kill()
            raise
        return self

    def stop(self) -> int:
        try:
            return self.signal_and_wait(signal.SIGTERM)
        except ProcError as exc:
            raise AssertionError(str(exc)) from None


class LeaseManagerDouble:
    """An in-process stand-in for the manager's two lease RPCs (AcquireWorker, ReleaseWorker), for
    the gateway's lease code against answers a real manager gives only by chance; a subclass says
    what each answers."""

    SERVICE = manager_pb.DESCRIPTOR.services_by_name["MemoryManagerService"].full_name

    async def acquire(self, request: manager_pb.AcquireWorkerRequest, context: Any) -> manager_pb.AcquireWorkerResponse:
        raise NotImplementedError

    async def release(self, request: manager_pb.ReleaseWorkerRequest, context: Any) -> manager_pb.ReleaseWorkerResponse:
        raise NotImplementedError

    def handler(self) -> grpc.GenericRpcHandler:
        """The two RPCs the gateway's lease uses, served under the manager's service name."""
        rpcs: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "AcquireWorker": grpc.unary_unary_rpc_method_handler(
                self.acquire,
                manager_pb.AcquireWorkerRequest.FromString,
                manager_pb.AcquireWorkerResponse.SerializeToString,
            ),
            "ReleaseWorker": grpc.unary_unary_rpc_method_handler(
                self.release,
                manager_pb.ReleaseWorkerRequest.FromString,
                manager_pb.ReleaseWorkerResponse.SerializeToString,
            ),
        }
        return grpc.method_handlers_generic_handler(self.SERVICE, rpcs)
