"""What survives a manager crash (SIGKILL), and what happens when a worker dies and comes back.

Policies and registrations live in the manager's store (a SQLite file, or PostgreSQL: each test runs
on both); memory state is re-learned from the workers. The restarted manager listens on a *different*
port, so the worker's heartbeats (still aimed at the old address) cannot help: the manager must
reach it through the stored address.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.field_mask_pb2 import FieldMask
from managerproc import Cluster, get, seconds, tags, wait_for, wait_state
from stores import STORE_KINDS, db_for

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cl = Cluster(tmp_path)
    yield cl
    cl.close()


@pytest.fixture(params=STORE_KINDS)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each test on each store: a restart reads back the same state from either."""
    return db_for(request, tmp_path / "state")


def _list(stub: manager_grpc.MemoryManagerServiceStub) -> list[manager_pb.Worker]:
    return list(stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers)


def test_manager_crash_keeps_policies_and_registrations_and_relearns_worker_state(cluster: Cluster, db: str) -> None:
    mgr = cluster.manager(db=db)
    stub = mgr.stub
    (wp,) = cluster.workers_up(mgr, ["persist"])
    address = get(stub, "persist").address
    assert address == wp.address

    default = manager_pb.Policy(
        tag_actions={"weights": common_pb.TAG_ACTION_OFFLOAD, "kv_cache": common_pb.TAG_ACTION_DISCARD},
        idle_sleep_timeout=Duration(seconds=3600),
        idle_deep_sleep_timeout=Duration(seconds=7200),
        device_budget_bytes=48 << 20,
        host_budget_bytes=1 << 30,
        time_slice=Duration(seconds=5),
        start_timeout=Duration(seconds=120),
    )
    stub.UpdatePolicy(manager_pb.UpdatePolicyRequest(policy=default), timeout=10)
    override = manager_pb.Policy(idle_deep_sleep_timeout=Duration(seconds=9000))
    stub.UpdatePolicy(
        manager_pb.UpdatePolicyRequest(
            name="workers/persist", policy=override, update_mask=FieldMask(paths=["idle_deep_sleep_timeout"])
        ),
        timeout=10,
    )
    want_default = stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy
    want_worker = stub.GetPolicy(manager_pb.GetPolicyRequest(name="workers/persist"), timeout=10).policy
    assert want_default == default
    assert seconds(want_worker.idle_deep_sleep_timeout) == 9000
    assert seconds(want_worker.idle_sleep_timeout) == 3600

    stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/persist"), timeout=60)
    asleep = wait_state(stub, "persist", common_pb.WORKER_STATE_ASLEEP)
    weights = tags(asleep)["weights"].offloaded_bytes
    assert weights > 0

    mgr.kill()  # SIGKILL: no shutdown path runs
    mgr2 = cluster.manager(db=db)
    assert mgr2.address != mgr.address
    stub2 = mgr2.stub
    # Policies: exactly what was set before the crash, default and per worker.
    assert stub2.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy == want_default
    assert stub2.GetPolicy(manager_pb.GetPolicyRequest(name="workers/persist"), timeout=10).policy == want_worker
    # Registration: known at once, at its stored address.
    names = [wk.name for wk in _list(stub2)]
    assert names == ["workers/persist"]
    assert get(stub2, "persist").address == address
    # Memory state: re-learned from the worker itself (asleep, weights still offloaded).
    wk = wait_state(stub2, "persist", common_pb.WORKER_STATE_ASLEEP, extra=lambda wk: "weights" in tags(wk))
    assert tags(wk)["weights"].state == common_pb.TAG_STATE_OFFLOADED
    assert tags(wk)["weights"].offloaded_bytes == weights
    assert wk.lease_count == 0

    # The worker dies: UNAVAILABLE within a few seconds, record and last status kept.
    wp.kill()
    wk = wait_state(stub2, "persist", common_pb.WORKER_STATE_UNAVAILABLE, timeout=10)
    assert wk.address == address
    assert wk.status.worker_id == "persist" and tags(wk)["weights"].offloaded_bytes == weights
    assert [x.name for x in _list(stub2)] == ["workers/persist"]
    with pytest.raises(grpc.RpcError) as err:
        stub2.WakeWorker(manager_pb.WakeWorkerRequest(name="workers/persist"), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    # Back with the same id (new port): it re-registers and is AWAKE again at its new address.
    (wp2,) = cluster.workers_up(mgr2, ["persist"])
    wk = wait_state(stub2, "persist", common_pb.WORKER_STATE_AWAKE, extra=lambda wk: wk.address == wp2.address)
    assert wk.address != address
    assert [x.name for x in _list(stub2)] == ["workers/persist"]
    # Its per-worker policy is still there.
    assert stub2.GetPolicy(manager_pb.GetPolicyRequest(name="workers/persist"), timeout=10).policy == want_worker

    # And the new registration (new address) is what a further crash recovers.
    mgr2.kill()
    mgr3 = cluster.manager(db=db)
    wk = wait_state(mgr3.stub, "persist", common_pb.WORKER_STATE_AWAKE)
    assert wk.address == wp2.address


def test_config_file_seeds_policy_and_static_workers_but_update_policy_wins_after_restart(
    cluster: Cluster, db: str
) -> None:
    cfg = cluster.tmp_path / "manager.toml"
    cfg.write_text(
        "[policy]\nidle_sleep_timeout = 600\nhost_budget_bytes = 1048576\n"
        '[[workers]]\nid = "static-one"\naddress = "127.0.0.1:1"\nhost = "elsewhere"\n'
    )
    mgr = cluster.manager(["--config", str(cfg)], db=db)
    pol = mgr.stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy
    assert seconds(pol.idle_sleep_timeout) == 600 and pol.host_budget_bytes == 1 << 20
    wk = get(mgr.stub, "static-one")
    assert wk.configured and wk.host == "elsewhere" and wk.address == "127.0.0.1:1"
    assert wk.state == common_pb.WORKER_STATE_UNAVAILABLE  # nothing listens there

    mgr.stub.UpdatePolicy(
        manager_pb.UpdatePolicyRequest(
            policy=manager_pb.Policy(idle_sleep_timeout=Duration(seconds=42)),
            update_mask=FieldMask(paths=["idle_sleep_timeout"]),
        ),
        timeout=10,
    )
    mgr.kill()
    mgr2 = cluster.manager(["--config", str(cfg)], db=db)
    pol = mgr2.stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy
    assert seconds(pol.idle_sleep_timeout) == 42, "the config file must not override a stored UpdatePolicy"
    assert pol.host_budget_bytes == 1 << 20
    wait_for(lambda: get(mgr2.stub, "static-one"), lambda wk: wk.configured, what="static worker after restart")


def test_a_hung_worker_that_stops_heartbeating_becomes_unavailable(cluster: Cluster) -> None:
    cfg = cluster.tmp_path / "fast.toml"
    cfg.write_text("[manager]\nheartbeat_interval = 0.5\n")
    mgr = cluster.manager(["--config", str(cfg)])
    (wp,) = cluster.workers_up(mgr, ["hung"])
    assert wp.proc is not None
    wp.proc.send_signal(signal.SIGSTOP)  # alive, socket open, but answers nothing and sends no heartbeat
    try:
        wait_state(mgr.stub, "hung", common_pb.WORKER_STATE_UNAVAILABLE, timeout=5)
    finally:
        wp.proc.send_signal(signal.SIGCONT)
    wait_state(mgr.stub, "hung", common_pb.WORKER_STATE_AWAKE, timeout=15)
