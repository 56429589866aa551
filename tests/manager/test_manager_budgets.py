"""Device and host budgets, with two real workers on one host and one (simulated) device.

The manager groups workers by (host, backend, device index); two host-backend workers on this
machine share device 0. Sizes come from the workers' own status (GetWorker status tags), so the
budgets below fit exactly one awake worker (device) or one worker's offloaded weights (host).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict, Unpack

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.field_mask_pb2 import FieldMask
from managerproc import Cluster, get, mapped, name, offloaded, seconds, tags, view, wait_for

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc
from memsvc.v1 import model_worker_service_pb2 as worker_pb


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cl = Cluster(tmp_path)
    yield cl
    cl.close()


def _awake_need(wk: manager_pb.Worker) -> int:
    """Device bytes the worker maps when every tag is awake."""
    return sum(t.awake_bytes for t in wk.status.tags)


class _Budgets(TypedDict, total=False):
    device_budget_bytes: int
    host_budget_bytes: int


def _update_default(
    stub: manager_grpc.MemoryManagerServiceStub, mask: list[str], **fields: Unpack[_Budgets]
) -> manager_pb.Policy:
    req = manager_pb.UpdatePolicyRequest(policy=manager_pb.Policy(**fields), update_mask=FieldMask(paths=mask))
    return stub.UpdatePolicy(req, timeout=10).policy


def _acquire(stub: manager_grpc.MemoryManagerServiceStub, wid: str) -> manager_pb.AcquireWorkerResponse:
    req = manager_pb.AcquireWorkerRequest(name=name(wid), holder="budget-test", ttl=Duration(seconds=120))
    return stub.AcquireWorker(req, timeout=60)


def _settled(
    stub: manager_grpc.MemoryManagerServiceStub, wid: str, state: common_pb.WorkerState.ValueType
) -> manager_pb.Worker:
    """The worker in ``state`` with tag sizes that agree with it (a state change may arrive before its sizes)."""

    def ok(wk: manager_pb.Worker) -> bool:
        if wk.state != state:
            return False
        if state == common_pb.WORKER_STATE_AWAKE:
            return all(t.state == common_pb.TAG_STATE_AWAKE and t.mapped_bytes == t.awake_bytes for t in wk.status.tags)
        return all(t.state != common_pb.TAG_STATE_AWAKE and t.mapped_bytes == 0 for t in wk.status.tags)

    return wait_for(lambda: get(stub, wid), ok, what=f"{wid} settled in {common_pb.WorkerState.Name(state)}")


def test_device_budget_puts_the_lru_idle_worker_to_sleep_and_refuses_when_nothing_can_be_freed(
    cluster: Cluster,
) -> None:
    mgr = cluster.manager()
    stub = mgr.stub
    cluster.workers_up(mgr, ["dev-a", "dev-b"])
    a, b = _settled(stub, "dev-a", common_pb.WORKER_STATE_AWAKE), _settled(stub, "dev-b", common_pb.WORKER_STATE_AWAKE)
    assert a.host == b.host and a.status.device.backend == b.status.device.backend == "host"
    assert a.status.device.index == b.status.device.index
    need = _awake_need(a)
    assert need > 0 and mapped(a) == need and _awake_need(b) == need
    # Room for one awake worker, not two (both are awake now: the budget is applied when one wakes).
    budget = need + need // 2
    assert _update_default(stub, ["device_budget_bytes"], device_budget_bytes=budget).device_budget_bytes == budget

    # B goes to sleep; then a lease on B must first put A (idle, unleased) to sleep to make room.
    stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/dev-b"), timeout=60)
    _settled(stub, "dev-b", common_pb.WORKER_STATE_ASLEEP)
    lease_b = _acquire(stub, "dev-b")
    assert lease_b.worker.state == common_pb.WORKER_STATE_AWAKE
    a = _settled(stub, "dev-a", common_pb.WORKER_STATE_ASLEEP)
    b = _settled(stub, "dev-b", common_pb.WORKER_STATE_AWAKE)
    assert tags(a)["weights"].state == common_pb.TAG_STATE_OFFLOADED, "the evicted worker sleeps at tier 1 (offload)"
    assert b.lease_count == 1 and a.lease_count == 0
    assert mapped(a) + mapped(b) <= budget

    # B holds a lease and is pinned (a time_slice of 0: it never gives up its turn, see
    # test_turns.py): nothing on the device can be freed, so waking A is refused, and nothing changes.
    pin = manager_pb.UpdatePolicyRequest(
        name="workers/dev-b", policy=manager_pb.Policy(), update_mask=FieldMask(paths=["time_slice"])
    )
    assert stub.UpdatePolicy(pin, timeout=10).policy.time_slice.ToNanoseconds() == 0
    before_a, before_b = view(a), view(b)
    for call, req in (
        ("AcquireWorker", manager_pb.AcquireWorkerRequest(name="workers/dev-a", ttl=Duration(seconds=60))),
        ("WakeWorker", manager_pb.WakeWorkerRequest(name="workers/dev-a")),
    ):
        with pytest.raises(grpc.RpcError) as err:
            getattr(stub, call)(req, timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{call}: {err.value.details()}"
        assert view(get(stub, "dev-a")) == before_a, f"{call} changed the worker it could not wake"
        assert view(get(stub, "dev-b")) == before_b, f"{call} changed the leased worker"

    unpin = manager_pb.UpdatePolicyRequest(name="workers/dev-b", clear_fields=["time_slice"])
    stub.UpdatePolicy(unpin, timeout=10)

    # After B's release the roles swap: acquiring A puts B (now the idle one) to sleep.
    stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease_b.lease.lease_id), timeout=10)
    lease_a = _acquire(stub, "dev-a")
    assert lease_a.worker.state == common_pb.WORKER_STATE_AWAKE
    _settled(stub, "dev-b", common_pb.WORKER_STATE_ASLEEP)
    _settled(stub, "dev-a", common_pb.WORKER_STATE_AWAKE)
    stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease_a.lease.lease_id), timeout=10)

    # Budget 0 means the device's capacity (64 MiB here): both fit, nobody is evicted.
    assert _update_default(stub, ["device_budget_bytes"], device_budget_bytes=0).device_budget_bytes == 0
    stub.WakeWorker(manager_pb.WakeWorkerRequest(name="workers/dev-b"), timeout=60)
    _settled(stub, "dev-b", common_pb.WORKER_STATE_AWAKE)
    assert get(stub, "dev-a").state == common_pb.WORKER_STATE_AWAKE


def test_device_budget_zero_uses_the_device_capacity(cluster: Cluster) -> None:
    """With no explicit budget the device's own size limits the awake workers that share it."""
    mgr = cluster.manager()
    stub = mgr.stub
    # 6 MiB simulated devices: one tiny worker (4 MiB awake) fits, two do not.
    cluster.workers_up(mgr, ["cap-a", "cap-b"], ["--host-capacity", "6MiB"])
    a = _settled(stub, "cap-a", common_pb.WORKER_STATE_AWAKE)
    assert a.status.device.total_bytes == 6 << 20 and _awake_need(a) == 4 << 20
    assert stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy.device_budget_bytes == 0
    stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/cap-b"), timeout=60)
    _settled(stub, "cap-b", common_pb.WORKER_STATE_ASLEEP)
    stub.WakeWorker(manager_pb.WakeWorkerRequest(name="workers/cap-b"), timeout=60)
    _settled(stub, "cap-b", common_pb.WORKER_STATE_AWAKE)
    _settled(stub, "cap-a", common_pb.WORKER_STATE_ASLEEP)


def test_host_budget_demotes_the_coldest_sleeper_to_level_2(cluster: Cluster) -> None:
    mgr = cluster.manager()
    stub = mgr.stub
    cluster.workers_up(mgr, ["host-a", "host-b"])
    a = _settled(stub, "host-a", common_pb.WORKER_STATE_AWAKE)
    weights = tags(a)["weights"].allocated_bytes
    assert weights > 0
    # Room for one worker's offloaded weights, not two.
    budget = weights + weights // 2
    assert _update_default(stub, ["host_budget_bytes"], host_budget_bytes=budget).host_budget_bytes == budget

    stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/host-a"), timeout=60)
    a = _settled(stub, "host-a", common_pb.WORKER_STATE_ASLEEP)
    assert tags(a)["weights"].state == common_pb.TAG_STATE_OFFLOADED and offloaded(a) == weights

    resp = stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/host-b"), timeout=60)
    assert resp.worker.state == common_pb.WORKER_STATE_ASLEEP
    b = _settled(stub, "host-b", common_pb.WORKER_STATE_ASLEEP)
    assert tags(b)["weights"].state == common_pb.TAG_STATE_OFFLOADED and offloaded(b) == weights
    a = wait_for(
        lambda: get(stub, "host-a"),
        lambda wk: tags(wk)["weights"].state == common_pb.TAG_STATE_DISCARDED,
        what="host-a demoted to level 2",
    )
    assert a.state == common_pb.WORKER_STATE_ASLEEP and offloaded(a) == 0
    assert a.status.sleep_level == common_pb.SLEEP_LEVEL_2
    assert offloaded(a) + offloaded(b) <= budget
    # B's sleep came after A's demotion made room (A's demotion finished first).
    assert seconds(a.status.last_transition.end_time) <= seconds(b.status.last_transition.end_time)

    # The demoted worker still wakes, reloading its weights.
    stub.WakeWorker(manager_pb.WakeWorkerRequest(name="workers/host-a"), timeout=60)
    _settled(stub, "host-a", common_pb.WORKER_STATE_AWAKE)


def test_device_budget_evicts_the_least_recently_used_idle_worker(cluster: Cluster) -> None:
    mgr = cluster.manager()
    stub = mgr.stub
    cluster.workers_up(mgr, ["lru-a", "lru-b", "lru-c"])
    need = _awake_need(_settled(stub, "lru-a", common_pb.WORKER_STATE_AWAKE))
    stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/lru-c"), timeout=60)
    _settled(stub, "lru-c", common_pb.WORKER_STATE_ASLEEP)
    # Use A, then B (a lease each, released at once): A is now the least recently used.
    for wid in ("lru-a", "lru-b"):
        stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=_acquire(stub, wid).lease.lease_id), timeout=10)
    a, b = get(stub, "lru-a"), get(stub, "lru-b")
    assert seconds(a.idle_since_time) < seconds(b.idle_since_time)
    # Two awake workers fit, three do not.
    _update_default(stub, ["device_budget_bytes"], device_budget_bytes=2 * need + need // 2)

    lease_c = _acquire(stub, "lru-c")
    assert lease_c.worker.state == common_pb.WORKER_STATE_AWAKE
    _settled(stub, "lru-a", common_pb.WORKER_STATE_ASLEEP)
    assert get(stub, "lru-b").state == common_pb.WORKER_STATE_AWAKE, "evicted more than needed, or not the LRU worker"
    assert get(stub, "lru-c").lease_count == 1


def test_host_budget_moves_a_sleeper_with_a_disk_tier_to_disk_and_it_wakes_with_the_same_tokens(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The demotion of a worker whose weights have no checkpoint to reload them from (synthetic ones
    from a seed here stand in for any): with --offload-dir it keeps every byte on disk instead of
    discarding them, and greedy tokens after the wake are the ones before the sleep."""
    mgr = cluster.manager()
    stub = mgr.stub
    offload = tmp_path / "offload"
    offload.mkdir()
    workers = cluster.workers_up(mgr, ["disk-a", "disk-b"], args=["--offload-dir", str(offload)])
    prompt = worker_pb.GenerateRequest(prompt_token_ids=[5, 17, 3, 99], max_new_tokens=12)
    before = workers[0].stub.Generate(prompt, timeout=60).token_ids
    a = _settled(stub, "disk-a", common_pb.WORKER_STATE_AWAKE)
    assert a.status.offload_dir == str(offload)
    weights = tags(a)["weights"].allocated_bytes
    budget = weights + weights // 2
    _update_default(stub, ["host_budget_bytes"], host_budget_bytes=budget)

    stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/disk-a"), timeout=60)
    stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/disk-b"), timeout=60)
    a = wait_for(
        lambda: get(stub, "disk-a"),
        lambda wk: tags(wk)["weights"].state == common_pb.TAG_STATE_ON_DISK,
        what="disk-a moved to disk",
    )
    assert tags(a)["weights"].disk_bytes == weights and offloaded(a) == 0
    assert a.status.disk_bytes >= weights and a.status.sleep_level != common_pb.SLEEP_LEVEL_2
    assert os.listdir(offload) == []  # the tier's files are unlinked
    b = _settled(stub, "disk-b", common_pb.WORKER_STATE_ASLEEP)
    assert tags(b)["weights"].state == common_pb.TAG_STATE_OFFLOADED and offloaded(a) + offloaded(b) <= budget

    woke = stub.WakeWorker(manager_pb.WakeWorkerRequest(name="workers/disk-a"), timeout=60)
    assert woke.transition.verified_bytes == weights  # every byte checked against its sleep-time sum
    assert workers[0].stub.Generate(prompt, timeout=60).token_ids == before
