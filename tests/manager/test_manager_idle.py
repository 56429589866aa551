"""Idle timers and leases of the manager, with a real manager and a real worker on loopback.

Tier 1 (idle T1): the policy's tag actions (weights OFFLOADED, KV DISCARDED). Tier 2 (idle T2):
level 2 (weights DISCARDED, host copy freed). A lease keeps the worker awake; idle time counts from
the last release or lease expiry. Every wait is a poll with a deadline; the order of events is
checked with the timestamps the services report, never with the test's own stopwatch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.field_mask_pb2 import FieldMask
from managerproc import Cluster, get, name, offloaded, seconds, tag_states, tags, wait_for, wait_state
from workerproc import WorkerProcess

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc
from memsvc.v1 import model_worker_service_pb2 as worker_pb

T1 = 1.0
T2 = 2.5
PROMPT = [5, 17, 42, 7, 99, 3]
NEW_TOKENS = 12
EPS = 0.02
"""Rounding slack between timestamps (nanosecond protobuf fields built from float seconds)."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cl = Cluster(tmp_path)
    yield cl
    cl.close()


def _duration(s: float) -> Duration:
    ns = int(round(s * 1e9))
    return Duration(seconds=ns // 1_000_000_000, nanos=ns % 1_000_000_000)


def _generate(wp: WorkerProcess) -> list[int]:
    resp = wp.stub.Generate(worker_pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=NEW_TOKENS), timeout=60)
    return list(resp.token_ids)


def _acquire(
    stub: manager_grpc.MemoryManagerServiceStub, wid: str, ttl: float, holder: str = "test"
) -> manager_pb.AcquireWorkerResponse:
    req = manager_pb.AcquireWorkerRequest(name=name(wid), holder=holder, ttl=_duration(ttl))
    return stub.AcquireWorker(req, timeout=60)


def _is_tier1(wk: manager_pb.Worker) -> bool:
    t = tags(wk)
    return (
        wk.state == common_pb.WORKER_STATE_ASLEEP
        and t["weights"].state == common_pb.TAG_STATE_OFFLOADED
        and t["weights"].offloaded_bytes > 0
        and t["kv_cache"].state == common_pb.TAG_STATE_DISCARDED
    )


def _is_tier2(wk: manager_pb.Worker) -> bool:
    t = tags(wk)
    return (
        wk.state == common_pb.WORKER_STATE_ASLEEP
        and t["weights"].state == common_pb.TAG_STATE_DISCARDED
        and t["kv_cache"].state == common_pb.TAG_STATE_DISCARDED
        and offloaded(wk) == 0
    )


def test_idle_tiers_then_lease_wakes_keeps_awake_and_release_restarts_the_clock(cluster: Cluster) -> None:
    mgr = cluster.manager()
    stub = mgr.stub
    (wp,) = cluster.workers_up(mgr, ["idle"])
    before = _generate(wp)
    assert len(before) == NEW_TOKENS

    # Hold a lease while the timers are switched on, so the idle clock starts at a known release.
    lease = _acquire(stub, "idle", ttl=60).lease
    policy = manager_pb.Policy(idle_sleep_timeout=_duration(T1), idle_deep_sleep_timeout=_duration(T2))
    mask = FieldMask(paths=["idle_sleep_timeout", "idle_deep_sleep_timeout"])
    got = stub.UpdatePolicy(manager_pb.UpdatePolicyRequest(policy=policy, update_mask=mask), timeout=10).policy
    assert (seconds(got.idle_sleep_timeout), seconds(got.idle_deep_sleep_timeout)) == (T1, T2)
    eff = stub.GetPolicy(manager_pb.GetPolicyRequest(name="workers/idle"), timeout=10).policy
    assert (seconds(eff.idle_sleep_timeout), seconds(eff.idle_deep_sleep_timeout)) == (T1, T2)
    assert get(stub, "idle").state == common_pb.WORKER_STATE_AWAKE  # leased: the timers do not touch it

    t_release = time.time()
    released = stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease.lease_id), timeout=10).worker
    assert released.lease_count == 0
    idle_since = seconds(released.idle_since_time)
    assert idle_since >= t_release - EPS, "the idle clock must start at the release"

    # Tier 1 after T1: asleep, weights offloaded byte for byte, KV cache discarded.
    wk = wait_for(lambda: get(stub, "idle"), _is_tier1, timeout=T1 + 15, what="tier-1 sleep (weights OFFLOADED)")
    t = tags(wk)
    assert t["weights"].offloaded_bytes == t["weights"].allocated_bytes
    assert t["weights"].mapped_bytes == 0 and t["kv_cache"].mapped_bytes == 0
    assert wk.status.last_transition.kind == "sleep"
    assert seconds(wk.status.last_transition.end_time) >= idle_since + T1 - EPS, "tier 1 came before T1"
    assert seconds(wk.idle_since_time) == pytest.approx(idle_since), "sleeping must not restart the idle clock"

    # Tier 2 after T2 (same idle clock): level 2, host copy freed.
    wk = wait_for(lambda: get(stub, "idle"), _is_tier2, timeout=T2 + 15, what="tier-2 sleep (weights DISCARDED)")
    assert wk.status.sleep_level == common_pb.SLEEP_LEVEL_2
    assert tags(wk)["weights"].discarded_bytes > 0
    assert seconds(wk.status.last_transition.end_time) >= idle_since + T2 - EPS, "tier 2 came before T2"

    # AcquireWorker wakes it (reloading the discarded weights) and returns once it is ready.
    resp = _acquire(stub, "idle", ttl=60)
    assert resp.worker.state == common_pb.WORKER_STATE_AWAKE
    assert resp.worker.lease_count == 1
    assert resp.lease.worker == "workers/idle" and resp.lease.lease_id
    assert set(tag_states(resp.worker).values()) == {"TAG_STATE_AWAKE"}
    assert _generate(wp) == before, "tokens differ after a level-2 sleep and wake"

    # Leased: stays awake well past T1 and T2.
    watch_until = time.monotonic() + T2 + 0.5
    while time.monotonic() < watch_until:
        wk = get(stub, "idle")
        assert wk.state == common_pb.WORKER_STATE_AWAKE, f"leased worker left AWAKE:\n{wk}"
        assert wk.lease_count == 1
        assert not wk.HasField("idle_since_time"), "idle_since_time must be unset while leased"
        time.sleep(0.1)

    # Release: the idle clock starts again and tier 1 follows after T1.
    t_release = time.time()
    released = stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=resp.lease.lease_id), timeout=10).worker
    idle_since = seconds(released.idle_since_time)
    assert idle_since >= t_release - EPS, "the idle clock must start at the release"
    wk = wait_for(lambda: get(stub, "idle"), _is_tier1, timeout=T1 + 15, what="tier-1 sleep after the release")
    assert seconds(wk.status.last_transition.end_time) >= idle_since + T1 - EPS


def test_lease_of_a_vanished_client_expires_then_idle_timer_sleeps(cluster: Cluster) -> None:
    # Timers seeded from the command line this time.
    mgr = cluster.manager(["--idle-sleep-timeout", str(T1), "--idle-deep-sleep-timeout", "0"])
    stub = mgr.stub
    pol = stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy
    assert seconds(pol.idle_sleep_timeout) == T1 and seconds(pol.idle_deep_sleep_timeout) == 0
    cluster.workers_up(mgr, ["expiry"], state=None)  # may already be asleep: T1 is short

    ttl = 1.0
    resp = _acquire(stub, "expiry", ttl=ttl, holder="gone-client")
    assert resp.worker.state == common_pb.WORKER_STATE_AWAKE and resp.worker.lease_count == 1
    expire = seconds(resp.lease.expire_time)
    assert expire > time.time() - 1  # sanity: a real timestamp near now + ttl
    # The client vanishes: no release, no renewal. The lease ends by itself.
    wk = wait_for(
        lambda: get(stub, "expiry"), lambda wk: wk.lease_count == 0, timeout=ttl + 10, what="the lease to expire"
    )
    assert wk.HasField("idle_since_time")
    assert seconds(wk.idle_since_time) >= expire - EPS, "idle clock must start at the expiry"
    with pytest.raises(grpc.RpcError) as err:
        stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=resp.lease.lease_id), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    wk = wait_for(lambda: get(stub, "expiry"), _is_tier1, timeout=T1 + 15, what="tier-1 sleep after the expiry")
    assert seconds(wk.status.last_transition.end_time) >= expire + T1 - EPS, "slept while the lease lived"
    wk = wait_state(stub, "expiry", common_pb.WORKER_STATE_ASLEEP)
    assert wk.lease_count == 0


def test_a_worker_serving_generate_is_not_idle(cluster: Cluster) -> None:
    mgr = cluster.manager(["--idle-sleep-timeout", str(T1)])
    (wp,) = cluster.workers_up(mgr, ["busy"], state=None)
    resp = _acquire(mgr.stub, "busy", ttl=60)  # awake, whatever the timer did meanwhile
    mgr.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=resp.lease.lease_id), timeout=10)
    # Steady traffic straight to the worker, for well over T1: the worker is not idle.
    until = time.monotonic() + 2.5 * T1
    while time.monotonic() < until:
        assert len(_generate(wp)) == NEW_TOKENS
        assert get(mgr.stub, "busy").state == common_pb.WORKER_STATE_AWAKE
        time.sleep(0.1)


def test_the_idle_sleep_covers_every_tag_of_the_worker_whatever_the_policy_names(cluster: Cluster) -> None:
    """A policy naming only tags this worker does not have used to make every idle sleep an empty
    Sleep (INVALID_ARGUMENT, retried every 5 s, never asleep); one naming some of its tags left the
    others mapped. Tier 1 acts on every tag the worker has: the policy's action where it names the
    tag, else the tag's level-1 action (memsvc.vocabulary.policy_actions); other names are ignored."""
    mgr = cluster.manager()
    stub = mgr.stub
    (wp,) = cluster.workers_up(mgr, ["cover"])
    lease = _acquire(stub, "cover", ttl=60).lease
    mask = FieldMask(paths=["idle_sleep_timeout", "tag_actions"])
    only_other = manager_pb.Policy(idle_sleep_timeout=_duration(T1), tag_actions={"lora": common_pb.TAG_ACTION_DISCARD})
    stub.UpdatePolicy(manager_pb.UpdatePolicyRequest(policy=only_other, update_mask=mask), timeout=10)
    stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease.lease_id), timeout=10)
    wait_for(lambda: get(stub, "cover"), _is_tier1, timeout=T1 + 15, what="tier 1 with a policy naming only 'lora'")
    assert "idle sleep of" not in mgr.stderr_text(), "the idle sleep failed first"

    lease = _acquire(stub, "cover", ttl=60).lease  # wakes it
    only_weights = manager_pb.Policy(
        idle_sleep_timeout=_duration(T1), tag_actions={"weights": common_pb.TAG_ACTION_OFFLOAD}
    )
    stub.UpdatePolicy(manager_pb.UpdatePolicyRequest(policy=only_weights, update_mask=mask), timeout=10)
    stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease.lease_id), timeout=10)
    wk = wait_for(lambda: get(stub, "cover"), _is_tier1, timeout=T1 + 15, what="tier 1 discarding the unnamed kv_cache")
    assert tags(wk)["kv_cache"].mapped_bytes == 0
    assert _acquire(stub, "cover", ttl=60).worker.state == common_pb.WORKER_STATE_AWAKE
    assert len(_generate(wp)) == NEW_TOKENS
