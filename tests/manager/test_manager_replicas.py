"""Manager replicas on one real PostgreSQL database: one leads, the others forward, and a follower
takes over when the leader dies (SIGKILL) or loses its database session, with every lease, policy and
registration intact (memsvc/manager/replicas.py, memsvc/manager/store_postgres.py).

Real ``memsvc manager`` processes, real host-backend workers, a real PostgreSQL server
(tests/pgserver.py). "Mid-call" is a condition, not a time: the worker the call needs is stopped
(SIGSTOP) and the leader is killed once its metrics show the call sent and unanswered
(``memsvc_worker_calls_in_flight``) or its AcquireWorker waiting (``waiting_acquires``).
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psycopg
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.field_mask_pb2 import FieldMask
from grpc_health.v1 import health_pb2
from managerproc import Cluster, ManagerProcess, get, seconds, wait_for, wait_state
from pgserver import PostgresServer

from memsvc import error_info, retry_delay
from memsvc.manager.store_postgres import LEADER_LOCK
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc

TAKEOVER_BOUND_S = 30.0
"""A generous bound for the tests (loopback takes about the poll interval plus a start: see
docs/operations.md); the tests wait for the condition, this only says when to give up."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cl = Cluster(tmp_path)
    yield cl
    cl.close()


def replicas(cluster: Cluster, url: str, n: int = 2) -> list[ManagerProcess]:
    """``n`` replicas on ``url``; the first is started alone, so it is the one that leads."""
    first = cluster.manager(db=url, metrics=True)  # it leads when this returns
    rest = [cluster.manager(db=url, metrics=True, lead=False) for _ in range(n - 1)]
    for mp in rest:
        wait_for(
            functools.partial(mp.health, ""),
            lambda s: s == health_pb2.HealthCheckResponse.SERVING,
            what="a follower's server to answer",
            timeout=60,
        )
    return [first, *rest]


def reachable(stub: manager_grpc.MemoryManagerServiceStub, worker_id: str) -> None:
    """Until the manager reaches ``worker_id`` (a new leader, or a worker that was stopped)."""
    wait_for(
        functools.partial(get, stub, worker_id),
        lambda w: w.state not in (common_pb.WORKER_STATE_UNAVAILABLE, common_pb.WORKER_STATE_UNSPECIFIED),
        what=f"the manager to reach {worker_id}",
        timeout=60,
    )


def in_flight(mp: ManagerProcess, worker_id: str) -> float:
    return mp.metrics().get(("memsvc_worker_calls_in_flight", frozenset({("worker", worker_id)})), 0.0)


def leases(mp: ManagerProcess) -> dict[str, manager_pb.Lease]:
    return {x.lease_id: x for x in mp.stub.ListLeases(manager_pb.ListLeasesRequest(), timeout=10).leases}


def set_policy(mp: ManagerProcess) -> manager_pb.Policy:
    mp.stub.UpdatePolicy(
        manager_pb.UpdatePolicyRequest(
            policy=manager_pb.Policy(idle_sleep_timeout=Duration(seconds=3600)),
            update_mask=FieldMask(paths=["idle_sleep_timeout"]),
        ),
        timeout=10,
    )
    mp.stub.UpdatePolicy(
        manager_pb.UpdatePolicyRequest(
            name="workers/w1",
            policy=manager_pb.Policy(idle_deep_sleep_timeout=Duration(seconds=9000)),
            update_mask=FieldMask(paths=["idle_deep_sleep_timeout"]),
        ),
        timeout=10,
    )
    return mp.stub.GetPolicy(manager_pb.GetPolicyRequest(name="workers/w1"), timeout=10).policy


def test_one_replica_leads_and_a_follower_forwards_every_call_with_its_errors(cluster: Cluster, pg_url: str) -> None:
    leader, follower = replicas(cluster, pg_url)
    assert follower.health() == health_pb2.HealthCheckResponse.NOT_SERVING, "a follower is not ready for the service"
    metrics = follower.metrics()
    assert metrics[("memsvc_manager_leader", frozenset())] == 0
    assert leader.metrics()[("memsvc_manager_leader", frozenset())] == 1

    # the workers register through the follower; the leader dials them and learns their state
    cluster.workers_up(follower, ["w1", "w2"])
    assert {w.name for w in leader.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers} == {
        "workers/w1",
        "workers/w2",
    }
    policy = set_policy(follower)
    assert leader.stub.GetPolicy(manager_pb.GetPolicyRequest(name="workers/w1"), timeout=10).policy == policy
    assert seconds(policy.idle_sleep_timeout) == 3600 and seconds(policy.idle_deep_sleep_timeout) == 9000

    lease = follower.stub.AcquireWorker(
        manager_pb.AcquireWorkerRequest(name="workers/w2", holder="t", request_id="r-1"), timeout=30
    ).lease
    assert set(leases(leader)) == {lease.lease_id}
    sleep = follower.stub.SleepWorker(
        manager_pb.SleepWorkerRequest(name="workers/w1", level=common_pb.SLEEP_LEVEL_1), timeout=30
    )
    assert sleep.worker.state == common_pb.WORKER_STATE_ASLEEP

    # the leader's errors come back as the leader said them: status, message and ErrorInfo
    with pytest.raises(grpc.RpcError) as err:
        follower.stub.GetWorker(manager_pb.GetWorkerRequest(name="workers/nope"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in (err.value.details() or "")
    info = error_info(err.value)
    assert info is not None and info.reason == "NOT_FOUND"
    with pytest.raises(grpc.RpcError) as err:
        follower.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=""), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    # a stream too: WatchWorkers through the follower starts with the leader's snapshot
    stream = follower.stub.WatchWorkers(manager_pb.WatchWorkersRequest(names=["workers/w2"]), timeout=30)
    first = next(stream)
    assert first.snapshot.name == "workers/w2" and first.snapshot.lease_count == 1
    stream.cancel()
    follower.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease.lease_id), timeout=10)
    assert leases(leader) == {}


def test_the_leader_killed_mid_acquire_a_follower_takes_over_with_every_lease_and_policy(
    cluster: Cluster, pg_url: str
) -> None:
    leader, follower = replicas(cluster, pg_url)
    w1, w2 = cluster.workers_up(leader, ["w1", "w2"])
    policy = set_policy(leader)
    held = leader.stub.AcquireWorker(
        manager_pb.AcquireWorkerRequest(
            name="workers/w1",
            holder="kept",
            request_id="grant-1",
            ttl=Duration(seconds=600),
            keep_alive=Duration(seconds=120),
        ),
        timeout=30,
    ).lease
    leader.stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/w2", level=common_pb.SLEEP_LEVEL_1), timeout=30)

    os.kill(w2.pid, signal.SIGSTOP)  # w2's wake cannot finish: the acquire below waits on it
    try:
        with ThreadPoolExecutor(1) as pool:
            mid = pool.submit(
                follower.stub.AcquireWorker,
                manager_pb.AcquireWorkerRequest(name="workers/w2", holder="mid", request_id="mid-1"),
                timeout=60,
            )
            wait_for(
                lambda: get(leader.stub, "w2").waiting_acquires,
                lambda n: n == 1,
                what="the leader's AcquireWorker to wait on w2",
            )
            killed = time.monotonic()
            leader.kill()
            with pytest.raises(grpc.RpcError) as err:
                mid.result()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        wait_for(follower.leads, bool, timeout=TAKEOVER_BOUND_S, what="the follower to take over")
        print(f"took over {time.monotonic() - killed:.2f} s after the leader's SIGKILL")
    finally:
        os.kill(w2.pid, signal.SIGCONT)

    stub = follower.stub
    assert stub.GetPolicy(manager_pb.GetPolicyRequest(name="workers/w1"), timeout=10).policy == policy
    wait_state(stub, "w1", common_pb.WORKER_STATE_AWAKE)  # re-learned from the worker's telemetry
    kept = leases(follower)
    assert set(kept) == {held.lease_id} and kept[held.lease_id].expire_time == held.expire_time
    assert kept[held.lease_id].holder == "kept"

    # a retry of a grant whose answer was lost gets the same lease; the cut acquire is granted once,
    # once the new leader reaches w2 again (stopped, it was unreachable: UNAVAILABLE, which a client retries)
    reachable(stub, "w2")
    again = stub.AcquireWorker(
        manager_pb.AcquireWorkerRequest(name="workers/w1", holder="kept", request_id="grant-1"), timeout=30
    ).lease
    assert again.lease_id == held.lease_id
    granted = stub.AcquireWorker(
        manager_pb.AcquireWorkerRequest(name="workers/w2", holder="mid", request_id="mid-1"), timeout=60
    )
    assert granted.worker.state == common_pb.WORKER_STATE_AWAKE
    assert set(leases(follower)) == {held.lease_id, granted.lease.lease_id}
    assert get(stub, "w2").lease_count == 1 and get(stub, "w1").lease_count == 1
    stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=held.lease_id), timeout=10)
    assert get(stub, "w1").keep_alive == Duration(seconds=120), "the lease's keep_alive came through the takeover"


def test_the_leader_killed_mid_sleep_the_retry_on_the_new_leader_ends_it(cluster: Cluster, pg_url: str) -> None:
    leader, follower = replicas(cluster, pg_url)
    (w1,) = cluster.workers_up(leader, ["w1"])
    policy = set_policy(leader)
    request = manager_pb.SleepWorkerRequest(name="workers/w1", level=common_pb.SLEEP_LEVEL_1, request_id="sleep-1")
    os.kill(w1.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            cut = pool.submit(follower.stub.SleepWorker, request, timeout=60)
            wait_for(lambda: in_flight(leader, "w1"), lambda n: n == 1, what="the leader's Sleep call to w1")
            leader.kill()
            with pytest.raises(grpc.RpcError) as err:
                cut.result()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        wait_for(follower.leads, bool, timeout=TAKEOVER_BOUND_S, what="the follower to take over")
    finally:
        os.kill(w1.pid, signal.SIGCONT)
    reachable(follower.stub, "w1")
    done = follower.stub.SleepWorker(request, timeout=60)  # the same request_id: the worker's replay, or a new run
    assert done.worker.state == common_pb.WORKER_STATE_ASLEEP
    wait_state(follower.stub, "w1", common_pb.WORKER_STATE_ASLEEP)
    assert follower.stub.GetPolicy(manager_pb.GetPolicyRequest(name="workers/w1"), timeout=10).policy == policy


def test_a_leader_that_loses_its_database_session_stops_and_a_follower_takes_over(
    cluster: Cluster, pg_url: str
) -> None:
    leader, follower = replicas(cluster, pg_url)
    cluster.workers_up(follower, ["w1"])
    held = follower.stub.AcquireWorker(
        manager_pb.AcquireWorkerRequest(name="workers/w1", holder="kept"), timeout=30
    ).lease
    with psycopg.connect(pg_url, autocommit=True) as db:  # the server ends the leader's session
        (ended,) = db.execute("SELECT pg_terminate_backend(pid) FROM memsvc_leader").fetchone() or (False,)
    assert ended
    assert leader.wait(timeout=TAKEOVER_BOUND_S) == 1, "a leader without its session stops, status 1"
    assert "stopped leading" in leader.stderr_text()
    wait_for(follower.leads, bool, timeout=TAKEOVER_BOUND_S, what="the follower to take over")
    assert set(leases(follower)) == {held.lease_id}
    wait_state(follower.stub, "w1", common_pb.WORKER_STATE_AWAKE)


def test_a_follower_with_no_leader_answers_no_leader_with_a_retry_delay(cluster: Cluster, pg_url: str) -> None:
    """Between a leader's loss and a takeover: here no takeover can come, as the follower's own
    session cannot take the lock while a third session (the test's) holds it."""
    with psycopg.connect(pg_url, autocommit=True) as db:
        db.execute("SELECT pg_advisory_lock(%s, %s)", LEADER_LOCK)  # memsvc's leader lock, held by no replica
        follower = cluster.manager(db=pg_url, lead=False)
        with pytest.raises(grpc.RpcError) as err:
            follower.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    info = error_info(err.value)
    assert info is not None and info.reason == "NO_LEADER"
    retry = retry_delay(err.value)
    assert retry is not None and retry > 0, "a NO_LEADER carries when to try again"
    wait_for(follower.leads, bool, timeout=TAKEOVER_BOUND_S, what="the follower to lead once the lock is free")


def test_while_the_database_restarts_no_replica_leads_and_one_takes_over_once_it_is_back(
    cluster: Cluster, pg_url: str, postgres_server: PostgresServer
) -> None:
    """The server's shutdown ends the leader's session: the leader stops (status 1); the follower,
    which cannot reach the database either, answers NO_LEADER; once the server is back it leads,
    with the lease granted before."""
    leader, follower = replicas(cluster, pg_url)
    cluster.workers_up(follower, ["w1"])
    held = follower.stub.AcquireWorker(
        manager_pb.AcquireWorkerRequest(name="workers/w1", holder="kept"), timeout=30
    ).lease
    postgres_server.stop()
    try:
        assert leader.wait(timeout=TAKEOVER_BOUND_S) == 1, "a leader without its session stops, status 1"
        with pytest.raises(grpc.RpcError) as err:
            follower.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10)
        info = error_info(err.value)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and info is not None and info.reason == "NO_LEADER"
    finally:
        postgres_server.run()
    wait_for(follower.leads, bool, timeout=TAKEOVER_BOUND_S, what="the follower to lead once the database is back")
    assert set(leases(follower)) == {held.lease_id}
    reachable(follower.stub, "w1")
