"""The manager's translation between protos and its own types (memsvc/manager/wire.py): what a worker
reports crosses the manager and comes out to its clients as the worker sent it, byte for byte, which
parts were sent included; a field the proto gains and the manager's types do not carry fails here."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from memsvc.manager import wire
from memsvc.manager.policy import Policy
from memsvc.manager.records import WorkerRecord
from memsvc.manager.reports import StateChange, Transition, WorkerStatus
from memsvc.manager.watch import WatchEvent
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.vocabulary import Action, TagState, WorkerState


def _filled(msg: Message, seed: int = 1) -> Message:
    """``msg`` with every field set to a value of its own (no default), two of each repeated one."""
    fields: Iterable[Any] = msg.DESCRIPTOR.fields  # FieldDescriptors (the stubs type them two ways)
    for n, f in enumerate(fields, start=seed):
        repeated = f.is_repeated
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            for i in range(2 if repeated else 1):
                sub = getattr(msg, f.name).add() if repeated else getattr(msg, f.name)
                if isinstance(sub, Timestamp | Duration):
                    sub.FromNanoseconds(1_700_000_000_123_456_789 + n + i)
                else:
                    _filled(sub, n * 10 + i)
            continue
        if f.type == FieldDescriptor.TYPE_ENUM:
            numbers = [v.number for v in f.enum_type.values] if f.enum_type is not None else [0, 1]
            value: object = numbers[1 + (n % (len(numbers) - 1))]
        elif f.type == FieldDescriptor.TYPE_STRING:
            value = f"{f.name}-{n}"
        elif f.type == FieldDescriptor.TYPE_BOOL:
            value = True
        elif f.type == FieldDescriptor.TYPE_DOUBLE:
            value = n + 0.25
        else:
            value = n
        if repeated:
            getattr(msg, f.name).extend([value, value])
        else:
            setattr(msg, f.name, value)
    return msg


def _status(**parts: Message) -> common_pb.WorkerStatus:
    return common_pb.WorkerStatus(worker_id="a", state=common_pb.WORKER_STATE_ASLEEP, **parts)  # type: ignore[arg-type]


def test_a_status_with_every_field_set_comes_out_as_it_went_in() -> None:
    sent = _filled(common_pb.WorkerStatus())
    assert isinstance(sent, common_pb.WorkerStatus)
    sent.state = common_pb.WORKER_STATE_PARTIALLY_AWAKE
    for i, t in enumerate(sent.tags):
        t.state = (common_pb.TAG_STATE_OFFLOADED, common_pb.TAG_STATE_ON_DISK)[i]
    assert wire.status_pb(wire.status_from_pb(sent)).SerializeToString() == sent.SerializeToString()


def test_which_parts_a_worker_sent_survives_the_crossing() -> None:
    """Absent parts stay absent, parts sent empty stay present (a client's HasField sees the same)."""
    empty_parts = {
        "device": common_pb.DeviceInfo(),
        "model": common_pb.ModelInfo(),
        "kv_cache": common_pb.KvCacheInfo(),
        "last_transition": common_pb.TransitionStats(),
        "update_time": Timestamp(),
        "last_activity_time": Timestamp(),
    }
    for sent in (common_pb.WorkerStatus(), _status(), _status(**empty_parts)):
        out = wire.status_pb(wire.status_from_pb(sent))
        assert out.SerializeToString() == sent.SerializeToString()
        assert [f.name for f, _ in out.ListFields()] == [f.name for f, _ in sent.ListFields()]


def test_a_transition_and_the_telemetry_events_cross_unchanged() -> None:
    t = _filled(common_pb.TransitionStats())
    assert isinstance(t, common_pb.TransitionStats)
    assert wire.transition_pb(wire.transition_from_pb(t)).SerializeToString() == t.SerializeToString()
    bare = common_pb.TransitionStats(kind="sleep", moved_bytes=5)  # no duration, no end time
    assert wire.transition_pb(wire.transition_from_pb(bare)).SerializeToString() == bare.SerializeToString()

    msg = worker_pb.StreamTelemetryResponse(transition=t)
    msg.time.FromNanoseconds(42)
    assert wire.telemetry_from_pb(msg).event == wire.transition_from_pb(t) and wire.telemetry_from_pb(msg).time_ns == 42
    change = worker_pb.StreamTelemetryResponse(
        state_change=common_pb.StateChange(
            from_state=common_pb.WORKER_STATE_AWAKE, to_state=common_pb.WORKER_STATE_SLEEPING, reason="Sleep"
        )
    )
    assert wire.telemetry_from_pb(change).event == StateChange(WorkerState.AWAKE, WorkerState.SLEEPING, "Sleep")
    assert wire.telemetry_from_pb(worker_pb.StreamTelemetryResponse()).event is None


def test_a_watch_event_carries_the_worker_as_it_was_and_what_happened() -> None:
    rec = WorkerRecord("a", "10.0.0.1:50051", "h1", reachable=True, last_seen=1.5)
    rec.status = WorkerStatus(state=WorkerState.AWAKE)
    view = rec.view()
    snapshot = wire.watch_pb(WatchEvent(view, time_ns=7))
    assert snapshot.WhichOneof("event") == "snapshot" and snapshot.snapshot == snapshot.worker
    assert snapshot.worker.name == "workers/a" and snapshot.worker.state == common_pb.WORKER_STATE_AWAKE
    assert snapshot.time.ToNanoseconds() == 7 and snapshot.worker.last_seen_time.ToNanoseconds() == 1_500_000_000
    assert snapshot.worker.HasField("idle_since_time") and not snapshot.worker.HasField("keep_alive")

    went = WatchEvent(view.showing(WorkerState.SLEEPING), StateChange(WorkerState.AWAKE, WorkerState.SLEEPING, "x"))
    msg = wire.watch_pb(went)
    assert msg.worker.state == common_pb.WORKER_STATE_SLEEPING, "the worker shows the state the change led to"
    assert (msg.state_change.from_state, msg.state_change.to_state, msg.state_change.reason) == (
        common_pb.WORKER_STATE_AWAKE,
        common_pb.WORKER_STATE_SLEEPING,
        "x",
    )
    rec.status = WorkerStatus(state=WorkerState.ASLEEP)
    assert view.state == WorkerState.AWAKE, "a view is the worker as it stood then"
    moved = wire.watch_pb(WatchEvent(view, Transition(kind="sleep", moved_bytes=3)))
    assert moved.transition == common_pb.TransitionStats(kind="sleep", moved_bytes=3)


def test_a_time_a_faulty_worker_sent_reads_as_unset_and_the_rest_of_its_report_crosses() -> None:
    """protobuf refuses to convert a Timestamp whose nanos are out of range; a worker that sends one
    must not take down its telemetry link (each message read raised there, and the link reconnected)."""
    bad = Timestamp(seconds=1, nanos=2_000_000_000)
    msg = worker_pb.StreamTelemetryResponse(transition=common_pb.TransitionStats(kind="wake", end_time=bad), time=bad)
    got = wire.telemetry_from_pb(msg)
    assert got.time_ns == 0 and got.event == Transition(kind="wake")
    status = wire.status_from_pb(_status(update_time=bad))
    assert status.update_time_ns is None and status.worker_id == "a"


def test_every_stream_that_shows_an_event_sends_the_one_message_built_for_it() -> None:
    event = WatchEvent(WorkerRecord("a", "10.0.0.1:50051", "h1").view(), time_ns=9)
    first = wire.watch_pb(event)
    assert wire.watch_pb(event) is first
    assert wire.watch_pb(WatchEvent(event.worker, time_ns=9)) is not first, "another event builds its own"


def test_a_policy_crosses_both_ways_unchanged() -> None:
    """What GetPolicy sends, sent back whole in an UpdatePolicy, is the same policy."""
    p = Policy(
        tag_actions={"weights": Action.OFFLOAD_DISK, "kv_cache": Action.DISCARD, "extra": Action.KEEP},
        idle_sleep_timeout=1.5,
        idle_deep_sleep_timeout=90.25,
        device_budget_bytes=7 << 30,
        host_budget_bytes=3 << 30,
        device_swap_headroom_bytes=1 << 20,
        time_slice=0.75,
        start_timeout=12.0,
    )
    assert Policy().with_fields(wire.policy_fields(wire.policy_pb(p), [])) == p


def test_the_known_tag_states_cross_and_one_this_version_does_not_know_reads_as_unspecified() -> None:
    """A newer worker's tag state (a number this version lacks) goes out to clients as unspecified,
    as an unset one does: never as a state the tag may not be in."""
    known = [state.proto for state in TagState]
    msg = common_pb.WorkerStatus(worker_id="a", state=common_pb.WORKER_STATE_ASLEEP)
    for i, number in enumerate([*known, 99]):
        msg.tags.add(tag=f"t{i}", state=common_pb.TagState.ValueType(number))
    out = [t.state for t in wire.status_pb(wire.status_from_pb(msg)).tags]
    assert out == [*known, common_pb.TAG_STATE_UNSPECIFIED]
