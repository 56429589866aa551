"""The worker service on the GPU: a ~1B-parameter synthetic model (Llama-3.2-1B shapes, bf16) on the
cuda backend gives identical greedy tokens across level-1 sleep, level-2 sleep (reload), and a swap
of its KV blocks out and back into different slots; sleep returns the device memory."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from worker import _native

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_native.cuda_device_count() == 0, reason="needs a CUDA device"),
]

from workerproc import WorkerProcess  # noqa: E402

PROMPT = [128000, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679]


@pytest.fixture(scope="module")
def gpu_worker() -> Iterator[WorkerProcess]:
    with WorkerProcess(
        ["--backend", "cuda", "--model", "synthetic:1b", "--kv-blocks", "1024", "--host-kv-blocks", "256"],
        ready_timeout=300,
    ) as wp:
        yield wp


def _tags(wp: WorkerProcess) -> dict[str, common_pb.TagMemory]:
    st = wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status
    return {t.tag: t for t in st.tags}


def _generate(wp: WorkerProcess, n: int = 24, prompt: list[int] = PROMPT, seq: str = "") -> worker_pb.GenerateResponse:
    return wp.stub.Generate(
        worker_pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=n, sequence_id=seq), timeout=120
    )


def test_cuda_graphs_is_a_tag_from_the_start_and_wakes_with_kv_cache(gpu_worker: WorkerProcess) -> None:
    """First in the module, so it sees the worker as soon as it serves (its graphs captured in the
    background): the cuda_graphs tag is listed already, a Sleep naming it is accepted, and vLLM's
    partial wake (weights, then kv_cache) ends AWAKE, serving the same tokens."""
    assert "cuda_graphs" in _tags(gpu_worker), "the tag must not appear only once a graph is captured"
    before = list(_generate(gpu_worker).token_ids)
    actions = {
        "weights": common_pb.TAG_ACTION_OFFLOAD,
        "kv_cache": common_pb.TAG_ACTION_DISCARD,
        "cuda_graphs": common_pb.TAG_ACTION_DISCARD,
    }
    r = gpu_worker.stub.Sleep(worker_pb.SleepRequest(tag_actions=actions), timeout=120)
    assert {t.tag: t.state for t in r.status.tags}["cuda_graphs"] == common_pb.TAG_STATE_DISCARDED
    woke = gpu_worker.stub.WakeUp(worker_pb.WakeUpRequest(tags=["weights"]), timeout=120)
    assert woke.status.state == common_pb.WORKER_STATE_PARTIALLY_AWAKE
    woke = gpu_worker.stub.WakeUp(worker_pb.WakeUpRequest(tags=["kv_cache"]), timeout=120)
    assert woke.status.state == common_pb.WORKER_STATE_AWAKE, "cuda_graphs wakes with kv_cache"
    assert list(_generate(gpu_worker).token_ids) == before


def test_level1_and_level2_keep_tokens_and_return_memory(gpu_worker: WorkerProcess) -> None:
    before = list(_generate(gpu_worker).token_ids)
    assert len(set(before)) > 3, f"degenerate synthetic model: {before}"
    # device free memory after Generate: torch's own caching allocator holds its activations
    st = gpu_worker.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status
    assert st.device.backend == "cuda" and st.model.parameter_count > 1_000_000_000
    tags = _tags(gpu_worker)
    mapped = tags["weights"].mapped_bytes + tags["kv_cache"].mapped_bytes
    free_awake = st.device.free_bytes

    r: worker_pb.SleepResponse | worker_pb.WakeUpResponse = gpu_worker.stub.Sleep(
        worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1), timeout=120
    )
    assert r.status.state == common_pb.WORKER_STATE_ASLEEP
    asleep = {t.tag: t for t in r.status.tags}
    assert asleep["weights"].mapped_bytes == 0 and asleep["weights"].offloaded_bytes == tags["weights"].allocated_bytes
    gained = r.status.device.free_bytes - free_awake
    print(
        f"level 1: {r.transition.moved_bytes} B in {r.transition.duration.ToNanoseconds() / 1e6:.1f} ms "
        f"({r.transition.gigabytes_per_second:.1f} GB/s); device free +{gained} of {mapped} mapped"
    )
    assert gained >= 0.99 * mapped
    r = gpu_worker.stub.WakeUp(worker_pb.WakeUpRequest(), timeout=120)
    print(f"wake: {r.transition.gigabytes_per_second:.1f} GB/s")
    assert r.status.state == common_pb.WORKER_STATE_AWAKE
    assert list(_generate(gpu_worker).token_ids) == before

    r = gpu_worker.stub.Sleep(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_2), timeout=120)
    assert {t.tag: t for t in r.status.tags}["weights"].state == common_pb.TAG_STATE_DISCARDED
    gpu_worker.stub.WakeUp(worker_pb.WakeUpRequest(), timeout=300)
    assert list(_generate(gpu_worker).token_ids) == before


def test_swap_out_and_back_into_other_slots_keeps_tokens(gpu_worker: WorkerProcess) -> None:
    whole = list(_generate(gpu_worker, 32, seq="ref").token_ids)
    first = _generate(gpu_worker, 16, seq="s")
    blocks = list(first.block_ids)
    assert blocks
    host = list(range(len(blocks)))
    out = gpu_worker.stub.SwapBlocks(
        worker_pb.SwapBlocksRequest(
            direction=common_pb.SWAP_DIRECTION_DEVICE_TO_HOST,
            pairs=[worker_pb.BlockPair(src_block=b, dst_block=h) for b, h in zip(blocks, host, strict=True)],
        )
    )
    assert out.moved_bytes == len(blocks) * out.kv_cache.block_bytes
    new = list(range(1000, 1000 + len(blocks)))
    gpu_worker.stub.SwapBlocks(  # back in with the packed form
        worker_pb.SwapBlocksRequest(direction=common_pb.SWAP_DIRECTION_HOST_TO_DEVICE, src_blocks=host, dst_blocks=new)
    )
    rest = _generate(gpu_worker, 16, prompt=[], seq="s")
    assert list(first.token_ids) + list(rest.token_ids) == whole
    assert list(rest.block_ids)[: len(new)] == new


def test_swaps_in_flight_together_keep_tokens(gpu_worker: WorkerProcess) -> None:
    """Eight sequences swapped out by eight SwapBlocks calls sent at once (packed ids), then back into
    other device blocks by eight more (raw u32le ids): each is checked and enqueued while the one
    before still copies on the device. Every sequence continues with the tokens it would have
    produced unmoved."""
    seqs = {f"fl{i}": [PROMPT[0], *(p + 17 * i for p in PROMPT[1:])] for i in range(8)}
    whole = {sid: list(_generate(gpu_worker, 24, prompt=p).token_ids) for sid, p in seqs.items()}
    first = {sid: _generate(gpu_worker, 12, prompt=p, seq=sid) for sid, p in seqs.items()}
    blocks = {sid: list(r.block_ids) for sid, r in first.items()}
    k = len(blocks["fl0"])
    host = {sid: list(range(i * k, (i + 1) * k)) for i, sid in enumerate(seqs)}
    device = {sid: list(range(1023 - i * k, 1023 - (i + 1) * k, -1)) for i, sid in enumerate(seqs)}
    assert not {b for bs in device.values() for b in bs} & {b for bs in blocks.values() for b in bs}

    def in_flight(
        direction: common_pb.SwapDirection.ValueType, src: dict[str, list[int]], dst: dict[str, list[int]]
    ) -> None:
        req = [
            worker_pb.SwapBlocksRequest(direction=direction, src_blocks=src[sid], dst_blocks=dst[sid]) for sid in seqs
        ]
        if direction == common_pb.SWAP_DIRECTION_HOST_TO_DEVICE:  # back in as raw little-endian u32 ids
            req = [
                worker_pb.SwapBlocksRequest(
                    direction=direction,
                    src_blocks_u32le=np.array(src[sid], "<u4").tobytes(),
                    dst_blocks_u32le=np.array(dst[sid], "<u4").tobytes(),
                )
                for sid in seqs
            ]
        calls = [gpu_worker.stub.SwapBlocks.future(r, timeout=120) for r in req]
        assert [f.result().moved_bytes > 0 for f in calls] == [True] * len(seqs)

    in_flight(common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, blocks, host)
    _generate(gpu_worker, 24, prompt=[PROMPT[0], 1, 2, 3, 4, 5, 6, 7, 8, 9], seq="")  # overwrite freed blocks
    in_flight(common_pb.SWAP_DIRECTION_HOST_TO_DEVICE, host, device)
    for sid in seqs:
        rest = _generate(gpu_worker, 12, prompt=[], seq=sid)
        assert list(first[sid].token_ids) + list(rest.token_ids) == whole[sid], sid
        assert list(rest.block_ids)[:k] == device[sid]


def _wait_until(ok: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _pinned_once(wp: WorkerProcess, ok: Callable[[int], bool], timeout: float = 60.0) -> int:
    """host_pinned_bytes once ``ok`` holds for it (the prepin runs in the background), or at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        pinned = wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status.host_pinned_bytes
        if ok(pinned) or time.monotonic() > deadline:
            return pinned
        time.sleep(0.05)


def test_the_default_host_reserve_prepins_the_weights_and_an_explicit_zero_pins_none(
    gpu_worker: WorkerProcess,
) -> None:
    """`auto` (the default, gpu_worker's) pre-pins the weights' size after the load and keeps it; an
    explicit `--host-reserve 0` is the operator's: the default `--host-prepin auto` then pins nothing
    (it pinned the weights' size and raised the reserve to it, before the fix)."""
    weights = _tags(gpu_worker)["weights"].mapped_bytes
    assert _pinned_once(gpu_worker, lambda p: p >= weights) >= weights
    args = ["--backend", "cuda", "--model", "synthetic:tiny", "--host-reserve", "0"]
    with WorkerProcess(args, ready_timeout=300) as wp:
        tiny = _tags(wp)["weights"].mapped_bytes
        st = wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status
        kv_pool = st.kv_cache.host_block_count * st.kv_cache.block_bytes
        time.sleep(1.0)  # a prepin would have started by now
        assert _pinned_once(wp, lambda p: p >= tiny + kv_pool, timeout=2.0) < tiny + kv_pool


def test_a_pausing_sleep_keeps_streams_and_they_go_on_with_their_alone_tokens(gpu_worker: WorkerProcess) -> None:
    """Three greedy 400-token streams (CUDA graphs replaying) are paused by a level-1 Sleep with
    pause_generations: their KV blocks go to the host pool while the device's are discarded. After a
    wake in two parts (weights, then kv_cache: they go on only once every tag is awake) each stream
    ends with exactly its alone tokens, none read again, and the KV cache ends empty."""
    import threading

    prompts = [[(PROMPT[i % len(PROMPT)] + 97 * i * j) % 128000 for j in range(8 + 9 * i)] for i in range(3)]
    reqs = [worker_pb.GenerateRequest(prompt_token_ids=p, max_new_tokens=400, ignore_eos=True) for p in prompts]
    alone = [list(gpu_worker.stub.Generate(r, timeout=120).token_ids) for r in reqs]
    status = gpu_worker.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status
    recomputed = status.kv_cache.recomputed_tokens
    got: list[list[int]] = [[] for _ in reqs]
    errors: list[BaseException] = []

    def read(i: int) -> None:
        try:
            for msg in gpu_worker.stub.GenerateStream(worker_pb.GenerateStreamRequest(request=reqs[i]), timeout=300):
                got[i].extend(msg.token_ids)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(reqs))]
    for t in threads:
        t.start()
    _wait_until(lambda: all(len(g) >= 5 for g in got), "the streams to start")
    slept = gpu_worker.stub.Sleep(
        worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1, pause_generations=True), timeout=120
    )
    paused = slept.status.paused_generations
    assert slept.status.state == common_pb.WORKER_STATE_ASLEEP and paused >= 1, slept.status
    assert slept.status.kv_cache.host_free_block_count < slept.status.kv_cache.host_block_count
    gpu_worker.stub.WakeUp(worker_pb.WakeUpRequest(tags=["weights"]), timeout=120)
    assert gpu_worker.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status.paused_generations == paused
    gpu_worker.stub.WakeUp(worker_pb.WakeUpRequest(tags=["kv_cache"]), timeout=120)
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert got == alone, "a paused stream changed"
    after = gpu_worker.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status
    assert after.kv_cache.recomputed_tokens == recomputed and after.paused_generations == 0
    kv = after.kv_cache
    assert kv.device_free_block_count == kv.device_block_count and kv.host_free_block_count == kv.host_block_count
    print(f"paused {paused} streams mid-generation; all resumed with their alone tokens")


def test_a_standby_handed_the_same_flags_serves_the_same_tokens_and_sleeps_as_deep(gpu_worker: WorkerProcess) -> None:
    """``memsvc worker --standby --backend cuda`` (torch, its CUDA context and cuBLAS made before the
    flags come: worker/standby.py), handed this module's worker's flags: its greedy tokens are the
    plain worker's, and a level-1 sleep gives back the device memory its weights and KV cache map."""
    import json
    import re
    import signal
    import sys

    from childproc import Proc
    from workerproc import _LISTENING, _READY

    before = list(_generate(gpu_worker).token_ids)
    proc = Proc(
        [sys.executable, "-m", "memsvc.cli", "worker", "--standby", "--backend", "cuda"],
        name="standby",
        new_session=False,
        stdin=True,
    )
    proc.start()
    try:
        proc.wait_lines([re.compile(r"^memsvc worker standby ready on cuda:0 in ")], 300)
        flags = [
            "--listen",
            "127.0.0.1:0",
            "--backend",
            "cuda",
            "--model",
            "synthetic:1b",
            "--kv-blocks",
            "1024",
            "--host-kv-blocks",
            "256",
        ]
        proc.write_stdin(json.dumps(flags) + "\n")
        listening, _ = proc.wait_lines([_LISTENING, _READY], 300)
        handed = WorkerProcess(flags)
        handed.address = listening["address"]
        try:
            assert list(_generate(handed).token_ids) == before
            tags = _tags(handed)
            mapped = tags["weights"].mapped_bytes + tags["kv_cache"].mapped_bytes
            free_awake = handed.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest()).status.device.free_bytes
            r = handed.stub.Sleep(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1), timeout=120)
            assert r.status.device.free_bytes - free_awake >= 0.99 * mapped
            handed.stub.WakeUp(worker_pb.WakeUpRequest(), timeout=120)
            assert list(_generate(handed).token_ids) == before
        finally:
            handed.close_channel()
        assert proc.signal_and_wait(signal.SIGTERM, 120) == 0
    finally:
        proc.close()
