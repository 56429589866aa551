"""The engine queues each step before it hands out the tokens of the step before (the device runs
step t while the host plans t+1; worker/model/engine.py), on the host backend: the order of steps and
tokens, the row a request that stops on a stop token costs, a request that leaves while its token is
in flight, and the device loop waiting for the step in flight before every command but an admission.
Every token is checked against the dense float64 reference (tests/model_helpers.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator

import pytest
from model_helpers import dense_greedy

from memsvc.errors import Cancelled
from memsvc.vocabulary import FinishReason
from worker.allocator import AllocatorConfig, MemoryAllocator
from worker.device_loop import DeviceLoop
from worker.model.generation import GenerationRequest, GenerationResult
from worker.model.runner import ModelRunner

PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def alloc() -> Iterator[MemoryAllocator]:
    a = MemoryAllocator(AllocatorConfig(backend="host", host_capacity_bytes=256 << 20))
    yield a
    a.close()


@pytest.fixture
def runner(alloc: MemoryAllocator) -> ModelRunner:
    return ModelRunner(alloc, "synthetic:tiny", 64, 8, block_size=4)


def reference(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    tokens = dense_greedy(runner.weights, runner.config, prompt, n)
    assert len(set(tokens)) >= 4, tokens  # a degenerate run would prove little
    return tokens


def drive(runner: ModelRunner, *futures: concurrent.futures.Future[GenerationResult]) -> None:
    engine = runner.engine
    while not all(f.done() for f in futures):
        engine.step()
    assert not engine.in_flight


def test_a_step_is_queued_before_the_tokens_of_the_step_before_are_handed_out(runner: ModelRunner) -> None:
    engine = runner.engine
    seen: list[int] = []
    future = engine.submit(GenerationRequest(PROMPT, 8, ignore_eos=True), on_token=lambda _: seen.append(engine.steps))
    drive(runner, future)
    assert future.result().tokens == reference(runner, PROMPT, 8)
    # token i is handed out once step i + 2 is queued (step 1 read the prompt); the last one ends the
    # request by its length, which is known ahead: no step is queued for it, so 8 steps in all
    assert seen == [2, 3, 4, 5, 6, 7, 8, 8]
    assert engine.steps == 8


def test_a_stop_token_costs_one_row_for_nothing_and_keeps_what_a_stop_kept_before(runner: ModelRunner) -> None:
    engine, kv = runner.engine, runner.kv_cache
    ref = reference(runner, PROMPT, 12)
    j = next(i for i in range(3, 12) if ref[i] not in ref[:i])  # stops at its (j+1)-th token
    request = GenerationRequest(PROMPT, 12, sequence_id="s", stop_token_ids=frozenset({ref[j]}), ignore_eos=True)
    future = engine.submit(request)
    drive(runner, future)
    result = future.result()
    assert (result.tokens, result.finish_reason) == (ref[: j + 1], FinishReason.STOP)
    assert engine.steps == j + 2  # the prompt, j decodes, and one queued before the stop token was seen
    seq = kv.sequence("s")
    # as if no step had been queued behind it: the stop token is kept but not read, and the blocks
    # past what it read went back
    assert seq.tokens == PROMPT + ref[: j + 1]
    assert seq.num_cached == len(seq.tokens) - 1
    assert len(seq.block_ids) == -(-seq.num_cached // kv.block_size) == len(result.block_ids)
    more = runner.generate([3, 4], 5, "s")
    assert more == reference(runner, PROMPT + ref[: j + 1] + [3, 4], 5)
    runner.free_sequence("s")
    assert kv.stats()["device_free_blocks"] == 64


def test_a_request_that_leaves_with_its_token_in_flight_changes_no_other_tokens(runner: ModelRunner) -> None:
    engine = runner.engine
    prompts = [PROMPT, [40, 41, 42, 43], [100, 7, 19, 23]]
    refs = [reference(runner, p, 10) for p in prompts]
    got: list[int] = []
    leave = threading.Event()

    def on_token(token: int) -> None:
        got.append(token)
        if len(got) == 3:
            leave.set()  # its fourth row is queued by now: the next step leaves it out, on the device too

    first = engine.submit(GenerationRequest(prompts[0], 10, ignore_eos=True), leave.is_set, on_token)
    others = [engine.submit(GenerationRequest(p, 10, ignore_eos=True)) for p in prompts[1:]]
    drive(runner, first, *others)
    with pytest.raises(Cancelled):
        first.result()
    assert got == refs[0][:3]  # the one in flight as it left is not handed out: nobody waits for it
    assert [f.result().tokens for f in others] == refs[1:]
    assert runner.kv_cache.stats()["device_free_blocks"] == 64 and not runner.kv_cache.sequences


def test_a_stop_beside_other_requests_changes_no_other_tokens(runner: ModelRunner) -> None:
    engine = runner.engine
    prompts = [PROMPT, [40, 41, 42, 43], [100, 7, 19, 23]]
    refs = [reference(runner, p, 10) for p in prompts]
    j = next(i for i in range(2, 10) if refs[1][i] not in refs[1][:i])
    stopping = GenerationRequest(prompts[1], 10, stop_token_ids=frozenset({refs[1][j]}), ignore_eos=True)
    futures = [engine.submit(GenerationRequest(prompts[0], 10, ignore_eos=True)), engine.submit(stopping)]
    futures.append(engine.submit(GenerationRequest(prompts[2], 10, ignore_eos=True)))
    drive(runner, *futures)
    assert [f.result().tokens for f in futures] == [refs[0], refs[1][: j + 1], refs[2]]
    assert runner.kv_cache.stats()["device_free_blocks"] == 64 and not runner.kv_cache.sequences


def test_the_device_loop_lands_the_step_in_flight_before_each_command_but_an_admission(runner: ModelRunner) -> None:
    engine = runner.engine
    loop = asyncio.new_event_loop()
    device = DeviceLoop(loop)
    device.serve(engine)
    seen: dict[str, concurrent.futures.Future[bool]] = {}

    def on_token(_: int) -> None:  # on the device loop, between the queuing of a step and the next
        if not seen:
            seen["admission"] = device.admit(lambda: engine.in_flight)
            seen["command"] = device.submit(lambda: engine.in_flight)

    try:
        admitted = device.admit(lambda: engine.submit(GenerationRequest(PROMPT, 30, ignore_eos=True), None, on_token))
        result = admitted.result(timeout=60).result(timeout=60)
        assert result.tokens == reference(runner, PROMPT, 30)
        assert seen["admission"].result(timeout=60) is True  # it ran beside the step in flight
        assert seen["command"].result(timeout=60) is False  # it waited for the step in flight
    finally:
        device.shutdown()
        loop.close()
