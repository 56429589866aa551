"""Leases, transitions and Generate interleaved by hypothesis against one live manager and one live worker.

One manager and one real worker (``sm``: host backend, synthetic:tiny, registered with the manager) live
for the whole test; a :class:`RuleBasedStateMachine` drives them through real gRPC stubs, and each
example starts from a known state (every lease released, the worker awake, a fresh model, request_ids
no earlier example used). The rules:

- AcquireWorker with a request_id from a small pool (or none) and a short (50-300 ms) or long deadline;
  the same call from three threads at once; and a retry of a request_id whose lease the model holds;
- ReleaseWorker of a held lease, of a released one and of one never granted (NOT_FOUND);
- SleepWorker (level 1 or 2) and WakeWorker (all tags, or one), request_ids from the same pool, so a
  request_id kept for one method is refused for another (INVALID_ARGUMENT) and a kept transition is
  answered again without running;
- Generate on the worker itself: a few tokens, checked against tokens computed at the start (greedy
  decoding is deterministic), and a long one in the background whose short deadline cancels it, so
  later steps meet a busy device loop (transitions queued behind it, or abandoned before they start);
- SleepWorker racing AcquireWorker (sent together, maybe behind a busy Generate, maybe with a second
  caller of the same fresh request_id and a long deadline): either may wait for the other on the
  manager's lock, the wake or the sleep may wait behind the Generate, a caller may leave midway;
- requests the services must refuse (bad ttl, holder, request_id, level, tags, max_new_tokens; an
  unknown lease to renew).

What the model predicts it asserts; where a short deadline makes the outcome "done" or
DEADLINE_EXCEEDED it accepts both and leaves the rest to the invariants, checked after every step once
the manager and the worker agree and no transition is in progress:

- no lease on a sleeping worker: while the model holds a lease, the worker itself says AWAKE;
- one lease per request_id: the manager's lease_count is the number of leases the model holds (retries
  never add one; a call whose deadline passed keeps none);
- a refused call (INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND) changed nothing: the worker's state,
  tag states and sizes and the lease count are what they were before it;
- at the end of each example, with everything released and the worker awake, the reference prompt
  generates exactly the reference tokens: no step corrupted the weights.

``MEMSVC_STATEFUL_EXAMPLES`` raises the number of examples for longer local runs (and lets hypothesis
pick new ones each run; CI runs the same few, derandomized). With ``-s`` the test prints what the steps
met (outcomes per call, replay cases, races).

A bug the machine found has a test of its own at the end: a caller that shared an in-flight call
through its request_id got that call's first caller's deadline (fixed: a shared call works to the latest
deadline of the callers waiting for it).
"""

from __future__ import annotations

import collections
import functools
import os
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from managerproc import Cluster, ManagerProcess, get, wait_for
from workerproc import WorkerProcess

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc
from memsvc.v1 import model_worker_service_pb2 as worker_pb

WID = "sm"
NAME = f"workers/{WID}"
LOCAL_RUN = os.environ.get("MEMSVC_STATEFUL_EXAMPLES")
EXAMPLES = int(LOCAL_RUN or "4")
LONG_S = 30.0
"""A deadline nothing here should reach (a tiny model's transitions take milliseconds)."""
SHORT = st.floats(0.05, 0.3)
DEADLINES = st.one_of(SHORT, st.just(LONG_S))
SETTLE_S = 10.0
"""How long the manager and the worker may take to agree after a step (a bound, not a speed claim)."""
LEASE_TTL = Duration(seconds=600)
"""Far beyond the test: no lease expires under the model."""
REQUEST_IDS = ("", "r0", "r1", "r2")
"""One pool for AcquireWorker, SleepWorker and WakeWorker ("": none); prefixed per example."""
PROMPTS: tuple[tuple[int, ...], ...] = ((1, 2, 3), (7, 7), (42, 5, 9, 11))
FEW = 6
"""Most tokens of a foreground Generate (the references are this long)."""
REF_PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)
REF_TOKENS = 16
LONG_TOKENS = 2000
"""A Generate that keeps the device loop busy far past its short deadline: it is cancelled."""
MAX_BACKGROUND = 2

OK = grpc.StatusCode.OK
DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
NOT_FOUND = grpc.StatusCode.NOT_FOUND
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
REFUSALS = {INVALID, PRECONDITION, NOT_FOUND}
OFFLOAD = common_pb.TAG_ACTION_OFFLOAD

ACQUIRE, SLEEP, WAKE = "AcquireWorker", "SleepWorker", "WakeWorker"
BUSY = {
    common_pb.WORKER_STATE_SLEEPING,
    common_pb.WORKER_STATE_WAKING,
    common_pb.WORKER_STATE_LOADING,
    common_pb.WORKER_STATE_UNSPECIFIED,
}
LEVEL_ACTIONS = {
    1: {"weights": common_pb.TAG_ACTION_OFFLOAD, "kv_cache": common_pb.TAG_ACTION_DISCARD},
    2: {"weights": common_pb.TAG_ACTION_DISCARD, "kv_cache": common_pb.TAG_ACTION_DISCARD},
}

R = TypeVar("R")
SEEN: collections.Counter[str] = collections.Counter()
"""What the steps met (printed at the end, with -s): outcomes by call, replay cases."""


def note(label: str) -> None:
    event(label)
    SEEN[label] += 1


# ---------------------------------------------------------------- the processes, once per test


@dataclass
class Env:
    cluster: Cluster
    manager: ManagerProcess
    worker: WorkerProcess
    reference: list[int]
    """REF_PROMPT's REF_TOKENS tokens, computed once at the start."""
    prompt_refs: dict[tuple[int, ...], list[int]]
    """FEW tokens of every prompt in PROMPTS, computed once at the start."""
    outstanding: set[str] = field(default_factory=set)
    """Every lease granted and not yet released, whatever example granted it (an example that failed
    midway leaves some: the next one releases them)."""
    background: list[grpc.Future[worker_pb.GenerateResponse]] = field(default_factory=list)
    examples: int = 0


def generate(worker: WorkerProcess, prompt: tuple[int, ...], tokens: int) -> list[int]:
    r = worker.stub.Generate(worker_pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=tokens), timeout=LONG_S)
    return list(r.token_ids)


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    cluster = Cluster(tmp_path)
    try:
        mp = cluster.manager()
        (wp,) = cluster.workers_up(mp, [WID])
        reference = generate(wp, REF_PROMPT, REF_TOKENS)
        assert len(reference) == REF_TOKENS and generate(wp, REF_PROMPT, REF_TOKENS) == reference
        refs = {p: generate(wp, p, FEW) for p in PROMPTS}
        yield Env(cluster, mp, wp, reference, refs)
    finally:
        cluster.close()


# ---------------------------------------------------------------- calls and views


@dataclass(frozen=True)
class Answer(Generic[R]):
    code: grpc.StatusCode
    value: R | None
    details: str = ""

    def get(self) -> R:
        assert self.value is not None, f"{self.code.name}: {self.details}"
        return self.value

    def __str__(self) -> str:
        return self.code.name + (f" ({self.details})" if self.details else "")


def ask(call: Callable[[], R]) -> Answer[R]:
    try:
        return Answer(OK, call())
    except grpc.RpcError as err:
        return Answer(err.code(), None, err.details() or "")


View = tuple[Any, ...]


def view(s: common_pb.WorkerStatus) -> View:
    """What a refused call must not change on the worker: its state and every tag's state and sizes."""
    tags = tuple(
        (
            t.tag,
            common_pb.TagState.Name(t.state),
            t.mapped_bytes,
            t.allocated_bytes,
            t.offloaded_bytes,
            t.discarded_bytes,
        )
        for t in sorted(s.tags, key=lambda t: t.tag)
    )
    return common_pb.WorkerState.Name(s.state), tags


def tag_states(s: common_pb.WorkerStatus) -> dict[str, common_pb.TagState.ValueType]:
    return {t.tag: t.state for t in s.tags}


def sleep_would_act(s: common_pb.WorkerStatus, level: int) -> bool:
    """Whether a fresh Sleep at ``level`` has anything to do (the worker refuses FAILED_PRECONDITION if not):
    a tag the level names is awake, or an offloaded one is to be discarded (a demotion)."""
    if s.state not in (
        common_pb.WORKER_STATE_AWAKE,
        common_pb.WORKER_STATE_PARTIALLY_AWAKE,
        common_pb.WORKER_STATE_ASLEEP,
    ):
        return False
    for tag, state in tag_states(s).items():
        action = LEVEL_ACTIONS[level].get(tag)
        if action is None:
            continue
        if state == common_pb.TAG_STATE_AWAKE or (
            state == common_pb.TAG_STATE_OFFLOADED and action == common_pb.TAG_ACTION_DISCARD
        ):
            return True
    return False


def wake_would_act(s: common_pb.WorkerStatus, tags: tuple[str, ...]) -> bool:
    """Whether a fresh WakeUp of ``tags`` (none: every sleeping tag) is accepted."""
    if s.state not in (common_pb.WORKER_STATE_ASLEEP, common_pb.WORKER_STATE_PARTIALLY_AWAKE):
        return False
    states = tag_states(s)
    return all(states[t] != common_pb.TAG_STATE_AWAKE for t in tags)


def collect(env: Env, wait: bool) -> list[str]:
    """Check the background Generates that ended (all of them, with ``wait``); what went wrong, if anything."""
    problems, still = [], []
    for fut in env.background:
        if not (wait or fut.done()):
            still.append(fut)
            continue
        try:
            fut.result(timeout=LONG_S)
            code = OK
        except grpc.RpcError as err:
            code = err.code()
        # cancelled at its deadline; refused because a Sleep ran before it started; or (on a very fast
        # machine) done
        note(f"background Generate -> {code.name}")
        if code not in (DEADLINE, PRECONDITION, OK):
            problems.append(f"a background Generate ended {code.name}")
    env.background[:] = still
    return problems


def settled(env: Env) -> tuple[manager_pb.Worker, common_pb.WorkerStatus]:
    """The manager's and the worker's views once no transition is in progress and they agree on the state."""

    def probe() -> tuple[manager_pb.Worker, common_pb.WorkerStatus]:
        ws = env.worker.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status
        return get(env.manager.stub, WID), ws

    def quiet(views: tuple[manager_pb.Worker, common_pb.WorkerStatus]) -> bool:
        mw, ws = views
        return (
            not ws.transition_in_progress
            and not mw.status.transition_in_progress
            and ws.state not in BUSY
            and mw.state == ws.state
        )

    return wait_for(probe, quiet, timeout=SETTLE_S, what="no transition in progress and the manager agreeing")


def release_quietly(env: Env, lease_id: str) -> None:
    r = ask(lambda: env.manager.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease_id), timeout=10))
    assert r.code in (OK, NOT_FOUND), f"ReleaseWorker({lease_id}) at reset: {r}"
    env.outstanding.discard(lease_id)


def reset(env: Env) -> None:
    """The known state an example starts from: no background work, no lease, the worker awake."""
    problems = collect(env, wait=True)
    assert not problems, problems
    for lease_id in sorted(env.outstanding):
        release_quietly(env, lease_id)
    mw, ws = settled(env)
    if ws.state != common_pb.WORKER_STATE_AWAKE:
        env.manager.stub.WakeWorker(manager_pb.WakeWorkerRequest(name=NAME), timeout=LONG_S)
    wait_for(
        lambda: settled(env),
        lambda v: v[1].state == common_pb.WORKER_STATE_AWAKE and v[0].lease_count == 0,
        timeout=SETTLE_S,
        what="an awake worker without leases",
    )


# ---------------------------------------------------------------- the machine


@dataclass
class Kept:
    """What the manager keeps for a request_id: the method's first result (a lease id or a transition)."""

    method: str
    result: str | bytes | None
    """None: kept, but which result the model did not see."""


class LeaseMachine(RuleBasedStateMachine):
    ENV: ClassVar[Env]

    def __init__(self) -> None:
        super().__init__()
        self.env = self.ENV
        self.env.examples += 1
        self.prefix = f"x{self.env.examples}-{uuid.uuid4().hex[:8]}-"
        self.leases: dict[str, str] = {}
        """Held lease id -> the request_id that acquired it ("" for none)."""
        self.released: list[str] = []
        self.kept: dict[str, Kept] = {}
        """request_id -> the manager's kept result (a lease id stays kept after its release, until an
        AcquireWorker with that request_id finds it stale and asks again)."""
        self.races = 0
        self.unsure: dict[str, str] = {}
        """request_id -> a method whose call with it passed its deadline: the server may have finished it
        as the deadline passed (and kept the result), or not."""
        reset(self.env)

    # ---- helpers ----
    @property
    def stub(self) -> manager_grpc.MemoryManagerServiceStub:
        return self.env.manager.stub

    def rid(self, r: str) -> str:
        return self.prefix + r if r else ""

    def worker_status(self) -> common_pb.WorkerStatus:
        return self.env.worker.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status

    def before(self) -> tuple[View, int, common_pb.WorkerStatus]:
        mw, ws = settled(self.env)
        return view(ws), mw.lease_count, ws

    def unchanged(self, before: tuple[View, int, common_pb.WorkerStatus], what: str, answer: Answer[Any]) -> None:
        """A call that was refused (or answered from a kept result) changed nothing."""
        mw, ws = settled(self.env)
        after = (view(ws), mw.lease_count)
        assert after == before[:2], f"{what} answered {answer} but changed things:\nbefore {before[:2]}\nafter  {after}"

    def allowed(self, expected: set[grpc.StatusCode], deadline: float) -> set[grpc.StatusCode]:
        return expected | {DEADLINE} if deadline < LONG_S else expected

    def check(self, answer: Answer[Any], expected: set[grpc.StatusCode], deadline: float, what: str) -> None:
        allowed = self.allowed(expected, deadline)
        note(f"{what.split('(')[0]} -> {answer.code.name}")
        assert answer.code in allowed, f"{what}: {answer}, expected one of {sorted(code.name for code in allowed)}"

    def held_lease(self, r: str) -> str | None:
        k = self.kept.get(r)
        if k is not None and k.method == ACQUIRE and isinstance(k.result, str) and k.result in self.leases:
            return k.result
        return None

    def conflict(self, r: str, method: str) -> bool:
        """The manager certainly refuses ``r`` for ``method``: it keeps a result of another method for it."""
        k = self.kept.get(r)
        return bool(r) and k is not None and k.method != method

    def maybe_conflict(self, r: str, method: str) -> bool:
        """The manager may refuse ``r`` for ``method`` (a call of another method with it passed its deadline)."""
        return bool(r) and r in self.unsure and self.unsure[r] != method

    def passed_deadline(self, r: str, method: str) -> None:
        if r and r not in self.kept:
            self.unsure.setdefault(r, method)

    def granted(self, r: str, answer: Answer[manager_pb.AcquireWorkerResponse], what: str) -> str:
        resp = answer.get()
        lease_id = resp.lease.lease_id
        assert lease_id and lease_id not in self.released, f"{what}: lease {lease_id} was granted before"
        assert resp.lease.worker == NAME, f"{what}: {resp.lease}"
        state = common_pb.WorkerState.Name(resp.worker.state)
        assert resp.worker.state == common_pb.WORKER_STATE_AWAKE, (
            f"{what}: granted on a worker the manager thinks {state}"
        )
        self.leases[lease_id] = r
        self.env.outstanding.add(lease_id)
        if r:
            self.kept[r] = Kept(ACQUIRE, lease_id)
            self.unsure.pop(r, None)
        return lease_id

    def acquire_request(self, r: str) -> manager_pb.AcquireWorkerRequest:
        return manager_pb.AcquireWorkerRequest(name=NAME, ttl=LEASE_TTL, holder="stateful", request_id=self.rid(r))

    # ---- leases ----
    @rule(
        how=st.sampled_from(["once", "once", "three at once", "retry a held one"]),
        r=st.sampled_from(REQUEST_IDS),
        deadline=DEADLINES,
        i=st.integers(0, 7),
    )
    def acquire(self, how: str, r: str, deadline: float, i: int) -> None:
        if how == "three at once":
            self.acquire_concurrently(r or REQUEST_IDS[1])
        elif how == "retry a held one":
            self.retry_acquire(i)
        else:
            self.acquire_once(r, deadline)

    def acquire_once(self, r: str, deadline: float) -> None:
        before = self.before()
        held = self.held_lease(r)
        what = f"AcquireWorker(request_id={r!r}, deadline={deadline:.2f})"
        answer = ask(lambda: self.stub.AcquireWorker(self.acquire_request(r), timeout=deadline))
        if self.conflict(r, ACQUIRE):
            self.check(answer, {INVALID}, deadline, what)
            self.unchanged(before, what, answer)
            return
        self.check(answer, {OK, INVALID} if self.maybe_conflict(r, ACQUIRE) else {OK}, deadline, what)
        if answer.code == OK:
            if held is not None:  # a retry: the first call's lease, nothing new
                assert answer.get().lease.lease_id == held, f"{what}: a retry got another lease"
                self.unchanged(before, what, answer)
            else:
                self.granted(r, answer, what)
        elif answer.code == INVALID:
            self.unchanged(before, what, answer)
        elif held is None:  # DEADLINE: the lease_count invariant checks that no lease was kept
            self.passed_deadline(r, ACQUIRE)

    def acquire_concurrently(self, r: str) -> None:
        """Three callers with one request_id at once: one lease (or one refusal) for all of them."""
        before = self.before()
        held = self.held_lease(r)
        what = f"3 x AcquireWorker(request_id={r!r})"
        req = self.acquire_request(r)
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: ask(lambda: self.stub.AcquireWorker(req, timeout=LONG_S)), range(3)))
        codes = {a.code for a in answers}
        assert len(codes) == 1, f"{what}: {[str(a) for a in answers]}"
        if self.conflict(r, ACQUIRE):
            assert codes == {INVALID}, f"{what}: {answers[0]}"
        else:
            assert codes <= ({OK, INVALID} if self.maybe_conflict(r, ACQUIRE) else {OK}), f"{what}: {answers[0]}"
        if codes == {OK}:
            ids = {a.get().lease.lease_id for a in answers}
            assert len(ids) == 1, f"{what}: {len(ids)} leases for one request_id"
            if held is not None:
                assert ids == {held}, f"{what}: a retry got another lease"
                self.unchanged(before, what, answers[0])
            else:
                self.granted(r, answers[0], what)
        else:
            self.unchanged(before, what, answers[0])

    def retry_acquire(self, i: int) -> None:
        """The request_id of a held lease again (long deadline): the same lease, nothing new."""
        mine = sorted(lid for lid, r in self.leases.items() if r and self.held_lease(r) == lid)
        if not mine:
            free = [r for r in REQUEST_IDS[1:] if r not in self.kept and r not in self.unsure]
            if not free:
                return
            first = ask(lambda: self.stub.AcquireWorker(self.acquire_request(free[0]), timeout=LONG_S))
            assert first.code == OK, f"AcquireWorker(request_id={free[0]!r}): {first}"
            mine = [self.granted(free[0], first, "AcquireWorker")]
        lease_id = mine[i % len(mine)]
        r = self.leases[lease_id]
        before = self.before()
        again = ask(lambda: self.stub.AcquireWorker(self.acquire_request(r), timeout=LONG_S))
        what = f"retried AcquireWorker(request_id={r!r})"
        assert again.code == OK and again.get().lease.lease_id == lease_id, f"{what}: {again}, expected {lease_id}"
        self.unchanged(before, what, again)

    @rule(which=st.sampled_from(["held", "held", "released", "unknown"]), i=st.integers(0, 7))
    def release(self, which: str, i: int) -> None:
        if which != "held" or not self.leases:
            self.release_unknown(stale=which != "unknown")
            return
        self.release_lease(sorted(self.leases)[i % len(self.leases)])

    def release_lease(self, lease_id: str) -> None:
        answer = ask(lambda: self.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease_id), timeout=10))
        assert answer.code == OK, f"ReleaseWorker of a held lease: {answer}"
        del self.leases[lease_id]
        self.released.append(lease_id)
        self.env.outstanding.discard(lease_id)
        assert answer.get().worker.lease_count == len(self.leases), f"ReleaseWorker answered {answer.get().worker}"

    def release_unknown(self, stale: bool) -> None:
        lease_id = self.released[-1] if stale and self.released else uuid.uuid4().hex
        before = self.before()
        what = f"ReleaseWorker({'a released' if lease_id in self.released else 'an unknown'} lease)"
        answer = ask(lambda: self.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease_id), timeout=10))
        assert answer.code == NOT_FOUND, f"{what}: {answer}"
        self.unchanged(before, what, answer)

    @rule(
        level=st.sampled_from([1, 2]),
        sleep_deadline=DEADLINES,
        acquire_deadline=DEADLINES,
        sleep_first=st.booleans(),
        busy=st.one_of(st.none(), SHORT),
        twin=st.booleans(),
    )
    def acquire_racing_a_sleep(
        self,
        level: int,
        sleep_deadline: float,
        acquire_deadline: float,
        sleep_first: bool,
        busy: float | None,
        twin: bool,
    ) -> None:
        """SleepWorker and AcquireWorker at once, maybe behind a Generate that keeps the device loop busy
        (``busy``: its deadline), so that either may wait for the other on the worker's lock and the wake
        or the sleep may wait behind the Generate. Whichever wins, a granted lease finds the worker awake
        (the invariant), and a call whose deadline passed keeps nothing. With ``twin``, a second caller
        with a long deadline sends the same (fresh) request_id: the call runs on while it waits, even if
        the first caller leaves, and both callers that get an answer get one lease.

        The held leases are released first: with one, the sleep is refused at once (the sleep rule
        covers that)."""
        for lease_id in sorted(self.leases):
            self.release_lease(lease_id)
        _, _, ws = self.before()
        if busy is not None and ws.state == common_pb.WORKER_STATE_AWAKE:
            self.generate_in_background(busy)
        sleep_ok = sleep_would_act(ws, level)
        self.races += 1
        rid = f"{self.prefix}race{self.races}" if twin else ""
        sleep_req = manager_pb.SleepWorkerRequest(name=NAME, level=common_pb.SleepLevel.ValueType(level))
        acquire_req = manager_pb.AcquireWorkerRequest(name=NAME, ttl=LEASE_TTL, holder="stateful", request_id=rid)
        if sleep_first:
            sleep_f = self.stub.SleepWorker.future(sleep_req, timeout=sleep_deadline)
        acquire_fs = [self.stub.AcquireWorker.future(acquire_req, timeout=acquire_deadline)]
        if twin:
            acquire_fs.append(self.stub.AcquireWorker.future(acquire_req, timeout=LONG_S))
        if not sleep_first:
            sleep_f = self.stub.SleepWorker.future(sleep_req, timeout=sleep_deadline)
        slept, acquired = ask(sleep_f.result), [ask(f.result) for f in acquire_fs]
        what = (
            f"SleepWorker(level {level}, deadline={sleep_deadline:.2f}) racing AcquireWorker(deadline="
            f"{acquire_deadline:.2f}{' and a twin' if twin else ''}) on a {view(ws)}"
            f"{' behind a Generate' if busy else ''}"
        )
        note(f"race: SleepWorker -> {slept.code.name}, AcquireWorker -> {'+'.join(a.code.name for a in acquired)}")
        self.check(slept, {OK, PRECONDITION} if sleep_ok else {PRECONDITION}, sleep_deadline, f"{what}: the sleep")
        first, *twins = acquired
        self.check(first, {OK}, acquire_deadline, f"{what}: the acquire")
        for answer in twins:
            self.check(answer, {OK}, LONG_S, f"{what}: the twin")
        leases = {a.get().lease.lease_id for a in acquired if a.code == OK}
        assert len(leases) <= 1, f"{what}: {len(leases)} leases for one request_id"
        if leases:
            self.granted("", next(a for a in acquired if a.code == OK), what)

    # ---- transitions ----
    def transition(
        self,
        method: str,
        r: str,
        deadline: float,
        call: Callable[[float], Any],
        acts: Callable[[common_pb.WorkerStatus], bool],
        what: str,
    ) -> Any | None:
        """SleepWorker or WakeWorker under the request_id rules; ``acts``: whether a fresh call would act on
        the worker (else the worker refuses it FAILED_PRECONDITION). The response when a call acted."""
        before = self.before()
        fresh_ok = acts(before[2])
        kept = self.kept.get(r) if r else None
        unsure = self.unsure.get(r) if r else None
        answer = ask(lambda: call(deadline))
        what = f"{what} of a {before[0]}"
        note(f"{method} on {before[0][0]} (fresh_ok={fresh_ok}) -> {answer.code.name}")
        if self.conflict(r, method):
            note(f"{method}: request_id kept for another method")
            self.check(answer, {INVALID}, deadline, what)
            self.unchanged(before, what, answer)
            return None
        if kept is not None:  # kept for this method: the first result again, and nothing runs
            note(f"{method}: request_id kept")
            self.check(answer, {OK}, deadline, what)
            if answer.code == OK and isinstance(kept.result, bytes):
                assert answer.get().transition.SerializeToString(deterministic=True) == kept.result, (
                    f"{what}: a retry answered another transition"
                )
            self.unchanged(before, what, answer)
            return None
        expected = {OK} if fresh_ok else {PRECONDITION}
        if unsure is not None:
            note(f"{method}: request_id of a call that passed its deadline")
        if unsure == method:
            expected.add(OK)  # the first call may have finished as its deadline passed: its result, kept
        elif unsure is not None:
            expected.add(INVALID)  # ... and kept for another method
        self.check(answer, expected, deadline, what)
        if answer.code in REFUSALS:
            self.unchanged(before, what, answer)
            return None
        if answer.code != OK:
            self.passed_deadline(r, method)
            return None
        if r:
            self.kept[r] = Kept(method, answer.get().transition.SerializeToString(deterministic=True))
            self.unsure.pop(r, None)
        if unsure == method:
            mw, ws = settled(self.env)
            if (view(ws), mw.lease_count) == before[:2]:
                return None  # the kept first result
        return answer.get()

    @rule(level=st.sampled_from([1, 2]), r=st.sampled_from(REQUEST_IDS), deadline=DEADLINES)
    def sleep(self, level: int, r: str, deadline: float) -> None:
        what = f"SleepWorker(level {level}, request_id={r!r}, deadline={deadline:.2f}) with {len(self.leases)} lease(s)"
        req = manager_pb.SleepWorkerRequest(
            name=NAME, level=common_pb.SleepLevel.ValueType(level), request_id=self.rid(r)
        )
        resp = self.transition(
            SLEEP,
            r,
            deadline,
            lambda t: self.stub.SleepWorker(req, timeout=t),
            lambda ws: not self.leases and sleep_would_act(ws, level),
            what,
        )
        if resp is not None:
            after = self.worker_status()
            assert after.state == common_pb.WORKER_STATE_ASLEEP, f"{what} answered OK: the worker is {view(after)}"
            assert resp.worker.state == common_pb.WORKER_STATE_ASLEEP, f"{what}: {resp.worker}"

    @rule(tags=st.sampled_from([(), ("weights",), ("kv_cache",)]), r=st.sampled_from(REQUEST_IDS), deadline=DEADLINES)
    def wake(self, tags: tuple[str, ...], r: str, deadline: float) -> None:
        what = f"WakeWorker(tags={list(tags)}, request_id={r!r}, deadline={deadline:.2f})"
        req = manager_pb.WakeWorkerRequest(name=NAME, tags=tags, request_id=self.rid(r))
        resp = self.transition(
            WAKE, r, deadline, lambda t: self.stub.WakeWorker(req, timeout=t), lambda ws: wake_would_act(ws, tags), what
        )
        if resp is not None:
            states = tag_states(after := self.worker_status())
            assert all(states[t] == common_pb.TAG_STATE_AWAKE for t in tags or states), (
                f"{what} answered OK: {view(after)}"
            )

    # ---- the data plane ----
    @rule(
        prompt=st.sampled_from(PROMPTS),
        tokens=st.integers(1, FEW),
        deadline=DEADLINES,
        background=st.sampled_from([False, False, True]),
    )
    def generate(self, prompt: tuple[int, ...], tokens: int, deadline: float, background: bool) -> None:
        if background:
            self.generate_in_background(min(deadline, 0.3))
            return
        before = self.before()
        awake = before[2].state == common_pb.WORKER_STATE_AWAKE
        req = worker_pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=tokens)
        what = f"Generate({list(prompt)}, {tokens}, deadline={deadline:.2f}) on a {view(before[2])}"
        answer = ask(lambda: self.env.worker.stub.Generate(req, timeout=deadline))
        self.check(answer, {OK} if awake else {PRECONDITION}, deadline, what)
        if answer.code == OK:
            got = list(answer.get().token_ids)
            assert got == self.env.prompt_refs[prompt][:tokens], f"{what}: {got}, expected the reference tokens"
        elif answer.code == PRECONDITION:
            self.unchanged(before, what, answer)

    def generate_in_background(self, deadline: float) -> None:
        """A long Generate, left running: its deadline cancels it while the next steps run."""
        problems = collect(self.env, wait=len(self.env.background) >= MAX_BACKGROUND)
        assert not problems, problems
        req = worker_pb.GenerateRequest(prompt_token_ids=PROMPTS[0], max_new_tokens=LONG_TOKENS)
        self.env.background.append(self.env.worker.stub.Generate.future(req, timeout=deadline))

    # ---- refusals ----
    @rule(
        kind=st.sampled_from(
            [
                "negative ttl",
                "long holder",
                "long request_id",
                "unknown lease",
                "level 7",
                "unknown tag",
                "tag twice",
                "too many tokens",
            ]
        )
    )
    def refused(self, kind: str) -> None:
        before = self.before()
        s, ws = self.stub, self.env.worker.stub
        expected = {INVALID}
        calls: dict[str, Callable[[], object]] = {
            "negative ttl": lambda: s.AcquireWorker(
                manager_pb.AcquireWorkerRequest(name=NAME, ttl=Duration(seconds=-1)), timeout=LONG_S
            ),
            "long holder": lambda: s.AcquireWorker(
                manager_pb.AcquireWorkerRequest(name=NAME, holder="h" * 300), timeout=LONG_S
            ),
            "long request_id": lambda: s.AcquireWorker(
                manager_pb.AcquireWorkerRequest(name=NAME, request_id="r" * 129), timeout=LONG_S
            ),
            "unknown lease": lambda: s.AcquireWorker(
                manager_pb.AcquireWorkerRequest(name=NAME, lease_id=uuid.uuid4().hex), timeout=LONG_S
            ),
            "level 7": lambda: s.SleepWorker(
                manager_pb.SleepWorkerRequest(name=NAME, level=common_pb.SleepLevel.ValueType(7)), timeout=LONG_S
            ),
            "unknown tag": lambda: s.SleepWorker(
                manager_pb.SleepWorkerRequest(name=NAME, tag_actions={"nope": OFFLOAD}), timeout=LONG_S
            ),
            "tag twice": lambda: s.WakeWorker(
                manager_pb.WakeWorkerRequest(name=NAME, tags=["weights", "weights"]), timeout=LONG_S
            ),
            "too many tokens": lambda: ws.Generate(
                worker_pb.GenerateRequest(prompt_token_ids=[1], max_new_tokens=4097), timeout=LONG_S
            ),
        }
        if kind == "unknown lease":
            expected = {NOT_FOUND}  # (bad tags are INVALID_ARGUMENT whatever the state, leased or not)
        answer = ask(calls[kind])
        what = f"refused request ({kind})"
        note(f"refused request -> {answer.code.name}")
        assert answer.code in expected, f"{what}: {answer}"
        self.unchanged(before, what, answer)

    # ---- invariants ----
    @invariant()
    def consistent(self) -> None:
        held = len(self.leases)
        mw, ws = wait_for(
            lambda: settled(self.env),
            lambda v: v[0].lease_count == held,
            timeout=SETTLE_S,
            what=f"the manager to count the {held} lease(s) the model holds",
        )
        if held:
            assert ws.state == common_pb.WORKER_STATE_AWAKE, f"{held} lease(s) on a worker that says {view(ws)}"

    def teardown(self) -> None:
        env = self.env
        problems = collect(env, wait=True)
        for lease_id in sorted(self.leases):
            req = manager_pb.ReleaseWorkerRequest(lease_id=lease_id)
            r = ask(functools.partial(self.stub.ReleaseWorker, req, timeout=10))
            if r.code != OK:
                problems.append(f"ReleaseWorker of a held lease at teardown: {r}")
            env.outstanding.discard(lease_id)
        self.leases.clear()
        _, ws = settled(env)
        if ws.state != common_pb.WORKER_STATE_AWAKE:
            env.manager.stub.WakeWorker(manager_pb.WakeWorkerRequest(name=NAME), timeout=LONG_S)
        mw, ws = settled(env)
        assert ws.state == common_pb.WORKER_STATE_AWAKE and mw.lease_count == 0, (mw, ws)
        tokens = generate(env.worker, REF_PROMPT, REF_TOKENS)
        assert tokens == env.reference, f"the weights changed: {tokens} != {env.reference}"
        assert not problems, problems


SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=12,
    deadline=None,
    derandomize=LOCAL_RUN is None,  # CI: the same examples every run; a longer local run explores new ones
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def test_leases_transitions_and_generate_interleaved(env: Env) -> None:
    class Machine(LeaseMachine):
        ENV = env

    SEEN.clear()
    run_state_machine_as_test(Machine, settings=SETTINGS)
    print(f"{env.examples} examples:", *(f"{n:5d}  {label}" for label, n in sorted(SEEN.items())), sep="\n")
    problems = collect(env, wait=True)
    assert not problems, problems


# ---------------------------------------------------------------- a bug the machine found


@pytest.mark.parametrize("method", [ACQUIRE, SLEEP])
def test_a_retry_sharing_a_call_is_not_bounded_by_the_first_callers_deadline(env: Env, method: str) -> None:
    """memsvc/runtime/replay.py: retries that arrive while the first call runs share it, and it runs for as long as
    one of its callers waits. It used to run under the first call's deadline: once that passed, the shared
    call failed and a retry with time to spare got UNAVAILABLE although the worker was reachable. Now it
    works to the latest waiting caller's deadline, and a worker call sent under an earlier one is sent
    again with the same request_id once the manager knows how it ended."""
    stub = env.manager.stub
    # The device loop is busy until the first caller's deadline has passed (then cancelled below). Its
    # sequence proves the engine admitted it: a Generate still on its way when the sleep arrives is
    # refused (a transition is pending), and the sleep, then the acquire's wake, would end at once.
    busy = env.worker.stub.Generate.future(
        worker_pb.GenerateRequest(prompt_token_ids=PROMPTS[0], max_new_tokens=LONG_TOKENS), timeout=LONG_S
    )
    wait_for(
        lambda: env.worker.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status.kv_cache,
        lambda kv: kv.sequence_count > 0 or busy.done(),
        what="the Generate to be admitted",
    )
    assert not busy.done(), f"the busy Generate ended at once: {busy.exception()}"
    first: grpc.Future[Any]
    retry: grpc.Future[Any]
    sleep: grpc.Future[manager_pb.SleepWorkerResponse] | None = None
    if method == ACQUIRE:  # a sleep holds the manager's lock on the worker while it waits behind the Generate
        sleep = stub.SleepWorker.future(
            manager_pb.SleepWorkerRequest(name=NAME, level=common_pb.SLEEP_LEVEL_1), timeout=LONG_S
        )
        # Asked of the worker itself: the manager's copy of its status follows the worker's telemetry,
        # which can come after the Generate has ended (a 2000-token Generate took about 1 s on a
        # development machine, and the manager's view turned 0.95 s after the worker's).
        wait_for(
            lambda: env.worker.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status,
            lambda status: status.transition_in_progress or busy.done(),
            timeout=LONG_S,
            what="the sleep to be accepted by the worker",
        )
        assert not busy.done(), f"the busy Generate ended before the sleep came: {busy.exception()}"
        req = manager_pb.AcquireWorkerRequest(name=NAME, ttl=LEASE_TTL, request_id="shared-acquire")
        first, retry = (stub.AcquireWorker.future(req, timeout=t) for t in (0.3, LONG_S))
    else:  # the sleep itself waits behind the Generate
        sreq = manager_pb.SleepWorkerRequest(name=NAME, level=common_pb.SLEEP_LEVEL_1, request_id="shared-sleep")
        first, retry = (stub.SleepWorker.future(sreq, timeout=t) for t in (0.3, LONG_S))
    assert ask(first.result).code == DEADLINE
    busy.cancel()  # the engine drops it at its next step; the shared call goes on for the retry
    answer = ask(retry.result)
    if sleep is not None:
        assert ask(sleep.result).code == OK
    assert answer.code == OK, f"{method} with a {LONG_S:.0f} s deadline, sharing a call: {answer}"
