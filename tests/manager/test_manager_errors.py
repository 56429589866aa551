"""Bad input on every RPC of MemoryManagerService: the right status code, and nothing changed.

One manager for the module, with a real worker ("real", awake) and a registered worker nobody
answers for ("ghost", UNAVAILABLE). After every test the ``unchanged`` fixture compares the workers
(state, leases, tags and sizes), the list of workers and the policies with what they were before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.field_mask_pb2 import FieldMask
from managerproc import Cluster, ManagerProcess, get, view, wait_state

from memsvc import error_info
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc
from memsvc.v1 import model_worker_service_pb2 as worker_pb

Code = grpc.StatusCode
REAL, GHOST = "workers/real", "workers/ghost"
T1_S, T2_S = 1000, 2000
"""Idle timers of the module's default policy: long enough never to fire during the tests."""


@pytest.fixture(scope="module")
def mgr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagerProcess]:
    cl = Cluster(tmp_path_factory.mktemp("manager-errors"))
    try:
        mp = cl.manager()
        cl.workers_up(mp, ["real"])
        mp.stub.RegisterWorker(
            manager_pb.RegisterWorkerRequest(worker_id="ghost", address="127.0.0.1:1", host="h"), timeout=10
        )
        wait_state(mp.stub, GHOST, common_pb.WORKER_STATE_UNAVAILABLE)
        mp.stub.UpdatePolicy(
            manager_pb.UpdatePolicyRequest(
                policy=manager_pb.Policy(
                    idle_sleep_timeout=Duration(seconds=T1_S), idle_deep_sleep_timeout=Duration(seconds=T2_S)
                ),
                update_mask=FieldMask(paths=["idle_sleep_timeout", "idle_deep_sleep_timeout"]),
            ),
            timeout=10,
        )
        yield mp
    finally:
        cl.close()


def _snapshot(mp: ManagerProcess) -> dict[str, Any]:
    stub = mp.stub
    listed = stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10)
    return {
        "workers": [x.name for x in listed.workers],
        "real": view(get(stub, REAL)),
        "ghost": view(get(stub, GHOST)),
        "default": stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy.SerializeToString(
            deterministic=True
        ),
        "real policy": stub.GetPolicy(manager_pb.GetPolicyRequest(name=REAL), timeout=10).policy.SerializeToString(
            deterministic=True
        ),
    }


@pytest.fixture
def unchanged(mgr: ManagerProcess) -> Iterator[ManagerProcess]:
    """The manager, checked after the test to be exactly as before it."""
    wait_state(mgr.stub, REAL, common_pb.WORKER_STATE_AWAKE, extra=lambda wk: wk.lease_count == 0)
    before = _snapshot(mgr)
    yield mgr
    assert _snapshot(mgr) == before, "a rejected request changed the manager's state"


def _expect(code: grpc.StatusCode, call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        if hasattr(result, "__next__"):  # a stream: its first message (or its error)
            next(result)
    assert err.value.code() == code, f"{err.value.code()}: {err.value.details()}"
    assert err.value.details(), "an error without a message"
    if code != Code.UNAVAILABLE:  # the manager answers these itself, with an ErrorInfo detail
        info = error_info(err.value)
        assert info is not None and info.domain == "memsvc.dev", "no google.rpc.ErrorInfo detail"
    return err.value


# ---- requests naming a worker ----

NAMED_CALLS: dict[str, Callable[[manager_grpc.MemoryManagerServiceStub, str], Any]] = {
    "GetWorker": lambda s, n: s.GetWorker(manager_pb.GetWorkerRequest(name=n), timeout=10),
    "SleepWorker": lambda s, n: s.SleepWorker(manager_pb.SleepWorkerRequest(name=n), timeout=10),
    "WakeWorker": lambda s, n: s.WakeWorker(manager_pb.WakeWorkerRequest(name=n), timeout=10),
    "SwapWorkerBlocks": lambda s, n: s.SwapWorkerBlocks(
        manager_pb.SwapWorkerBlocksRequest(
            name=n,
            direction=common_pb.SWAP_DIRECTION_DEVICE_TO_HOST,
            pairs=[worker_pb.BlockPair(src_block=0, dst_block=0)],
        ),
        timeout=10,
    ),
    "AcquireWorker": lambda s, n: s.AcquireWorker(
        manager_pb.AcquireWorkerRequest(name=n, ttl=Duration(seconds=30)), timeout=10
    ),
    "GetPolicy": lambda s, n: s.GetPolicy(manager_pb.GetPolicyRequest(name=n), timeout=10),
    "UpdatePolicy": lambda s, n: s.UpdatePolicy(
        manager_pb.UpdatePolicyRequest(
            name=n,
            policy=manager_pb.Policy(device_budget_bytes=1 << 20),
            update_mask=FieldMask(paths=["device_budget_bytes"]),
        ),
        timeout=10,
    ),
    "WatchWorkers": lambda s, n: s.WatchWorkers(manager_pb.WatchWorkersRequest(names=[REAL, n]), timeout=10),
}


@pytest.mark.parametrize("rpc", list(NAMED_CALLS))
@pytest.mark.parametrize("worker", ["workers/nobody", "nobody"])
def test_unknown_worker_is_not_found(unchanged: ManagerProcess, rpc: str, worker: str) -> None:
    err = _expect(Code.NOT_FOUND, lambda: NAMED_CALLS[rpc](unchanged.stub, worker))
    assert "nobody" in (err.details() or "")


MALFORMED = ["workers/", "a/b", "workers/a/b", "workers/x\ny", "workers/" + "x" * 129, ""]


@pytest.mark.parametrize(
    "rpc, worker",
    [
        (rpc, worker)
        for rpc in NAMED_CALLS
        for worker in MALFORMED
        if not (worker == "" and rpc in ("GetPolicy", "UpdatePolicy"))  # there "" names the default policy
    ],
)
def test_malformed_worker_name_is_invalid_argument(unchanged: ManagerProcess, rpc: str, worker: str) -> None:
    _expect(Code.INVALID_ARGUMENT, lambda: NAMED_CALLS[rpc](unchanged.stub, worker))


@pytest.mark.parametrize("rpc", ["SleepWorker", "WakeWorker", "SwapWorkerBlocks", "AcquireWorker"])
def test_unreachable_worker_is_unavailable(unchanged: ManagerProcess, rpc: str) -> None:
    _expect(Code.UNAVAILABLE, lambda: NAMED_CALLS[rpc](unchanged.stub, GHOST))
    assert get(unchanged.stub, GHOST).lease_count == 0


def test_unreachable_worker_is_still_listed_and_described(unchanged: ManagerProcess) -> None:
    ghost = get(unchanged.stub, GHOST)
    assert ghost.state == common_pb.WORKER_STATE_UNAVAILABLE and ghost.address == "127.0.0.1:1" and ghost.host == "h"
    assert not ghost.configured


# ---- policies ----


def _dur(seconds: int = 0, nanos: int = 0) -> Duration:
    return Duration(seconds=seconds, nanos=nanos)


BAD_POLICIES: dict[str, tuple[manager_pb.Policy, list[str]]] = {
    "negative idle_sleep_timeout": (manager_pb.Policy(idle_sleep_timeout=_dur(-1)), ["idle_sleep_timeout"]),
    "negative idle_sleep_timeout nanos": (manager_pb.Policy(idle_sleep_timeout=_dur(0, -5)), ["idle_sleep_timeout"]),
    "negative idle_deep_sleep_timeout": (
        manager_pb.Policy(idle_deep_sleep_timeout=_dur(-3)),
        ["idle_deep_sleep_timeout"],
    ),
    "negative device budget": (manager_pb.Policy(device_budget_bytes=-1), ["device_budget_bytes"]),
    "negative host budget": (manager_pb.Policy(host_budget_bytes=-(1 << 30)), ["host_budget_bytes"]),
    "T2 < T1 in one request": (
        manager_pb.Policy(idle_sleep_timeout=_dur(10), idle_deep_sleep_timeout=_dur(5)),
        ["idle_sleep_timeout", "idle_deep_sleep_timeout"],
    ),
    "T2 below the stored T1": (manager_pb.Policy(idle_deep_sleep_timeout=_dur(T1_S - 1)), ["idle_deep_sleep_timeout"]),
    "T1 above the stored T2": (manager_pb.Policy(idle_sleep_timeout=_dur(T2_S + 1)), ["idle_sleep_timeout"]),
    "timeout over a year": (manager_pb.Policy(idle_sleep_timeout=_dur(400 * 24 * 3600)), ["idle_sleep_timeout"]),
    "unknown tag action": (manager_pb.Policy(tag_actions={"weights": 9}), ["tag_actions"]),  # type: ignore[dict-item]
    "unspecified tag action": (
        manager_pb.Policy(tag_actions={"weights": common_pb.TAG_ACTION_UNSPECIFIED}),
        ["tag_actions"],
    ),
    "empty tag name": (manager_pb.Policy(tag_actions={"": common_pb.TAG_ACTION_KEEP}), ["tag_actions"]),
    "unknown update_mask path": (manager_pb.Policy(device_budget_bytes=1), ["device_budget"]),
    "update_mask path with a prefix": (manager_pb.Policy(device_budget_bytes=1), ["policy.device_budget_bytes"]),
    "one good and one unknown path": (manager_pb.Policy(device_budget_bytes=1), ["device_budget_bytes", "nope"]),
    "negative budget, whole policy": (manager_pb.Policy(host_budget_bytes=-1), []),
}


@pytest.mark.parametrize("scope", ["", REAL])
@pytest.mark.parametrize("case", list(BAD_POLICIES))
def test_bad_policy_is_invalid_argument(unchanged: ManagerProcess, scope: str, case: str) -> None:
    policy, paths = BAD_POLICIES[case]
    req = manager_pb.UpdatePolicyRequest(name=scope, policy=policy, update_mask=FieldMask(paths=paths))
    _expect(Code.INVALID_ARGUMENT, lambda: unchanged.stub.UpdatePolicy(req, timeout=10))


def test_update_policy_without_a_policy_is_invalid_argument(unchanged: ManagerProcess) -> None:
    _expect(Code.INVALID_ARGUMENT, lambda: unchanged.stub.UpdatePolicy(manager_pb.UpdatePolicyRequest(), timeout=10))


# ---- leases ----


def test_release_with_an_empty_lease_id_is_invalid_argument(unchanged: ManagerProcess) -> None:
    _expect(Code.INVALID_ARGUMENT, lambda: unchanged.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(), timeout=10))


def test_release_of_an_unknown_lease_is_not_found(unchanged: ManagerProcess) -> None:
    req = manager_pb.ReleaseWorkerRequest(lease_id="0123456789abcdef0123456789abcdef")
    _expect(Code.NOT_FOUND, lambda: unchanged.stub.ReleaseWorker(req, timeout=10))


@pytest.mark.parametrize(
    "ttl", [_dur(-1), _dur(0, -1), _dur(-5, 0), _dur(25 * 3600), _dur(0)], ids=["-1s", "-1ns", "-5s", "over-max", "0s"]
)
def test_acquire_with_a_bad_ttl_is_invalid_argument(unchanged: ManagerProcess, ttl: Duration) -> None:
    req = manager_pb.AcquireWorkerRequest(name=REAL, ttl=ttl)
    _expect(Code.INVALID_ARGUMENT, lambda: unchanged.stub.AcquireWorker(req, timeout=10))


def test_acquire_with_a_too_long_holder_is_invalid_argument(unchanged: ManagerProcess) -> None:
    req = manager_pb.AcquireWorkerRequest(name=REAL, ttl=_dur(30), holder="h" * 257)
    _expect(Code.INVALID_ARGUMENT, lambda: unchanged.stub.AcquireWorker(req, timeout=10))


def test_renewing_an_unknown_lease_is_not_found(unchanged: ManagerProcess) -> None:
    req = manager_pb.AcquireWorkerRequest(name=REAL, ttl=_dur(30), lease_id="no-such-lease")
    _expect(Code.NOT_FOUND, lambda: unchanged.stub.AcquireWorker(req, timeout=10))


def test_leased_worker_refuses_sleep_and_a_lease_renews_only_on_its_worker(unchanged: ManagerProcess) -> None:
    stub = unchanged.stub
    lease = stub.AcquireWorker(manager_pb.AcquireWorkerRequest(name=REAL, ttl=_dur(60), holder="t"), timeout=30).lease
    try:
        leased = view(get(stub, REAL))
        assert leased[3] == 1
        for sleep_req in (
            manager_pb.SleepWorkerRequest(name=REAL),
            manager_pb.SleepWorkerRequest(name=REAL, level=common_pb.SLEEP_LEVEL_2),
            manager_pb.SleepWorkerRequest(name=REAL, tag_actions={"kv_cache": common_pb.TAG_ACTION_DISCARD}),
        ):
            err = _expect(Code.FAILED_PRECONDITION, functools.partial(stub.SleepWorker, sleep_req, timeout=30))
            info = error_info(err)
            assert info is not None and info.reason == "WRONG_STATE", info
            assert info.metadata["workerId"] == "real" and info.metadata["leaseCount"] == "1", info
            assert view(get(stub, REAL)) == leased
        # Renewing with the right lease id on the wrong worker is NOT_FOUND, and changes no lease.
        req = manager_pb.AcquireWorkerRequest(name=GHOST, ttl=_dur(30), lease_id=lease.lease_id)
        _expect(Code.NOT_FOUND, lambda: stub.AcquireWorker(req, timeout=10))
        # Renewing on the right worker extends the same lease.
        renewed = stub.AcquireWorker(
            manager_pb.AcquireWorkerRequest(name=REAL, ttl=_dur(600), lease_id=lease.lease_id), timeout=10
        ).lease
        assert renewed.lease_id == lease.lease_id
        assert renewed.expire_time.ToNanoseconds() > lease.expire_time.ToNanoseconds()
        assert view(get(stub, REAL)) == leased
    finally:
        stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease.lease_id), timeout=10)
    # Released: the lease is gone for good.
    _expect(
        Code.NOT_FOUND, lambda: stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease.lease_id), timeout=10)
    )


# ---- transitions the worker refuses ----


@pytest.mark.parametrize(
    "req",
    [
        manager_pb.SleepWorkerRequest(name=REAL, level=7),  # type: ignore[arg-type]
        manager_pb.SleepWorkerRequest(name=REAL, tag_actions={"weights": 9}),  # type: ignore[dict-item]
        manager_pb.SleepWorkerRequest(name=REAL, tag_actions={"no-such-tag": common_pb.TAG_ACTION_OFFLOAD}),
    ],
    ids=["level 7", "action 9", "unknown tag"],
)
def test_bad_sleep_request_is_invalid_argument(unchanged: ManagerProcess, req: manager_pb.SleepWorkerRequest) -> None:
    _expect(Code.INVALID_ARGUMENT, lambda: unchanged.stub.SleepWorker(req, timeout=30))


def test_waking_an_awake_worker_is_failed_precondition(unchanged: ManagerProcess) -> None:
    """The worker's own refusal, relayed, names the worker (a client acting on many tells which)."""
    req = manager_pb.WakeWorkerRequest(name=REAL)
    err = _expect(Code.FAILED_PRECONDITION, lambda: unchanged.stub.WakeWorker(req, timeout=30))
    info = error_info(err)
    assert info is not None and info.reason == "WRONG_STATE" and info.metadata["workerId"] == "real", info


@pytest.mark.parametrize(
    "direction, pairs",
    [
        (common_pb.SWAP_DIRECTION_UNSPECIFIED, [(0, 0)]),
        (common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, []),
        (common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, [(0, 100_000)]),
        (common_pb.SWAP_DIRECTION_HOST_TO_DEVICE, [(-1, 0)]),
        (common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, [(0, 1), (0, 2)]),
    ],
    ids=["no direction", "no pairs", "dst out of range", "negative src", "src twice"],
)
def test_bad_swap_is_invalid_argument(
    unchanged: ManagerProcess, direction: common_pb.SwapDirection.ValueType, pairs: list[tuple[int, int]]
) -> None:
    req = manager_pb.SwapWorkerBlocksRequest(
        name=REAL, direction=direction, pairs=[worker_pb.BlockPair(src_block=s, dst_block=d) for s, d in pairs]
    )
    _expect(Code.INVALID_ARGUMENT, lambda: unchanged.stub.SwapWorkerBlocks(req, timeout=30))


def test_swap_through_the_manager_moves_blocks(mgr: ManagerProcess) -> None:
    kv = get(mgr.stub, REAL).status.kv_cache
    req = manager_pb.SwapWorkerBlocksRequest(
        name=REAL,
        direction=common_pb.SWAP_DIRECTION_DEVICE_TO_HOST,
        pairs=[worker_pb.BlockPair(src_block=1, dst_block=2)],
    )
    resp = mgr.stub.SwapWorkerBlocks(req, timeout=30)
    assert resp.moved_bytes == kv.block_bytes > 0
    assert resp.kv_cache.device_block_count == kv.device_block_count
    # The packed form passes through too (free blocks: a plain copy, nothing changes hands).
    req = manager_pb.SwapWorkerBlocksRequest(
        name=REAL, direction=common_pb.SWAP_DIRECTION_HOST_TO_DEVICE, src_blocks=[2, 3, 4], dst_blocks=[5, 6, 7]
    )
    resp = mgr.stub.SwapWorkerBlocks(req, timeout=30)
    assert resp.moved_bytes == 3 * kv.block_bytes
    assert resp.kv_cache.device_free_block_count == kv.device_free_block_count
    req.pairs.append(worker_pb.BlockPair(src_block=1, dst_block=2))  # both forms at once
    _expect(Code.INVALID_ARGUMENT, lambda: mgr.stub.SwapWorkerBlocks(req, timeout=30))
    # And the raw form: 4-byte little-endian ids (back out to the host blocks they came from).
    raw = manager_pb.SwapWorkerBlocksRequest(
        name=REAL,
        direction=common_pb.SWAP_DIRECTION_DEVICE_TO_HOST,
        src_blocks_u32le=b"".join(x.to_bytes(4, "little") for x in (5, 6, 7)),
        dst_blocks_u32le=b"".join(x.to_bytes(4, "little") for x in (2, 3, 4)),
    )
    resp = mgr.stub.SwapWorkerBlocks(raw, timeout=30)
    assert resp.moved_bytes == 3 * kv.block_bytes
    raw.dst_blocks_u32le = raw.dst_blocks_u32le[:-1]  # not whole ids
    _expect(Code.INVALID_ARGUMENT, lambda: mgr.stub.SwapWorkerBlocks(raw, timeout=30))


def test_swap_on_a_sleeping_kv_cache_is_failed_precondition(mgr: ManagerProcess) -> None:
    stub = mgr.stub
    stub.SleepWorker(manager_pb.SleepWorkerRequest(name=REAL), timeout=60)
    try:
        before = view(wait_state(stub, REAL, common_pb.WORKER_STATE_ASLEEP))
        req = manager_pb.SwapWorkerBlocksRequest(
            name=REAL,
            direction=common_pb.SWAP_DIRECTION_DEVICE_TO_HOST,
            pairs=[worker_pb.BlockPair(src_block=0, dst_block=0)],
        )
        _expect(Code.FAILED_PRECONDITION, lambda: stub.SwapWorkerBlocks(req, timeout=30))
        # Sleeping again is a wrong state too, relayed from the worker.
        _expect(
            Code.FAILED_PRECONDITION, lambda: stub.SleepWorker(manager_pb.SleepWorkerRequest(name=REAL), timeout=30)
        )
        assert view(get(stub, REAL)) == before
    finally:
        stub.WakeWorker(manager_pb.WakeWorkerRequest(name=REAL), timeout=60)
    wait_state(stub, REAL, common_pb.WORKER_STATE_AWAKE)


# ---- registry ----


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagerProcess]:
    """A manager of its own for registrations, so one that wrongly succeeds cannot disturb the others."""
    cl = Cluster(tmp_path_factory.mktemp("manager-register"))
    try:
        yield cl.manager()
    finally:
        cl.close()


def _not_registered(mp: ManagerProcess, worker_id: str) -> None:
    listed = [x.name for x in mp.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers]
    assert f"workers/{worker_id}" not in listed, f"a rejected registration left a record: {listed}"


@pytest.mark.parametrize(
    "address",
    [
        "",
        "localhost",
        "localhost:",
        "localhost:http",
        "localhost:-1",
        "localhost:50061/x",
        "localhost:99999",
        "localhost:0",
    ],
)
def test_register_with_a_bad_address_is_invalid_argument(bare: ManagerProcess, address: str) -> None:
    wid = "newcomer-" + "".join(ch if ch.isalnum() else "_" for ch in address)
    req = manager_pb.RegisterWorkerRequest(worker_id=wid, address=address, host="h")
    _expect(Code.INVALID_ARGUMENT, lambda: bare.stub.RegisterWorker(req, timeout=10))
    _not_registered(bare, wid)


@pytest.mark.parametrize("worker_id", ["", "workers/", "a/b", "x" * 129])
def test_register_with_a_bad_worker_id_is_invalid_argument(bare: ManagerProcess, worker_id: str) -> None:
    before = bare.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10)
    req = manager_pb.RegisterWorkerRequest(worker_id=worker_id, address="127.0.0.1:5", host="h")
    _expect(Code.INVALID_ARGUMENT, lambda: bare.stub.RegisterWorker(req, timeout=10))
    assert bare.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10) == before


def test_list_with_a_negative_page_size_is_invalid_argument(unchanged: ManagerProcess) -> None:
    _expect(
        Code.INVALID_ARGUMENT,
        lambda: unchanged.stub.ListWorkers(manager_pb.ListWorkersRequest(page_size=-1), timeout=10),
    )


@pytest.mark.parametrize(
    "token",
    [
        "garbage",
        "zzzz",
        "!!!!",
        "%%%",
        "bm8=x",
    ],
)
def test_list_with_a_garbage_page_token_is_invalid_argument(unchanged: ManagerProcess, token: str) -> None:
    req = manager_pb.ListWorkersRequest(page_size=1, page_token=token)
    _expect(Code.INVALID_ARGUMENT, lambda: unchanged.stub.ListWorkers(req, timeout=10))


def test_list_pages_through_every_worker_in_name_order(unchanged: ManagerProcess) -> None:
    stub = unchanged.stub
    seen: list[str] = []
    token = ""
    for _ in range(10):
        page = stub.ListWorkers(manager_pb.ListWorkersRequest(page_size=1, page_token=token), timeout=10)
        assert len(page.workers) == 1
        seen.append(page.workers[0].name)
        token = page.next_page_token
        if not token:
            break
    assert seen == [GHOST, REAL]
    everything = stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10)
    assert [x.name for x in everything.workers] == [GHOST, REAL] and not everything.next_page_token
    assert [x.name for x in stub.ListWorkers(manager_pb.ListWorkersRequest(page_size=5000), timeout=10).workers] == seen


def test_heartbeat_with_the_same_address_changes_nothing(unchanged: ManagerProcess) -> None:
    """RegisterWorker is also the heartbeat: repeating it keeps the record, reachable state and leases."""
    stub = unchanged.stub
    real = get(stub, REAL)
    resp = stub.RegisterWorker(
        manager_pb.RegisterWorkerRequest(worker_id="real", address=real.address, host=real.host), timeout=10
    )
    assert resp.worker.name == REAL and resp.heartbeat_interval.ToNanoseconds() > 0


def test_a_default_change_cannot_make_a_workers_effective_policy_invalid(bare: ManagerProcess) -> None:
    stub = bare.stub
    stub.RegisterWorker(manager_pb.RegisterWorkerRequest(worker_id="pol", address="127.0.0.1:1", host="h"), timeout=10)
    override = manager_pb.Policy(idle_deep_sleep_timeout=_dur(50))
    mask = FieldMask(paths=["idle_deep_sleep_timeout"])
    stub.UpdatePolicy(manager_pb.UpdatePolicyRequest(name="workers/pol", policy=override, update_mask=mask), timeout=10)
    try:
        default = manager_pb.Policy(idle_sleep_timeout=_dur(100))
        stub.UpdatePolicy(
            manager_pb.UpdatePolicyRequest(policy=default, update_mask=FieldMask(paths=["idle_sleep_timeout"])),
            timeout=10,
        )
    except grpc.RpcError as err:  # refusing the change is one right answer
        assert err.code() == Code.INVALID_ARGUMENT
    eff = stub.GetPolicy(manager_pb.GetPolicyRequest(name="workers/pol"), timeout=10).policy
    t1, t2 = eff.idle_sleep_timeout.ToNanoseconds(), eff.idle_deep_sleep_timeout.ToNanoseconds()
    assert not (t1 and t2 and t2 < t1), f"effective policy of workers/pol has T1={t1} ns > T2={t2} ns"


def test_worker_names_follow_one_rule_and_not_found_has_one_wording(unchanged: ManagerProcess) -> None:
    """``workers/{id}`` and the bare ``{id}`` name the same worker in every RPC; NOT_FOUND names it as
    ``workers/{id}`` however it was spelled; a malformed name is INVALID_ARGUMENT everywhere."""
    stub = unchanged.stub
    assert stub.GetWorker(manager_pb.GetWorkerRequest(name="real"), timeout=10).worker.name == REAL
    assert stub.GetWorker(manager_pb.GetWorkerRequest(name=REAL), timeout=10).worker.name == REAL
    texts = set()
    calls: list[Callable[[str], Any]] = [
        lambda n: stub.GetWorker(manager_pb.GetWorkerRequest(name=n), timeout=10),
        lambda n: stub.SleepWorker(manager_pb.SleepWorkerRequest(name=n), timeout=10),
        lambda n: stub.AcquireWorker(manager_pb.AcquireWorkerRequest(name=n), timeout=10),
        lambda n: next(iter(stub.WatchWorkers(manager_pb.WatchWorkersRequest(names=[n]), timeout=10))),
    ]
    for spelled in ("nope", "workers/nope"):
        for call in calls:
            err = _expect(grpc.StatusCode.NOT_FOUND, functools.partial(call, spelled))
            texts.add(err.details())
            info = error_info(err)
            assert info is not None and info.metadata["name"] == "workers/nope", info
    assert texts == {"no worker 'workers/nope'"}, texts
    for bad in ("WORKERS/real", "workers/", "a/b"):
        for call in (calls[0], calls[3]):
            _expect(grpc.StatusCode.INVALID_ARGUMENT, functools.partial(call, bad))


def test_a_workers_override_can_be_removed_and_it_follows_the_default_again(unchanged: ManagerProcess) -> None:
    """An override of 0 shadowed the default for good; clear_fields removes it (also with "*"), and
    a bad clear is INVALID_ARGUMENT that changes nothing."""
    stub = unchanged.stub
    default = stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy
    zero = manager_pb.Policy(idle_sleep_timeout=Duration(seconds=0))
    mask = FieldMask(paths=["idle_sleep_timeout"])
    got = stub.UpdatePolicy(manager_pb.UpdatePolicyRequest(name=REAL, policy=zero, update_mask=mask), timeout=10).policy
    assert got.idle_sleep_timeout.ToSeconds() == 0 != default.idle_sleep_timeout.ToSeconds()
    cleared = stub.UpdatePolicy(
        manager_pb.UpdatePolicyRequest(name=REAL, clear_fields=["idle_sleep_timeout"]), timeout=10
    )
    assert cleared.policy.idle_sleep_timeout == default.idle_sleep_timeout, "it follows the default again"
    stub.UpdatePolicy(manager_pb.UpdatePolicyRequest(name=REAL, policy=zero, update_mask=mask), timeout=10)
    everything = stub.UpdatePolicy(manager_pb.UpdatePolicyRequest(name=REAL, clear_fields=["*"]), timeout=10).policy
    assert everything == stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy
    for bad in (
        manager_pb.UpdatePolicyRequest(clear_fields=["idle_sleep_timeout"]),  # the default has no overrides
        manager_pb.UpdatePolicyRequest(name=REAL, clear_fields=["bogus"]),
        manager_pb.UpdatePolicyRequest(name=REAL, policy=zero, update_mask=mask, clear_fields=["idle_sleep_timeout"]),
        manager_pb.UpdatePolicyRequest(name=REAL),  # neither a policy nor fields to clear
    ):
        _expect(grpc.StatusCode.INVALID_ARGUMENT, functools.partial(stub.UpdatePolicy, bad, timeout=10))
