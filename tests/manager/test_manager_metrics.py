"""The manager's Prometheus endpoint agrees with GetWorker: bytes per tag, state, leases, reachability."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.field_mask_pb2 import FieldMask
from managerproc import Cluster, ManagerProcess, get, wait_for, wait_state

from memsvc.manager.metrics import STATES
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb

WID = "metered"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cl = Cluster(tmp_path)
    yield cl
    cl.close()


def _sample(scrape: dict[tuple[str, frozenset[tuple[str, str]]], float], metric: str, **labels: str) -> float | None:
    return scrape.get((metric, frozenset(labels.items())))


def _disagreements(mgr: ManagerProcess) -> list[str]:
    """Where /metrics and GetWorker differ right now (empty when they agree)."""
    wk = get(mgr.stub, WID)
    scrape = mgr.metrics()
    out = []
    state = common_pb.WorkerState.Name(wk.state).removeprefix("WORKER_STATE_").lower()
    for s in STATES:
        got = _sample(scrape, "memsvc_worker_state", worker=WID, state=s)
        if got != (1.0 if s == state else 0.0):
            out.append(f"memsvc_worker_state{{state={s}}} = {got}, GetWorker says {state}")
    got = _sample(scrape, "memsvc_worker_leases", worker=WID)
    if got != wk.lease_count:
        out.append(f"memsvc_worker_leases = {got}, lease_count {wk.lease_count}")
    up = 0.0 if wk.state == common_pb.WORKER_STATE_UNAVAILABLE else 1.0
    if _sample(scrape, "memsvc_worker_up", worker=WID) != up:
        out.append(f"memsvc_worker_up = {_sample(scrape, 'memsvc_worker_up', worker=WID)}, want {up}")
    if not wk.status.tags:
        out.append("GetWorker has no tags yet")
    for t in wk.status.tags:
        for metric, want in (
            ("memsvc_worker_mapped_bytes", t.mapped_bytes),
            ("memsvc_worker_offloaded_bytes", t.offloaded_bytes),
            ("memsvc_worker_allocated_bytes", t.allocated_bytes),
        ):
            got = _sample(scrape, metric, worker=WID, tag=t.tag)
            if got != want:
                out.append(f"{metric}{{tag={t.tag}}} = {got}, GetWorker says {want}")
    return out


def _agree(mgr: ManagerProcess, what: str) -> None:
    wait_for(lambda: _disagreements(mgr), lambda d: not d, timeout=10, what=f"/metrics to match GetWorker ({what})")


def _counter(mgr: ManagerProcess, metric: str, **labels: str) -> float:
    return _sample(mgr.metrics(), metric, **labels) or 0.0


def _counted(mgr: ManagerProcess, kind: str) -> None:
    """Wait until a finished transition of ``kind`` is counted: its own event follows the new state on the
    worker's telemetry stream, so a scrape between the two shows the state and not yet the count (a
    fresh-clone run on a loaded machine did)."""
    wait_for(
        lambda: _counter(mgr, "memsvc_worker_transitions_total", worker=WID, kind=kind),
        lambda n: n >= 1,
        timeout=10,
        what=f"a {kind} transition to be counted",
    )


def test_metrics_match_get_worker_through_sleep_wake_lease_and_death(cluster: Cluster) -> None:
    mgr = cluster.manager(metrics=True)
    assert mgr.metrics_url.startswith("http://127.0.0.1:") and mgr.metrics_url.endswith("/metrics")
    stub = mgr.stub
    (wp,) = cluster.workers_up(mgr, [WID])

    _agree(mgr, "awake")
    scrape = mgr.metrics()
    assert _sample(scrape, "memsvc_worker_state", worker=WID, state="awake") == 1.0
    assert (_sample(scrape, "memsvc_worker_mapped_bytes", worker=WID, tag="weights") or 0) > 0
    # the load at the worker's start (TransitionStats.kind "load") is counted once, from its first snapshot
    assert _sample(scrape, "memsvc_worker_transitions_total", worker=WID, kind="load") == 1.0
    # what it serves where, for per-model panels without a hand join: one series, as GetWorker says
    status = stub.GetWorker(manager_pb.GetWorkerRequest(name=f"workers/{WID}"), timeout=10).worker.status
    info = [dict(k[1]) for k, v in scrape.items() if k[0] == "memsvc_worker_info" and v == 1.0]
    assert info == [{"worker": WID, "model": status.model.served_model_name, "backend": "host", "device": "0"}]
    assert status.model.served_model_name

    stub.SleepWorker(manager_pb.SleepWorkerRequest(name=f"workers/{WID}"), timeout=60)
    wait_state(stub, WID, common_pb.WORKER_STATE_ASLEEP)
    _agree(mgr, "asleep")
    _counted(mgr, "sleep")
    scrape = mgr.metrics()
    assert _sample(scrape, "memsvc_worker_state", worker=WID, state="asleep") == 1.0
    assert (_sample(scrape, "memsvc_worker_offloaded_bytes", worker=WID, tag="weights") or 0) > 0
    assert _sample(scrape, "memsvc_worker_mapped_bytes", worker=WID, tag="weights") == 0
    # the backup lives in page-locked host chunks, which the worker's status counts
    pinned = _sample(scrape, "memsvc_worker_host_pinned_bytes", worker=WID) or 0
    assert pinned >= (_sample(scrape, "memsvc_worker_offloaded_bytes", worker=WID, tag="weights") or 0) > 0
    assert _sample(scrape, "memsvc_worker_disk_bytes", worker=WID) == 0
    assert (_sample(scrape, "memsvc_worker_transitions_total", worker=WID, kind="sleep") or 0) >= 1
    assert (_sample(scrape, "memsvc_worker_transition_duration_seconds_count", worker=WID, kind="sleep") or 0) >= 1
    assert not [k for k in scrape if k[0].endswith("_created")], "no *_created series"
    build = [(dict(k[1]), v) for k, v in scrape.items() if k[0] == "memsvc_build_info"]
    assert len(build) == 1 and build[0][1] == 1.0 and set(build[0][0]) == {"version", "python", "grpcio"}, build

    lease = stub.AcquireWorker(
        manager_pb.AcquireWorkerRequest(name=f"workers/{WID}", ttl=Duration(seconds=60)), timeout=60
    ).lease
    _agree(mgr, "awake with one lease")
    assert _counter(mgr, "memsvc_worker_leases", worker=WID) == 1
    assert _counter(mgr, "memsvc_leases_granted_total") == 1
    second = stub.AcquireWorker(
        manager_pb.AcquireWorkerRequest(name=f"workers/{WID}", ttl=Duration(seconds=60)), timeout=60
    ).lease
    _agree(mgr, "two leases")
    assert _counter(mgr, "memsvc_worker_leases", worker=WID) == 2
    # A direct worker Sleep under the leases (the manager would refuse one): counted and logged
    assert _counter(mgr, "memsvc_leased_worker_sleeps_total", worker=WID) == 0
    wp.stub.Sleep(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1), timeout=60)
    wait_state(stub, WID, common_pb.WORKER_STATE_ASLEEP)
    wait_for(
        lambda: _counter(mgr, "memsvc_leased_worker_sleeps_total", worker=WID),
        lambda n: n == 1,
        timeout=10,
        what="the leased sleep to be counted",
    )
    assert "while 2 lease(s) hold it: not the manager's doing" in mgr.stderr_text()
    wp.stub.WakeUp(worker_pb.WakeUpRequest(), timeout=60)
    wait_state(stub, WID, common_pb.WORKER_STATE_AWAKE)
    for lease_id in (lease.lease_id, second.lease_id):
        stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease_id), timeout=10)
    _agree(mgr, "released")
    assert _counter(mgr, "memsvc_worker_leases", worker=WID) == 0
    _counted(mgr, "wake")

    # Level 2: nothing offloaded any more.
    stub.SleepWorker(manager_pb.SleepWorkerRequest(name=f"workers/{WID}", level=common_pb.SLEEP_LEVEL_2), timeout=60)
    wait_state(stub, WID, common_pb.WORKER_STATE_ASLEEP)
    _agree(mgr, "asleep at level 2")
    assert _counter(mgr, "memsvc_worker_offloaded_bytes", worker=WID, tag="weights") == 0

    wp.kill()
    wait_state(stub, WID, common_pb.WORKER_STATE_UNAVAILABLE, timeout=10)
    _agree(mgr, "unavailable")
    scrape = mgr.metrics()
    assert _sample(scrape, "memsvc_worker_up", worker=WID) == 0.0
    assert _sample(scrape, "memsvc_worker_state", worker=WID, state="unavailable") == 1.0

    stub.DeregisterWorker(manager_pb.DeregisterWorkerRequest(name=f"workers/{WID}"), timeout=10)
    assert not [k for k in mgr.metrics() if dict(k[1]).get("worker") == WID], "a deregistered worker's series stayed"


def test_metrics_count_idle_sleeps_and_budget_evictions(cluster: Cluster) -> None:
    mgr = cluster.manager(metrics=True)
    stub = mgr.stub
    cluster.workers_up(mgr, ["ev-a", "ev-b"])
    awake = sum(t.awake_bytes for t in get(stub, "ev-a").status.tags)
    stub.UpdatePolicy(
        manager_pb.UpdatePolicyRequest(
            policy=manager_pb.Policy(device_budget_bytes=awake + awake // 2),
            update_mask=FieldMask(paths=["device_budget_bytes"]),
        ),
        timeout=10,
    )
    stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/ev-b"), timeout=60)
    wait_state(stub, "ev-b", common_pb.WORKER_STATE_ASLEEP)
    assert _counter(mgr, "memsvc_budget_evictions_total") == 0
    stub.WakeWorker(manager_pb.WakeWorkerRequest(name="workers/ev-b"), timeout=60)
    wait_state(stub, "ev-a", common_pb.WORKER_STATE_ASLEEP)
    assert _counter(mgr, "memsvc_budget_evictions_total") == 1

    assert _counter(mgr, "memsvc_idle_sleeps_total", tier="1") == 0
    stub.UpdatePolicy(
        manager_pb.UpdatePolicyRequest(
            policy=manager_pb.Policy(idle_sleep_timeout=Duration(nanos=300_000_000)),
            update_mask=FieldMask(paths=["idle_sleep_timeout"]),
        ),
        timeout=10,
    )
    wait_state(stub, "ev-b", common_pb.WORKER_STATE_ASLEEP)
    wait_for(
        lambda: _counter(mgr, "memsvc_idle_sleeps_total", tier="1"),
        lambda v: v == 1,
        timeout=10,
        what="one tier-1 idle sleep counted",
    )
