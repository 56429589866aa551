"""A small synchronous client of the manager, for the CLI and for scripts.

Other services can use the generated stubs directly; this adds defaults (deadlines, names) and turns
failed calls into memsvc.errors exceptions with the server's message.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from memsvc.runtime.auth import Security, channel
from memsvc.runtime.rpc_errors import from_rpc_error
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc
from memsvc.vocabulary import WorkerState

DEFAULT_MANAGER = "127.0.0.1:50051"


def manager_address(explicit: str | None = None) -> str:
    return explicit or os.environ.get("MEMSVC_MANAGER", DEFAULT_MANAGER)


def worker_name(worker: str) -> str:
    return worker if worker.startswith("workers/") else f"workers/{worker}"


class ManagerClient:
    """``security`` (memsvc.runtime.auth): TLS, client certificate and token; default: the MEMSVC_* variables
    (MEMSVC_TOKEN_FILE or MEMSVC_TOKEN, MEMSVC_TLS_CA, MEMSVC_TLS_CLIENT_CERT/KEY), else plaintext."""

    def __init__(self, address: str | None = None, timeout: float = 10.0, security: Security | None = None) -> None:
        self.address = manager_address(address)
        self.timeout = timeout
        self.channel = channel(self.address, security if security is not None else Security.from_args(None))
        self.stub = manager_grpc.MemoryManagerServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> ManagerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        try:
            return getattr(self.stub, method)(request, timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def workers(self) -> list[manager_pb.Worker]:
        out: list[manager_pb.Worker] = []
        token = ""
        while True:
            r = self._call("ListWorkers", manager_pb.ListWorkersRequest(page_size=1000, page_token=token))
            out.extend(r.workers)
            token = r.next_page_token
            if not token:
                return out

    def worker(self, worker: str) -> manager_pb.Worker:
        return self._call("GetWorker", manager_pb.GetWorkerRequest(name=worker_name(worker))).worker  # type: ignore[no-any-return]

    def sleep(self, worker: str, level: int = 0, timeout: float = 600.0) -> manager_pb.SleepWorkerResponse:
        return self._call("SleepWorker", manager_pb.SleepWorkerRequest(name=worker_name(worker), level=level), timeout)  # type: ignore[arg-type, no-any-return]

    def wake(self, worker: str, tags: Sequence[str] = (), timeout: float = 600.0) -> manager_pb.WakeWorkerResponse:
        request = manager_pb.WakeWorkerRequest(name=worker_name(worker), tags=list(tags))
        return self._call("WakeWorker", request, timeout)  # type: ignore[no-any-return]

    def acquire(
        self,
        worker: str,
        ttl_s: float = 60.0,
        holder: str = "",
        timeout: float = 600.0,
        keep_alive_s: float | None = None,
    ) -> manager_pb.Lease:
        """A lease (waking the worker); ``keep_alive_s``: its idle time once this lease is the last to
        end (0: sleep at once, negative: no idle sleep; None: the policy's)."""
        req = manager_pb.AcquireWorkerRequest(name=worker_name(worker), holder=holder)
        if ttl_s > 0:  # 0: the manager's default (an explicit 0 s ttl is refused)
            req.ttl.FromNanoseconds(int(ttl_s * 1e9))
        if keep_alive_s is not None:
            req.keep_alive.FromNanoseconds(int(keep_alive_s * 1e9))
        return self._call("AcquireWorker", req, timeout).lease  # type: ignore[no-any-return]

    def leases(self, worker: str = "") -> list[manager_pb.Lease]:
        """Every live lease (of ``worker`` only, when given), following the pages."""
        out: list[manager_pb.Lease] = []
        token = ""
        while True:
            req = manager_pb.ListLeasesRequest(
                name=worker_name(worker) if worker else "", page_size=1000, page_token=token
            )
            r = self._call("ListLeases", req)
            out.extend(r.leases)
            token = r.next_page_token
            if not token:
                return out

    def release(self, lease_id: str) -> manager_pb.Worker:
        return self._call("ReleaseWorker", manager_pb.ReleaseWorkerRequest(lease_id=lease_id)).worker  # type: ignore[no-any-return]

    def deregister(self, worker: str) -> None:
        """Forget a worker (DeregisterWorker): refused while it holds a lease; one that registers
        again is known again."""
        self._call("DeregisterWorker", manager_pb.DeregisterWorkerRequest(name=worker_name(worker)))

    def watch(self) -> WatchStream:
        """WatchWorkers as an iterator of its messages, which :meth:`WatchStream.cancel` ends."""
        return WatchStream(self.stub.WatchWorkers(manager_pb.WatchWorkersRequest()))


class WatchStream:
    """A WatchWorkers stream: iterate for its messages; :meth:`cancel` (from any thread, or a signal
    handler) ends the iteration cleanly, and the CLI's Ctrl-C does that rather than raise
    KeyboardInterrupt wherever the main thread happens to be (inside a lock of the live table, a
    loaded machine showed, the exit then waited for ever)."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def cancel(self) -> None:
        self._call.cancel()

    def __iter__(self) -> Iterator[manager_pb.WatchWorkersResponse]:
        try:
            yield from self._call
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                raise from_rpc_error(err) from None


def state_name(state: int) -> str:
    return WorkerState.of(state).label


def human_bytes(n: int) -> str:
    """``n`` bytes in IEC units, three significant digits: ``0 B``, ``512 B``, ``6.00 MiB``, ``15.0 GiB``."""
    if abs(n) < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if abs(size) < 1024 or unit == "TiB":
            break
    digits = 0 if abs(size) >= 100 else 1 if abs(size) >= 10 else 2
    return f"{size:.{digits}f} {unit}"
