"""Faults with real processes and signals: each has a defined outcome (docs/operations.md, "When things fail").

- a worker SIGKILLed in the middle of a Sleep or a WakeUp: the manager marks it UNAVAILABLE and keeps
  its record; restarted with the same id it registers AWAKE and generates what it generated before;
- a worker SIGTERMed in the middle of a Sleep: the drain lets the Sleep finish, exit code 0;
- the manager SIGKILLed with a SleepWorker in flight, or while a lease lives: restarted on the same
  --db it still has the lease and re-learns the worker's real state;
- clients that vanish: a lease expires after its TTL; dead watchers (WatchWorkers, StreamTelemetry)
  are dropped and their connections closed, and later watches work;
- out of device memory on wake: allocator level (OutOfMemory, the host copy is kept, a later wake
  restores identical bytes) and service level (the manager's device budget: RESOURCE_EXHAUSTED,
  nothing changed, a later wake works);
- a corrupted host copy: the wake fails with IntegrityError naming the allocation.

Transitions are made long enough to interrupt by a 1 GiB KV cache that is offloaded (not discarded).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.field_mask_pb2 import FieldMask
from managerproc import Cluster, get, wait_for, wait_state
from workerproc import REPO_ROOT, WorkerProcess

from memsvc import DOMAIN, error_info
from memsvc.errors import IntegrityError, OutOfMemory
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc
from worker.allocator import AllocatorConfig, MemoryAllocator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals, /proc and the host backend")

MiB = 1 << 20
BIG = ["--model", "synthetic:small", "--kv-blocks", "16384", "--host-capacity", "2GiB", "--seed", "7"]
"""A worker whose full offload moves 1 GiB of KV cache (about 0.5-3 s on the host backend)."""
OFFLOAD_ALL = {"weights": common_pb.TAG_ACTION_OFFLOAD, "kv_cache": common_pb.TAG_ACTION_OFFLOAD}
PROMPT = [1, 2, 3, 4, 5]
CALL = 60.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cl = Cluster(tmp_path)
    try:
        yield cl
    finally:
        cl.close()


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def generate(stub: worker_grpc.ModelWorkerServiceStub) -> list[int]:
    return list(
        stub.Generate(worker_pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=8), timeout=CALL).token_ids
    )


class InFlight:
    """One blocking call run in a thread; ``result()`` is its response or the RpcError it raised."""

    def __init__(self, fn: Any) -> None:
        self._out: Any = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Any) -> None:
        try:
            self._out = fn()
        except grpc.RpcError as err:
            self._out = err

    def result(self, timeout: float = CALL) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the call did not end"
        return self._out


def wait_worker_state(address: str, state: common_pb.WorkerState.ValueType, timeout: float = 20.0) -> None:
    """Follow the worker's telemetry until it reports ``state`` (a state-change event or a snapshot)."""
    with grpc.insecure_channel(address) as ch:
        stream = worker_grpc.ModelWorkerServiceStub(ch).StreamTelemetry(
            worker_pb.StreamTelemetryRequest(), timeout=timeout
        )
        try:
            for msg in stream:
                if msg.HasField("state_change") and msg.state_change.to_state == state:
                    return
                if msg.HasField("snapshot") and msg.snapshot.state == state:
                    return
        finally:
            stream.cancel()
    raise AssertionError(f"telemetry ended before {common_pb.WorkerState.Name(state)}")


def start_when(address: str, state: common_pb.WorkerState.ValueType, call: Any) -> InFlight:
    """Start ``call`` and return once the worker reports ``state`` (the call is then in flight)."""
    seen = threading.Event()
    err: list[BaseException] = []

    def watch() -> None:
        try:
            wait_worker_state(address, state)
            seen.set()
        except BaseException as exc:  # noqa: BLE001 - reported below
            err.append(exc)
            seen.set()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    time.sleep(0.3)  # the telemetry stream is open and has sent its snapshot
    flight = InFlight(call)
    assert seen.wait(30), f"the worker never reported {common_pb.WorkerState.Name(state)}"
    if err:
        raise err[0]
    return flight


def assert_status(result: Any, *codes: grpc.StatusCode) -> None:
    assert isinstance(result, grpc.RpcError), f"the call succeeded: {result}"
    assert result.code() in codes, f"{result.code().name}: {result.details()}"


def worker_status(address: str) -> common_pb.WorkerStatus:
    with grpc.insecure_channel(address) as ch:
        return (
            worker_grpc.ModelWorkerServiceStub(ch)
            .GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10)
            .status
        )


def tag_view(tags: Iterable[common_pb.TagMemory]) -> dict[str, tuple[int, int, int]]:
    return {t.tag: (t.state, t.mapped_bytes, t.offloaded_bytes) for t in tags}


# ---------------------------------------------------------------- a worker dies


@pytest.mark.parametrize("during", ["sleep", "wake"])
def test_worker_sigkilled_mid_transition_is_unavailable_then_comes_back(cluster: Cluster, during: str) -> None:
    mp = cluster.manager()
    (wp,) = cluster.workers_up(mp, ["big"], BIG)
    reference = generate(wp.stub)  # what a fresh worker with this model and seed generates
    if during == "wake":
        wp.stub.Sleep(worker_pb.SleepRequest(tag_actions=OFFLOAD_ALL), timeout=CALL)
        wait_state(mp.stub, "big", common_pb.WORKER_STATE_ASLEEP)
    ch = wp.new_channel()
    stub = worker_grpc.ModelWorkerServiceStub(ch)
    if during == "sleep":
        flight = start_when(
            wp.address,
            common_pb.WORKER_STATE_SLEEPING,
            lambda: stub.Sleep(worker_pb.SleepRequest(tag_actions=OFFLOAD_ALL), timeout=CALL),
        )
    else:
        flight = start_when(
            wp.address, common_pb.WORKER_STATE_WAKING, lambda: stub.WakeUp(worker_pb.WakeUpRequest(), timeout=CALL)
        )
    assert wp.proc is not None
    wp.proc.kill()
    t_kill = time.monotonic()
    assert_status(flight.result(), grpc.StatusCode.UNAVAILABLE)  # the call in flight fails
    ch.close()
    wp.kill()

    # the manager notices within seconds and keeps the record
    wait_state(mp.stub, "big", common_pb.WORKER_STATE_UNAVAILABLE, timeout=10)
    assert time.monotonic() - t_kill < 10
    names = [x.name for x in mp.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers]
    assert "workers/big" in names
    with pytest.raises(grpc.RpcError) as ei:
        mp.stub.SleepWorker(
            manager_pb.SleepWorkerRequest(name="workers/big", level=common_pb.SLEEP_LEVEL_1), timeout=10
        )
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    info = error_info(ei.value)
    assert info is not None and info.domain == DOMAIN

    # restarted with the same id: a cold start, AWAKE, the same tokens
    again = cluster.worker_process(mp.address, "big", BIG).start()
    wk = wait_state(mp.stub, "big", common_pb.WORKER_STATE_AWAKE, timeout=30)
    assert wk.address == again.address
    assert generate(again.stub) == reference


def test_worker_sigterm_mid_sleep_drains_and_exits_zero() -> None:
    with WorkerProcess(BIG) as wp:
        ch = wp.new_channel()
        stub = worker_grpc.ModelWorkerServiceStub(ch)
        flight = start_when(
            wp.address,
            common_pb.WORKER_STATE_SLEEPING,
            lambda: stub.Sleep(worker_pb.SleepRequest(tag_actions=OFFLOAD_ALL), timeout=CALL),
        )
        wp.terminate()
        result = flight.result()
        ch.close()
        assert not isinstance(result, grpc.RpcError), (
            f"the drain cut the Sleep: {result.code().name} {result.details()}"
        )
        assert result.status.state == common_pb.WORKER_STATE_ASLEEP
        assert result.transition.moved_bytes >= 1 << 30
        assert wp.wait() == 0, wp.failure("exit code after SIGTERM")
        assert any(line.endswith("stopped") for line in wp.lines)


# ---------------------------------------------------------------- the manager dies


def test_manager_sigkilled_mid_sleepworker_relearns_the_finished_transition(cluster: Cluster, tmp_path: Path) -> None:
    address = free_address()
    mp = cluster.manager(listen=address)
    (wp,) = cluster.workers_up(mp, ["big"], BIG)
    mch = grpc.insecure_channel(mp.address)
    mstub = manager_grpc.MemoryManagerServiceStub(mch)
    flight = start_when(
        wp.address,
        common_pb.WORKER_STATE_SLEEPING,
        lambda: mstub.SleepWorker(
            manager_pb.SleepWorkerRequest(name="workers/big", tag_actions=OFFLOAD_ALL), timeout=CALL
        ),
    )
    mp.kill()
    assert_status(flight.result(), grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    mch.close()
    # the worker finishes the transition by itself
    wait_for(
        lambda: worker_status(wp.address),
        lambda s: s.state == common_pb.WORKER_STATE_ASLEEP,
        timeout=30,
        what="the worker to finish its Sleep",
    )
    own = worker_status(wp.address)
    assert tag_view(own.tags)["kv_cache"][0] == common_pb.TAG_STATE_OFFLOADED

    mp2 = cluster.manager(listen=address, db=mp.db)
    wk = wait_for(
        lambda: get(mp2.stub, "big"),
        lambda x: x.state == common_pb.WORKER_STATE_ASLEEP and tag_view(x.status.tags) == tag_view(own.tags),
        timeout=30,
        what="the restarted manager to re-learn the sleeper",
    )
    assert wk.address == wp.address
    # and it can drive it again
    mp2.stub.WakeWorker(manager_pb.WakeWorkerRequest(name="workers/big"), timeout=CALL)
    assert worker_status(wp.address).state == common_pb.WORKER_STATE_AWAKE


def test_manager_sigkilled_mid_lease_keeps_the_lease(cluster: Cluster) -> None:
    address = free_address()
    mp = cluster.manager(listen=address)
    cluster.workers_up(mp, ["w1"])
    lease = mp.stub.AcquireWorker(
        manager_pb.AcquireWorkerRequest(name="workers/w1", holder="fault-test", ttl=Duration(seconds=300)), timeout=CALL
    ).lease
    mp.kill()
    mp2 = cluster.manager(listen=address, db=mp.db)
    wk = wait_for(
        lambda: get(mp2.stub, "w1"),
        lambda x: x.state == common_pb.WORKER_STATE_AWAKE,
        timeout=30,
        what="w1 to be re-learned AWAKE",
    )
    assert wk.lease_count == 1
    with pytest.raises(grpc.RpcError) as ei:  # the lease still protects the worker
        mp2.stub.SleepWorker(
            manager_pb.SleepWorkerRequest(name="workers/w1", level=common_pb.SLEEP_LEVEL_1), timeout=CALL
        )
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    renewed = mp2.stub.AcquireWorker(
        manager_pb.AcquireWorkerRequest(name="workers/w1", lease_id=lease.lease_id), timeout=CALL
    )
    assert renewed.lease.lease_id == lease.lease_id
    assert (
        mp2.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease.lease_id), timeout=10).worker.lease_count
        == 0
    )


# ---------------------------------------------------------------- clients vanish

_CLIENT = r"""
import sys, time, grpc
from memsvc.v1 import memory_manager_service_pb2 as manager_pb, memory_manager_service_pb2_grpc as manager_grpc
from memsvc.v1 import model_worker_service_pb2 as worker_pb, model_worker_service_pb2_grpc as worker_grpc
kind, address = sys.argv[1], sys.argv[2]
ch = grpc.insecure_channel(address)
if kind == "lease":
    r = manager_grpc.MemoryManagerServiceStub(ch).AcquireWorker(
        manager_pb.AcquireWorkerRequest(name=sys.argv[3], ttl={"seconds": 2}, holder="vanishing"), timeout=60)
    print("lease", r.lease.lease_id, flush=True)
elif kind == "watch":
    it = manager_grpc.MemoryManagerServiceStub(ch).WatchWorkers(manager_pb.WatchWorkersRequest())
    next(it)
    ch2 = grpc.insecure_channel(sys.argv[3])
    it2 = worker_grpc.ModelWorkerServiceStub(ch2).StreamTelemetry(
        worker_pb.StreamTelemetryRequest(interval={"nanos": 50000000}))
    next(it2)
    print("watching", flush=True)
time.sleep(3600)
"""


def spawn_client(*args: str) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([sys.executable, "-c", _CLIENT, *args], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    assert line, f"client exited with {p.wait()}"
    return p, line


def test_client_that_vanishes_with_a_lease_loses_it_after_the_ttl(cluster: Cluster) -> None:
    mp = cluster.manager(metrics=True)
    cluster.workers_up(mp, ["w1"])
    client, line = spawn_client("lease", mp.address, "workers/w1")
    try:
        assert get(mp.stub, "w1").lease_count == 1
    finally:
        client.kill()  # gone without ReleaseWorker
        client.wait()
    wk = wait_state(mp.stub, "w1", common_pb.WORKER_STATE_AWAKE, timeout=15, extra=lambda x: x.lease_count == 0)
    assert wk.HasField("idle_since_time")  # the idle clock started
    assert mp.metrics()[("memsvc_leases_expired_total", frozenset())] == 1
    with pytest.raises(grpc.RpcError) as ei:
        mp.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=line.split()[1]), timeout=10)
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND


def open_fds(pid: int) -> int:
    """File descriptors open in ``pid`` and its children: with ``--rpc-front process`` the worker's
    public connections are its front child's."""
    children: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            children += [int(child) for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    n = len(os.listdir(f"/proc/{pid}/fd"))
    for child in children:
        with contextlib.suppress(OSError):  # a child that ended meanwhile holds none
            n += open_fds(child)
    return n


def test_vanished_watchers_are_dropped(cluster: Cluster) -> None:
    mp = cluster.manager()
    (wp,) = cluster.workers_up(mp, ["w1"])
    assert mp.proc is not None and wp.proc is not None
    mgr_proc, worker_proc = mp.proc, wp.proc
    # the start's last child first: the RPC front's writer of the decoding for stop strings (its
    # descriptors are the worker's, counted below) has ended once the worker read what it wrote
    wait_for(wp.stderr_text, lambda said: "its decoding read for stop strings" in said, timeout=60, what="the decoding")
    counts = []
    for _round in range(3):
        base = (open_fds(mp.proc.pid), open_fds(wp.proc.pid))
        clients = [spawn_client("watch", mp.address, wp.address)[0] for _ in range(4)]
        during = (open_fds(mp.proc.pid), open_fds(wp.proc.pid))
        assert during[0] > base[0] and during[1] > base[1]  # each watcher holds a connection
        for p in clients:
            p.kill()
            p.wait()

        def at_base(now: tuple[int, int], base: tuple[int, int] = base) -> bool:
            return now[0] <= base[0] and now[1] <= base[1]

        # the servers see the connections close and drop the subscribers: back to the baseline
        counts.append(
            wait_for(
                lambda: (open_fds(mgr_proc.pid), open_fds(worker_proc.pid)),
                at_base,
                timeout=15,
                what="the dead watchers' connections to close",
            )
        )
        assert mp.running and wp.running
    assert counts[-1][0] <= counts[0][0] and counts[-1][1] <= counts[0][1], f"growth: {counts}"
    # a new watcher still gets the snapshot and later events
    stream = mp.stub.WatchWorkers(manager_pb.WatchWorkersRequest(names=["workers/w1"]), timeout=60)
    try:
        assert next(stream).HasField("snapshot")
        mp.stub.SleepWorker(
            manager_pb.SleepWorkerRequest(name="workers/w1", level=common_pb.SLEEP_LEVEL_1), timeout=CALL
        )
        for msg in stream:
            if msg.HasField("state_change") and msg.state_change.to_state == common_pb.WORKER_STATE_ASLEEP:
                break
    finally:
        stream.cancel()
    tele = wp.stub.StreamTelemetry(worker_pb.StreamTelemetryRequest(), timeout=30)
    try:
        assert next(tele).snapshot.state == common_pb.WORKER_STATE_ASLEEP
    finally:
        tele.cancel()


# ---------------------------------------------------------------- out of device memory on wake


def _fill(t: Any, seed: int) -> str:
    import torch

    g = torch.Generator().manual_seed(seed)
    t.view(-1).view(torch.uint8).copy_(
        torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=g)
    )
    return hashlib.sha256(memoryview(t.view(-1).view(torch.uint8).numpy())).hexdigest()


def _digest(t: Any) -> str:
    import torch

    return hashlib.sha256(memoryview(t.view(-1).view(torch.uint8).numpy())).hexdigest()


@pytest.mark.parametrize("checksum", [False, True])
def test_allocator_wake_out_of_memory_keeps_the_host_copy(checksum: bool) -> None:
    import torch

    alloc = MemoryAllocator(
        AllocatorConfig(backend="host", host_capacity_bytes=16 * MiB, host_chunk_bytes=4 * MiB, checksum=checksum)
    )
    try:
        weights = alloc.empty(8 * MiB, torch.uint8, tag="weights")
        digest = _fill(weights, 1)
        alloc.sleep({"weights": "offload"})
        filler = alloc.empty(12 * MiB, torch.uint8, tag="filler")  # the device is now too full for the weights
        before = alloc.stats()
        with pytest.raises(OutOfMemory):
            alloc.wake_up(["weights"])
        after = alloc.stats()
        t0, t1 = before.tags["weights"], after.tags["weights"]
        assert (t1.state, t1.offloaded_bytes, t1.mapped_bytes) == ("offloaded", t0.offloaded_bytes, 0)
        assert t1.offloaded_bytes >= 8 * MiB
        assert after.device_free_bytes == before.device_free_bytes
        del filler
        gc.collect()
        alloc.wake_up(["weights"])
        assert alloc.stats().tags["weights"].state == "awake"
        assert _digest(weights) == digest
    finally:
        alloc.close()


def test_service_wake_over_the_device_budget_changes_nothing(cluster: Cluster) -> None:
    """The worker's own device cannot be filled from outside on the host backend (each worker process has
    its own simulated device, and nothing allocates in it while asleep), so the service-level case is the
    manager's device budget: RESOURCE_EXHAUSTED, the worker stays asleep with its host copy."""
    mp = cluster.manager()
    (wp,) = cluster.workers_up(mp, ["w1"])
    reference = generate(wp.stub)
    mp.stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/w1", level=common_pb.SLEEP_LEVEL_1), timeout=CALL)
    asleep = worker_status(wp.address)
    mp.stub.UpdatePolicy(
        manager_pb.UpdatePolicyRequest(
            name="workers/w1",
            policy=manager_pb.Policy(device_budget_bytes=MiB),
            update_mask=FieldMask(paths=["device_budget_bytes"]),
        ),
        timeout=10,
    )
    with pytest.raises(grpc.RpcError) as ei:
        mp.stub.WakeWorker(manager_pb.WakeWorkerRequest(name="workers/w1"), timeout=CALL)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = error_info(ei.value)
    assert info is not None and info.domain == DOMAIN and info.reason == "OUT_OF_MEMORY"
    now = worker_status(wp.address)
    assert now.state == common_pb.WORKER_STATE_ASLEEP and tag_view(now.tags) == tag_view(asleep.tags)
    assert sum(t.offloaded_bytes for t in now.tags) > 0
    mp.stub.UpdatePolicy(
        manager_pb.UpdatePolicyRequest(
            name="workers/w1",
            policy=manager_pb.Policy(device_budget_bytes=0),
            update_mask=FieldMask(paths=["device_budget_bytes"]),
        ),
        timeout=10,
    )
    mp.stub.WakeWorker(manager_pb.WakeWorkerRequest(name="workers/w1"), timeout=CALL)
    assert generate(wp.stub) == reference  # the restored weights are the same bytes


# ---------------------------------------------------------------- a corrupted host copy

_MAPS = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \d+\s*(.*)$")


def _corrupt_copies(marker: bytes, exclude: list[tuple[int, int]]) -> int:
    """Flip one byte after every copy of ``marker`` in this process's anonymous writable memory, outside
    ``exclude``; how many were flipped. Uses /proc/self/mem, as a stray write or a bit flip in host RAM would."""
    hits = []
    with open("/proc/self/maps") as f:
        regions = [mm.groups() for line in f if (mm := _MAPS.match(line.strip()))]
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        for lo_s, hi_s, perms, path in regions:
            lo, hi = int(lo_s, 16), int(hi_s, 16)
            if not perms.startswith("rw") or path or hi - lo > 1 << 30:
                continue
            try:
                mem.seek(lo)
                data = mem.read(hi - lo)
            except OSError:
                continue
            pos = data.find(marker)
            while pos >= 0:
                addr = lo + pos
                if not any(a <= addr < b for a, b in exclude):
                    hits.append(addr)
                pos = data.find(marker, pos + 1)
        for addr in hits:
            mem.seek(addr + 100)
            b = mem.read(1)
            mem.seek(addr + 100)
            mem.write(bytes([b[0] ^ 0x40]))
    return len(hits)


def test_corrupted_host_copy_fails_the_wake_naming_the_allocation() -> None:
    import torch

    alloc = MemoryAllocator(
        AllocatorConfig(backend="host", host_capacity_bytes=64 * MiB, host_chunk_bytes=4 * MiB, checksum=True)
    )
    try:
        t = alloc.empty(2 * MiB, torch.uint8, tag="weights")
        _fill(t, 2)
        marker = bytes(t[:4096].numpy())
        alloc.sleep({"weights": "offload"})
        own = id(marker) + sys.getsizeof(b"") - 1  # where CPython keeps the bytes object's data
        exclude = [(own, own + len(marker)), (t.data_ptr(), t.data_ptr() + 2 * MiB)]
        if _corrupt_copies(marker, exclude) == 0:
            pytest.skip(
                "the host copy was not found in anonymous memory; it is reachable only through native internals"
            )
        with pytest.raises(IntegrityError) as ei:
            alloc.wake_up()
        assert f"{t.data_ptr():#x}" in str(ei.value), str(ei.value)
        assert "'weights'" in str(ei.value)
    finally:
        alloc.close()
