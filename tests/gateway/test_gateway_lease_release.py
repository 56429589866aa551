"""A gateway request's lease lasts as long as its request, no longer (issue 25 item 3), with real
processes: a manager on a fixed address and SQLite file (so it can be killed and started again on
both, restoring the leases it had), a worker serving synthetic:tiny, and ``memsvc gateway``.

- A release the manager misses (killed while the request ran) is retried until the restarted manager
  takes it; it used to be dropped, and the restored lease held the worker awake for its whole TTL (no
  idle sleep, no eviction). The gateway's lease TTL is 120 s here, so only the retry can release it
  within the test's wait.
- A response that runs for several lease TTLs keeps its lease (the gateway renews it, moving its
  expire_time) and releases it when it ends.

The worker is stopped (SIGSTOP) while the request runs, to hold it open for as long as the test needs."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from gatewayproc import GatewayProcess, LeaseManagerDouble
from managerproc import ManagerProcess, seconds, wait_for
from upproc import free_port
from workerproc import WorkerProcess

from memsvc.gateway.backends import LAST_RELEASE_TIMEOUT_S, Backends, Served
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb

MODEL = "synthetic:tiny"
WORKER = "workers/lw0"


class Stack:
    """A manager that can be killed and started again on its address and database, a worker, a gateway."""

    def __init__(self, tmp_path: Path, lease_ttl: float) -> None:
        self.db = tmp_path / "manager.db"
        self.listen = f"127.0.0.1:{free_port()}"
        self.manager = ManagerProcess(self.db, listen=self.listen).start()
        self.worker = WorkerProcess(["--manager", self.manager.address, "--worker-id", "lw0"]).start()
        self.gateway = GatewayProcess(self.manager.address, ["--lease-ttl", f"{lease_ttl:g}"]).start()
        wait_for(
            lambda: self.manager.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers,
            lambda ws: any(x.status.model.served_model_name == MODEL for x in ws),
            what="registration",
            timeout=60,
        )

    def restart_manager(self) -> None:
        self.manager.kill()
        self.manager = ManagerProcess(self.db, listen=self.listen).start()

    def leases(self) -> list[manager_pb.Lease]:
        return list(self.manager.stub.ListLeases(manager_pb.ListLeasesRequest(name=WORKER), timeout=10).leases)

    def lease_count(self) -> int:
        return int(self.manager.stub.GetWorker(manager_pb.GetWorkerRequest(name=WORKER), timeout=10).worker.lease_count)

    def log(self, text: str) -> list[str]:
        """The gateway's log lines that contain ``text``."""
        return [line for line in self.gateway.stderr_text().splitlines() if text in line]

    def close(self) -> None:
        self.gateway.kill()
        self.worker.kill()
        self.manager.kill()


@contextlib.contextmanager
def stack(tmp_path: Path, lease_ttl: float) -> Iterator[Stack]:
    s = Stack(tmp_path, lease_ttl)
    try:
        yield s
    finally:
        s.close()


def request(url: str, stream: bool, max_tokens: int) -> tuple[int, list[str]]:
    """A completion through the gateway, read to the end of its body: its status and its SSE data lines."""
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    with httpx.Client(base_url=url, timeout=240) as http, http.stream("POST", "/v1/completions", json=body) as r:
        return r.status_code, [line for line in r.iter_lines() if line.startswith("data: ")]


def ended(answer: Future[tuple[int, list[str]]], stream: bool) -> None:
    status, events = answer.result()
    assert status == 200, events
    assert not stream or events[-1] == "data: [DONE]", events[-3:]


@contextlib.contextmanager
def stopped(worker: WorkerProcess) -> Iterator[None]:
    """``worker`` stopped (SIGSTOP): a request on it waits for its next token for as long as this lasts."""
    assert worker.proc is not None
    worker.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        worker.proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
def test_a_release_the_manager_missed_lands_once_it_is_back(tmp_path: Path, stream: bool) -> None:
    with stack(tmp_path, lease_ttl=120) as s, ThreadPoolExecutor(1) as pool:
        answer = pool.submit(request, s.gateway.url, stream, 100)  # seconds of tokens: synthetic:tiny is slow
        wait_for(s.lease_count, lambda n: n == 1, what="the request's lease")
        with stopped(s.worker):
            assert s.lease_count() == 1, "the request ended before the test could stop its worker"
            s.manager.kill()
        ended(answer, stream)  # after the release was tried (before a plain answer, before a stream's end)
        # the manager was down when the request ended: its release failed, and is being retried
        assert len(s.log("releasing lease")) == 1, s.gateway.stderr_text()[-4000:]
        s.restart_manager()  # it restores the lease from its store
        wait_for(s.lease_count, lambda n: n == 0, what="the retried release to reach the restarted manager", timeout=45)
        wait_for(lambda: s.log("released, after"), lambda lines: len(lines) == 1, what="its log line")
        assert len(s.log("releasing lease")) == 1, "logged once, not per attempt"


def test_a_stream_longer_than_the_lease_ttl_keeps_its_lease_renewed(tmp_path: Path) -> None:
    ttl = 10.0  # renewed every 3.3 s: a loaded machine stalls a process's loop for 2 s at times
    with stack(tmp_path, lease_ttl=ttl) as s, ThreadPoolExecutor(1) as pool:
        answer = pool.submit(request, s.gateway.url, True, 100)
        wait_for(s.lease_count, lambda n: n == 1, what="the stream's lease")
        with stopped(s.worker):
            leases = s.leases()
            assert len(leases) == 1, "the stream ended before the test could stop its worker"
            first = leases[0]
            expires = seconds(first.expire_time)

            def held() -> float:
                """The lease's expire_time, asserting that it is the same lease, still held."""
                now = time.time()
                leases = s.leases()
                lapsed = f"the lease lapsed {now - expires:.1f} s after its first expiry"
                assert [x.lease_id for x in leases] == [first.lease_id], lapsed
                return seconds(leases[0].expire_time)

            # renewed while it streams: held past its first expiry and one more TTL, which it would
            # not have been without renewals
            wait_for(
                held,
                lambda e: e >= expires + 2 * ttl and time.time() > expires + ttl,
                what="the lease to be renewed past two more TTLs",
                timeout=60,
            )
        ended(answer, True)
        assert s.lease_count() == 0, "released before the stream's body ended"
        assert not s.log("is gone") and not s.log("renewing lease"), s.gateway.stderr_text()[-4000:]


class Refuses(LeaseManagerDouble):
    """A manager whose AcquireWorker grants at once and whose ReleaseWorker always fails with ``code``."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code
        self.releases = 0

    async def acquire(self, request: manager_pb.AcquireWorkerRequest, context: Any) -> manager_pb.AcquireWorkerResponse:
        r = manager_pb.AcquireWorkerResponse()
        r.lease.lease_id = request.lease_id or "lease-0"
        return r

    async def release(self, request: manager_pb.ReleaseWorkerRequest, context: Any) -> manager_pb.ReleaseWorkerResponse:
        self.releases += 1
        await context.abort(self.code, "refused")
        raise AssertionError("abort returned")


@pytest.mark.asyncio
@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND], ids=lambda code: code.name)
async def test_a_failed_release_is_retried_until_the_gateway_stops_and_a_missing_lease_is_not(
    code: grpc.StatusCode,
) -> None:
    """UNAVAILABLE: tried again after 0.5 s, and so on; the gateway's close cuts the pause short with
    one last attempt and returns at once. NOT_FOUND: the lease is gone already, one attempt in all."""
    manager = Refuses(code)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((manager.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    backends = Backends(f"127.0.0.1:{port}", lease_ttl_s=60)
    loop = asyncio.get_running_loop()
    try:
        async with backends.lease(
            Served(WORKER, "127.0.0.1:1", common_pb.WORKER_STATE_AWAKE, 0), "gateway req-1", 10.0
        ):
            pass
        assert manager.releases == 1  # the first attempt, before the block's end returns
        if code == grpc.StatusCode.UNAVAILABLE:
            deadline = loop.time() + 30
            while manager.releases < 2:
                assert loop.time() < deadline, "the failed release was not tried again"
                await asyncio.sleep(0.02)
        tried = manager.releases
        started = loop.time()
        await backends.close()
        assert loop.time() - started < LAST_RELEASE_TIMEOUT_S + 3
        if code == grpc.StatusCode.UNAVAILABLE:
            assert manager.releases > tried, "no last attempt at close"
        else:
            assert manager.releases == 1
    finally:
        await backends.close()
        await server.stop(0)
