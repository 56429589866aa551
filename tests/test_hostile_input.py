"""Hostile input: generated requests to every RPC of both services must never hurt the servers.

One manager and one real worker (``w0``, host backend, synthetic:tiny, registered with the manager)
live for the whole module. For every RPC of ModelWorkerService and MemoryManagerService, hypothesis
sends requests built generically from the message descriptors (every field type: integers at and
past their limits, enum values out of range, empty/unicode/very long/NUL strings, repeated fields,
maps, nested messages, negative Durations), and raw random bytes as the body. Properties:

- the call ends with a status within its deadline (no hang; streams are read for one or two
  messages and cancelled);
- a non-OK status carries a ``google.rpc.ErrorInfo`` with domain ``memsvc.dev`` (transport codes
  UNAVAILABLE / CANCELLED excepted), and is never INTERNAL/UNKNOWN (an unhandled exception);
- a rejected call changes nothing: worker status (state, tags, KV cache) and the manager's view
  (workers, leases, default and w0 policy) are identical before and after;
- both processes still run, answer health SERVING, and answer GetWorkerStatus / ListWorkers.

Calls that succeed may change state; each example starts from a settled state (w0 AWAKE or put in
the example's precondition state, no leases, the original policies, the manager agreeing with the
worker), restored after a successful call.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias, TypedDict, cast

import grpc
import pytest
from google.protobuf import message as pb_message
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from managerproc import Cluster, ManagerProcess, get, wait_for
from workerproc import WorkerProcess

from memsvc import DOMAIN, error_info
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

if TYPE_CHECKING:
    from google._upb import _message as _upb

    # The protobuf stubs describe the pure-Python descriptors and the upb ones as two classes (a message's
    # DESCRIPTOR is either); at run time they are one type, so the walk below takes both.
    _Descriptor: TypeAlias = Descriptor | _upb.Descriptor
    _Field: TypeAlias = FieldDescriptor | _upb.FieldDescriptor

W0 = "w0"
W0_NAME = "workers/w0"
CALL_TIMEOUT = 30.0
"""Deadline of one hostile call: far above anything a tiny model needs; reaching it is a hang."""
STREAM_TIMEOUT = 10.0
TRANSPORT_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
"""Codes the transport itself may produce, without an ErrorInfo."""

WORKER_SERVICE = "memsvc.v1.ModelWorkerService"
MANAGER_SERVICE = "memsvc.v1.MemoryManagerService"


class _Settings(TypedDict):
    deadline: None
    derandomize: bool
    database: None
    suppress_health_check: list[HealthCheck]


SETTINGS: _Settings = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---------------------------------------------------------------- generic strategies from descriptors

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_INTERESTING_INTS = (
    0,
    1,
    -1,
    2,
    3,
    5,
    7,
    8,
    15,
    16,
    63,
    64,
    255,
    511,
    512,
    1000,
    2047,
    2048,
    4096,
    4097,
    65536,
    10**9,
    10**9 + 1,
    86401,
    2**31 - 1,
    -(2**31),
    2**32,
    2**53 + 1,
)
_INTERESTING_STRINGS = (
    "",
    "\x00",
    " ",
    "w0",
    "workers/w0",
    "workers/",
    "workers/nope",
    "workers/w0/x",
    "nope",
    "weights",
    "kv_cache",
    "weights\x00",
    "WEIGHTS",
    "seq-1",
    "127.0.0.1:9",
    "127.0.0.1:0",
    "127.0.0.1:65536",
    ":",
    "[::1]:9",
    "é" * 3,
    "\U0001f980",
    "\u202e\u0000x",
    "x" * 63,
    "x" * 64,
    "x" * 128,
    "x" * 129,
    "x" * 257,
    "y" * 1000,
    "../../etc/passwd",
    "%s%n%x",
    "'; DROP TABLE workers;--",
    "d29ya2Vycy93MA==",
    "idle_sleep_timeout",
    "tag_actions",
    "policy.idle_sleep_timeout",
    "*",
    "workers/\U0001f980",
)
MAX_REPEATED = 12

_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
STRINGS = st.one_of(st.sampled_from(_INTERESTING_STRINGS), _text)
"""Any valid UTF-8 string (protobuf refuses lone surrogates on the client already)."""


def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [v for v in (*_INTERESTING_INTS, *(-v for v in _INTERESTING_INTS), lo, hi, lo + 1, hi - 1) if lo <= v <= hi]
    return st.one_of(st.sampled_from(sorted(set(edges))), st.integers(lo, hi))


def _scalar(f: _Field) -> st.SearchStrategy[Any]:
    t = f.type
    if t in _INT_RANGES:
        return ints(*_INT_RANGES[t])
    if t == FieldDescriptor.TYPE_ENUM:
        assert f.enum_type is not None, f.full_name  # every enum field has its enum type
        known = [v.number for v in f.enum_type.values]
        return st.one_of(st.sampled_from(known), ints(-(2**31), 2**31 - 1))  # open enums: out of range too
    if t == FieldDescriptor.TYPE_STRING:
        return STRINGS
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(width=32 if t == FieldDescriptor.TYPE_FLOAT else 64)
    raise AssertionError(f"unhandled field type {t} of {f.full_name}")


def _message_type(f: _Field) -> _Descriptor:
    """The message type of a TYPE_MESSAGE field (every one has it)."""
    assert f.message_type is not None, f.full_name
    return f.message_type


def _is_map(f: _Field) -> bool:
    return f.type == FieldDescriptor.TYPE_MESSAGE and _message_type(f).GetOptions().map_entry


def _is_repeated(f: _Field) -> bool:
    return bool(f.is_repeated)


MAX_DEPTH = 3


def _field(f: _Field, depth: int) -> st.SearchStrategy[Any] | None:
    if _is_map(f):
        key, value = _message_type(f).fields_by_name["key"], _message_type(f).fields_by_name["value"]
        return st.dictionaries(_scalar(key), _value(value, depth + 1), max_size=6)  # type: ignore[arg-type]
    one = _value(f, depth)
    if one is None:
        return None
    if _is_repeated(f):
        return st.lists(one, max_size=MAX_REPEATED)
    return one


def _value(f: _Field, depth: int) -> st.SearchStrategy[Any] | None:
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        if depth >= MAX_DEPTH:
            return None
        return messages(_message_type(f), depth + 1)
    return _scalar(f)


def _build(cls: type[pb_message.Message], values: dict[str, Any]) -> pb_message.Message:
    msg = cls()
    desc = cls.DESCRIPTOR
    for name, value in values.items():
        f = desc.fields_by_name[name]
        if _is_map(f):
            target = getattr(msg, name)
            for k, v in value.items():
                if isinstance(v, pb_message.Message):
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif _is_repeated(f):
            if f.type == FieldDescriptor.TYPE_MESSAGE:
                for v in value:
                    getattr(msg, name).add().CopyFrom(v)
            else:
                getattr(msg, name).extend(value)
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            getattr(msg, name).CopyFrom(value)
        else:
            setattr(msg, name, value)
    return msg


_cache: dict[tuple[str, int], st.SearchStrategy[Any]] = {}


def messages(desc: _Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """Messages of type ``desc`` with any subset of fields set to hostile values (generic, by walking
    the descriptor; nested messages up to MAX_DEPTH, then left unset)."""
    key = (desc.full_name, depth)
    if key not in _cache:
        cls = GetMessageClass(cast(Descriptor, desc))  # the stubs take only the pure-Python class (see _Descriptor)
        fields = {f.name: s for f in desc.fields if (s := _field(f, depth)) is not None}
        _cache[key] = st.fixed_dictionaries({}, optional=fields).map(lambda d: _build(cls, d))
    return _cache[key]


# ---------------------------------------------------------------- the servers and their state


@dataclass
class Env:
    cluster: Cluster
    manager: ManagerProcess
    worker: WorkerProcess
    mchan: grpc.Channel
    wchan: grpc.Channel
    default_policy: manager_pb.Policy
    w0_policy: manager_pb.Policy
    worker_host: str
    leases: set[str] = field(default_factory=set)

    @property
    def wstub(self) -> worker_grpc.ModelWorkerServiceStub:
        return worker_grpc.ModelWorkerServiceStub(self.wchan)

    @property
    def mstub(self) -> manager_grpc.MemoryManagerServiceStub:
        return self.manager.stub


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    cluster = Cluster(tmp_path_factory.mktemp("hostile"))
    try:
        mp = cluster.manager()
        (wp,) = cluster.workers_up(mp, [W0])
        mchan = grpc.insecure_channel(mp.address)
        wchan = grpc.insecure_channel(wp.address)
        default = mp.stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy
        w0p = mp.stub.GetPolicy(manager_pb.GetPolicyRequest(name=W0_NAME), timeout=10).policy
        yield Env(cluster, mp, wp, mchan, wchan, default, w0p, get(mp.stub, W0).host)
        mchan.close()
        wchan.close()
    finally:
        cluster.close()


def worker_snapshot(e: Env) -> tuple[Any, ...]:
    s = e.wstub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status
    tags = tuple(
        (
            t.tag,
            t.state,
            t.mapped_bytes,
            t.allocated_bytes,
            t.offloaded_bytes,
            t.discarded_bytes,
            t.allocation_count,
            t.awake_bytes,
        )
        for t in s.tags
    )
    kv = s.kv_cache
    return (
        common_pb.WorkerState.Name(s.state),
        s.sleep_level,
        tags,
        s.device.free_bytes,
        kv.device_block_count,
        kv.device_free_block_count,
        kv.host_block_count,
        kv.host_free_block_count,
        kv.sequence_count,
    )


def manager_snapshot(e: Env) -> tuple[Any, ...]:
    stub = e.mstub
    workers = stub.ListWorkers(manager_pb.ListWorkersRequest(page_size=1000), timeout=10).workers
    out: list[tuple[object, ...]] = []
    for wk in workers:
        if wk.name == W0_NAME:  # tag bytes: compared at the source (worker_snapshot), the mirror lags by design
            out.append(
                (wk.name, wk.address, wk.host, wk.configured, wk.lease_count, common_pb.WorkerState.Name(wk.state))
            )
        else:  # records of hostile registrations: their reachability moves on its own, the rest must not
            out.append((wk.name, wk.address, wk.host, wk.configured, wk.lease_count))
    default = stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy
    w0p = stub.GetPolicy(manager_pb.GetPolicyRequest(name=W0_NAME), timeout=10).policy
    return tuple(out), default.SerializeToString(deterministic=True), w0p.SerializeToString(deterministic=True)


def snapshot(e: Env) -> tuple[Any, ...]:
    return worker_snapshot(e), manager_snapshot(e)


def assert_alive(e: Env) -> None:
    assert e.worker.running, e.worker.failure("the worker died")
    assert e.manager.running, e.manager.failure("the manager died")
    for chan in (e.wchan, e.mchan):
        r = health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    e.wstub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10)
    e.mstub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10)


def _agree(e: Env) -> bool:
    """The manager's view of w0 matches the worker's own state (events carry states at once; tag byte
    counts follow with the next periodic snapshot, so the manager's copy of them is not compared)."""
    s = e.wstub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status
    mw = get(e.mstub, W0)
    return mw.state == s.state and mw.address == e.worker.address and mw.lease_count == 0


def _retry(fn: Callable[[], Any]) -> None:
    """A reset call that may meet a transition the manager is still finishing."""
    for _ in range(100):
        try:
            fn()
            return
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.ABORTED:
                raise
            time.sleep(0.05)


def reset(e: Env, precondition: str = "awake") -> None:
    """Undo what accepted calls changed, then put w0 in ``precondition``; return once the manager agrees."""
    stub = e.mstub
    for lease in sorted(e.leases):
        try:
            stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease), timeout=10)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND, err
    e.leases.clear()
    try:
        mw = get(stub, W0)
    except grpc.RpcError as err:  # an accepted DeregisterWorker of w0: register it as its heartbeat would
        assert err.code() == grpc.StatusCode.NOT_FOUND, err
        mw = manager_pb.Worker()
    if mw.address != e.worker.address or mw.host != e.worker_host:
        stub.RegisterWorker(
            manager_pb.RegisterWorkerRequest(worker_id=W0, address=e.worker.address, host=e.worker_host), timeout=10
        )
    if stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy != e.default_policy:
        stub.UpdatePolicy(manager_pb.UpdatePolicyRequest(policy=e.default_policy), timeout=10)
    if stub.GetPolicy(manager_pb.GetPolicyRequest(name=W0_NAME), timeout=10).policy != e.w0_policy:
        stub.UpdatePolicy(manager_pb.UpdatePolicyRequest(name=W0_NAME, policy=e.w0_policy), timeout=10)
    ws = e.wstub
    state = ws.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status.state
    if state != common_pb.WORKER_STATE_AWAKE:
        _retry(lambda: ws.WakeUp(worker_pb.WakeUpRequest(), timeout=CALL_TIMEOUT))
    if precondition == "asleep":
        ws.Sleep(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1), timeout=CALL_TIMEOUT)
    elif precondition == "partial":
        ws.Sleep(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1), timeout=CALL_TIMEOUT)
        ws.WakeUp(worker_pb.WakeUpRequest(tags=["weights"]), timeout=CALL_TIMEOUT)
    wait_for(lambda: _agree(e), bool, timeout=20, what="the manager to agree with w0")


# ---------------------------------------------------------------- sending one hostile request


@dataclass
class Outcome:
    code: grpc.StatusCode
    err: grpc.RpcError | None
    response: bytes | None


def _unary(e: Env, service: str, method: str, body: bytes) -> Outcome:
    chan = e.wchan if service == WORKER_SERVICE else e.mchan
    call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = chan.unary_unary(
        f"/{service}/{method}", request_serializer=None, response_deserializer=None
    )
    try:
        resp = call(body, timeout=CALL_TIMEOUT)
    except grpc.RpcError as err:
        return Outcome(err.code(), err, None)
    return Outcome(grpc.StatusCode.OK, None, resp)


def _stream(e: Env, service: str, method: str, body: bytes) -> Outcome:
    chan = e.wchan if service == WORKER_SERVICE else e.mchan
    call: grpc.UnaryStreamMultiCallable[bytes, bytes] = chan.unary_stream(
        f"/{service}/{method}", request_serializer=None, response_deserializer=None
    )
    it = call(body, timeout=STREAM_TIMEOUT)
    try:
        first = next(it)  # one message (the snapshot), then the client cancels
        return Outcome(grpc.StatusCode.OK, None, first)
    except StopIteration:
        return Outcome(it.code(), None, None)
    except grpc.RpcError as err:
        return Outcome(err.code(), err, None)
    finally:
        it.cancel()


STREAMING = {"StreamTelemetry", "WatchWorkers"}


def send(e: Env, service: str, method: str, body: bytes) -> Outcome:
    return (_stream if method in STREAMING else _unary)(e, service, method, body)


def check_status(out: Outcome, what: str) -> None:
    assert out.code != grpc.StatusCode.DEADLINE_EXCEEDED, f"{what}: no status within the deadline (a hang)"
    if out.code == grpc.StatusCode.OK:
        return
    assert out.code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (
        f"{what}: {out.code.name} {out.err.details() if out.err else ''} (an unhandled server error)"
    )
    if out.code in TRANSPORT_CODES and out.err is not None and error_info(out.err) is None:
        return
    assert out.err is not None, f"{what}: stream ended with {out.code.name} without an error"
    info = error_info(out.err)
    assert info is not None, f"{what}: {out.code.name} {out.err.details()!r} has no ErrorInfo"
    assert info.domain == DOMAIN, f"{what}: ErrorInfo domain {info.domain!r}"
    assert info.reason, f"{what}: ErrorInfo without a reason"


def remember_success(e: Env, method: str, out: Outcome) -> None:
    """Note what an accepted call created, so reset() can undo it."""
    if out.response is None:
        return
    if method == "AcquireWorker":
        e.leases.add(manager_pb.AcquireWorkerResponse.FromString(out.response).lease.lease_id)


def free_sequence_of(e: Env, method: str, body: bytes, out: Outcome) -> None:
    if method != "Generate" or out.code != grpc.StatusCode.OK:
        return
    seq = worker_pb.GenerateRequest.FromString(body).sequence_id
    if seq:
        e.wstub.FreeSequence(worker_pb.FreeSequenceRequest(sequence_id=seq), timeout=10)


def exercise(e: Env, service: str, method: str, body: bytes, precondition: str) -> None:
    what = f"{method}({body[:200]!r}{'...' if len(body) > 200 else ''}) on a {precondition} worker"
    reset(e, precondition)
    before = snapshot(e)
    out = send(e, service, method, body)
    check_status(out, what)
    if out.code != grpc.StatusCode.OK:
        after = snapshot(e)
        assert after == before, f"{what} was rejected ({out.code.name}) but changed state:\n{before}\n{after}"
    else:
        remember_success(e, method, out)
        free_sequence_of(e, method, body, out)
    assert_alive(e)


# ---------------------------------------------------------------- the properties

WORKER_RPCS = {
    "GetWorkerStatus": worker_pb.GetWorkerStatusRequest,
    "Sleep": worker_pb.SleepRequest,
    "WakeUp": worker_pb.WakeUpRequest,
    "ReloadWeights": worker_pb.ReloadWeightsRequest,
    "SwapBlocks": worker_pb.SwapBlocksRequest,
    "StreamTelemetry": worker_pb.StreamTelemetryRequest,
    "Generate": worker_pb.GenerateRequest,
    "FreeSequence": worker_pb.FreeSequenceRequest,
    "GenerateStream": worker_pb.GenerateStreamRequest,
}
MANAGER_RPCS = {
    "RegisterWorker": manager_pb.RegisterWorkerRequest,
    "ListWorkers": manager_pb.ListWorkersRequest,
    "GetWorker": manager_pb.GetWorkerRequest,
    "SleepWorker": manager_pb.SleepWorkerRequest,
    "WakeWorker": manager_pb.WakeWorkerRequest,
    "SwapWorkerBlocks": manager_pb.SwapWorkerBlocksRequest,
    "AcquireWorker": manager_pb.AcquireWorkerRequest,
    "ReleaseWorker": manager_pb.ReleaseWorkerRequest,
    "GetPolicy": manager_pb.GetPolicyRequest,
    "UpdatePolicy": manager_pb.UpdatePolicyRequest,
    "WatchWorkers": manager_pb.WatchWorkersRequest,
    "DeregisterWorker": manager_pb.DeregisterWorkerRequest,
    "ListLeases": manager_pb.ListLeasesRequest,
}
STATEFUL = {
    "Sleep",
    "WakeUp",
    "ReloadWeights",
    "SwapBlocks",
    "Generate",
    "FreeSequence",
    "SleepWorker",
    "WakeWorker",
    "AcquireWorker",
    "SwapWorkerBlocks",
}
"""RPCs whose outcome depends on the worker's state: they also run on an asleep / partially awake w0."""

CASES = [(WORKER_SERVICE, name, cls) for name, cls in WORKER_RPCS.items()] + [
    (MANAGER_SERVICE, name, cls) for name, cls in MANAGER_RPCS.items()
]


def test_every_rpc_is_covered() -> None:
    from memsvc.v1 import memory_manager_service_pb2, model_worker_service_pb2

    w_methods = set(model_worker_service_pb2.DESCRIPTOR.services_by_name["ModelWorkerService"].methods_by_name)
    m_methods = set(memory_manager_service_pb2.DESCRIPTOR.services_by_name["MemoryManagerService"].methods_by_name)
    assert w_methods == set(WORKER_RPCS)
    assert m_methods == set(MANAGER_RPCS)


def _preconditions(method: str) -> st.SearchStrategy[str]:
    return st.sampled_from(["awake", "asleep", "partial"]) if method in STATEFUL else st.just("awake")


@pytest.mark.parametrize(("service", "method", "cls"), CASES, ids=[case[1] for case in CASES])
def test_generated_messages(env: Env, service: str, method: str, cls: type[pb_message.Message]) -> None:
    @settings(max_examples=60 if method in STATEFUL else 40, **SETTINGS)
    @given(msg=messages(cls.DESCRIPTOR), precondition=_preconditions(method))
    def prop(msg: pb_message.Message, precondition: str) -> None:
        exercise(env, service, method, msg.SerializeToString(), precondition)

    prop()


RAW_EDGES = [b"\xff" * 16, b"\x0a\xff\xff\xff\xff\x0f", b"\x08" + b"\xff" * 9 + b"\x01", b"\x80", b"\x0a\x05ab"]
"""Truncated varints, a length past the end, an over-long varint, a lone continuation byte."""


@pytest.mark.parametrize(("service", "method", "cls"), CASES, ids=[case[1] for case in CASES])
def test_raw_bytes(env: Env, service: str, method: str, cls: type[pb_message.Message]) -> None:
    @settings(max_examples=25, **SETTINGS)
    @given(body=st.one_of(st.binary(max_size=256), st.sampled_from(RAW_EDGES)))
    def prop(body: bytes) -> None:
        exercise(env, service, method, body, "awake")

    prop()


def test_page_token_of_every_shape_is_refused_cleanly(env: Env) -> None:
    """ListWorkers' page_token is decoded by the server: tokens that decode to junk are INVALID_ARGUMENT."""
    for raw in (b"\xff\xfe", b"workers/x", b"", b"\x00", "é".encode()):
        token = base64.urlsafe_b64encode(raw).decode()
        out = send(
            env, MANAGER_SERVICE, "ListWorkers", manager_pb.ListWorkersRequest(page_token=token).SerializeToString()
        )
        check_status(out, f"ListWorkers(page_token={token!r})")
    assert_alive(env)


LONG = "y" * 70000
"""Far longer than gRPC's 16 KiB limit on received metadata once echoed into the status message."""


@pytest.mark.parametrize(
    ("service", "method", "request_"),
    [
        (MANAGER_SERVICE, "GetWorker", manager_pb.GetWorkerRequest(name=LONG)),
        (MANAGER_SERVICE, "GetPolicy", manager_pb.GetPolicyRequest(name=LONG)),
        (MANAGER_SERVICE, "ReleaseWorker", manager_pb.ReleaseWorkerRequest(lease_id=LONG)),
        (WORKER_SERVICE, "FreeSequence", worker_pb.FreeSequenceRequest(sequence_id=LONG)),
    ],
    ids=["GetWorker", "GetPolicy", "ReleaseWorker", "FreeSequence"],
)
def test_a_very_long_string_is_refused_with_error_info(
    env: Env, service: str, method: str, request_: pb_message.Message
) -> None:
    exercise(env, service, method, request_.SerializeToString(), "awake")
