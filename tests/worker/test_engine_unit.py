"""The engine's scheduling in process, on the host backend: a batch, chunked prefill and preemption
each give every request the tokens it gets alone (greedy and seeded sampling), and nothing is left
behind. tests/worker/test_engine.py drives the same engine through real worker processes."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from memsvc.cli import build_parser
from memsvc.errors import InvalidArgument, OutOfMemory
from memsvc.vocabulary import FinishReason
from worker.allocator import AllocatorConfig, MemoryAllocator
from worker.model.decoder import HostStep
from worker.model.engine import SHORT_PREFIX
from worker.model.generation import GenerationRequest
from worker.model.runner import ModelRunner
from worker.model.sampling import SamplingParams
from worker.model.step_limits import DEFAULT_MAX_STEP_TOKENS


@pytest.fixture(scope="module")
def alloc() -> Iterator[MemoryAllocator]:
    a = MemoryAllocator(AllocatorConfig(backend="host", host_capacity_bytes=256 << 20))
    yield a
    a.close()


def requests(n: int, prompt_len: int = 30, new: int = 20) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(n):
        prompt = torch.randint(0, 2048, (prompt_len + i,), generator=g).tolist()
        sampling = SamplingParams(temperature=0.9, top_k=50, seed=7 + i) if i % 2 else SamplingParams()
        out.append(GenerationRequest(prompt, new, sampling=sampling, ignore_eos=True))
    return out


def concurrently(runner: ModelRunner, reqs: list[GenerationRequest]) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in reqs]
    errors: list[BaseException] = []
    start = threading.Barrier(len(reqs))

    def one(i: int) -> None:
        start.wait()
        try:
            results[i] = runner.run(reqs[i]).tokens
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


def together(runner: ModelRunner, reqs: list[GenerationRequest]) -> list[list[int]]:
    """Every request submitted before the first step, then stepped on this thread until all end: they
    always meet in the engine, which threads released at once (:func:`concurrently`) need not do on
    a busy machine, where the first can finish before the others submit."""
    futures = [runner.engine.submit(r) for r in reqs]
    while not all(f.done() for f in futures):
        runner.engine.step()
    return [f.result().tokens for f in futures]


def test_preempted_requests_resume_with_their_alone_tokens(alloc: MemoryAllocator) -> None:
    # 12 blocks of 4 tokens: each request needs 13 of its own at the end, so they cannot all run at once
    runner = ModelRunner(alloc, "synthetic:small", 16, 4, block_size=4)
    reqs = requests(4, prompt_len=20, new=30)
    alone = [runner.run(r).tokens for r in reqs]
    assert len({tuple(t) for t in alone}) == len(reqs)
    before = runner.engine.preemptions
    assert together(runner, reqs) == alone
    assert runner.engine.preemptions > before, "the pool was meant to run out"
    assert runner.kv_cache.stats()["device_free_blocks"] == 16 and not runner.kv_cache.sequences


def test_a_steps_token_budget_is_512_or_max_batch_whichever_is_more_unless_given(alloc: MemoryAllocator) -> None:
    """512 rows is the most a mixed step replays from a CUDA graph (step_limits.DEFAULT_MAX_STEP_TOKENS
    says why); a larger max_batch needs a budget of at least one token per running request."""
    assert DEFAULT_MAX_STEP_TOKENS == 512
    sizes = [(8, None, 512), (600, None, 600), (4, 16, 16)]
    for max_batch, given, budget in sizes:
        runner = ModelRunner(alloc, "synthetic:tiny", 16, 4, max_batch=max_batch, max_step_tokens=given)
        assert runner.engine.max_step_tokens == budget, (max_batch, given)
    with pytest.raises(InvalidArgument, match=r"max_step_tokens must be an integer >= max_batch \(8\), got 4"):
        ModelRunner(alloc, "synthetic:tiny", 16, 4, max_batch=8, max_step_tokens=4)
    assert build_parser().parse_args(["worker"]).max_step_tokens is None
    assert build_parser().parse_args(["worker", "--max-step-tokens", "auto"]).max_step_tokens is None
    assert build_parser().parse_args(["worker", "--max-step-tokens", "300"]).max_step_tokens == 300


@pytest.mark.parametrize("paged", [False, True], ids=["spans", "paged-rows"])
def test_long_prompts_are_read_in_chunks_beside_the_decodes(alloc: MemoryAllocator, paged: bool) -> None:
    """Prompt chunks as spans (the host backend's way) or as rows through the block tables (CUDA's,
    tests/worker/test_reference.py checks it against transformers): each request's tokens are its alone ones."""
    runner = ModelRunner(alloc, "synthetic:small", 128, 4, block_size=8, max_batch=4, max_step_tokens=16)
    reqs = requests(3, prompt_len=50, new=12)
    alone = [runner.run(r).tokens for r in reqs]
    runner.engine.paged_rows = 1 << 30 if paged else 0
    steps = runner.engine.steps
    one = runner.run(reqs[0])
    assert one.tokens == alone[0]
    assert runner.engine.steps - steps >= 50 // 16 + 12, "a 50-token prompt takes several 16-token steps"
    assert concurrently(runner, reqs) == alone


def test_a_burst_of_short_prompts_is_one_paged_step_and_a_long_prompt_is_a_span(alloc: MemoryAllocator) -> None:
    """Past ``paged_rows`` a step is still planned as paged rows while its rows' prefixes are short
    (engine.SHORT_PREFIX): twelve new short prompts are one step that attends through the block
    tables, not twelve spans of their own launches; a long prompt's chunk, whose rows would each read a
    long prefix, is a span. Either way every request gets its alone tokens."""
    runner = ModelRunner(alloc, "synthetic:small", 256, 4, block_size=8, max_batch=16, max_step_tokens=1024)
    short, (long,) = requests(12, prompt_len=10, new=4), requests(1, prompt_len=2 * SHORT_PREFIX + 100, new=4)
    alone = [runner.run(r).tokens for r in [*short, long]]
    runner.engine.paged_rows = 8
    plans: list[tuple[int, bool]] = []
    run_step = runner.engine._run_step

    def record(step: HostStep) -> torch.Tensor:
        plans.append((len(step.token_ids), step.row_tables is not None))
        return run_step(step)

    runner.engine._run_step = record
    assert together(runner, short) == alone[:-1]  # one thread: all of them meet the first step
    assert plans[0] == (sum(len(r.prompt) for r in short), True), plans[:3]
    plans.clear()
    assert runner.run(long).tokens == alone[-1]
    assert plans[0] == (len(long.prompt), False), plans[:3]


def test_a_request_larger_than_the_pool_beside_kept_sequences_fails_at_once(alloc: MemoryAllocator) -> None:
    runner = ModelRunner(alloc, "synthetic:small", 8, 4, block_size=4)
    runner.run(GenerationRequest([1] * 16, 0, sequence_id="kept"))  # holds 4 of the 8 blocks
    with pytest.raises(OutOfMemory, match="kept sequences hold 4"):
        runner.run(GenerationRequest([2] * 10, 10))  # needs 5
    assert runner.kv_cache.stats()["device_free_blocks"] == 4
    assert runner.run(GenerationRequest([2] * 10, 6)).tokens  # 4 blocks: fits
    runner.free_sequence("kept")
    assert runner.kv_cache.stats()["device_free_blocks"] == 8


def test_a_step_that_fails_ends_its_batch_but_keeps_what_ended_before(alloc: MemoryAllocator) -> None:
    """A request that ended earlier in the failing step keeps its result and its kept sequence; the
    others get the error and keep nothing; the engine serves on."""
    runner = ModelRunner(alloc, "synthetic:small", 64, 4, block_size=4)
    kept = GenerationRequest([5, 6, 7, 8], 1, sequence_id="kept")
    doomed = GenerationRequest([9, 10, 11], 5)
    ok = runner.engine.submit(kept)

    def boom(token: int) -> None:
        raise RuntimeError(f"client gone at {token}")

    bad = runner.engine.submit(doomed, on_token=boom)
    while not (ok.done() and bad.done()):
        runner.engine.step()
    assert len(ok.result().tokens) == 1 and ok.result().block_ids
    with pytest.raises(RuntimeError, match="client gone"):
        bad.result()
    seq = runner.kv_cache.sequence("kept")
    assert len(seq.tokens) == 5 and list(runner.kv_cache.sequences) == ["kept"]
    assert runner.run(GenerationRequest([1, 2, 3], 4)).tokens


def test_stop_at_context_ends_at_the_models_length_instead_of_refusing(alloc: MemoryAllocator) -> None:
    runner = ModelRunner(alloc, "synthetic:tiny", 160, 4, block_size=16)  # tiny: 2048 positions
    prompt = [7] * 2040
    with pytest.raises(InvalidArgument, match="would reach 2140"):
        runner.run(GenerationRequest(prompt, 100, ignore_eos=True))
    r = runner.run(GenerationRequest(prompt, 100, ignore_eos=True, stop_at_context=True))
    assert len(r.tokens) == 8 and r.finish_reason == FinishReason.LENGTH
    with pytest.raises(InvalidArgument, match="no room"):
        runner.run(GenerationRequest([7] * 2048, 5, stop_at_context=True))
    assert runner.kv_cache.stats()["device_free_blocks"] == 160


def test_a_request_for_more_than_the_whole_pool_is_refused_naming_the_flag(alloc: MemoryAllocator) -> None:
    """Prompt and max_new_tokens past every block of the pool (8 of 4 tokens): INVALID_ARGUMENT (the
    gateway's 400) naming the limit and the flag that sets it, and nothing is taken."""
    runner = ModelRunner(alloc, "synthetic:small", 8, 4, block_size=4)
    with pytest.raises(InvalidArgument, match=r"the KV cache holds 32 .*--kv-blocks"):
        runner.run(GenerationRequest([2] * 10, 30))  # feeds 39 tokens: 10 blocks
    assert runner.kv_cache.stats()["device_free_blocks"] == 8 and not runner.kv_cache.sequences
    assert len(runner.run(GenerationRequest([2] * 10, 23, ignore_eos=True)).tokens) == 23  # feeds 32: fits


def test_up_to_max_new_tokens_ends_where_the_pool_ends(alloc: MemoryAllocator) -> None:
    """The OpenAI client's default (max_tokens unset: the gateway asks for up to 4096) on a pool
    smaller than that: blocks are taken as tokens are made, and the pool ends the generation with
    LENGTH, the tokens those of an explicit request for exactly that many; alone or several at
    once (they preempt each other and still get their alone tokens)."""
    runner = ModelRunner(alloc, "synthetic:small", 8, 4, block_size=4)  # 32 tokens fed at most
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    r = runner.run(GenerationRequest(prompt, 4096, ignore_eos=True, stop_at_context=True))
    assert r.finish_reason == FinishReason.LENGTH and len(r.tokens) == 32 + 1 - len(prompt)
    assert r.tokens == runner.run(GenerationRequest(prompt, len(r.tokens), ignore_eos=True)).tokens
    assert runner.kv_cache.stats()["device_free_blocks"] == 8
    reqs = [
        GenerationRequest(q.prompt, 4096, sampling=q.sampling, ignore_eos=True, stop_at_context=True)
        for q in requests(3, prompt_len=8)
    ]
    alone = [runner.run(q).tokens for q in reqs]
    assert [len(t) for t in alone] == [33 - len(q.prompt) for q in reqs]
    before = runner.engine.preemptions
    assert together(runner, reqs) == alone
    assert runner.engine.preemptions > before, "three sequences of a whole pool each were meant to preempt"
    assert runner.kv_cache.stats()["device_free_blocks"] == 8 and not runner.kv_cache.sequences


def test_cuda_graphs_where_they_cannot_run_are_refused_before_anything_is_allocated() -> None:
    """The host backend has no CUDA graphs: the runner says so before it allocates its KV cache or
    loads a byte of weights (it refused only after both, and a caller holding the error held them)."""
    a = MemoryAllocator(AllocatorConfig(backend="host", host_capacity_bytes=64 << 20))
    try:
        with pytest.raises(InvalidArgument, match="CUDA graphs need the cuda backend"):
            ModelRunner(a, "synthetic:tiny", 16, 4, cuda_graphs=True)
        assert sum(t.allocated_bytes for t in a.stats().tags.values()) == 0
    finally:
        a.close()
