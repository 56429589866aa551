"""The worker's engine under concurrent load: continuous batching, as a client sees it.

Concurrent Generate calls run in one batch on the worker, and requests join and leave it at every
step. Whatever a request shares a step with, it must return exactly the tokens it returns alone on
the same worker (greedy, or sampled with a fixed seed). Around that, the contract these tests hold
the engine to:

- a request that does not fit in the free KV blocks waits for them (or is preempted and resumed)
  instead of failing; one that could never fit in the whole pool fails at once with
  RESOURCE_EXHAUSTED and changes nothing;
- a streaming client that cancels frees its blocks;
- a Sleep that arrives mid-batch drains it: it returns once every running request finished in
  full, and a Generate sent while it is pending is refused (FAILED_PRECONDITION);
- a kept sequence that is being generated cannot be swapped, freed or continued by a second call
  (FAILED_PRECONDITION, or ABORTED for the second call), and its generation goes on unharmed;
- ``--max-batch N`` bounds the requests run per step; the others wait and still finish.

Real ``memsvc worker`` processes (host backend, ``synthetic:small`` in float32) and real gRPC calls,
each from a thread of its own. "Alone" tokens are always taken on the same worker first, one request
at a time. Ordering is checked with events and client-side timestamps, never with sleeps; every RPC
and every wait has a bounded timeout.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2
from workerproc import WorkerProcess

from memsvc import DOMAIN, error_info
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

MODEL = "synthetic:small"
SEED = 5
BLOCK_SIZE = 16
KV_BLOCKS = 128
"""The shared worker's device pool: the 8 concurrent requests of the first test need at most 56 blocks."""
SMALL_KV_BLOCKS = 8
"""The exhaustion worker's device pool: 128 token slots."""
SERVICE = "memsvc.v1.ModelWorkerService"

CALL_TIMEOUT = 180.0
"""Deadline of every RPC that is expected to succeed: a bound on a wait, not a measure (a 200-token
Generate on the host backend took over 30 s with two suites on the machine's two cores)."""
FAST_TIMEOUT = 10.0
"""Deadline of an RPC that must be refused at once: a refusal that waits runs into it."""
WAIT_TIMEOUT = 120.0
"""Bound of every wait for an event (tokens streamed, a thread ended, blocks freed)."""
FREE_TIMEOUT = 60.0
"""How long a cancelled stream may take to give its blocks back (a bound, as above)."""

Stub = worker_grpc.ModelWorkerServiceStub
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# helpers


def status(stub: Stub) -> common_pb.WorkerStatus:
    return stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=CALL_TIMEOUT).status


def kv_view(kv: common_pb.KvCacheInfo) -> tuple[int, int, int, int, int]:
    return (
        kv.device_block_count,
        kv.device_free_block_count,
        kv.host_block_count,
        kv.host_free_block_count,
        kv.sequence_count,
    )


def kv_empty(kv: common_pb.KvCacheInfo) -> bool:
    return (
        kv.sequence_count == 0
        and kv.device_free_block_count == kv.device_block_count
        and kv.host_free_block_count == kv.host_block_count
    )


def wait_kv_empty(stub: Stub, timeout: float = FREE_TIMEOUT) -> common_pb.KvCacheInfo:
    """The KV cache once every block is free and no sequence is left (or the last view after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        kv = status(stub).kv_cache
        if kv_empty(kv) or time.monotonic() >= deadline:
            return kv
        time.sleep(0.01)


def settle(stub: Stub) -> common_pb.WorkerStatus:
    """Status once no transition runs."""
    busy = (common_pb.WORKER_STATE_SLEEPING, common_pb.WORKER_STATE_WAKING, common_pb.WORKER_STATE_LOADING)
    deadline = time.monotonic() + WAIT_TIMEOUT
    while True:
        st = status(stub)
        if st.state not in busy:
            return st
        assert time.monotonic() < deadline, f"worker stuck in {common_pb.WorkerState.Name(st.state)}"
        time.sleep(0.01)


def reset(stub: Stub) -> None:
    """Bring a shared worker back to AWAKE with an empty KV cache (a failed test may leave it otherwise)."""
    st = settle(stub)
    if st.state in (common_pb.WORKER_STATE_ASLEEP, common_pb.WORKER_STATE_PARTIALLY_AWAKE):
        stub.WakeUp(worker_pb.WakeUpRequest(), timeout=CALL_TIMEOUT)
    assert status(stub).state == common_pb.WORKER_STATE_AWAKE
    kv = wait_kv_empty(stub)
    if not kv_empty(kv):  # a level-1 sleep discards the KV cache: sequences on the device are dropped
        stub.Sleep(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1), timeout=CALL_TIMEOUT)
        stub.WakeUp(worker_pb.WakeUpRequest(), timeout=CALL_TIMEOUT)
        kv = wait_kv_empty(stub)
    assert kv_empty(kv), f"a previous test left the KV cache in use: {kv}"


def round_trip(wp: WorkerProcess) -> None:
    """One health check on the worker's channel: when it returns, every call sent earlier on that
    channel has reached the server."""
    r = wp.health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=CALL_TIMEOUT)
    assert r.status == health_pb2.HealthCheckResponse.SERVING


def random_prompt(rng: random.Random, vocab: int, length: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


def request(
    prompt: Sequence[int], n: int, sequence_id: str = "", sampling: worker_pb.SamplingParams | None = None
) -> worker_pb.GenerateRequest:
    """A Generate that runs its full length (``ignore_eos``), greedy unless ``sampling`` says otherwise."""
    return worker_pb.GenerateRequest(
        prompt_token_ids=list(prompt), max_new_tokens=n, sequence_id=sequence_id, sampling=sampling, ignore_eos=True
    )


def check_answer(r: worker_pb.GenerateResponse, req: worker_pb.GenerateRequest) -> list[int]:
    """The answer's tokens, after checking it ran the request's full length."""
    tokens = list(r.token_ids)
    assert len(tokens) == req.max_new_tokens, f"{len(tokens)} tokens for max_new_tokens={req.max_new_tokens}"
    assert r.finish_reason == common_pb.FINISH_REASON_LENGTH
    assert r.completion_token_count == len(tokens)
    assert r.sequence_id == req.sequence_id
    return tokens


def generate(stub: Stub, req: worker_pb.GenerateRequest, timeout: float = CALL_TIMEOUT) -> list[int]:
    return check_answer(stub.Generate(req, timeout=timeout), req)


def stream_tokens(stub: Stub, req: worker_pb.GenerateRequest) -> list[int]:
    """GenerateStream read to its end on this thread: the streamed tokens, which must add up to the answer."""
    tokens: list[int] = []
    done: worker_pb.GenerateResponse | None = None
    for msg in stub.GenerateStream(worker_pb.GenerateStreamRequest(request=req), timeout=CALL_TIMEOUT):
        assert done is None, "a message came after the one carrying the whole answer"
        tokens.extend(msg.token_ids)
        if msg.HasField("done"):
            done = msg.done
    assert done is not None, "the stream ended without the whole answer"
    assert tokens == list(done.token_ids), "the streamed tokens do not add up to the answer"
    return check_answer(done, req)


def run(stub: Stub, req: worker_pb.GenerateRequest, streamed: bool) -> list[int]:
    return stream_tokens(stub, req) if streamed else generate(stub, req)


def alone(stub: Stub, requests: Sequence[worker_pb.GenerateRequest]) -> list[list[int]]:
    """Each request's tokens run alone: one Generate at a time, nothing else on the worker."""
    return [generate(stub, r) for r in requests]


def concurrently(calls: Sequence[Callable[[], T]], timeout: float = WAIT_TIMEOUT) -> list[T]:
    """Run every call on a thread of its own, all released at once; their results in order. An
    exception one of them raised is raised here once all have ended."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)

    def call(i: int) -> None:
        try:
            barrier.wait(timeout)
            results[i] = calls[i]()
        except BaseException as exc:
            errors[i] = exc

    threads = [threading.Thread(target=call, args=(i,), name=f"client-{i}", daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout + CALL_TIMEOUT
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        assert not t.is_alive(), f"{t.name} still running after its RPC deadline"
    for exc in errors:
        if exc is not None:
            raise exc
    return results


def expect_error(what: str, call: Callable[[], object], *codes: grpc.StatusCode) -> grpc.RpcError:
    """``call`` (``what`` it does, for the message) fails with one of ``codes`` and an ErrorInfo detail
    of memsvc's domain."""
    names = " or ".join(code.name for code in codes)
    try:
        call()
    except grpc.RpcError as err:
        assert err.code() in codes, f"{what}: expected {names}, got {err.code().name}: {err.details()}"
        info = error_info(err)
        assert info is not None and info.domain == DOMAIN, f"{what}: {err.code().name} without memsvc's ErrorInfo"
        return err
    raise AssertionError(f"{what} succeeded; expected {names}")


def free_sequence(stub: Stub, sequence_id: str) -> common_pb.KvCacheInfo:
    return stub.FreeSequence(worker_pb.FreeSequenceRequest(sequence_id=sequence_id), timeout=CALL_TIMEOUT).kv_cache


class Streamed:
    """A GenerateStream read on a thread of its own: the tokens as they come, the whole answer, and
    when it ended (``time.monotonic()`` at the last message, or at the error). Streams given the same
    ``cond`` share it, so a test can wait for a condition over all of them."""

    def __init__(
        self,
        stub: Stub,
        req: worker_pb.GenerateRequest,
        cond: threading.Condition | None = None,
        timeout: float = CALL_TIMEOUT,
    ) -> None:
        self.request = req
        self.timeout = timeout
        self.cond = cond or threading.Condition()
        self.tokens: list[int] = []
        self.done: worker_pb.GenerateResponse | None = None
        self.error: grpc.RpcError | None = None
        self.finished_at: float | None = None
        self.call = stub.GenerateStream(worker_pb.GenerateStreamRequest(request=req), timeout=timeout)
        self._thread = threading.Thread(target=self._read, name="stream-reader", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                with self.cond:
                    self.tokens.extend(msg.token_ids)
                    if msg.HasField("done"):
                        self.done = msg.done
                        self.finished_at = time.monotonic()
                    self.cond.notify_all()
        except grpc.RpcError as exc:
            with self.cond:
                self.error = exc
        finally:
            with self.cond:
                if self.finished_at is None:
                    self.finished_at = time.monotonic()
                self.cond.notify_all()

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    def wait_tokens(self, n: int) -> None:
        """Return once ``n`` tokens have come (AssertionError if the stream ended or timed out first)."""
        with self.cond:
            self.cond.wait_for(lambda: len(self.tokens) >= n or self.finished, WAIT_TIMEOUT)
            got, error = len(self.tokens), self.error
        assert got >= n, f"the stream sent {got} tokens, not {n} (ended: {self.finished}, error: {error})"

    def join(self) -> None:
        self._thread.join(self.timeout + WAIT_TIMEOUT)
        assert not self._thread.is_alive(), "the stream did not end within its deadline"

    def result(self) -> list[int]:
        """The whole answer's tokens once the stream ended (its RpcError if it failed), checked against
        the streamed ones."""
        self.join()
        if self.error is not None:
            raise self.error
        assert self.done is not None, "the stream ended without the whole answer"
        assert self.tokens == list(self.done.token_ids), "the streamed tokens do not add up to the answer"
        return check_answer(self.done, self.request)

    def cancel(self) -> None:
        self.call.cancel()
        self.join()


class Leftovers:
    """What a test leaves behind when it fails midway: its streams are cancelled and the sequences it
    kept are freed at teardown, so the next test on the shared worker starts clean."""

    def __init__(self) -> None:
        self.streams: list[Streamed] = []
        self.sequences: list[tuple[Stub, str]] = []

    def stream(self, stub: Stub, req: worker_pb.GenerateRequest, cond: threading.Condition | None = None) -> Streamed:
        s = Streamed(stub, req, cond)
        self.streams.append(s)
        return s

    def keep(self, stub: Stub, sequence_id: str) -> str:
        self.sequences.append((stub, sequence_id))
        return sequence_id

    def close(self) -> None:
        for s in self.streams:
            s.cancel()
        for stub, seq in self.sequences:
            deadline = time.monotonic() + FREE_TIMEOUT
            while True:
                try:
                    free_sequence(stub, seq)
                except grpc.RpcError as exc:
                    # FAILED_PRECONDITION: still generating (or the worker sleeps); retry for a while.
                    if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and time.monotonic() < deadline:
                        time.sleep(0.05)
                        continue
                break


def keep_prompt(stub: Stub, sequence_id: str, prompt: list[int]) -> list[int]:
    """Keep ``prompt`` as sequence ``sequence_id`` (max_new_tokens 0); its block ids."""
    r = stub.Generate(request(prompt, 0, sequence_id), timeout=CALL_TIMEOUT)
    assert list(r.token_ids) == [] and r.sequence_id == sequence_id
    blocks = list(r.block_ids)
    assert len(blocks) == math.ceil(len(prompt) / BLOCK_SIZE) == len(set(blocks)), blocks
    return blocks


def continued_alone(stub: Stub, sequence_id: str, prompt: list[int], counts: Sequence[int]) -> list[list[int]]:
    """The tokens of continuing a kept ``prompt`` by each of ``counts`` in turn, alone; then freed."""
    keep_prompt(stub, sequence_id, prompt)
    out = [generate(stub, request([], n, sequence_id)) for n in counts]
    free_sequence(stub, sequence_id)
    return out


# ---------------------------------------------------------------------------------------------
# fixtures


def worker_args(kv_blocks: int) -> list[str]:
    return ["--model", MODEL, "--seed", str(SEED), "--kv-blocks", str(kv_blocks), "--block-size", str(BLOCK_SIZE)]


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with WorkerProcess(worker_args(KV_BLOCKS)) as wp:
        yield wp
        wp.stop()


@pytest.fixture(scope="module")
def small_kv_worker() -> Iterator[WorkerProcess]:
    """A worker whose device KV pool holds 8 blocks of 16 tokens."""
    with WorkerProcess(worker_args(SMALL_KV_BLOCKS)) as wp:
        yield wp
        wp.stop()


@pytest.fixture(scope="module")
def vocab(worker: WorkerProcess) -> int:
    st = status(worker.stub)
    assert st.model.source == MODEL and st.device.backend == "host"
    assert (st.kv_cache.device_block_count, st.kv_cache.block_size_tokens) == (KV_BLOCKS, BLOCK_SIZE)
    return int(st.model.vocab_size)


@pytest.fixture
def stub(worker: WorkerProcess) -> Stub:
    reset(worker.stub)
    return worker.stub


@pytest.fixture
def small_kv_stub(small_kv_worker: WorkerProcess) -> Stub:
    reset(small_kv_worker.stub)
    return small_kv_worker.stub


@pytest.fixture
def leftovers() -> Iterator[Leftovers]:
    left = Leftovers()
    yield left
    left.close()


# ---------------------------------------------------------------------------------------------
# 1, 2: a batch returns what each request returns alone


def test_concurrent_generates_return_their_alone_tokens(stub: Stub, vocab: int) -> None:
    """Eight greedy requests, prompts of 5..60 tokens and 20..40 new tokens, sent at once from eight
    threads (three of them as GenerateStream): each returns exactly its alone tokens."""
    rng = random.Random(1)
    lengths = [5, 60, *rng.sample(range(6, 60), 6)]  # all different
    requests = [request(random_prompt(rng, vocab, n), rng.randint(20, 40)) for n in lengths]
    expected = alone(stub, requests)
    assert len({tuple(t) for t in expected}) == len(requests), "two requests give the same tokens: mix-ups would pass"

    streamed = [i in (1, 4, 6) for i in range(len(requests))]
    got = concurrently([partial(run, stub, r, s) for r, s in zip(requests, streamed, strict=True)])
    for i, (tokens, want) in enumerate(zip(got, expected, strict=True)):
        via = "GenerateStream" if streamed[i] else "Generate"
        assert tokens == want, f"request {i} ({via}, prompt {lengths[i]} tokens) differs from its alone tokens"


def test_mixed_sampling_in_one_batch_returns_each_requests_alone_tokens(stub: Stub, vocab: int) -> None:
    """Greedy requests and sampled ones (temperature, top_k, top_p, a fixed seed) in one batch: each
    returns the tokens the same request returns alone. The same sampled request twice in the batch
    gives the same tokens twice (each request has its own random numbers), another seed other ones."""
    rng = random.Random(2)
    p1, p2, p3 = (random_prompt(rng, vocab, n) for n in (12, 33, 50))
    hot = worker_pb.SamplingParams(temperature=0.9, top_k=40, seed=101)
    requests = [
        request(p1, 24),
        request(p1, 24, sampling=hot),
        request(p1, 24, sampling=hot),  # the same request again: the same tokens
        request(p1, 24, sampling=worker_pb.SamplingParams(temperature=0.9, top_k=40, seed=102)),
        request(p2, 30, sampling=worker_pb.SamplingParams(temperature=1.3, top_p=0.9, seed=7)),
        request(p3, 20, sampling=worker_pb.SamplingParams(temperature=0.6, top_k=10, top_p=0.95, seed=8)),
        request(p2, 30),
        request(p3, 20),
    ]
    expected = alone(stub, requests)
    assert expected[1] == expected[2], "the same seed gave different tokens even alone"
    assert expected[1] != expected[0], "sampling at temperature 0.9 gave the greedy tokens: it proves nothing"
    assert expected[1] != expected[3], "seeds 101 and 102 gave the same tokens"
    assert expected[4] != expected[6] and expected[5] != expected[7], "sampled tokens equal the greedy ones"

    streamed = [i % 2 == 1 for i in range(len(requests))]
    got = concurrently([partial(run, stub, r, s) for r, s in zip(requests, streamed, strict=True)])
    for i, (tokens, want) in enumerate(zip(got, expected, strict=True)):
        sampling = str(requests[i].sampling).replace("\n", " ") if requests[i].HasField("sampling") else "greedy"
        assert tokens == want, f"request {i} ({sampling}) in the batch differs from its alone tokens"


# ---------------------------------------------------------------------------------------------
# 3: requests join and leave a running batch


def test_short_requests_join_and_leave_while_a_long_one_streams(stub: Stub, vocab: int, leftovers: Leftovers) -> None:
    """A 150-token stream runs; once it has sent 5 tokens, four 10-token requests are sent. All four
    return while the long one still streams (they joined its batch and left it), and every request
    returns its alone tokens."""
    rng = random.Random(3)
    long_req = request(random_prompt(rng, vocab, 20), 150)
    shorts = [request(random_prompt(rng, vocab, n), 10) for n in (7, 19, 31, 44)]
    long_alone, *shorts_alone = alone(stub, [long_req, *shorts])

    long = leftovers.stream(stub, long_req)
    long.wait_tokens(5)
    assert not long.finished, "set-up: the long request ended before the short ones were sent"

    def timed(r: worker_pb.GenerateRequest) -> tuple[list[int], float]:
        tokens = generate(stub, r)
        return tokens, time.monotonic()

    answers = concurrently([partial(timed, r) for r in shorts])
    shorts_returned_at = max(t for _, t in answers)
    long_running_then = not long.finished
    assert long.result() == long_alone, "the long request's tokens differ from its alone tokens"
    for i, ((tokens, _), want) in enumerate(zip(answers, shorts_alone, strict=True)):
        assert tokens == want, f"short request {i} differs from its alone tokens"
    assert long.finished_at is not None
    assert long_running_then and shorts_returned_at < long.finished_at, (
        f"the short requests returned {shorts_returned_at - long.finished_at:+.3f} s after the long one ended: "
        "they waited for it instead of joining its batch"
    )


# ---------------------------------------------------------------------------------------------
# 4: KV blocks run out


def test_requests_wait_for_kv_blocks_instead_of_failing(small_kv_stub: Stub, vocab: int) -> None:
    """Three requests needing 5 blocks each (40 prompt + 40 new tokens) on a pool of 8 blocks: all
    succeed with their alone tokens, whether the later ones wait or are preempted and resumed."""
    rng = random.Random(4)
    requests = [request(random_prompt(rng, vocab, 40), 40) for _ in range(3)]
    assert math.ceil((40 + 40 - 1) / BLOCK_SIZE) == 5  # two at once would need 10 of the 8 blocks
    expected = alone(small_kv_stub, requests)
    assert len({tuple(t) for t in expected}) == 3

    streamed = [False, True, False]
    got = concurrently([partial(run, small_kv_stub, r, s) for r, s in zip(requests, streamed, strict=True)])
    for i, (tokens, want) in enumerate(zip(got, expected, strict=True)):
        assert tokens == want, f"request {i} differs from its alone tokens"
    kv = wait_kv_empty(small_kv_stub)
    assert kv_empty(kv) and kv.device_block_count == SMALL_KV_BLOCKS, f"blocks still held after every call ended: {kv}"


def test_a_request_larger_than_the_pool_fails_at_once_and_changes_nothing(small_kv_stub: Stub, vocab: int) -> None:
    """100 prompt + 100 new tokens need 13 blocks; the pool has 8. Waiting cannot help: the request
    fails at once with INVALID_ARGUMENT naming the pool's size (not OVERLOADED, whose meaning is
    "retry later"), and the worker is as it was and serves the next request."""
    rng = random.Random(5)
    fits = request(random_prompt(rng, vocab, 30), 20)
    want = generate(small_kv_stub, fits)
    before = status(small_kv_stub)
    too_big = request(random_prompt(rng, vocab, 100), 100)
    err = expect_error(
        "a Generate needing 13 blocks of 8",
        lambda: small_kv_stub.Generate(too_big, timeout=FAST_TIMEOUT),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    info = error_info(err)
    assert info is not None and info.metadata["neededBlocks"] == "13", info
    details = str(err.details())
    assert "the KV cache holds 128" in details and "tmp-" not in details, (
        "the error names the request, not an internal sequence id the client never sent: " + details
    )
    after = status(small_kv_stub)
    assert after.state == before.state == common_pb.WORKER_STATE_AWAKE
    assert kv_view(after.kv_cache) == kv_view(before.kv_cache), "the refused request changed the KV cache"
    assert generate(small_kv_stub, fits) == want


# ---------------------------------------------------------------------------------------------
# 5: a client that cancels


def test_a_cancelled_stream_frees_its_blocks_and_the_batch_goes_on(
    stub: Stub, vocab: int, leftovers: Leftovers
) -> None:
    """A 500-token stream that holds KV blocks is cancelled after 2 tokens, with another request just
    sent beside it: that one returns its alone tokens, every block comes back within 10 s, and a
    Generate afterwards returns its alone tokens too."""
    rng = random.Random(6)
    pool = status(stub).kv_cache.device_block_count
    companion_req = request(random_prompt(rng, vocab, 25), 60)
    after_req = request(random_prompt(rng, vocab, 9), 16)
    companion_alone, after_alone = alone(stub, [companion_req, after_req])

    doomed = leftovers.stream(stub, request(random_prompt(rng, vocab, 10), 500))
    doomed.wait_tokens(2)
    held = status(stub).kv_cache
    assert held.device_free_block_count < pool and not doomed.finished, f"the running stream holds no block: {held}"
    companion = leftovers.stream(stub, companion_req)
    doomed.cancel()
    assert doomed.error is not None and doomed.error.code() == grpc.StatusCode.CANCELLED, doomed.error
    assert len(doomed.tokens) < 500

    assert companion.result() == companion_alone, "the request sent beside the cancelled one went wrong"
    kv = wait_kv_empty(stub, FREE_TIMEOUT)
    assert kv.device_free_block_count == pool and kv.sequence_count == 0, (
        f"{pool - kv.device_free_block_count} blocks still held {FREE_TIMEOUT:.0f} s after the cancel: {kv}"
    )
    assert generate(stub, after_req) == after_alone


# ---------------------------------------------------------------------------------------------
# 6: Sleep arriving mid-batch


def test_sleep_mid_batch_drains_it_and_refuses_new_generates(
    worker: WorkerProcess, stub: Stub, vocab: int, leftovers: Leftovers
) -> None:
    """Three 60-token streams run; after each has sent 3 tokens a Sleep is sent. A Generate sent
    while the Sleep is pending is refused with FAILED_PRECONDITION; the Sleep returns once all three
    have finished, each with its full alone tokens (they are complete before anything wakes the
    worker: nothing was paused to be resumed later); after WakeUp, Generate gives the alone tokens."""
    rng = random.Random(7)
    requests = [request(random_prompt(rng, vocab, n), 60) for n in (8, 23, 41)]
    late = request(random_prompt(rng, vocab, 6), 8)
    *expected, late_alone = alone(stub, [*requests, late])

    cond = threading.Condition()
    streams = [leftovers.stream(stub, r, cond) for r in requests]
    for s in streams:
        s.wait_tokens(3)
    running = [i for i, s in enumerate(streams) if not s.finished]
    assert running, "set-up: every stream ended before the Sleep was sent"

    sleep = stub.Sleep.future(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1), timeout=CALL_TIMEOUT)
    round_trip(worker)  # the Sleep has reached the worker
    assert not sleep.done(), "set-up: the Sleep returned before a Generate could be sent while it was pending"
    expect_error(
        "a Generate sent while the Sleep is pending",
        lambda: stub.Generate(late, timeout=CALL_TIMEOUT),
        grpc.StatusCode.FAILED_PRECONDITION,
    )

    slept = sleep.result(timeout=CALL_TIMEOUT)
    assert slept.status.state == common_pb.WORKER_STATE_ASLEEP
    for i, (s, want) in enumerate(zip(streams, expected, strict=True)):
        assert s.result() == want, f"stream {i} (running when the Sleep came: {i in running}) was cut or changed"
    assert status(stub).state == common_pb.WORKER_STATE_ASLEEP

    stub.WakeUp(worker_pb.WakeUpRequest(), timeout=CALL_TIMEOUT)
    assert generate(stub, late) == late_alone
    assert generate(stub, requests[0]) == expected[0]


# ---------------------------------------------------------------------------------------------
# 7: a kept sequence while it generates


LONG = 100
"""New tokens of the generation the other calls of these tests meet."""


def test_swapping_a_generating_sequences_blocks_is_refused(stub: Stub, vocab: int, leftovers: Leftovers) -> None:
    """SwapBlocks naming the blocks of a kept sequence that is being generated fails with
    FAILED_PRECONDITION while it generates and moves nothing; the generation's tokens are its alone
    tokens, and once it has ended a swap of all its blocks is accepted (the refusal was about the
    generation, not the request)."""
    rng = random.Random(8)
    prompt = random_prompt(rng, vocab, 20)
    (want,) = continued_alone(stub, "engine-swap-ref", prompt, [LONG])

    seq = leftovers.keep(stub, "engine-swap")
    blocks = keep_prompt(stub, seq, prompt)
    gen = leftovers.stream(stub, request([], LONG, seq))
    gen.wait_tokens(5)
    swap_out = worker_pb.SwapBlocksRequest(
        direction=common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, src_blocks=blocks, dst_blocks=list(range(len(blocks)))
    )
    expect_error(
        "SwapBlocks of a generating sequence's blocks",
        lambda: stub.SwapBlocks(swap_out, timeout=FAST_TIMEOUT),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    assert not gen.finished, "the SwapBlocks was answered only after the generation ended"
    kv = status(stub).kv_cache
    assert kv.host_free_block_count == kv.host_block_count, f"the refused swap moved blocks: {kv}"

    assert gen.result() == want, "the generation's tokens changed"
    assert gen.done is not None
    now = list(gen.done.block_ids)
    idle_swap = worker_pb.SwapBlocksRequest(
        direction=common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, src_blocks=now, dst_blocks=list(range(len(now)))
    )
    moved = stub.SwapBlocks(idle_swap, timeout=CALL_TIMEOUT)
    assert moved.kv_cache.host_free_block_count == moved.kv_cache.host_block_count - len(now)
    assert free_sequence(stub, seq).sequence_count == 0


def test_freeing_a_generating_sequence_is_refused(stub: Stub, vocab: int, leftovers: Leftovers) -> None:
    """FreeSequence of a kept sequence that is being generated fails with FAILED_PRECONDITION; the
    generation ends with its alone tokens, and then FreeSequence frees every block."""
    rng = random.Random(9)
    prompt = random_prompt(rng, vocab, 20)
    (want,) = continued_alone(stub, "engine-free-ref", prompt, [LONG])

    seq = leftovers.keep(stub, "engine-free")
    keep_prompt(stub, seq, prompt)
    gen = leftovers.stream(stub, request([], LONG, seq))
    gen.wait_tokens(5)
    free = worker_pb.FreeSequenceRequest(sequence_id=seq)
    expect_error(
        "FreeSequence of a generating sequence",
        lambda: stub.FreeSequence(free, timeout=FAST_TIMEOUT),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    assert not gen.finished, "the FreeSequence was answered only after the generation ended"

    assert gen.result() == want, "the generation's tokens changed"
    assert status(stub).kv_cache.sequence_count == 1, "the sequence is gone after its generation"
    kv = free_sequence(stub, seq)
    assert kv_empty(kv), kv


def test_a_second_generate_continuing_a_generating_sequence_is_refused(
    stub: Stub, vocab: int, leftovers: Leftovers
) -> None:
    """Two Generates continuing the same kept sequence at once: the second fails with
    FAILED_PRECONDITION (or ABORTED) while the first runs, the first returns its alone tokens, and
    the sequence is as the first left it (continuing it afterwards gives the alone tokens)."""
    rng = random.Random(10)
    prompt = random_prompt(rng, vocab, 20)
    want_first, want_next = continued_alone(stub, "engine-twice-ref", prompt, [LONG, 10])

    seq = leftovers.keep(stub, "engine-twice")
    keep_prompt(stub, seq, prompt)
    first = leftovers.stream(stub, request([], LONG, seq))
    first.wait_tokens(5)
    second = request([], 10, seq)
    expect_error(
        "a second Generate continuing the generating sequence",
        lambda: stub.Generate(second, timeout=FAST_TIMEOUT),
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ABORTED,
    )
    assert not first.finished, "the second Generate was answered only after the first ended"

    assert first.result() == want_first, "the first generation's tokens changed"
    assert generate(stub, second) == want_next, "the refused call changed the sequence"
    assert kv_empty(free_sequence(stub, seq))


BESIDE = 1800
"""New tokens asked of the generation five calls are answered beside: nearly the whole pool and context
(2,048), so that no machine, however loaded, ends it before them (600 did end first once, with three
suites on two cores); the test cancels it once they were answered."""


def test_a_swap_and_a_free_run_between_the_steps_of_a_running_generation(
    stub: Stub, vocab: int, leftovers: Leftovers
) -> None:
    """The device loop runs SwapBlocks and FreeSequence as commands between two engine steps: while a
    long stream runs, another kept sequence is swapped out and back in to other device blocks and a
    third is freed, each answered before the stream ends. The stream's tokens up to its cancel are
    its alone tokens and the swapped sequence continues exactly as if it had never moved."""
    rng = random.Random(11)
    prompt, other, long_prompt = (random_prompt(rng, vocab, n) for n in (20, 12, 9))
    (want,) = continued_alone(stub, "engine-beside-ref", prompt, [10])

    seq = leftovers.keep(stub, "engine-beside")
    blocks = keep_prompt(stub, seq, prompt)
    spare = leftovers.keep(stub, "engine-beside-freed")
    keep_prompt(stub, spare, other)
    gen = leftovers.stream(stub, request(long_prompt, BESIDE))
    gen.wait_tokens(5)

    host = list(range(len(blocks)))
    out = stub.SwapBlocks(
        worker_pb.SwapBlocksRequest(
            direction=common_pb.SWAP_DIRECTION_DEVICE_TO_HOST, src_blocks=blocks, dst_blocks=host
        ),
        timeout=FAST_TIMEOUT,
    )
    assert out.kv_cache.host_free_block_count == out.kv_cache.host_block_count - len(blocks)
    free_sequence(stub, spare)
    top = status(stub).kv_cache.device_block_count - 1  # blocks go out lowest first: the top ones are free
    back = list(range(top, top - len(blocks), -1))
    stub.SwapBlocks(
        worker_pb.SwapBlocksRequest(
            direction=common_pb.SWAP_DIRECTION_HOST_TO_DEVICE, src_blocks=host, dst_blocks=back
        ),
        timeout=FAST_TIMEOUT,
    )
    assert not gen.finished, "the swaps and the free were answered only after the generation ended"
    gen.cancel()
    assert gen.error is not None and gen.error.code() == grpc.StatusCode.CANCELLED, gen.error
    got = list(gen.tokens)

    assert got == alone(stub, [request(long_prompt, len(got))])[0], "the running generation's tokens changed"
    assert generate(stub, request([], 10, seq)) == want, "the swapped sequence does not continue as before"
    free_sequence(stub, seq)
    assert kv_empty(wait_kv_empty(stub)), "the cancelled generation's blocks did not come back"


# ---------------------------------------------------------------------------------------------
# 8: --max-batch


def test_max_batch_bounds_the_batch_and_the_rest_wait(vocab: int) -> None:
    """A worker started with ``--max-batch 2``: of six streams sent at once, never more than two hold
    a sequence in the KV cache (the worker's own count, polled while they run: what a client sees
    of the streams depends on how fast it reads them), two do at some point, and all six finish
    with their alone tokens."""
    rng = random.Random(11)
    requests = [request(random_prompt(rng, vocab, rng.randint(5, 40)), 100) for _ in range(6)]
    with WorkerProcess([*worker_args(KV_BLOCKS), "--max-batch", "2"]) as wp:
        expected = alone(wp.stub, requests)
        # the last stream waits for four others to end: its deadline is not the test's subject
        streams = [Streamed(wp.stub, r, timeout=10 * CALL_TIMEOUT) for r in requests]
        seen: set[int] = set()
        try:
            while not all(s.finished_at is not None for s in streams):
                status = wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=CALL_TIMEOUT).status
                seen.add(status.kv_cache.sequence_count)
                time.sleep(0.01)  # the worker needs the cores more than this loop does
            assert max(seen) == 2, f"sequences held at once: {sorted(seen)}"
            for i, (s, want) in enumerate(zip(streams, expected, strict=True)):
                assert s.result() == want, f"stream {i} differs from its alone tokens"
        finally:
            for s in streams:
                s.cancel()
        wp.stop()


# ---------------------------------------------------------------------------------------------
# 8: a Sleep that pauses the batch (the manager's turns between busy workers)


def pause(stub: Stub) -> common_pb.WorkerStatus:
    """Sleep at level 1 (the KV cache discarded) pausing whatever runs; the status it answers."""
    r = stub.Sleep(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1, pause_generations=True), timeout=CALL_TIMEOUT)
    assert r.status.state == common_pb.WORKER_STATE_ASLEEP
    return r.status


def test_a_pausing_sleep_keeps_streams_open_and_they_go_on_with_their_alone_tokens(
    stub: Stub, vocab: int, leftovers: Leftovers
) -> None:
    """Three greedy 200-token streams and a seeded sampled one run; after each has sent 3 tokens a
    level-1 Sleep with pause_generations returns without waiting for them: the worker is asleep
    with every unfinished stream paused (its count in the status), their KV blocks in the host pool
    (the device pool's were discarded), and a Generate is refused. After WakeUp every stream ends
    with exactly its alone tokens, no token was read again (the status' count), and the KV cache
    ends empty."""
    rng = random.Random(12)
    sampled = worker_pb.SamplingParams(temperature=0.8, top_p=0.9, seed=21)
    requests = [request(random_prompt(rng, vocab, n), 200) for n in (8, 23, 41)]
    requests.append(request(random_prompt(rng, vocab, 17), 200, sampling=sampled))
    late = request(random_prompt(rng, vocab, 6), 8)
    *expected, late_alone = alone(stub, [*requests, late])
    recomputed = status(stub).kv_cache.recomputed_tokens

    cond = threading.Condition()
    streams = [leftovers.stream(stub, r, cond) for r in requests]
    for s in streams:
        s.wait_tokens(3)
    asleep = pause(stub)
    with cond:
        unfinished = [s for s in streams if not s.finished]
        counts = [len(s.tokens) for s in streams]
    assert unfinished, "set-up: every stream ended before the Sleep came"
    assert asleep.paused_generations == len(unfinished), asleep
    kv = asleep.kv_cache
    assert kv.host_free_block_count < kv.host_block_count, f"no paused KV block in the host pool: {kv}"
    expect_error(
        "a Generate while paused",
        lambda: stub.Generate(late, timeout=CALL_TIMEOUT),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    with cond:
        assert [len(s.tokens) for s in streams] == counts, "a paused stream sent tokens while the worker slept"

    woke = stub.WakeUp(worker_pb.WakeUpRequest(), timeout=CALL_TIMEOUT).status
    assert woke.state == common_pb.WORKER_STATE_AWAKE and woke.paused_generations == 0
    for i, (s, want) in enumerate(zip(streams, expected, strict=True)):
        assert s.result() == want, f"stream {i} differs from its alone tokens after the pause"
    assert status(stub).kv_cache.recomputed_tokens == recomputed, "a paused request read its tokens again"
    assert kv_empty(wait_kv_empty(stub))
    assert generate(stub, late) == late_alone


def test_a_stream_cancelled_while_paused_gives_its_host_blocks_back(
    stub: Stub, vocab: int, leftovers: Leftovers
) -> None:
    """Two streams are paused by a Sleep; one is cancelled while the worker sleeps: its host blocks
    come back at once (no step runs to notice it), the other goes on after WakeUp with its alone
    tokens, and the KV cache ends empty."""
    rng = random.Random(13)
    keep_req, drop_req = (request(random_prompt(rng, vocab, n), 200) for n in (30, 50))
    (keep_alone,) = alone(stub, [keep_req])
    keep, drop = leftovers.stream(stub, keep_req), leftovers.stream(stub, drop_req)
    keep.wait_tokens(2)
    drop.wait_tokens(2)
    kv = pause(stub).kv_cache
    held = kv.host_block_count - kv.host_free_block_count
    assert held and not drop.finished and not keep.finished, f"set-up: nothing paused: {kv}"

    drop.cancel()
    deadline = time.monotonic() + FREE_TIMEOUT
    while (now := status(stub).kv_cache).host_free_block_count <= kv.host_free_block_count:
        assert time.monotonic() < deadline, f"the cancelled stream's host blocks were not given back: {now}"
        time.sleep(0.01)
    assert status(stub).paused_generations == 1

    stub.WakeUp(worker_pb.WakeUpRequest(), timeout=CALL_TIMEOUT)
    assert keep.result() == keep_alone
    assert kv_empty(wait_kv_empty(stub))


def test_a_kept_sequence_whose_continuation_ends_while_paused_is_on_the_device_again_after_the_wake(
    stub: Stub, vocab: int, leftovers: Leftovers
) -> None:
    """A 200-token continuation of a kept sequence is paused (the sequence's blocks go to the host
    pool) and cancelled while the worker sleeps: after the wake the kept sequence is back on the
    device as it was before the call, and continuing it gives what continuing it alone gives."""
    rng = random.Random(15)
    prompt = random_prompt(rng, vocab, 20)
    (want,) = continued_alone(stub, "kept-ref", prompt, [8])
    sid = leftovers.keep(stub, "kept-paused")
    keep_prompt(stub, sid, prompt)
    stream = leftovers.stream(stub, request([], 200, sid))
    stream.wait_tokens(2)
    assert pause(stub).paused_generations == 1 and not stream.finished
    stream.cancel()
    stub.WakeUp(worker_pb.WakeUpRequest(), timeout=CALL_TIMEOUT)
    assert generate(stub, request([], 8, sid)) == want, "the kept sequence changed, or stayed on the host"
    free_sequence(stub, sid)
    assert kv_empty(wait_kv_empty(stub))


def test_a_pause_the_host_pool_cannot_hold_reads_the_tokens_again(vocab: int) -> None:
    """A worker whose host pool holds 2 blocks: of three streams paused, those that do not fit read
    their tokens again after the wake (the status counts them), and every stream still ends with
    its alone tokens."""
    rng = random.Random(14)
    requests = [request(random_prompt(rng, vocab, n), 120) for n in (40, 45, 50)]
    with WorkerProcess([*worker_args(KV_BLOCKS), "--host-kv-blocks", "2"]) as wp:
        expected = alone(wp.stub, requests)
        streams = [Streamed(wp.stub, r) for r in requests]
        try:
            for s in streams:
                s.wait_tokens(2)
            paused = pause(wp.stub)
            assert paused.paused_generations >= 2, f"set-up: {paused.paused_generations} streams paused"
            wp.stub.WakeUp(worker_pb.WakeUpRequest(), timeout=CALL_TIMEOUT)
            for i, (s, want) in enumerate(zip(streams, expected, strict=True)):
                assert s.result() == want, f"stream {i} differs from its alone tokens"
            assert status(wp.stub).kv_cache.recomputed_tokens >= 40, "no paused request read its tokens again"
            assert kv_empty(wait_kv_empty(wp.stub))
        finally:
            for s in streams:
                s.cancel()
        wp.stop()


def test_a_worker_stopped_while_paused_ends_the_paused_streams_at_once(vocab: int) -> None:
    """SIGTERM to a worker whose streams a Sleep paused: no wake will come, so they end at once with
    UNAVAILABLE instead of holding the drain (120 s here) open, and the worker exits 0."""
    rng = random.Random(16)
    with WorkerProcess([*worker_args(KV_BLOCKS), "--drain-timeout", "120"]) as wp:
        streams = [Streamed(wp.stub, request(random_prompt(rng, vocab, 12), 400)) for _ in range(2)]
        try:
            for s in streams:
                s.wait_tokens(2)
            assert pause(wp.stub).paused_generations == 2
            wp.terminate()
            for s in streams:
                s.join()
                assert s.error is not None and s.error.code() == grpc.StatusCode.UNAVAILABLE, s.error
            wp.stop(timeout=60)  # exit code 0, well inside the drain
        finally:
            for s in streams:
                s.cancel()
