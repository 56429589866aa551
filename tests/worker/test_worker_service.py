"""ModelWorkerService end to end: real ``memsvc worker`` processes (host backend) driven by real gRPC
clients over loopback. No mocks: every assertion is about what a client sees.

Most tests share one module-scoped worker (synthetic:tiny); the ``awake`` fixture puts it back into
a clean AWAKE state with an empty KV cache before each test. Tests that need their own process (a
checkpoint directory, a bigger model for cancellation, SIGTERM) start one with :class:`WorkerProcess`.

Greedy generation is deterministic on one worker, so "the model still works" is checked as "the
tokens equal the ones this worker produced before" (``reference``).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2
from grpc_health.v1 import health_pb2
from workerproc import WorkerProcess, WorkerStartError

from memsvc import DOMAIN, error_info
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

SEED = 3
PROMPT = [11, 22, 33, 44, 55, 66, 77]
N_NEW = 8
BLOCK_SIZE = 16
KV_BLOCKS = 64
HOST_KV_BLOCKS = 32
SERVICE = "memsvc.v1.ModelWorkerService"
CALL_TIMEOUT = 60.0
SETTLE_TIMEOUT = 60.0

Stub = worker_grpc.ModelWorkerServiceStub

REASON = {
    grpc.StatusCode.INVALID_ARGUMENT: "INVALID_ARGUMENT",
    grpc.StatusCode.FAILED_PRECONDITION: "WRONG_STATE",
    grpc.StatusCode.ABORTED: "TRANSITION_IN_PROGRESS",
    grpc.StatusCode.NOT_FOUND: "NOT_FOUND",
}
"""The ErrorInfo reason each status code comes with (memsvc.errors)."""


# ---------------------------------------------------------------------------------------------
# helpers


def status(stub: Stub) -> common_pb.WorkerStatus:
    return stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=CALL_TIMEOUT).status


def state_name(value: common_pb.WorkerState.ValueType) -> str:
    return common_pb.WorkerState.Name(value).removeprefix("WORKER_STATE_")


def tags(st: common_pb.WorkerStatus) -> dict[str, common_pb.TagMemory]:
    return {t.tag: t for t in st.tags}


def tag_state(t: common_pb.TagMemory) -> str:
    return common_pb.TagState.Name(t.state).removeprefix("TAG_STATE_")


def generate_full(stub: Stub, prompt: list[int], n: int = N_NEW, sequence_id: str = "") -> worker_pb.GenerateResponse:
    r = stub.Generate(
        worker_pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=n, sequence_id=sequence_id),
        timeout=CALL_TIMEOUT,
    )
    assert r.sequence_id == sequence_id
    assert len(r.token_ids) == n
    if not sequence_id:
        assert list(r.block_ids) == []  # a temporary sequence holds nothing after the call
    return r


def generate(stub: Stub, prompt: list[int], n: int = N_NEW, sequence_id: str = "") -> list[int]:
    return list(generate_full(stub, prompt, n, sequence_id).token_ids)


def sleep(
    stub: Stub, level: common_pb.SleepLevel.ValueType = common_pb.SLEEP_LEVEL_1, request_id: str = "", **kw: Any
) -> worker_pb.SleepResponse:
    return stub.Sleep(worker_pb.SleepRequest(level=level, request_id=request_id, **kw), timeout=CALL_TIMEOUT)


def wake(stub: Stub, tags_: list[str] | None = None, request_id: str = "") -> worker_pb.WakeUpResponse:
    return stub.WakeUp(worker_pb.WakeUpRequest(tags=tags_ or [], request_id=request_id), timeout=CALL_TIMEOUT)


def expect_error(call: Callable[[], Any], code: grpc.StatusCode) -> grpc.RpcError:
    """``call`` fails with ``code`` and the ErrorInfo detail that goes with it."""
    with pytest.raises(grpc.RpcError) as ei:
        call()
    err = ei.value
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()}"
    info = error_info(err)
    assert info is not None, f"{code.name} without an ErrorInfo detail: {err.details()}"
    assert info.domain == DOMAIN
    assert info.reason == REASON[code], info
    return err


def blocks_for(num_tokens: int, new_tokens: int) -> int:
    """Device blocks a generation holds: the last generated token is never fed, so no K/V for it."""
    return math.ceil((num_tokens + new_tokens - 1) / BLOCK_SIZE)


def settle(stub: Stub) -> common_pb.WorkerStatus:
    """Status once no transition runs: the state is neither SLEEPING nor WAKING, and the transition
    that set it has ended (it sets ASLEEP or AWAKE a moment before it lets the next one start)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while True:
        st = status(stub)
        busy = st.state in (
            common_pb.WORKER_STATE_SLEEPING,
            common_pb.WORKER_STATE_WAKING,
            common_pb.WORKER_STATE_LOADING,
        )
        if not busy and not st.transition_in_progress:
            return st
        assert time.monotonic() < deadline, f"worker stuck in {state_name(st.state)}"
        time.sleep(0.02)


def memory_view(st: common_pb.WorkerStatus) -> tuple[Any, ...]:
    """What a rejected request must leave unchanged: state, level, per-tag memory, KV block counts."""
    per_tag = tuple(
        (t.tag, t.state, t.mapped_bytes, t.allocated_bytes, t.offloaded_bytes, t.discarded_bytes, t.allocation_count)
        for t in st.tags
    )
    kv = st.kv_cache
    kv_view = (
        kv.device_block_count,
        kv.device_free_block_count,
        kv.host_block_count,
        kv.host_free_block_count,
        kv.sequence_count,
    )
    return (st.state, st.sleep_level, per_tag, kv_view)


def reset(stub: Stub) -> common_pb.WorkerStatus:
    """Bring the shared worker back to AWAKE with an empty KV cache."""
    st = settle(stub)
    if st.state in (common_pb.WORKER_STATE_ASLEEP, common_pb.WORKER_STATE_PARTIALLY_AWAKE):
        wake(stub)
    st = status(stub)
    assert st.state == common_pb.WORKER_STATE_AWAKE, state_name(st.state)
    kv = st.kv_cache
    if kv.sequence_count or kv.device_free_block_count != kv.device_block_count:
        sleep(stub)  # level 1 discards the KV cache: sequences holding device blocks are dropped
        wake(stub)
        st = status(stub)
    kv = st.kv_cache
    assert kv.sequence_count == 0 and kv.device_free_block_count == kv.device_block_count, kv
    assert kv.host_free_block_count == kv.host_block_count, f"a previous test left sequences in the host pool: {kv}"
    return st


# ---------------------------------------------------------------------------------------------
# fixtures


@dataclass(frozen=True)
class Info:
    """Facts about the shared worker, taken once at start."""

    weights_bytes: int
    """allocated_bytes of the ``weights`` tag."""
    kv_bytes: int
    vocab: int
    block_bytes: int
    device_blocks: int
    host_blocks: int
    reference: list[int]
    """Greedy tokens for PROMPT on a freshly started worker."""


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    args = ["--model", "synthetic:tiny", "--seed", str(SEED), "--kv-blocks", str(KV_BLOCKS)]
    args += ["--host-kv-blocks", str(HOST_KV_BLOCKS), "--block-size", str(BLOCK_SIZE)]
    with WorkerProcess(args) as wp:
        yield wp
        wp.stop()


@pytest.fixture(scope="module")
def info(worker: WorkerProcess) -> Info:
    st = status(worker.stub)
    assert st.state == common_pb.WORKER_STATE_AWAKE
    t = tags(st)
    assert set(t) == {"weights", "kv_cache"}
    assert st.model.source == "synthetic:tiny" and st.device.backend == "host"
    kv = st.kv_cache
    assert (kv.device_block_count, kv.host_block_count, kv.block_size_tokens) == (KV_BLOCKS, HOST_KV_BLOCKS, BLOCK_SIZE)
    return Info(
        weights_bytes=t["weights"].allocated_bytes,
        kv_bytes=t["kv_cache"].allocated_bytes,
        vocab=st.model.vocab_size,
        block_bytes=kv.block_bytes,
        device_blocks=kv.device_block_count,
        host_blocks=kv.host_block_count,
        reference=generate(worker.stub, PROMPT),
    )


@pytest.fixture
def stub(worker: WorkerProcess, info: Info) -> Stub:
    """The shared worker's stub, reset to AWAKE with an empty KV cache."""
    reset(worker.stub)
    return worker.stub


# ---------------------------------------------------------------------------------------------
# sleep and wake


def test_level1_sleep_offloads_weights_and_wake_restores_same_tokens(stub: Stub, info: Info) -> None:
    assert info.weights_bytes > 0
    before = generate(stub, PROMPT)
    assert before == info.reference
    st0 = status(stub)
    weights0 = tags(st0)["weights"]
    assert tag_state(weights0) == "AWAKE" and weights0.mapped_bytes >= info.weights_bytes

    r: worker_pb.SleepResponse | worker_pb.WakeUpResponse = sleep(stub, common_pb.SLEEP_LEVEL_1)
    assert r.transition.kind == "sleep"
    assert r.transition.moved_bytes == info.weights_bytes
    for st in (r.status, status(stub)):
        assert st.state == common_pb.WORKER_STATE_ASLEEP
        assert st.sleep_level == common_pb.SLEEP_LEVEL_1
        t = tags(st)
        assert tag_state(t["weights"]) == "OFFLOADED"
        assert t["weights"].mapped_bytes == 0
        assert t["weights"].offloaded_bytes == info.weights_bytes
        assert t["weights"].discarded_bytes == 0
        assert tag_state(t["kv_cache"]) == "DISCARDED"
        assert t["kv_cache"].mapped_bytes == 0
        assert t["kv_cache"].offloaded_bytes == 0
        assert t["kv_cache"].discarded_bytes == info.kv_bytes
        assert st.host_pinned_bytes - st0.host_pinned_bytes >= info.weights_bytes
        assert st.last_transition.kind == "sleep"

    r = wake(stub)
    assert r.transition.kind == "wake"
    assert r.transition.moved_bytes == info.weights_bytes
    st = status(stub)
    assert st.state == common_pb.WORKER_STATE_AWAKE
    assert st.sleep_level == common_pb.SLEEP_LEVEL_UNSPECIFIED
    t = tags(st)
    assert tag_state(t["weights"]) == "AWAKE" and t["weights"].mapped_bytes == weights0.mapped_bytes
    assert t["weights"].offloaded_bytes == 0
    assert tag_state(t["kv_cache"]) == "AWAKE" and t["kv_cache"].mapped_bytes == tags(st0)["kv_cache"].mapped_bytes
    assert generate(stub, PROMPT) == before


def test_host_prepin_serves_the_first_sleep() -> None:
    """``--host-prepin weights`` page-locks the weights pool's size in the background after the load:
    the first sleep then finds its host memory ready (pinned bytes do not grow), and the wake keeps
    it for the next sleep (the reserve was raised), although --host-reserve is 0."""
    with WorkerProcess(["--model", "synthetic:tiny", "--host-prepin", "weights", "--host-reserve", "0"]) as wp:
        st = status(wp.stub)
        weights = tags(st)["weights"].mapped_bytes
        kv_pool = st.kv_cache.host_block_count * st.kv_cache.block_bytes
        deadline = time.monotonic() + 60
        while st.host_pinned_bytes < weights + kv_pool and time.monotonic() < deadline:
            time.sleep(0.05)
            st = status(wp.stub)
        pinned = st.host_pinned_bytes
        assert pinned >= weights + kv_pool > 0
        reference = generate(wp.stub, PROMPT)
        r = sleep(wp.stub, common_pb.SLEEP_LEVEL_1)
        assert r.transition.moved_bytes == tags(st)["weights"].allocated_bytes
        assert r.status.host_pinned_bytes == pinned  # the sleep made no chunk of its own
        assert wake(wp.stub).status.host_pinned_bytes == pinned  # and the wake kept them
        assert generate(wp.stub, PROMPT) == reference
        assert sleep(wp.stub, common_pb.SLEEP_LEVEL_1).status.host_pinned_bytes == pinned
        wake(wp.stub)
        wp.stop()
        assert "host prepin: " in wp.stderr_text(), "no prepin log line"


def test_continuing_a_sequence_that_a_sleep_discarded_is_not_found(stub: Stub, info: Info) -> None:
    """A level-1 sleep discards the KV cache and its sequences: continuing one (no prompt) is
    NOT_FOUND naming it, not the INVALID_ARGUMENT of a new sequence without a prompt."""
    generate_full(stub, [4, 5, 6], 2, sequence_id="kept-then-discarded")
    sleep(stub)
    wake(stub)
    err = expect_error(lambda: generate(stub, [], 2, sequence_id="kept-then-discarded"), grpc.StatusCode.NOT_FOUND)
    assert "kept-then-discarded" in str(err.details()), err.details()
    found = error_info(err)
    assert found is not None and dict(found.metadata) == {"sequenceId": "kept-then-discarded"}, found
    expect_error(lambda: generate(stub, [], 2), grpc.StatusCode.INVALID_ARGUMENT)  # no id: a prompt is needed


def test_reload_weights_keeps_tokens(stub: Stub, info: Info) -> None:
    r = stub.ReloadWeights(worker_pb.ReloadWeightsRequest(), timeout=CALL_TIMEOUT)
    assert r.transition.kind == "reload_weights"
    assert r.transition.moved_bytes == info.weights_bytes
    assert r.status.state == common_pb.WORKER_STATE_AWAKE
    assert generate(stub, PROMPT) == info.reference


def test_partial_wake(stub: Stub, info: Info) -> None:
    sleep(stub, common_pb.SLEEP_LEVEL_1)
    r = wake(stub, ["weights"])
    assert r.transition.kind == "wake" and r.transition.moved_bytes == info.weights_bytes
    for st in (r.status, status(stub)):
        assert st.state == common_pb.WORKER_STATE_PARTIALLY_AWAKE
        t = tags(st)
        assert tag_state(t["weights"]) == "AWAKE" and t["weights"].mapped_bytes >= info.weights_bytes
        assert tag_state(t["kv_cache"]) == "DISCARDED" and t["kv_cache"].mapped_bytes == 0

    expect_error(lambda: generate(stub, PROMPT), grpc.StatusCode.FAILED_PRECONDITION)
    pairs = [worker_pb.BlockPair(src_block=0, dst_block=0)]
    expect_error(
        lambda: stub.SwapBlocks(
            worker_pb.SwapBlocksRequest(direction=common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, pairs=pairs),
            timeout=CALL_TIMEOUT,
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    expect_error(lambda: stub.ReloadWeights(worker_pb.ReloadWeightsRequest()), grpc.StatusCode.FAILED_PRECONDITION)
    expect_error(lambda: wake(stub, ["weights"]), grpc.StatusCode.FAILED_PRECONDITION)  # not asleep
    assert status(stub).state == common_pb.WORKER_STATE_PARTIALLY_AWAKE

    r = wake(stub)
    assert r.status.state == common_pb.WORKER_STATE_AWAKE
    assert all(tag_state(t) == "AWAKE" for t in r.status.tags)
    assert generate(stub, PROMPT) == info.reference

    # The other order: the KV cache first, weights still offloaded.
    sleep(stub, common_pb.SLEEP_LEVEL_1)
    r = wake(stub, ["kv_cache"])
    assert r.status.state == common_pb.WORKER_STATE_PARTIALLY_AWAKE
    t = tags(r.status)
    assert tag_state(t["weights"]) == "OFFLOADED" and tag_state(t["kv_cache"]) == "AWAKE"
    expect_error(lambda: generate(stub, PROMPT), grpc.StatusCode.FAILED_PRECONDITION)
    r = wake(stub, ["weights"])
    assert r.status.state == common_pb.WORKER_STATE_AWAKE
    assert generate(stub, PROMPT) == info.reference


def write_checkpoint(path: Path, seed: int) -> None:
    """A Hugging Face-layout checkpoint of the tiny preset with seeded weights, written here."""
    import torch

    from worker.model.config import PRESETS
    from worker.model.weights import fill_synthetic, save_checkpoint, weight_shapes

    config = PRESETS["tiny"]
    weights = {name: torch.empty(shape, dtype=config.torch_dtype) for name, shape in weight_shapes(config).items()}
    fill_synthetic(weights, config, seed)
    save_checkpoint(path, weights, config)


def test_level2_sleep_discards_and_wake_reloads_from_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, seed=11)
    with WorkerProcess(["--model", str(ckpt)]) as wp:
        s = wp.stub
        st = status(s)
        assert st.model.source == str(ckpt)
        weights_bytes = tags(st)["weights"].allocated_bytes
        kv_bytes = tags(st)["kv_cache"].allocated_bytes
        before = generate(s, PROMPT)

        r: worker_pb.SleepResponse | worker_pb.WakeUpResponse = sleep(s, common_pb.SLEEP_LEVEL_2)
        assert r.transition.kind == "sleep"
        assert r.transition.moved_bytes == 0  # nothing is copied: both tags are dropped
        st = status(s)
        assert st.state == common_pb.WORKER_STATE_ASLEEP and st.sleep_level == common_pb.SLEEP_LEVEL_2
        t = tags(st)
        assert tag_state(t["weights"]) == "DISCARDED"
        assert t["weights"].mapped_bytes == 0 and t["weights"].offloaded_bytes == 0
        assert t["weights"].discarded_bytes == weights_bytes
        assert tag_state(t["kv_cache"]) == "DISCARDED" and t["kv_cache"].discarded_bytes == kv_bytes

        r = wake(s)
        assert r.transition.kind == "wake"
        assert r.transition.moved_bytes == weights_bytes  # reloaded from the checkpoint
        st = status(s)
        assert st.state == common_pb.WORKER_STATE_AWAKE
        assert tag_state(tags(st)["weights"]) == "AWAKE" and tags(st)["weights"].mapped_bytes >= weights_bytes
        assert generate(s, PROMPT) == before

        # The wake really reads the checkpoint directory: other weights on disk, other tokens.
        sleep(s, common_pb.SLEEP_LEVEL_2)
        write_checkpoint(ckpt, seed=12)
        wake(s)
        assert generate(s, PROMPT) != before
        # ... and ReloadWeights reads it again, back to the original tokens.
        write_checkpoint(ckpt, seed=11)
        r2 = s.ReloadWeights(worker_pb.ReloadWeightsRequest(), timeout=CALL_TIMEOUT)
        assert r2.transition.kind == "reload_weights" and r2.transition.moved_bytes == weights_bytes
        assert generate(s, PROMPT) == before
        wp.stop()


# ---------------------------------------------------------------------------------------------
# KV block swaps


def swap(
    stub: Stub,
    direction: common_pb.SwapDirection.ValueType,
    pairs: list[tuple[int, int]],
    packed: bool = False,
    raw: bool = False,
    **kw: Any,
) -> worker_pb.SwapBlocksResponse:
    """SwapBlocks with ``pairs`` as BlockPair messages, ``packed`` as src_blocks + dst_blocks, or ``raw`` as
    src_blocks_u32le + dst_blocks_u32le."""
    if raw:
        req = worker_pb.SwapBlocksRequest(
            direction=direction,
            src_blocks_u32le=u32le([s for s, _ in pairs]),
            dst_blocks_u32le=u32le([d for _, d in pairs]),
            **kw,
        )
    elif packed:
        req = worker_pb.SwapBlocksRequest(
            direction=direction, src_blocks=[s for s, _ in pairs], dst_blocks=[d for _, d in pairs], **kw
        )
    else:
        req = worker_pb.SwapBlocksRequest(
            direction=direction, pairs=[worker_pb.BlockPair(src_block=s, dst_block=d) for s, d in pairs], **kw
        )
    return stub.SwapBlocks(req, timeout=CALL_TIMEOUT)


@pytest.mark.parametrize("raw_out", [False, True], ids=["out-as-pairs", "out-as-u32le"])
def test_swap_out_and_in_continues_generation(stub: Stub, info: Info, raw_out: bool) -> None:
    """A sequence swapped to the host (as BlockPairs, or as raw u32le ids) and back into other device
    blocks (as packed lists) continues as if never moved.

    The block ids come from GenerateResponse.block_ids. Another kept sequence is created first, so
    the swapped one does not simply hold blocks 0..k-1; the free counts after the swap-out confirm
    that the reported blocks were the sequence's (moving a free block moves no ownership).
    """
    prompt = [(7 * i + 3) % info.vocab for i in range(20)]
    n1, n2 = 14, 10
    k = blocks_for(len(prompt), n1)
    uninterrupted = generate(stub, prompt, n1 + n2)  # a temporary sequence: freed after the call

    other = generate_full(stub, [9, 8, 7, 6, 5], 4, sequence_id="swap-other")
    assert len(other.block_ids) == blocks_for(5, 4)
    first = generate_full(stub, prompt, n1, sequence_id="swap-a")
    assert list(first.token_ids) == uninterrupted[:n1]
    device_src = list(first.block_ids)
    assert len(device_src) == k == len(set(device_src))
    assert all(0 <= b < info.device_blocks for b in device_src)
    assert not set(device_src) & set(other.block_ids)
    kv = status(stub).kv_cache
    assert kv.sequence_count == 2
    held = info.device_blocks - len(other.block_ids)
    assert kv.device_free_block_count == held - k
    host_dst = [info.host_blocks - 1 - 2 * i for i in range(k)]

    r = swap(stub, common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, list(zip(device_src, host_dst, strict=True)), raw=raw_out)
    assert r.moved_bytes == k * info.block_bytes
    assert r.kv_cache.device_free_block_count == held
    assert r.kv_cache.host_free_block_count == info.host_blocks - k
    assert r.kv_cache.sequence_count == 2
    assert status(stub).last_transition.kind == "swap_blocks"

    # Swapped out, the sequence cannot run.
    expect_error(lambda: generate(stub, [], n2, sequence_id="swap-a"), grpc.StatusCode.FAILED_PRECONDITION)
    # Overwrite the device blocks it left with another sequence's K/V, so stale data cannot pass.
    generate(stub, [(5 * i + 1) % info.vocab for i in range(len(prompt))], n1)

    free_now = set(range(info.device_blocks)) - set(other.block_ids)
    device_dst = sorted(free_now - set(device_src), reverse=True)[::3][:k]
    assert len(device_dst) == k
    # Back in with the packed form (src_blocks + dst_blocks) of the same request.
    r = swap(stub, common_pb.SWAP_DIRECTION_HOST_TO_DEVICE, list(zip(host_dst, device_dst, strict=True)), packed=True)
    assert r.moved_bytes == k * info.block_bytes
    assert r.kv_cache.device_free_block_count == held - k
    assert r.kv_cache.host_free_block_count == info.host_blocks

    rest = generate_full(stub, [], n2, sequence_id="swap-a")
    assert list(rest.token_ids) == uninterrupted[n1:]
    # The block table followed the swap: the first k entries are where the blocks went.
    assert list(rest.block_ids)[:k] == device_dst
    assert len(rest.block_ids) == blocks_for(len(prompt), n1 + n2)
    # The other sequence was never touched.
    assert generate(stub, [], 4, sequence_id="swap-other") == generate(stub, [9, 8, 7, 6, 5], 8)[4:]


def test_swaps_in_flight_together_keep_every_sequence(stub: Stub, info: Info) -> None:
    """Four sequences swapped out by four SwapBlocks calls in flight at once, then back in to other
    device blocks by four more: the worker checks and enqueues each while the one before copies.
    Every sequence continues exactly as if never moved, and the counts add up."""
    prompts = {f"fl-{i}": [(13 * j + 7 * i + 1) % info.vocab for j in range(18)] for i in range(4)}
    n1, n2 = 6, 6
    whole = {sid: generate(stub, p, n1 + n2) for sid, p in prompts.items()}
    first = {sid: generate_full(stub, p, n1, sequence_id=sid) for sid, p in prompts.items()}
    blocks = {sid: list(r.block_ids) for sid, r in first.items()}
    k = blocks_for(18, n1)
    assert all(len(b) == k for b in blocks.values())
    host = {sid: [info.host_blocks - 1 - (i * k + j) for j in range(k)] for i, sid in enumerate(prompts)}

    def in_flight(
        direction: common_pb.SwapDirection.ValueType, src: dict[str, list[int]], dst: dict[str, list[int]]
    ) -> list[grpc.Future[worker_pb.SwapBlocksResponse]]:
        req = [
            worker_pb.SwapBlocksRequest(direction=direction, src_blocks=src[sid], dst_blocks=dst[sid])
            for sid in prompts
        ]
        return [stub.SwapBlocks.future(r, timeout=CALL_TIMEOUT) for r in req]  # all sent before any answer

    out = in_flight(common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, blocks, host)
    assert all(f.result().moved_bytes == k * info.block_bytes for f in out)
    assert status(stub).kv_cache.host_free_block_count == info.host_blocks - 4 * k
    used = {b for bs in blocks.values() for b in bs}
    spare = sorted(set(range(info.device_blocks)) - used, reverse=True)
    device = {sid: spare[i * k : (i + 1) * k] for i, sid in enumerate(prompts)}
    back = in_flight(common_pb.SWAP_DIRECTION_HOST_TO_DEVICE, host, device)
    assert all(f.result().moved_bytes == k * info.block_bytes for f in back)
    kv = status(stub).kv_cache
    assert (kv.host_free_block_count, kv.device_free_block_count) == (info.host_blocks, info.device_blocks - 4 * k)
    for sid in prompts:
        rest = generate_full(stub, [], n2, sequence_id=sid)
        assert whole[sid] == list(first[sid].token_ids) + list(rest.token_ids), sid
        assert list(rest.block_ids)[:k] == device[sid]


@pytest.mark.parametrize("kv_action", ["OFFLOAD", "KEEP", "DISCARD"])
def test_sequence_across_sleep_with_kv_action(stub: Stub, info: Info, kv_action: str) -> None:
    """A kept sequence survives a Sleep whose kv_cache action is OFFLOAD or KEEP and continues exactly
    after the wake; with DISCARD (what level 1 does) it is gone and its blocks are free again."""
    prompt = [(11 * i + 5) % info.vocab for i in range(20)]
    n1, n2 = 14, 10
    uninterrupted = generate(stub, prompt, n1 + n2)
    assert generate(stub, prompt, n1, sequence_id="across") == uninterrupted[:n1]
    held = blocks_for(len(prompt), n1)

    action = common_pb.TagAction.Value(f"TAG_ACTION_{kv_action}")
    r = sleep(
        stub,
        common_pb.SLEEP_LEVEL_UNSPECIFIED,
        tag_actions={"weights": common_pb.TAG_ACTION_OFFLOAD, "kv_cache": action},
    )
    assert r.status.state == common_pb.WORKER_STATE_ASLEEP
    assert r.status.sleep_level == common_pb.SLEEP_LEVEL_UNSPECIFIED  # an explicit tag map, no level
    kv_state = {"OFFLOAD": "OFFLOADED", "KEEP": "AWAKE", "DISCARD": "DISCARDED"}[kv_action]
    assert tag_state(tags(r.status)["kv_cache"]) == kv_state
    assert tag_state(tags(r.status)["weights"]) == "OFFLOADED"
    expected_moved = info.weights_bytes + (info.kv_bytes if kv_action == "OFFLOAD" else 0)
    assert r.transition.moved_bytes == expected_moved
    expect_error(lambda: generate(stub, [], n2, sequence_id="across"), grpc.StatusCode.FAILED_PRECONDITION)

    wake(stub)
    kv = status(stub).kv_cache
    if kv_action == "DISCARD":
        assert kv.sequence_count == 0 and kv.device_free_block_count == info.device_blocks
        expect_error(lambda: generate(stub, [], n2, sequence_id="across"), grpc.StatusCode.NOT_FOUND)
    else:
        assert kv.sequence_count == 1 and kv.device_free_block_count == info.device_blocks - held
        assert generate(stub, [], n2, sequence_id="across") == uninterrupted[n1:]
    assert generate(stub, PROMPT) == info.reference


# ---------------------------------------------------------------------------------------------
# telemetry


def test_telemetry_snapshot_then_state_changes_and_transitions(stub: Stub, info: Info) -> None:
    # A 1 h interval (the maximum): no periodic snapshot interleaves with the events below.
    call = stub.StreamTelemetry(
        worker_pb.StreamTelemetryRequest(interval=duration_pb2.Duration(seconds=3600)), timeout=60
    )
    try:
        first = next(call)
        assert first.WhichOneof("event") == "snapshot"
        assert first.sequence_number == 1
        assert first.snapshot.state == common_pb.WORKER_STATE_AWAKE
        assert tags(first.snapshot)["weights"].allocated_bytes == info.weights_bytes
        # The stream subscribes before it sends its first message, so nothing below can be missed.
        sleep(stub, common_pb.SLEEP_LEVEL_1)
        wake(stub)
        messages = []
        for m in call:
            messages.append(m)
            if m.WhichOneof("event") == "transition" and m.transition.kind == "wake":
                break
    finally:
        call.cancel()

    assert [m.sequence_number for m in messages] == list(range(2, len(messages) + 2))
    events: list[tuple[str, str | int]] = []
    for m in messages:
        kind = m.WhichOneof("event")
        if kind == "state_change":
            events.append((state_name(m.state_change.from_state), state_name(m.state_change.to_state)))
        elif kind == "transition":
            events.append((m.transition.kind, m.transition.moved_bytes))
    assert events == [
        ("AWAKE", "SLEEPING"),
        ("SLEEPING", "ASLEEP"),
        ("sleep", info.weights_bytes),
        ("ASLEEP", "WAKING"),
        ("WAKING", "AWAKE"),
        ("wake", info.weights_bytes),
    ]
    assert all(m.state_change.reason for m in messages if m.WhichOneof("event") == "state_change")


# ---------------------------------------------------------------------------------------------
# request ids


def test_request_id_replays_sleep_and_wake(stub: Stub, info: Info) -> None:
    r1 = sleep(stub, common_pb.SLEEP_LEVEL_1, request_id="rid-sleep-1")
    r2 = sleep(stub, common_pb.SLEEP_LEVEL_1, request_id="rid-sleep-1")
    assert r2.transition == r1.transition  # the first call's result, end_time included
    assert r2.status.state == common_pb.WORKER_STATE_ASLEEP

    # A replay does not act again, even when the rest of the request differs (level 2 would drop
    # the offloaded weights).
    r3 = sleep(stub, common_pb.SLEEP_LEVEL_2, request_id="rid-sleep-1")
    assert r3.transition == r1.transition
    assert tag_state(tags(status(stub))["weights"]) == "OFFLOADED"

    # A new request id is a new Sleep, and the worker is already asleep.
    expect_error(
        lambda: sleep(stub, common_pb.SLEEP_LEVEL_1, request_id="rid-sleep-2"), grpc.StatusCode.FAILED_PRECONDITION
    )
    # A request id that named a Sleep cannot name a WakeUp.
    expect_error(lambda: wake(stub, request_id="rid-sleep-1"), grpc.StatusCode.INVALID_ARGUMENT)
    st = status(stub)
    assert st.state == common_pb.WORKER_STATE_ASLEEP and tag_state(tags(st)["weights"]) == "OFFLOADED"

    w1 = wake(stub, request_id="rid-wake-1")
    w2 = wake(stub, request_id="rid-wake-1")
    assert w2.transition == w1.transition
    assert w2.status.state == common_pb.WORKER_STATE_AWAKE
    assert generate(stub, PROMPT) == info.reference
    # Replayed after the worker moved on, the answer is still the first call's: the status it left.
    r4 = sleep(stub, common_pb.SLEEP_LEVEL_1, request_id="rid-sleep-1")
    assert r4 == r1 and r4.status.state == common_pb.WORKER_STATE_ASLEEP, "a replay reported the status of now (awake)"


# ---------------------------------------------------------------------------------------------
# malformed input on every RPC


SEQ = "held"
SEQ_PROMPT = [(3 * i + 2) % 500 for i in range(20)]
SEQ_N1, SEQ_N2 = 14, 6


Call = Callable[[Stub, Info, list[int]], Any]
"""A request: (stub, facts about the worker, the device blocks of SEQ in the "sequence" set-up)."""


@dataclass(frozen=True)
class Bad:
    id: str
    setup: str
    """"awake"; "asleep" (after Sleep level 1); "sequence" (awake, the kept sequence SEQ holds device blocks)."""
    call: Call
    code: grpc.StatusCode


Pairs = Callable[[Info, list[int]], list[tuple[int, int]]]


def _swap(direction: common_pb.SwapDirection.ValueType, pairs: Pairs, **kw: Any) -> Call:
    return lambda s, i, b: swap(s, direction, pairs(i, b), **kw)


def _packed(
    direction: common_pb.SwapDirection.ValueType,
    src: Callable[[Info, list[int]], list[int]],
    dst: Callable[[Info, list[int]], list[int]],
    pairs: Pairs | None = None,
) -> Call:
    """SwapBlocks with the packed src_blocks/dst_blocks form (and pairs too, if given)."""

    def call(s: Stub, i: Info, b: list[int]) -> Any:
        req = worker_pb.SwapBlocksRequest(direction=direction, src_blocks=src(i, b), dst_blocks=dst(i, b))
        if pairs is not None:
            req.pairs.extend(worker_pb.BlockPair(src_block=x, dst_block=y) for x, y in pairs(i, b))
        return s.SwapBlocks(req, timeout=CALL_TIMEOUT)

    return call


def _u32le(
    direction: common_pb.SwapDirection.ValueType,
    src: Callable[[Info, list[int]], bytes],
    dst: Callable[[Info, list[int]], bytes],
    **kw: Any,
) -> Call:
    """SwapBlocks with raw src_blocks_u32le/dst_blocks_u32le bytes (and any other fields in ``kw``)."""

    def call(s: Stub, i: Info, b: list[int]) -> Any:
        req = worker_pb.SwapBlocksRequest(
            direction=direction, src_blocks_u32le=src(i, b), dst_blocks_u32le=dst(i, b), **kw
        )
        return s.SwapBlocks(req, timeout=CALL_TIMEOUT)

    return call


def u32le(ids: list[int]) -> bytes:
    """Block ids as the raw form: 4 bytes each, unsigned little-endian."""
    return b"".join(x.to_bytes(4, "little") for x in ids)


def _gen(prompt: Callable[[Info], list[int]], n: int, seq: str = "") -> Call:
    return lambda s, i, b: s.Generate(
        worker_pb.GenerateRequest(prompt_token_ids=prompt(i), max_new_tokens=n, sequence_id=seq), timeout=CALL_TIMEOUT
    )


def _sleep(**kw: Any) -> Call:
    return lambda s, i, b: s.Sleep(worker_pb.SleepRequest(**kw), timeout=CALL_TIMEOUT)


def _wake(tags_: list[str]) -> Call:
    return lambda s, i, b: s.WakeUp(worker_pb.WakeUpRequest(tags=tags_), timeout=CALL_TIMEOUT)


def _stream(interval: duration_pb2.Duration) -> Call:
    return lambda s, i, b: next(
        s.StreamTelemetry(worker_pb.StreamTelemetryRequest(interval=interval), timeout=CALL_TIMEOUT)
    )


def _free_device(i: Info, b: list[int], n: int = 1) -> list[int]:
    """``n`` device blocks SEQ does not hold (free in the "sequence" set-up), highest first."""
    return [x for x in range(i.device_blocks - 1, -1, -1) if x not in b][:n]


INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
NOT_FOUND = grpc.StatusCode.NOT_FOUND
OUT, IN = common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, common_pb.SWAP_DIRECTION_HOST_TO_DEVICE
OFFLOAD, DISCARD = common_pb.TAG_ACTION_OFFLOAD, common_pb.TAG_ACTION_DISCARD

BAD_REQUESTS = [
    # Sleep
    Bad("sleep-no-level-no-tags", "awake", _sleep(), INVALID),
    Bad("sleep-bad-level", "awake", _sleep(level=7), INVALID),
    Bad("sleep-negative-level", "awake", _sleep(level=-1), INVALID),
    Bad("sleep-bad-level-valid-tags", "sequence", _sleep(level=7, tag_actions={"weights": OFFLOAD}), INVALID),
    Bad("sleep-unknown-tag", "awake", _sleep(tag_actions={"bogus": OFFLOAD}), INVALID),
    Bad("sleep-unknown-tag-with-known", "sequence", _sleep(tag_actions={"weights": OFFLOAD, "nope": DISCARD}), INVALID),
    Bad("sleep-bad-action", "awake", _sleep(tag_actions={"weights": 9}), INVALID),
    Bad(
        "sleep-unspecified-action", "awake", _sleep(tag_actions={"weights": common_pb.TAG_ACTION_UNSPECIFIED}), INVALID
    ),
    Bad("sleep-bad-action-with-good", "sequence", _sleep(tag_actions={"weights": OFFLOAD, "kv_cache": 42}), INVALID),
    Bad(
        "sleep-while-asleep",
        "asleep",
        _sleep(level=common_pb.SLEEP_LEVEL_1, request_id="bad-sleep-asleep"),
        PRECONDITION,
    ),
    # WakeUp
    Bad("wake-when-awake", "awake", _wake([]), PRECONDITION),
    Bad("wake-unknown-tag", "asleep", _wake(["bogus"]), INVALID),
    Bad("wake-unknown-tag-with-known", "asleep", _wake(["weights", "bogus"]), INVALID),
    Bad("wake-duplicate-tag", "asleep", _wake(["weights", "weights"]), INVALID),
    # Generate
    Bad("generate-token-eq-vocab", "awake", _gen(lambda i: [1, i.vocab], 4), INVALID),
    Bad("generate-token-huge", "awake", _gen(lambda i: [1, 2**31 - 1], 4), INVALID),
    Bad("generate-token-negative", "awake", _gen(lambda i: [1, -1], 4), INVALID),
    Bad("generate-max-new-negative", "awake", _gen(lambda i: [1, 2], -1), INVALID),
    Bad("generate-max-new-huge", "awake", _gen(lambda i: [1, 2], 2**31 - 1), INVALID),
    Bad("generate-beyond-context", "awake", _gen(lambda i: [1, 2], 4096), INVALID),
    Bad("generate-empty-prompt-no-sequence", "awake", _gen(lambda i: [], 4), INVALID),
    Bad("generate-empty-prompt-unknown-sequence", "awake", _gen(lambda i: [], 4, "never-seen"), NOT_FOUND),
    Bad("generate-bad-token-on-sequence", "sequence", _gen(lambda i: [i.vocab], 4, SEQ), INVALID),
    Bad("generate-negative-max-on-sequence", "sequence", _gen(lambda i: [], -1, SEQ), INVALID),
    Bad("generate-beyond-context-on-sequence", "sequence", _gen(lambda i: [], 2040, SEQ), INVALID),
    Bad("generate-while-asleep", "asleep", _gen(lambda i: PROMPT, 4), PRECONDITION),
    # SwapBlocks. Where a request names a valid pair first, a half-applied swap would show.
    Bad(
        "swap-unspecified-direction",
        "sequence",
        _swap(common_pb.SWAP_DIRECTION_UNSPECIFIED, lambda i, b: [(b[0], 3)]),
        INVALID,
    ),
    Bad("swap-bad-direction", "sequence", _swap(9, lambda i, b: [(b[0], 3)]), INVALID),  # type: ignore[arg-type]
    Bad("swap-no-pairs", "awake", _swap(OUT, lambda i, b: []), INVALID),
    Bad("swap-negative-src", "sequence", _swap(OUT, lambda i, b: [(b[0], 3), (-1, 4)]), INVALID),
    Bad("swap-negative-dst", "sequence", _swap(IN, lambda i, b: [(0, _free_device(i, b)[0]), (1, -2)]), INVALID),
    Bad("swap-huge-dst", "sequence", _swap(OUT, lambda i, b: [(b[0], 3), (b[1], 2**40)]), INVALID),
    Bad("swap-huge-src", "sequence", _swap(OUT, lambda i, b: [(b[0], 3), (2**62, 4)]), INVALID),
    Bad("swap-src-eq-pool-size", "sequence", _swap(OUT, lambda i, b: [(b[0], 3), (i.device_blocks, 4)]), INVALID),
    Bad("swap-dst-eq-pool-size", "sequence", _swap(OUT, lambda i, b: [(b[0], 3), (b[1], i.host_blocks)]), INVALID),
    Bad("swap-duplicate-dst", "sequence", _swap(OUT, lambda i, b: [(b[0], 3), (b[1], 3)]), INVALID),
    Bad("swap-duplicate-src", "sequence", _swap(OUT, lambda i, b: [(b[0], 3), (b[0], 4)]), INVALID),
    Bad("swap-dst-in-use", "sequence", _swap(IN, lambda i, b: [(5, _free_device(i, b)[0]), (6, b[1])]), INVALID),
    Bad("swap-bad-method", "sequence", _swap(OUT, lambda i, b: [(b[0], 3)], method=99), INVALID),
    Bad("swap-while-kv-asleep", "asleep", _swap(OUT, lambda i, b: [(0, 3)]), PRECONDITION),
    # SwapBlocks, packed form: the same checks, plus the two forms' consistency.
    Bad("packed-length-mismatch", "sequence", _packed(OUT, lambda i, b: b[:2], lambda i, b: [3]), INVALID),
    Bad("packed-only-dst", "sequence", _packed(OUT, lambda i, b: [], lambda i, b: [3]), INVALID),
    Bad(
        "packed-and-pairs",
        "sequence",
        _packed(OUT, lambda i, b: [b[0]], lambda i, b: [3], pairs=lambda i, b: [(b[1], 4)]),
        INVALID,
    ),
    Bad("packed-duplicate-dst", "sequence", _packed(OUT, lambda i, b: b[:2], lambda i, b: [3, 3]), INVALID),
    Bad("packed-duplicate-src", "sequence", _packed(OUT, lambda i, b: [b[0], b[0]], lambda i, b: [3, 4]), INVALID),
    Bad("packed-huge-src", "sequence", _packed(OUT, lambda i, b: [b[0], 2**62], lambda i, b: [3, 4]), INVALID),
    Bad("packed-negative-dst", "sequence", _packed(OUT, lambda i, b: b[:2], lambda i, b: [3, -1]), INVALID),
    Bad(
        "packed-dst-in-use",
        "sequence",
        _packed(IN, lambda i, b: [5, 6], lambda i, b: [_free_device(i, b)[0], b[1]]),
        INVALID,
    ),
    Bad("packed-while-kv-asleep", "asleep", _packed(OUT, lambda i, b: [0], lambda i, b: [3]), PRECONDITION),
    # SwapBlocks, raw u32le form: whole 4-byte ids, as many on each side, one form only, then the same checks.
    Bad(
        "u32le-partial-id", "sequence", _u32le(OUT, lambda i, b: u32le(b[:2])[:7], lambda i, b: u32le([3, 4])), INVALID
    ),
    Bad("u32le-length-mismatch", "sequence", _u32le(OUT, lambda i, b: u32le(b[:2]), lambda i, b: u32le([3])), INVALID),
    Bad("u32le-only-dst", "sequence", _u32le(OUT, lambda i, b: b"", lambda i, b: u32le([3])), INVALID),
    Bad(
        "u32le-and-packed",
        "sequence",
        _u32le(OUT, lambda i, b: u32le([b[0]]), lambda i, b: u32le([3]), src_blocks=[5], dst_blocks=[4]),
        INVALID,
    ),
    Bad(
        "u32le-and-pairs",
        "sequence",
        _u32le(
            OUT,
            lambda i, b: u32le([b[0]]),
            lambda i, b: u32le([3]),
            pairs=[worker_pb.BlockPair(src_block=5, dst_block=4)],
        ),
        INVALID,
    ),
    Bad("u32le-duplicate-dst", "sequence", _u32le(OUT, lambda i, b: u32le(b[:2]), lambda i, b: u32le([3, 3])), INVALID),
    Bad(
        "u32le-max-id", "sequence", _u32le(OUT, lambda i, b: u32le(b[:2]), lambda i, b: u32le([3, 2**32 - 1])), INVALID
    ),
    Bad(
        "u32le-dst-in-use",
        "sequence",
        _u32le(IN, lambda i, b: u32le([5, 6]), lambda i, b: u32le([_free_device(i, b)[0], b[1]])),
        INVALID,
    ),
    Bad("u32le-while-kv-asleep", "asleep", _u32le(OUT, lambda i, b: u32le([0]), lambda i, b: u32le([3])), PRECONDITION),
    # StreamTelemetry
    Bad("telemetry-negative-interval", "awake", _stream(duration_pb2.Duration(seconds=-1)), INVALID),
    Bad("telemetry-negative-nanos", "awake", _stream(duration_pb2.Duration(nanos=-5)), INVALID),
    # ReloadWeights
    Bad(
        "reload-while-asleep", "asleep", lambda s, i, b: s.ReloadWeights(worker_pb.ReloadWeightsRequest()), PRECONDITION
    ),
]


@pytest.mark.parametrize("bad", BAD_REQUESTS, ids=[b.id for b in BAD_REQUESTS])
def test_malformed_request_is_rejected_and_changes_nothing(stub: Stub, info: Info, bad: Bad) -> None:
    expected_rest: list[int] = []
    blocks: list[int] = []
    if bad.setup == "asleep":
        sleep(stub, common_pb.SLEEP_LEVEL_1)
    elif bad.setup == "sequence":
        uninterrupted = generate(stub, SEQ_PROMPT, SEQ_N1 + SEQ_N2)
        r = generate_full(stub, SEQ_PROMPT, SEQ_N1, sequence_id=SEQ)
        assert list(r.token_ids) == uninterrupted[:SEQ_N1]
        expected_rest = uninterrupted[SEQ_N1:]
        blocks = list(r.block_ids)
        assert len(blocks) == blocks_for(len(SEQ_PROMPT), SEQ_N1) >= 2
        assert status(stub).kv_cache.device_free_block_count == info.device_blocks - len(blocks)
    before = status(stub)

    expect_error(lambda: bad.call(stub, info, blocks), bad.code)

    after = status(stub)
    assert memory_view(after) == memory_view(before)
    if bad.setup == "asleep":
        assert after.state == common_pb.WORKER_STATE_ASLEEP
        wake(stub)
    elif bad.setup == "sequence":
        # The sequence's blocks and data are where they were: it continues exactly.
        r = generate_full(stub, [], SEQ_N2, sequence_id=SEQ)
        assert list(r.token_ids) == expected_rest
        assert list(r.block_ids)[: len(blocks)] == blocks
    assert generate(stub, PROMPT) == info.reference


METHODS = ["GetWorkerStatus", "Sleep", "WakeUp", "ReloadWeights", "SwapBlocks", "Generate"]
GARBAGE = b"\xff\xff\xff\xff"
"""Not a protobuf message: a field header with field number 0x1fffffff... and a truncated varint."""


def _raw_call(worker: WorkerProcess, method: str) -> None:
    path = f"/{SERVICE}/{method}"
    if method == "StreamTelemetry":
        call: grpc.UnaryStreamMultiCallable[bytes, bytes] = worker.channel.unary_stream(path)
        for _ in call(GARBAGE, timeout=CALL_TIMEOUT):
            pass
    else:
        unary: grpc.UnaryUnaryMultiCallable[bytes, bytes] = worker.channel.unary_unary(path)
        unary(GARBAGE, timeout=CALL_TIMEOUT)


@pytest.mark.parametrize("method", [*METHODS, "StreamTelemetry"])
def test_undecodable_request_is_refused_and_worker_keeps_serving(
    worker: WorkerProcess, stub: Stub, info: Info, method: str
) -> None:
    before = status(stub)
    with pytest.raises(grpc.RpcError) as ei:
        _raw_call(worker, method)
    assert ei.value.code() != grpc.StatusCode.OK
    assert memory_view(status(stub)) == memory_view(before)
    assert generate(stub, PROMPT) == info.reference


@pytest.mark.parametrize("method", ["Sleep", "Generate"])
def test_undecodable_request_is_invalid_argument(worker: WorkerProcess, stub: Stub, method: str) -> None:
    expect_error(lambda: _raw_call(worker, method), grpc.StatusCode.INVALID_ARGUMENT)


# ---------------------------------------------------------------------------------------------
# concurrency and cancellation


def call_concurrently(method: Callable[..., Any], requests: list[Any]) -> list[Any]:
    """Send every request at once (one thread each, released together); responses or RpcErrors."""
    barrier = threading.Barrier(len(requests))
    results: list[Any] = [None] * len(requests)

    def call(i: int) -> None:
        barrier.wait()
        try:
            results[i] = method(requests[i], timeout=CALL_TIMEOUT)
        except grpc.RpcError as e:
            results[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_concurrent_sleeps_one_wins(stub: Stub, info: Info) -> None:
    """Eight Sleeps at once (different request ids): exactly one runs. Each of the others is either
    ABORTED (it arrived while the winner's transition was running) or FAILED_PRECONDITION (it arrived
    after the winner finished: the worker is asleep). Which of the two depends on timing; both are
    correct answers. The same holds for eight concurrent WakeUps."""
    rounds: list[tuple[Callable[..., Any], list[Any], str]] = [
        (
            stub.Sleep,
            [worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1, request_id=f"conc-sleep-{i}") for i in range(8)],
            "ASLEEP",
        ),
        (stub.WakeUp, [worker_pb.WakeUpRequest(request_id=f"conc-wake-{i}") for i in range(8)], "AWAKE"),
    ]
    for method, requests, end_state in rounds:
        results = call_concurrently(method, requests)
        ok = [r for r in results if not isinstance(r, grpc.RpcError)]
        errors = [r for r in results if isinstance(r, grpc.RpcError)]
        assert len(ok) == 1, [r.details() if isinstance(r, grpc.RpcError) else "ok" for r in results]
        assert state_name(ok[0].status.state) == end_state
        for e in errors:
            assert e.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION), e.details()
            ei = error_info(e)
            assert ei is not None and ei.reason == REASON[e.code()]
        st = status(stub)
        assert state_name(st.state) == end_state
        t = tags(st)
        if end_state == "ASLEEP":
            assert tag_state(t["weights"]) == "OFFLOADED" and t["weights"].offloaded_bytes == info.weights_bytes
            assert tag_state(t["kv_cache"]) == "DISCARDED"
        else:
            assert all(tag_state(x) == "AWAKE" for x in t.values())
    assert generate(stub, PROMPT) == info.reference


LONG_GENERATE_TOKENS = 400
"""Long enough on synthetic:small that the Generate is still running after a few more round trips."""


class TransitionLockLeaked(AssertionError):
    """The worker is AWAKE or ASLEEP with nothing running, yet refuses every transition as ABORTED."""


def check_consistent_after_cancel(s: Stub, reference: list[int]) -> None:
    """Settled state, nothing stuck, model intact: AWAKE or ASLEEP, then a full cycle works."""
    st = settle(s)
    assert st.state in (common_pb.WORKER_STATE_AWAKE, common_pb.WORKER_STATE_ASLEEP), state_name(st.state)
    if st.state == common_pb.WORKER_STATE_AWAKE:
        # A barrier through the device loop: any job queued before it has finished afterwards.
        try:
            generate(s, [1, 2, 3], 1)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e.details()  # a queued Sleep ran meanwhile
        st = settle(s)
    t = tags(st)
    if st.state == common_pb.WORKER_STATE_ASLEEP:
        assert tag_state(t["weights"]) == "OFFLOADED" and tag_state(t["kv_cache"]) == "DISCARDED"
        wake(s)
    else:
        assert st.state == common_pb.WORKER_STATE_AWAKE
        assert all(tag_state(x) == "AWAKE" for x in t.values())
    assert generate(s, PROMPT) == reference
    try:
        sleep(s, common_pb.SLEEP_LEVEL_1, request_id="after-cancel")
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.ABORTED:
            raise TransitionLockLeaked(f"worker is {state_name(status(s).state)} but Sleep says: {e.details()}") from e
        raise
    assert status(s).state == common_pb.WORKER_STATE_ASLEEP
    wake(s)
    assert generate(s, PROMPT) == reference


@pytest.fixture
def small_worker() -> Iterator[WorkerProcess]:
    """A worker on synthetic:small: long enough generations to have a job running on the device loop."""
    with WorkerProcess(["--model", "synthetic:small", "--seed", str(SEED)]) as wp:
        yield wp
        wp.stop()


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_client_cancelling_sleep_leaves_worker_consistent(small_worker: WorkerProcess, how: str) -> None:
    """The client gives up on a Sleep right after sending it (cancel, or a deadline too short to be
    met). Whether the Sleep ran or not, the worker must settle in AWAKE or ASLEEP and work on."""
    s = small_worker.stub
    reference = generate(s, PROMPT)
    req = worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1, request_id=f"cancelled-{how}")
    if how == "cancel":
        fut = s.Sleep.future(req, timeout=CALL_TIMEOUT)
        fut.cancel()
    else:
        with pytest.raises(grpc.RpcError) as ei:
            s.Sleep(req, timeout=0.001)
        # the client's own timer (DEADLINE_EXCEEDED), or the worker's answer when it comes first:
        # CANCELLED, "its callers' deadline passed before it could start; nothing changed"
        assert ei.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
    check_consistent_after_cancel(s, reference)


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = SETTLE_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def round_trip(wp: WorkerProcess) -> None:
    """One health check: when it returns, every call sent earlier on this channel has reached the server.

    (A GetWorkerStatus would do too, were it not blocked while a Generate runs: see
    test_status_answers_while_generate_runs.)
    """
    r = wp.health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=CALL_TIMEOUT)
    assert r.status == health_pb2.HealthCheckResponse.SERVING


def start_long_generate(wp: WorkerProcess, n: int = LONG_GENERATE_TOKENS) -> grpc.Future[worker_pb.GenerateResponse]:
    """A Generate that keeps the device loop busy for a while, running in the engine on return.

    Received by the server is not enough: on a loaded machine a transition sent next can still reach
    the device loop before the Generate is admitted there, and the Generate then finds the worker
    asleep. Holding KV blocks means the engine has admitted it (a transition queued now waits for it).
    """
    fut = wp.stub.Generate.future(worker_pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=n), timeout=300)
    round_trip(wp)

    def admitted() -> bool:
        kv = status(wp.stub).kv_cache
        return kv.device_free_block_count < kv.device_block_count or fut.done()

    wait_for(admitted, "the long Generate to hold KV blocks")
    return fut


@pytest.mark.parametrize("rpc", ["Sleep", "ReloadWeights"])
def test_cancelling_transition_queued_behind_generate(small_worker: WorkerProcess, rpc: str) -> None:
    """A transition that waits for the device loop (a Generate runs there) is cancelled by its client.

    Set-up, each step checked through the API rather than by timing: (1) a long Generate reached the
    server first; (2) the transition was accepted and holds the transition lock (a WakeUp probe is
    ABORTED); (3) the client cancels it while the Generate is still in flight; (4) the Generate then
    completes in full (so it ran before the transition, which was queued behind it). The cancelled
    transition may run later or not at all, but the worker must not be left refusing every later
    transition.
    """
    s = small_worker.stub
    reference = generate(s, PROMPT)
    long_run = start_long_generate(small_worker)
    fut: grpc.Future[worker_pb.SleepResponse] | grpc.Future[worker_pb.ReloadWeightsResponse]
    if rpc == "Sleep":
        fut = s.Sleep.future(
            worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1, request_id="queued-sleep"), timeout=CALL_TIMEOUT
        )
    else:
        fut = s.ReloadWeights.future(worker_pb.ReloadWeightsRequest(request_id="queued-reload"), timeout=CALL_TIMEOUT)

    def transition_holds_lock() -> bool:
        try:
            wake(s)  # harmless probe: FAILED_PRECONDITION while awake and unlocked, ABORTED while locked
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.ABORTED:
                return True
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e.details()
            return fut.done() or long_run.done()
        raise AssertionError("WakeUp succeeded on an awake worker")

    wait_for(transition_holds_lock, f"the {rpc} to be accepted")
    assert not long_run.done() and not fut.done(), "set-up raced: the Generate finished before the cancel"
    fut.cancel()
    assert len(long_run.result().token_ids) == LONG_GENERATE_TOKENS
    check_consistent_after_cancel(s, reference)


class StatusBlocked(AssertionError):
    """GetWorkerStatus did not answer until a running Generate had finished."""


def test_status_answers_while_generate_runs(small_worker: WorkerProcess) -> None:
    """core.py promises "the event loop stays free for status and telemetry" while device work runs.

    Order-based, no clock: while a long Generate runs, two status answers in a row must both show its
    temporary sequence (KvCacheInfo.sequence_count == 1). If status waits for the Generate, an answer
    that shows the sequence comes only after the Generate has freed it, so the next one cannot.
    """
    s = small_worker.stub
    long_run = start_long_generate(small_worker)
    seen = 0
    while seen < 2:
        st = status(s)
        if st.kv_cache.sequence_count == 1:
            seen += 1
        elif seen or long_run.done():
            raise StatusBlocked(
                f"no two status answers while a {LONG_GENERATE_TOKENS}-token Generate ran (seen {seen})"
            )
    assert len(long_run.result().token_ids) == LONG_GENERATE_TOKENS


# ---------------------------------------------------------------------------------------------
# health and shutdown


def test_health_serving_and_sigterm_drains() -> None:
    with WorkerProcess(["--model", "synthetic:tiny", "--seed", str(SEED)]) as wp:
        for service in ("", SERVICE):
            r = wp.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT)
            assert r.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as ei:
            wp.health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=CALL_TIMEOUT)
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND

        # SIGTERM while a Generate is in flight (the server has it: a later call returned): the call
        # completes in full, then the process exits 0 and says so.
        n = 300
        in_flight = start_long_generate(wp, n)
        wp.terminate()
        assert len(in_flight.result().token_ids) == n
        rc = wp.wait()
        assert rc == 0, wp.stderr_text()[-4000:]
        lines = wp.lines
        assert lines[-1] == f"memsvc worker {wp.worker_id} stopped", lines
        assert any(" ready: synthetic:tiny on host" in line for line in lines), lines


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--model", "/nonexistent/ckpt"], 2, "checkpoint directory does not exist"),  # the user's error: one line
        (["--model", "synthetic:no-such-preset"], 2, "unknown synthetic preset"),
        (["--kv-blocks", "0"], 2, "argument --kv-blocks: must be an integer >= 1"),
    ],
)
def test_worker_that_cannot_start_exits_nonzero_and_says_why(args: list[str], code: int, says: str) -> None:
    with pytest.raises(WorkerStartError) as ei, WorkerProcess(args):
        pass
    message = str(ei.value)
    assert f"worker exited with code {code} before 'ready'" in message, message
    assert says in message, message


def test_free_sequence_returns_its_blocks_wherever_they_are(stub: Stub, info: Info) -> None:
    base = status(stub).kv_cache
    kept = generate_full(stub, [3, 1, 4, 1, 5], sequence_id="to-free")
    blocks = list(kept.block_ids)
    assert blocks and status(stub).kv_cache.sequence_count == base.sequence_count + 1
    free_host = sorted(range(base.host_block_count))[: len(blocks)]
    swap(stub, common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, list(zip(blocks, free_host, strict=True)))
    assert status(stub).kv_cache.host_free_block_count == base.host_free_block_count - len(blocks)
    r = stub.FreeSequence(worker_pb.FreeSequenceRequest(sequence_id="to-free"))
    assert r.kv_cache.sequence_count == base.sequence_count
    assert r.kv_cache.host_free_block_count == base.host_free_block_count
    assert r.kv_cache.device_free_block_count == base.device_free_block_count
    expect_error(
        lambda: stub.FreeSequence(worker_pb.FreeSequenceRequest(sequence_id="to-free")), grpc.StatusCode.NOT_FOUND
    )
    expect_error(lambda: stub.FreeSequence(worker_pb.FreeSequenceRequest()), grpc.StatusCode.INVALID_ARGUMENT)


def test_a_failed_level2_reload_changes_nothing_and_a_retry_recovers(tmp_path: Path) -> None:
    """The reload of a level-2 wake cannot read its checkpoint (gone): FAILED_PRECONDITION (the request
    was fine, the worker's files are not), and nothing changed — the worker is asleep exactly as
    before, KV cache included (it used to come back PARTIALLY_AWAKE with the KV cache awake while the
    error said nothing changed). Once the checkpoint is back, WakeUp works."""
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, seed=5)
    with WorkerProcess(["--model", str(ckpt)]) as wp:
        s = wp.stub
        before = generate(s, PROMPT)
        sleep(s, common_pb.SLEEP_LEVEL_2)
        asleep = status(s)
        ckpt.rename(tmp_path / "moved")
        with pytest.raises(grpc.RpcError) as err:
            wake(s)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        assert "stays asleep" in (err.value.details() or "")
        st = status(s)
        assert (st.state, st.sleep_level) == (asleep.state, asleep.sleep_level) == (common_pb.WORKER_STATE_ASLEEP, 2)
        assert {t.tag: tag_state(t) for t in st.tags} == {"weights": "DISCARDED", "kv_cache": "DISCARDED"}
        expect_error(lambda: generate(s, PROMPT), grpc.StatusCode.FAILED_PRECONDITION)
        (tmp_path / "moved").rename(ckpt)
        wake(s)
        assert status(s).state == common_pb.WORKER_STATE_AWAKE
        assert generate(s, PROMPT) == before


def test_reload_weights_from_an_unreadable_checkpoint_changes_nothing(tmp_path: Path) -> None:
    """ReloadWeights checks its source before copying a byte: a checkpoint that went away is
    FAILED_PRECONDITION and the weights are the ones it had (same tokens, still AWAKE)."""
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, seed=7)
    with WorkerProcess(["--model", str(ckpt)]) as wp:
        s = wp.stub
        before = generate(s, PROMPT)
        ckpt.rename(tmp_path / "moved")
        with pytest.raises(grpc.RpcError) as err:
            s.ReloadWeights(worker_pb.ReloadWeightsRequest(), timeout=60)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        assert "unchanged" in (err.value.details() or "")
        assert status(s).state == common_pb.WORKER_STATE_AWAKE
        assert generate(s, PROMPT) == before


def test_swap_blocks_needs_the_kv_cache_resident_not_the_worker_awake(stub: Stub, info: Info) -> None:
    """The documented rule: asleep with kv_cache KEPT (weights offloaded), blocks still swap; with the
    kv_cache discarded (level 1), SwapBlocks is FAILED_PRECONDITION until the wake."""
    kept = generate_full(stub, [2, 7, 1, 8], 2, sequence_id="swap-while-asleep")
    blocks = list(kept.block_ids)
    host = sorted(range(status(stub).kv_cache.host_block_count))[: len(blocks)]
    sleep(
        stub,
        common_pb.SLEEP_LEVEL_UNSPECIFIED,
        tag_actions={"weights": common_pb.TAG_ACTION_OFFLOAD, "kv_cache": common_pb.TAG_ACTION_KEEP},
    )
    assert status(stub).state == common_pb.WORKER_STATE_ASLEEP
    swap(stub, common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, list(zip(blocks, host, strict=True)))
    swap(stub, common_pb.SWAP_DIRECTION_HOST_TO_DEVICE, list(zip(host, blocks, strict=True)))
    wake(stub)
    stub.FreeSequence(worker_pb.FreeSequenceRequest(sequence_id="swap-while-asleep"), timeout=CALL_TIMEOUT)
    sleep(stub)  # level 1: kv_cache discarded
    err = expect_error(lambda: swap(stub, common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, [(0, 0)]), PRECONDITION)
    assert "KV cache is asleep" in str(err.details()), err.details()
    wake(stub)
