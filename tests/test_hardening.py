"""Broken promises and missing bounds found by attacking a live manager and worker, each a test that
failed before its fix (real processes where the bug needs them).

- a transition whose caller gave up never runs later behind the caller's back, so a lease granted
  meanwhile is never broken;
- work ends when its caller leaves: an expired Generate stops and frees its blocks, queued work is
  bounded, SIGTERM meets the drain time;
- retries with one request_id share one result (one lease, one sleep), on the manager and the worker;
- every string and count a client can make a server keep is bounded, and a refused call keeps nothing;
- a manager paused for longer than the silence limit does not mark healthy workers unavailable.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.field_mask_pb2 import FieldMask
from managerproc import Cluster, get, name, wait_for, wait_state
from workerproc import WorkerProcess

from memsvc import error_info
from memsvc.runtime.limits import MAX_ID_BYTES, MAX_QUEUED_GENERATES, MAX_SWAP_PAIRS
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

LONG = 2000
"""Tokens of a Generate that keeps synthetic:tiny's device loop busy for ~2 s on this host."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cl = Cluster(tmp_path)
    yield cl
    cl.close()


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    raise AssertionError("the call succeeded")


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    try:
        call()
    except grpc.RpcError as err:
        return err
    raise AssertionError("the call succeeded")


def worker_status(stub: worker_grpc.ModelWorkerServiceStub) -> common_pb.WorkerStatus:
    return stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status


def busy_generates(stub: worker_grpc.ModelWorkerServiceStub, count: int, tokens: int = LONG) -> ThreadPoolExecutor:
    """``count`` long Generate calls, each already admitted by the engine when this returns (its
    sequence exists): a Generate still on its way when a Sleep arrives is refused instead of waited for."""
    base = worker_status(stub).kv_cache.sequence_count
    pool = ThreadPoolExecutor(count)
    req = worker_pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=tokens)
    calls = [pool.submit(stub.Generate, req, timeout=300) for _ in range(count)]
    wait_for(
        lambda: worker_status(stub).kv_cache.sequence_count,
        lambda n: n >= base + count or any(f.done() for f in calls),
        what="the busy Generates to be admitted",
    )
    early = [f.exception() for f in calls if f.done()]
    assert not early, f"a busy Generate ended at once: {early}"
    return pool


# ---- 1. a transition the caller gave up on does not run later ----


def test_a_sleep_whose_caller_gave_up_behind_a_generate_never_breaks_a_lease_granted_after(cluster: Cluster) -> None:
    mgr = cluster.manager()
    (wp,) = cluster.workers_up(mgr, ["leased"])
    pool = busy_generates(wp.stub, 3)  # seconds of device work running
    sleep = manager_pb.SleepWorkerRequest(name=name("leased"), level=common_pb.SLEEP_LEVEL_1)
    assert code_of(lambda: mgr.stub.SleepWorker(sleep, timeout=0.5)) == grpc.StatusCode.DEADLINE_EXCEEDED
    after = manager_pb.AcquireWorkerRequest(name=name("leased"), holder="after", ttl=Duration(seconds=600))
    lease = mgr.stub.AcquireWorker(after, timeout=60)  # the TTL outlasts the Generates on a loaded machine
    assert lease.worker.state == common_pb.WORKER_STATE_AWAKE
    pool.shutdown(wait=True)  # the Generates are done: a queued Sleep would run now
    time.sleep(1.0)
    st = worker_status(wp.stub)
    assert st.state == common_pb.WORKER_STATE_AWAKE and not st.transition_in_progress, "the abandoned Sleep ran"
    assert get(mgr.stub, "leased").lease_count == 1
    out = wp.stub.Generate(worker_pb.GenerateRequest(prompt_token_ids=[1, 2], max_new_tokens=4), timeout=30)
    assert len(out.token_ids) == 4
    mgr.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease.lease.lease_id), timeout=10)


def test_a_queued_worker_sleep_whose_caller_left_never_runs_and_frees_the_transition_lock() -> None:
    with WorkerProcess(["--model", "synthetic:tiny"]) as wp:
        pool = busy_generates(wp.stub, 2)
        req = worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1)
        # the client's timer, or the worker's answer that the deadline passed before it could start
        # (CANCELLED, docs/operations.md), whichever comes first on a loaded machine: it never ran
        code = code_of(lambda: wp.stub.Sleep(req, timeout=0.3))
        assert code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED), code
        st = wait_for(
            lambda: worker_status(wp.stub),
            lambda s: not s.transition_in_progress,
            timeout=5,
            what="the abandoned Sleep to let go of the lock while the Generates still run",
        )
        assert st.state == common_pb.WORKER_STATE_AWAKE
        pool.shutdown(wait=True)
        assert worker_status(wp.stub).state == common_pb.WORKER_STATE_AWAKE
        assert wp.stub.Sleep(req, timeout=30).status.state == common_pb.WORKER_STATE_ASLEEP  # the lock is free


# ---- 2. work ends when its caller leaves; queues are bounded; SIGTERM drains in time ----


def test_expired_generates_stop_and_free_their_blocks_and_a_sleep_after_them_runs_at_once() -> None:
    with WorkerProcess(["--model", "synthetic:small"]) as wp:
        base = worker_status(wp.stub).kv_cache
        req = worker_pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=LONG)
        with ThreadPoolExecutor(20) as pool:
            codes = list(pool.map(lambda _: code_of(lambda: wp.stub.Generate(req, timeout=0.3)), range(20)))
        assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}
        t0 = time.monotonic()
        r = wp.stub.Sleep(
            worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1), timeout=20
        )  # 20 x 2000 tokens would be minutes
        assert r.status.state == common_pb.WORKER_STATE_ASLEEP, f"after {time.monotonic() - t0:.1f} s"
        wp.stub.WakeUp(worker_pb.WakeUpRequest(), timeout=30)
        kv = worker_status(wp.stub).kv_cache
        assert (kv.device_free_block_count, kv.sequence_count) == (base.device_free_block_count, base.sequence_count)


def test_a_cancelled_generate_keeps_no_sequence_and_a_continued_one_goes_back_to_before() -> None:
    with WorkerProcess(["--model", "synthetic:small"]) as wp:
        base = worker_status(wp.stub).kv_cache
        new = worker_pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=LONG, sequence_id="fresh")
        assert code_of(lambda: wp.stub.Generate(new, timeout=0.5)) == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(
            lambda: worker_status(wp.stub).kv_cache,
            lambda kv: kv.sequence_count == base.sequence_count,
            what="the cancelled call's sequence to be freed",
        )
        assert code_of(lambda: wp.stub.FreeSequence(worker_pb.FreeSequenceRequest(sequence_id="fresh"))) == (
            grpc.StatusCode.NOT_FOUND
        )
        kept = wp.stub.Generate(
            worker_pb.GenerateRequest(prompt_token_ids=[5, 6, 7], max_new_tokens=8, sequence_id="kept")
        )
        more = worker_pb.GenerateRequest(max_new_tokens=LONG, sequence_id="kept")
        assert code_of(lambda: wp.stub.Generate(more, timeout=0.5)) == grpc.StatusCode.DEADLINE_EXCEEDED
        kv = wait_for(
            lambda: worker_status(wp.stub).kv_cache,
            lambda kv: kv.device_free_block_count == base.device_free_block_count - len(kept.block_ids),
            what="the continued sequence's new blocks to be given back",
        )
        assert kv.sequence_count == base.sequence_count + 1
        # the same continuation, uncancelled, gives what it would have given had the failed call never been
        again = wp.stub.Generate(worker_pb.GenerateRequest(max_new_tokens=4, sequence_id="kept"), timeout=60)
        ref = wp.stub.Generate(worker_pb.GenerateRequest(prompt_token_ids=[5, 6, 7], max_new_tokens=12), timeout=60)
        assert list(kept.token_ids) + list(again.token_ids) == list(ref.token_ids)


def test_generate_calls_beyond_the_queue_bound_are_refused_resource_exhausted() -> None:
    with WorkerProcess(["--model", "synthetic:small"]) as wp:
        n = MAX_QUEUED_GENERATES + 8
        req = worker_pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=LONG)
        calls = [wp.stub.Generate.future(req, timeout=120) for _ in range(n)]
        # every call arrives long before the first finishes (~9 s): exactly the 8 beyond the bound end at once
        done = wait_for(
            lambda: [f for f in calls if f.done()],
            lambda d: len(d) >= 8,
            timeout=8,
            what="the calls beyond the bound to be refused",
        )
        refused = [f.exception() for f in done]
        assert len(refused) == 8, [f.code() for f in done]
        assert {e.code() for e in refused if isinstance(e, grpc.RpcError)} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert isinstance(refused[0], grpc.RpcError)
        info = error_info(refused[0])
        assert (
            info is not None and info.reason == "OVERLOADED" and info.metadata["maxQueued"] == str(MAX_QUEUED_GENERATES)
        )
        for call in calls:  # the callers leave: every queued one is dropped, the running one stops
            call.cancel()
        small = worker_pb.GenerateRequest(prompt_token_ids=[1, 2], max_new_tokens=2)
        r = wait_for(
            lambda: wp.stub.Generate(small, timeout=20),
            lambda r: len(r.token_ids) == 2,
            timeout=10,
            what="the bound to take calls again once their callers left",
        )
        assert len(r.token_ids) == 2


def test_sigterm_cancels_what_still_runs_after_the_drain_time() -> None:
    wp = WorkerProcess(["--model", "synthetic:small", "--drain-timeout", "2"]).start()
    try:
        pool = busy_generates(wp.stub, 10)  # far more work than the drain time
        t0 = time.monotonic()
        assert wp.proc is not None
        wp.proc.send_signal(signal.SIGTERM)
        assert wp.proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 15, "the drain took far longer than --drain-timeout"
        pool.shutdown(wait=False, cancel_futures=True)
    finally:
        wp.kill()


# ---- 3. one request_id, one result ----


def test_concurrent_acquires_with_one_request_id_grant_one_lease(cluster: Cluster) -> None:
    mgr = cluster.manager()
    cluster.workers_up(mgr, ["once"])
    mgr.stub.SleepWorker(manager_pb.SleepWorkerRequest(name=name("once"), level=common_pb.SLEEP_LEVEL_1), timeout=60)
    req = manager_pb.AcquireWorkerRequest(
        name=name("once"), holder="retry", request_id="acq-1", ttl=Duration(seconds=300)
    )
    with ThreadPoolExecutor(5) as pool:
        leases = list(pool.map(lambda _: mgr.stub.AcquireWorker(req, timeout=60).lease.lease_id, range(5)))
    assert len(set(leases)) == 1
    assert get(mgr.stub, "once").lease_count == 1
    mgr.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=leases[0]), timeout=10)
    assert get(mgr.stub, "once").lease_count == 0


def test_concurrent_worker_sleeps_with_one_request_id_share_the_first_result() -> None:
    with WorkerProcess(["--model", "synthetic:tiny"]) as wp:
        pool = busy_generates(wp.stub, 1)  # the first Sleep queues behind it, the retries arrive meanwhile
        req = worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1, request_id="sleep-1")
        with ThreadPoolExecutor(4) as sleeps:
            # as long as the Generate's own deadline: the Sleeps wait for it, and on a loaded 2-core
            # machine its 2,000 tokens took over 60 s (DEADLINE_EXCEEDED in a run beside two others)
            answers = list(sleeps.map(lambda _: wp.stub.Sleep(req, timeout=300), range(4)))
        pool.shutdown(wait=True)
        assert len({a.transition.SerializeToString() for a in answers}) == 1
        assert worker_status(wp.stub).last_transition.kind == "sleep"


# ---- 4-9. bounds ----


def test_register_worker_refuses_oversized_fields_and_listing_keeps_working(cluster: Cluster) -> None:
    mgr = cluster.manager()
    huge = "h" * (5 << 20)
    for req in (
        manager_pb.RegisterWorkerRequest(worker_id="big", address=huge + ":1", host="h"),
        manager_pb.RegisterWorkerRequest(worker_id="big", address="127.0.0.1:9", host=huge),
        manager_pb.RegisterWorkerRequest(worker_id="x" * (MAX_ID_BYTES + 1), address="127.0.0.1:9", host="h"),
    ):
        assert code_of(functools.partial(mgr.stub.RegisterWorker, req, timeout=30)) == grpc.StatusCode.INVALID_ARGUMENT
    assert list(mgr.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers) == []


def test_request_ids_and_sequence_ids_are_bounded_and_a_refused_call_keeps_nothing(cluster: Cluster) -> None:
    mgr = cluster.manager()
    (wp,) = cluster.workers_up(mgr, ["ids"])
    big = "r" * (8 << 20)
    assert code_of(
        lambda: wp.stub.Sleep(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1, request_id=big), timeout=30)
    ) == (grpc.StatusCode.INVALID_ARGUMENT)
    sleep = manager_pb.SleepWorkerRequest(name=name("ids"), level=common_pb.SLEEP_LEVEL_1, request_id=big)
    assert code_of(lambda: mgr.stub.SleepWorker(sleep, timeout=30)) == grpc.StatusCode.INVALID_ARGUMENT
    acquire = manager_pb.AcquireWorkerRequest(name=name("ids"), request_id=big)
    assert code_of(lambda: mgr.stub.AcquireWorker(acquire, timeout=30)) == grpc.StatusCode.INVALID_ARGUMENT
    assert worker_status(wp.stub).state == common_pb.WORKER_STATE_AWAKE and get(mgr.stub, "ids").lease_count == 0
    base = worker_status(wp.stub).kv_cache.sequence_count
    gen = worker_pb.GenerateRequest(prompt_token_ids=[1], max_new_tokens=0, sequence_id=big)
    err = rpc_error(lambda: wp.stub.Generate(gen, timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert worker_status(wp.stub).kv_cache.sequence_count == base


def test_kept_sequences_are_bounded_even_without_new_tokens() -> None:
    with WorkerProcess(["--model", "synthetic:tiny", "--kv-blocks", "4", "--host-kv-blocks", "4"]) as wp:
        for i in range(4):  # max_new_tokens=0 keeps a sequence that holds its prompt's block at once
            wp.stub.Generate(worker_pb.GenerateRequest(prompt_token_ids=[1], max_new_tokens=0, sequence_id=f"s{i}"))
        assert worker_status(wp.stub).kv_cache.device_free_block_count == 0
        req = worker_pb.GenerateRequest(prompt_token_ids=[1], max_new_tokens=0, sequence_id="one-more")
        err = rpc_error(lambda: wp.stub.Generate(req, timeout=10))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert worker_status(wp.stub).kv_cache.sequence_count == 4
        wp.stub.FreeSequence(worker_pb.FreeSequenceRequest(sequence_id="s0"))
        wp.stub.Generate(req, timeout=10)


def test_policies_are_bounded_and_an_unknown_tag_in_the_default_does_not_break_policy_sleeps(
    cluster: Cluster,
) -> None:
    mgr = cluster.manager()
    cluster.workers_up(mgr, ["pol"])
    before = mgr.stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy
    many = manager_pb.Policy(tag_actions={f"tag{i}": common_pb.TAG_ACTION_KEEP for i in range(300)})
    upd = manager_pb.UpdatePolicyRequest(policy=many, update_mask=FieldMask(paths=["tag_actions"]))
    assert code_of(lambda: mgr.stub.UpdatePolicy(upd, timeout=30)) == grpc.StatusCode.INVALID_ARGUMENT
    assert mgr.stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy == before
    other = manager_pb.Policy(
        tag_actions={
            "weights": common_pb.TAG_ACTION_OFFLOAD,
            "kv_cache": common_pb.TAG_ACTION_DISCARD,
            "optimizer": common_pb.TAG_ACTION_OFFLOAD,
        }
    )
    mgr.stub.UpdatePolicy(
        manager_pb.UpdatePolicyRequest(policy=other, update_mask=FieldMask(paths=["tag_actions"])), timeout=10
    )
    r = mgr.stub.SleepWorker(manager_pb.SleepWorkerRequest(name=name("pol")), timeout=60)  # the policy's actions
    assert r.worker.state == common_pb.WORKER_STATE_ASLEEP


def test_an_oversized_swap_is_refused_by_the_manager_before_any_per_block_work(cluster: Cluster) -> None:
    mgr = cluster.manager()
    cluster.workers_up(mgr, ["swap"])
    ids = np.arange(MAX_SWAP_PAIRS + 1, dtype="<u4").tobytes()
    req = manager_pb.SwapWorkerBlocksRequest(
        name=name("swap"), direction=common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, src_blocks_u32le=ids, dst_blocks_u32le=ids
    )
    err = rpc_error(lambda: mgr.stub.SwapWorkerBlocks(req, timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "worker swap" not in (err.details() or ""), "the worker, not the manager, refused it"
    two = manager_pb.SwapWorkerBlocksRequest(
        name=name("swap"),
        direction=common_pb.SWAP_DIRECTION_DEVICE_TO_HOST,
        pairs=[worker_pb.BlockPair(src_block=0, dst_block=0)],
        src_blocks=[1],
        dst_blocks=[1],
    )
    assert code_of(lambda: mgr.stub.SwapWorkerBlocks(two, timeout=30)) == grpc.StatusCode.INVALID_ARGUMENT


def test_deregister_forgets_a_worker_but_not_while_it_is_leased(cluster: Cluster) -> None:
    mgr = cluster.manager()
    (wp,) = cluster.workers_up(mgr, ["gone"])
    lease = mgr.stub.AcquireWorker(manager_pb.AcquireWorkerRequest(name=name("gone")), timeout=30).lease
    dereg = manager_pb.DeregisterWorkerRequest(name=name("gone"))
    assert code_of(lambda: mgr.stub.DeregisterWorker(dereg, timeout=10)) == grpc.StatusCode.FAILED_PRECONDITION
    mgr.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease.lease_id), timeout=10)
    wp.stop()
    wait_state(mgr.stub, "gone", common_pb.WORKER_STATE_UNAVAILABLE)
    mgr.stub.DeregisterWorker(dereg, timeout=10)
    assert code_of(lambda: get(mgr.stub, "gone")) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: mgr.stub.DeregisterWorker(dereg, timeout=10)) == grpc.StatusCode.NOT_FOUND
    mgr.stop()
    again = cluster.manager()  # the stored registration went too
    assert list(again.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers) == []


# ---- 12. a paused manager ----


def test_a_manager_paused_longer_than_the_silence_limit_does_not_mark_healthy_workers_unavailable(
    cluster: Cluster,
) -> None:
    mgr = cluster.manager(["--config", str(_config(cluster.tmp_path, "[manager]\nunavailable_after = 3.0\n"))])
    cluster.workers_up(mgr, ["steady"])
    seen: list[common_pb.WorkerState.ValueType] = []
    channel = grpc.insecure_channel(mgr.address)
    stream = manager_grpc.MemoryManagerServiceStub(channel).WatchWorkers(manager_pb.WatchWorkersRequest())

    def follow() -> None:
        try:
            for msg in stream:
                if msg.WhichOneof("event") == "state_change":
                    seen.append(msg.state_change.to_state)
        except grpc.RpcError:
            pass

    threading.Thread(target=follow, daemon=True).start()
    time.sleep(1.0)
    assert mgr.proc is not None
    mgr.proc.send_signal(signal.SIGSTOP)
    time.sleep(6.0)  # twice the silence limit
    mgr.proc.send_signal(signal.SIGCONT)
    time.sleep(4.0)
    stream.cancel()
    channel.close()
    assert common_pb.WORKER_STATE_UNAVAILABLE not in seen, [common_pb.WorkerState.Name(s) for s in seen]
    assert get(mgr.stub, "steady").state == common_pb.WORKER_STATE_AWAKE


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "manager.toml"
    path.write_text(text)
    return path
