"""WatchWorkers: the current state first, then every state change, in order, until the client cancels."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from managerproc import Cluster, get, wait_for, wait_state

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc
from memsvc.vocabulary import WorkerState

S = common_pb.WorkerState


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cl = Cluster(tmp_path)
    yield cl
    cl.close()


class Watch:
    """A WatchWorkers stream read on a thread; ``events`` grows as messages arrive."""

    def __init__(self, stub: manager_grpc.MemoryManagerServiceStub, names: list[str] | None = None) -> None:
        self.call = stub.WatchWorkers(manager_pb.WatchWorkersRequest(names=names or []))
        self.events: list[manager_pb.WatchWorkersResponse] = []
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                self.events.append(msg)
        except grpc.RpcError as err:
            self.error = err

    def cancel(self) -> None:
        self.call.cancel()
        self._thread.join(timeout=10)

    def of(self, worker: str) -> list[manager_pb.WatchWorkersResponse]:
        return [e for e in list(self.events) if e.worker.name == worker]

    def changes(self, worker: str) -> list[tuple[common_pb.WorkerState.ValueType, common_pb.WorkerState.ValueType]]:
        return [
            (e.state_change.from_state, e.state_change.to_state)
            for e in self.of(worker)
            if e.WhichOneof("event") == "state_change"
        ]

    def to_states(self, worker: str) -> list[common_pb.WorkerState.ValueType]:
        """The state each change of ``worker`` led to, in order."""
        return [to for _, to in self.changes(worker)]


def _is_subsequence(
    want: Sequence[common_pb.WorkerState.ValueType], seq: Sequence[common_pb.WorkerState.ValueType]
) -> bool:
    it = iter(seq)
    return all(any(x == y for y in it) for x in want)


def _names(states: Sequence[common_pb.WorkerState.ValueType]) -> list[str]:
    return [S.Name(s) for s in states]


def test_watch_streams_snapshot_then_every_state_change_in_order(cluster: Cluster) -> None:
    mgr = cluster.manager()
    stub = mgr.stub
    (wp,) = cluster.workers_up(mgr, ["watched"])
    watch = Watch(stub)
    named = Watch(stub, ["workers/watched"])
    cycle = [S.WORKER_STATE_SLEEPING, S.WORKER_STATE_ASLEEP, S.WORKER_STATE_WAKING, S.WORKER_STATE_AWAKE]
    try:
        for wt in (watch, named):
            wait_for(functools.partial(wt.of, "workers/watched"), lambda ev: len(ev) > 0, what="the first event")
        stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/watched"), timeout=60)
        stub.WakeWorker(manager_pb.WakeWorkerRequest(name="workers/watched"), timeout=60)
        for wt in (watch, named):
            wait_for(
                functools.partial(wt.to_states, "workers/watched"),
                lambda tos: _is_subsequence(cycle, tos),
                timeout=10,
                what=f"state changes {_names(cycle)}",
            )
            # the worker reports a transition after its last state change: kill it only once that is in
            wait_for(
                functools.partial(wt.of, "workers/watched"),
                lambda ev: "wake" in [e.transition.kind for e in ev if e.WhichOneof("event") == "transition"],
                timeout=10,
                what="the wake's transition event",
            )
        wp.kill()
        wait_state(stub, "workers/watched", S.WORKER_STATE_UNAVAILABLE, timeout=10)
        for wt in (watch, named):
            wait_for(
                functools.partial(wt.to_states, "workers/watched"),
                lambda tos: tos[-1:] == [S.WORKER_STATE_UNAVAILABLE],
                timeout=10,
                what="the change to UNAVAILABLE",
            )
    finally:
        watch.cancel()
        named.cancel()

    for wt in (watch, named):
        events = wt.of("workers/watched")
        kinds = [e.WhichOneof("event") for e in events]
        assert kinds[0] == "snapshot", f"first event is {kinds[0]}, not the snapshot"
        first = events[0].snapshot
        assert first.name == "workers/watched" and first.state == S.WORKER_STATE_AWAKE
        assert first.address == wp.address
        for e in events:
            assert e.HasField("time") and e.worker.name == "workers/watched"
        changes = wt.changes("workers/watched")
        # The first change starts at the snapshot's state, and the chain never skips a state.
        chain = [S.WORKER_STATE_AWAKE]
        for frm, to in changes:
            assert frm == chain[-1], f"change {S.Name(frm)}->{S.Name(to)} after {S.Name(chain[-1])}: {changes}"
            chain.append(to)
        assert _is_subsequence([S.WORKER_STATE_AWAKE, *cycle, S.WORKER_STATE_UNAVAILABLE], chain), _names(chain)
        # The event's worker carries the state the change led to.
        for e in events:
            if e.WhichOneof("event") == "state_change":
                assert e.worker.state == e.state_change.to_state
        trans = [e.transition.kind for e in events if e.WhichOneof("event") == "transition"]
        assert "sleep" in trans and "wake" in trans, "sleep and wake transitions are streamed too"
        # A transition's event carries the memory it left: mapped weights after the wake, none after
        # the sleep (not the figures from before it, which a state change alone would copy).
        mapped = {
            e.transition.kind: sum(t.mapped_bytes for t in e.worker.status.tags if t.tag == "weights")
            for e in events
            if e.WhichOneof("event") == "transition"
        }
        assert mapped["sleep"] == 0 and mapped["wake"] > 0, mapped
        # Each change says what started it at the manager, every step of one transition alike.
        reasons = {
            (e.state_change.from_state, e.state_change.to_state): e.state_change.reason
            for e in events
            if e.WhichOneof("event") == "state_change"
        }
        assert reasons[(S.WORKER_STATE_AWAKE, S.WORKER_STATE_SLEEPING)] == "SleepWorker", reasons
        assert reasons[(S.WORKER_STATE_SLEEPING, S.WORKER_STATE_ASLEEP)] == "SleepWorker", reasons
        assert reasons[(S.WORKER_STATE_ASLEEP, S.WORKER_STATE_WAKING)] == "WakeWorker", reasons
        assert reasons[(S.WORKER_STATE_WAKING, S.WORKER_STATE_AWAKE)] == "WakeWorker", reasons
    # Cancelling ended both streams from the client side, nothing else did.
    assert watch.error is not None and watch.error.code() == grpc.StatusCode.CANCELLED


def test_late_telemetry_never_moves_a_worker_backwards(cluster: Cluster) -> None:
    """A real worker's WakeUp response and its WAKING/AWAKE telemetry travel on separate streams; under
    load the response can be applied first (seen in this suite). The scripted worker makes that exact."""
    mgr = cluster.manager()
    stub = mgr.stub
    sw = cluster.scripted("scripted", S.WORKER_STATE_ASLEEP)
    stub.RegisterWorker(
        manager_pb.RegisterWorkerRequest(worker_id="scripted", address=sw.address, host="h"), timeout=10
    )
    wait_state(stub, "scripted", S.WORKER_STATE_ASLEEP)
    watch = Watch(stub, ["workers/scripted"])
    try:
        wait_for(lambda: watch.of("workers/scripted"), lambda ev: len(ev) > 0, what="the snapshot")
        resp = stub.WakeWorker(manager_pb.WakeWorkerRequest(name="workers/scripted"), timeout=30)
        assert resp.worker.state == S.WORKER_STATE_AWAKE
        sw.release_events()  # ASLEEP->WAKING, WAKING->AWAKE, transition: all older than the response
        wait_for(
            lambda: [e.transition.kind for e in watch.of("workers/scripted") if e.WhichOneof("event") == "transition"],
            lambda kinds: "wake" in kinds,
            what="the manager to process the late telemetry",
        )
        # Every message before the transition has been applied by now (one telemetry stream, in order).
        states = [get(stub, "scripted").state]
    finally:
        watch.cancel()
    tos = [to for _, to in watch.changes("workers/scripted")]
    # the late WAKING is dropped, yet the watch skips no state: the manager reports what the wake passed
    assert tos == [S.WORKER_STATE_WAKING, S.WORKER_STATE_AWAKE], f"state changes after the wake: {_names(tos)}"
    assert states == [S.WORKER_STATE_AWAKE]


def test_watch_filters_by_name_and_reports_a_newly_registered_worker(cluster: Cluster) -> None:
    mgr = cluster.manager()
    stub = mgr.stub
    # A worker that cannot be reached (nothing listens on its port) and one real worker.
    stub.RegisterWorker(
        manager_pb.RegisterWorkerRequest(worker_id="ghost", address="127.0.0.1:1", host="h"), timeout=10
    )
    only_ghost = Watch(stub, ["workers/ghost"])
    everyone = Watch(stub)
    try:
        wait_for(lambda: only_ghost.of("workers/ghost"), lambda ev: len(ev) > 0, what="ghost snapshot")
        cluster.workers_up(mgr, ["late"])
        wait_for(lambda: everyone.of("workers/late"), lambda ev: len(ev) > 0, what="an event for the new worker")
        wait_for(
            lambda: [to for _, to in everyone.changes("workers/late")],
            lambda tos: S.WORKER_STATE_AWAKE in tos,
            what="the new worker becoming AWAKE",
        )
    finally:
        only_ghost.cancel()
        everyone.cancel()
    assert {e.worker.name for e in only_ghost.events} == {"workers/ghost"}
    ghost = only_ghost.of("workers/ghost")[0]
    assert ghost.WhichOneof("event") == "snapshot"
    assert ghost.snapshot.state == S.WORKER_STATE_UNAVAILABLE


@pytest.mark.asyncio
async def test_a_watch_sees_the_state_a_worker_passed_through_when_the_answer_overtakes_the_stream() -> None:
    """The manager hears of a wake twice: the worker's telemetry stream says WAKING, then AWAKE, and
    the WakeUp answer says AWAKE, on another connection. When the answer comes first, the stream's
    WAKING is older than what was applied and is dropped; a watcher still sees ASLEEP → WAKING →
    AWAKE, never a jump (the run through real processes above meets this only when timing is
    unlucky, so the order is forced here)."""
    from memsvc.manager import wire
    from memsvc.manager.metrics import ManagerMetrics
    from memsvc.manager.records import WorkerRecord
    from memsvc.manager.reports import Telemetry, WorkerStatus
    from memsvc.manager.telemetry import TelemetryIngest
    from memsvc.manager.watch import WatchEvent, WatchHub
    from memsvc.v1 import model_worker_service_pb2 as worker_pb

    hub = WatchHub()
    queue = hub.subscribe()
    ingest = TelemetryIngest(ManagerMetrics(), hub)
    rec = WorkerRecord("a", "127.0.0.1:1", "h1")

    def status(state: common_pb.WorkerState.ValueType, t_ns: int) -> WorkerStatus:
        st = common_pb.WorkerStatus(state=state)
        st.update_time.FromNanoseconds(t_ns)
        return wire.status_from_pb(st)  # as the worker's link hands it on

    def stream_change(
        frm: common_pb.WorkerState.ValueType, to: common_pb.WorkerState.ValueType, t_ns: int
    ) -> Telemetry:
        msg = worker_pb.StreamTelemetryResponse(
            state_change=common_pb.StateChange(from_state=frm, to_state=to, reason="WakeUp")
        )
        msg.time.FromNanoseconds(t_ns)
        return wire.telemetry_from_pb(msg)

    await ingest.set_status(rec, status(S.WORKER_STATE_ASLEEP, 1_000), True, "telemetry")
    await ingest.set_status(rec, status(S.WORKER_STATE_AWAKE, 3_000), True, "WakeWorker")  # the answer
    await ingest.on_telemetry(rec, stream_change(S.WORKER_STATE_ASLEEP, S.WORKER_STATE_WAKING, 2_000))  # late
    await ingest.on_telemetry(rec, stream_change(S.WORKER_STATE_WAKING, S.WORKER_STATE_AWAKE, 2_500))  # late
    # and down again, the Sleep's answer first
    await ingest.set_status(rec, status(S.WORKER_STATE_ASLEEP, 5_000), True, "SleepWorker")
    await ingest.on_telemetry(rec, stream_change(S.WORKER_STATE_AWAKE, S.WORKER_STATE_SLEEPING, 4_000))

    published = [queue.get_nowait() for _ in range(queue.qsize())]
    events = [wire.watch_pb(e) for e in published if isinstance(e, WatchEvent)]  # what a watcher is sent
    changes = [(e.state_change.from_state, e.state_change.to_state, e.worker.state) for e in events]
    A, Z, WK, SL = S.WORKER_STATE_AWAKE, S.WORKER_STATE_ASLEEP, S.WORKER_STATE_WAKING, S.WORKER_STATE_SLEEPING
    assert changes == [
        (S.WORKER_STATE_UNAVAILABLE, Z, Z),  # a new record reads unavailable until the worker speaks
        (Z, WK, WK),
        (WK, A, A),
        (A, SL, SL),
        (SL, Z, Z),
    ], [(S.Name(f), S.Name(t)) for f, t, _ in changes]
    assert [e.state_change.reason for e in events[1:3]] == ["WakeWorker", "WakeWorker"]
    assert rec.state == WorkerState.ASLEEP
