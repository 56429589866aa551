"""The manager's one translation between its own types and the wire's messages.

Inside, the manager speaks its own types: a worker's reports (memsvc/manager/reports.py), a
:class:`~memsvc.manager.records.WorkerView`, a :class:`~memsvc.manager.records.Lease`, a
:class:`~memsvc.manager.policy.Policy`, a :class:`~memsvc.manager.watch.WatchEvent`. Protos live at
its two edges, and both come here to cross:

- the servicer (memsvc/manager/servicer.py): MemoryManagerService's requests in, its answers out;
- the gRPC link to a worker (memsvc/manager/links.py): ModelWorkerService's answers and telemetry
  in, its Sleep and WakeUp requests out.

A worker's status and transitions cross twice, in from the worker and out to the manager's clients,
and come out as they went in, field for field (which message fields were set included); the tests
in tests/manager/test_wire.py hold that. What this version does not know does not cross: a field a
newer worker adds is dropped, an enum number it adds reads as unspecified (as the manager reads it),
and a time that is not valid as unset. The one message the manager forwards as it is, SwapBlocks,
is built and read here too (see ``WorkerLink.swap_blocks`` for why it is not translated).
"""

from __future__ import annotations

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from memsvc.errors import InvalidArgument
from memsvc.manager.policy import DURATION_FIELDS, FIELDS, Policy, field_value
from memsvc.manager.records import NAME_PREFIX, Lease, WorkerView
from memsvc.manager.reports import (
    Answer,
    Device,
    KvCache,
    ServedModel,
    SleepCall,
    StateChange,
    TagMemory,
    Telemetry,
    Transition,
    WakeCall,
    WorkerStatus,
)
from memsvc.manager.watch import WatchEvent
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.vocabulary import SleepLevel, TagState, WorkerState


def _nanos(value: Timestamp | Duration, present: bool = True) -> int | None:
    """A time or duration of a worker's message in nanoseconds; None where it was not sent, or is
    not a valid one (a Timestamp whose nanos are out of range: protobuf refuses to convert it, and a
    faulty worker's field must not take down its link)."""
    if not present:
        return None
    try:
        return value.ToNanoseconds()
    except ValueError:
        return None


# ---- a worker's reports, in ----
def status_from_pb(s: common_pb.WorkerStatus) -> WorkerStatus:
    d, m, kv = s.device, s.model, s.kv_cache
    return WorkerStatus(
        worker_id=s.worker_id,
        state=WorkerState.of(s.state),
        device=(
            Device(d.backend, d.index, d.name, d.uuid, d.total_bytes, d.free_bytes) if s.HasField("device") else None
        ),
        model=(
            ServedModel(
                source=m.source,
                family=m.family,
                parameter_count=m.parameter_count,
                weights_bytes=m.weights_bytes,
                vocab_size=m.vocab_size,
                layer_count=m.layer_count,
                context_length=m.context_length,
                eos_token_ids=tuple(m.eos_token_ids),
                has_tokenizer=m.has_tokenizer,
                has_chat_template=m.has_chat_template,
                served_model_name=m.served_model_name,
            )
            if s.HasField("model")
            else None
        ),
        tags=tuple(
            TagMemory(
                tag=t.tag,
                state=TagState.of(t.state),
                mapped_bytes=t.mapped_bytes,
                allocated_bytes=t.allocated_bytes,
                offloaded_bytes=t.offloaded_bytes,
                discarded_bytes=t.discarded_bytes,
                allocation_count=t.allocation_count,
                awake_bytes=t.awake_bytes,
                disk_bytes=t.disk_bytes,
            )
            for t in s.tags
        ),
        kv_cache=(
            KvCache(
                block_bytes=kv.block_bytes,
                block_size_tokens=kv.block_size_tokens,
                device_block_count=kv.device_block_count,
                device_free_block_count=kv.device_free_block_count,
                host_block_count=kv.host_block_count,
                host_free_block_count=kv.host_free_block_count,
                sequence_count=kv.sequence_count,
                recomputed_tokens=kv.recomputed_tokens,
            )
            if s.HasField("kv_cache")
            else None
        ),
        last_transition=transition_from_pb(s.last_transition) if s.HasField("last_transition") else None,
        host_pinned_bytes=s.host_pinned_bytes,
        update_time_ns=_nanos(s.update_time, s.HasField("update_time")),
        sleep_level=s.sleep_level,
        last_activity_ns=_nanos(s.last_activity_time, s.HasField("last_activity_time")),
        transition_in_progress=s.transition_in_progress,
        offload_dir=s.offload_dir,
        disk_bytes=s.disk_bytes,
        paused_generations=s.paused_generations,
    )


def transition_from_pb(t: common_pb.TransitionStats) -> Transition:
    return Transition(
        kind=t.kind,
        moved_bytes=t.moved_bytes,
        duration_ns=_nanos(t.duration, t.HasField("duration")),
        gigabytes_per_second=t.gigabytes_per_second,
        verified_bytes=t.verified_bytes,
        end_time_ns=_nanos(t.end_time, t.HasField("end_time")),
    )


def answer_from_pb(resp: worker_pb.SleepResponse | worker_pb.WakeUpResponse) -> Answer:
    return Answer(status_from_pb(resp.status), transition_from_pb(resp.transition))


def telemetry_from_pb(msg: worker_pb.StreamTelemetryResponse) -> Telemetry:
    kind = msg.WhichOneof("event")
    event: WorkerStatus | StateChange | Transition | None = None
    if kind == "snapshot":
        event = status_from_pb(msg.snapshot)
    elif kind == "state_change":
        c = msg.state_change
        event = StateChange(WorkerState.of(c.from_state), WorkerState.of(c.to_state), c.reason)
    elif kind == "transition":
        event = transition_from_pb(msg.transition)
    return Telemetry(_nanos(msg.time) or 0, event)


# ---- the manager's calls, out to a worker ----
def sleep_request_pb(call: SleepCall) -> worker_pb.SleepRequest:
    return worker_pb.SleepRequest(
        level=call.level.proto if call.level is not None else common_pb.SLEEP_LEVEL_UNSPECIFIED,
        tag_actions={t: a.proto for t, a in call.actions.items()},
        request_id=call.request_id,
        pause_generations=call.pause_generations,
    )


def wake_request_pb(call: WakeCall) -> worker_pb.WakeUpRequest:
    return worker_pb.WakeUpRequest(tags=call.tags, request_id=call.request_id)


def swap_request_pb(request: manager_pb.SwapWorkerBlocksRequest) -> worker_pb.SwapBlocksRequest:
    """The worker's SwapBlocks for a SwapWorkerBlocks: the same fields, less the worker's name (the
    raw form passes through as two byte strings)."""
    return worker_pb.SwapBlocksRequest(
        direction=request.direction,
        pairs=request.pairs,
        method=request.method,
        src_blocks=request.src_blocks,
        dst_blocks=request.dst_blocks,
        src_blocks_u32le=request.src_blocks_u32le,
        dst_blocks_u32le=request.dst_blocks_u32le,
    )


def swap_response_pb(r: worker_pb.SwapBlocksResponse) -> manager_pb.SwapWorkerBlocksResponse:
    return manager_pb.SwapWorkerBlocksResponse(
        moved_bytes=r.moved_bytes,
        duration=r.duration,
        gigabytes_per_second=r.gigabytes_per_second,
        kv_cache=r.kv_cache,
    )


# ---- the manager's answers, out to its clients ----
def status_pb(s: WorkerStatus) -> common_pb.WorkerStatus:
    out = common_pb.WorkerStatus(
        worker_id=s.worker_id,
        state=s.state.proto,
        tags=[
            common_pb.TagMemory(
                tag=t.tag,
                state=t.state.proto if t.state is not None else common_pb.TAG_STATE_UNSPECIFIED,
                mapped_bytes=t.mapped_bytes,
                allocated_bytes=t.allocated_bytes,
                offloaded_bytes=t.offloaded_bytes,
                discarded_bytes=t.discarded_bytes,
                allocation_count=t.allocation_count,
                awake_bytes=t.awake_bytes,
                disk_bytes=t.disk_bytes,
            )
            for t in s.tags
        ],
        host_pinned_bytes=s.host_pinned_bytes,
        sleep_level=SleepLevel.proto_of(s.sleep_level),
        transition_in_progress=s.transition_in_progress,
        offload_dir=s.offload_dir,
        disk_bytes=s.disk_bytes,
        paused_generations=s.paused_generations,
    )
    if (d := s.device) is not None:
        out.device.CopyFrom(
            common_pb.DeviceInfo(
                backend=d.backend,
                index=d.index,
                name=d.name,
                uuid=d.uuid,
                total_bytes=d.total_bytes,
                free_bytes=d.free_bytes,
            )
        )
    if (m := s.model) is not None:
        out.model.CopyFrom(
            common_pb.ModelInfo(
                source=m.source,
                family=m.family,
                parameter_count=m.parameter_count,
                weights_bytes=m.weights_bytes,
                vocab_size=m.vocab_size,
                layer_count=m.layer_count,
                context_length=m.context_length,
                eos_token_ids=m.eos_token_ids,
                has_tokenizer=m.has_tokenizer,
                has_chat_template=m.has_chat_template,
                served_model_name=m.served_model_name,
            )
        )
    if (kv := s.kv_cache) is not None:
        out.kv_cache.CopyFrom(
            common_pb.KvCacheInfo(
                block_bytes=kv.block_bytes,
                block_size_tokens=kv.block_size_tokens,
                device_block_count=kv.device_block_count,
                device_free_block_count=kv.device_free_block_count,
                host_block_count=kv.host_block_count,
                host_free_block_count=kv.host_free_block_count,
                sequence_count=kv.sequence_count,
                recomputed_tokens=kv.recomputed_tokens,
            )
        )
    if s.last_transition is not None:
        out.last_transition.CopyFrom(transition_pb(s.last_transition))
    if s.update_time_ns is not None:
        out.update_time.FromNanoseconds(s.update_time_ns)
    if s.last_activity_ns is not None:
        out.last_activity_time.FromNanoseconds(s.last_activity_ns)
    return out


def transition_pb(t: Transition) -> common_pb.TransitionStats:
    out = common_pb.TransitionStats(
        kind=t.kind,
        moved_bytes=t.moved_bytes,
        gigabytes_per_second=t.gigabytes_per_second,
        verified_bytes=t.verified_bytes,
    )
    if t.duration_ns is not None:
        out.duration.FromNanoseconds(t.duration_ns)
    if t.end_time_ns is not None:
        out.end_time.FromNanoseconds(t.end_time_ns)
    return out


def view_pb(v: WorkerView) -> manager_pb.Worker:
    w = manager_pb.Worker(
        name=v.name,
        address=v.address,
        state=v.state.proto,
        lease_count=v.lease_count,
        configured=v.configured,
        host=v.host,
        waiting_acquires=v.waiting_acquires,
        turns_yielded=v.turns_yielded,
    )
    if v.status is not None:
        w.status.CopyFrom(status_pb(v.status))
    if v.last_seen:
        w.last_seen_time.FromNanoseconds(int(v.last_seen * 1e9))
    if v.idle_since is not None:
        w.idle_since_time.FromNanoseconds(int(v.idle_since * 1e9))
    if v.keep_alive is not None:
        w.keep_alive.FromNanoseconds(int(v.keep_alive * 1e9))
    if v.waiting_since is not None:
        w.waiting_since_time.FromNanoseconds(int(v.waiting_since * 1e9))
    return w


def lease_pb(lease: Lease) -> manager_pb.Lease:
    out = manager_pb.Lease(lease_id=lease.lease_id, worker=NAME_PREFIX + lease.worker_id, holder=lease.holder)
    out.expire_time.FromNanoseconds(int(lease.expire_time * 1e9))
    return out


def policy_pb(p: Policy) -> manager_pb.Policy:
    out = manager_pb.Policy(
        device_budget_bytes=p.device_budget_bytes,
        host_budget_bytes=p.host_budget_bytes,
        device_swap_headroom_bytes=p.device_swap_headroom_bytes,
    )
    out.tag_actions.update({t: a.proto for t, a in p.tag_actions.items()})
    out.idle_sleep_timeout.FromNanoseconds(int(p.idle_sleep_timeout * 1e9))
    out.idle_deep_sleep_timeout.FromNanoseconds(int(p.idle_deep_sleep_timeout * 1e9))
    out.time_slice.FromNanoseconds(int(p.time_slice * 1e9))
    out.start_timeout.FromNanoseconds(int(p.start_timeout * 1e9))
    return out


def watch_pb(e: WatchEvent) -> manager_pb.WatchWorkersResponse:
    """The event's message, built once for every stream that shows it (the streams only read it)."""
    built = e.encoded.get("watch")
    if isinstance(built, manager_pb.WatchWorkersResponse):
        return built
    msg = manager_pb.WatchWorkersResponse(worker=view_pb(e.worker))
    if e.change is None:
        msg.snapshot.CopyFrom(msg.worker)
    elif isinstance(e.change, StateChange):
        c = e.change
        msg.state_change.CopyFrom(common_pb.StateChange(from_state=c.old.proto, to_state=c.new.proto, reason=c.reason))
    else:
        msg.transition.CopyFrom(transition_pb(e.change))
    msg.time.FromNanoseconds(e.time_ns)
    e.encoded["watch"] = msg
    return msg


# ---- the manager's requests, in ----
def policy_fields(p: manager_pb.Policy, paths: list[str]) -> dict[str, object]:
    """The fields of ``p`` named by an update mask (all fields when ``paths`` is empty), each checked
    by the policy's rules (policy.field_value)."""
    unknown = [x for x in paths if x not in FIELDS]
    if unknown:
        raise InvalidArgument(
            f"unknown policy field(s) in update_mask: {', '.join(unknown)}; known: {', '.join(FIELDS)}"
        )
    out: dict[str, object] = {}
    for f in paths or FIELDS:
        if f == "tag_actions":
            raw: object = p.tag_actions
        elif f in DURATION_FIELDS:
            raw = _asked(getattr(p, f), f)
        else:
            raw = getattr(p, f)
        out[f] = field_value(f, raw)
    return out


def acquire_times(request: manager_pb.AcquireWorkerRequest) -> tuple[float, float | None]:
    """An AcquireWorker's ttl (0: the default) and keep_alive (None: unset) in seconds."""
    ttl = _asked(request.ttl, "ttl")
    if request.HasField("ttl") and ttl == 0:
        raise InvalidArgument(
            "ttl 0 s would expire at once: leave ttl unset for the default, or give a positive one",
            metadata={"field": "ttl"},
        )
    keep_alive = request.keep_alive.ToNanoseconds() / 1e9 if request.HasField("keep_alive") else None
    return ttl / 1e9, keep_alive


def _asked(d: Duration, field: str) -> int:
    """A duration a client asked for, in nanoseconds; INVALID_ARGUMENT where it is negative."""
    if d.seconds < 0 or d.nanos < 0:  # a Duration's parts: either sign makes it negative
        raise InvalidArgument(f"{field} must not be negative", metadata={"field": field})
    return d.ToNanoseconds()


def register_response_pb(v: WorkerView, heartbeat_interval: float) -> manager_pb.RegisterWorkerResponse:
    resp = manager_pb.RegisterWorkerResponse(worker=view_pb(v))
    resp.heartbeat_interval.FromNanoseconds(int(heartbeat_interval * 1e9))
    return resp


__all__ = [
    "acquire_times",
    "answer_from_pb",
    "lease_pb",
    "policy_fields",
    "policy_pb",
    "register_response_pb",
    "sleep_request_pb",
    "status_from_pb",
    "status_pb",
    "swap_request_pb",
    "swap_response_pb",
    "telemetry_from_pb",
    "transition_from_pb",
    "transition_pb",
    "view_pb",
    "wake_request_pb",
    "watch_pb",
]
