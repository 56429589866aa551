"""Real ``memsvc manager`` processes (and the workers that register with them) for the manager tests.

:class:`ManagerProcess` starts ``python -m memsvc.cli manager`` on a loopback port picked by the
process itself (``--listen 127.0.0.1:0``), reads the bound address from its "listening on" line (and
the metrics URL from its "metrics on" line), and hands out a gRPC stub. ``kill()`` is SIGKILL (a
crash: nothing is flushed or closed), ``stop()`` the graceful SIGTERM path.

:class:`Cluster` owns every process a test starts and ends them all at teardown, whatever happened,
so a failing test never leaks a manager or a worker. Workers are :class:`workerproc.WorkerProcess`
(host backend, simulated device) started with ``--manager``.

The polling helpers (:func:`wait_for`, :func:`wait_state`) give timer behaviour a bounded wait and
fail with the last thing they saw; they never assert on speed.
"""

from __future__ import annotations

import functools
import queue
import re
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
from childproc import Proc, ProcError
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from workerproc import WorkerProcess

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

READY_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
WORKER_MODEL = "synthetic:tiny"
WORKER_CAPACITY = "64MiB"
"""Simulated device size of a test worker; synthetic:tiny maps 4 MiB awake (2 MiB weights, 2 MiB KV)."""

MANAGER_SERVICE = manager_pb.DESCRIPTOR.services_by_name["MemoryManagerService"].full_name
_LISTENING = re.compile(r"^memsvc manager listening on (?P<address>\S+)$")
_METRICS = re.compile(r"^memsvc manager metrics on (?P<url>http://\S+)$")

T = TypeVar("T")


class ManagerStartError(ProcError):
    """The manager exited or did not print its address in time; the message carries its output."""


class ManagerProcess(Proc):
    """One manager process; ``args`` are extra flags after ``memsvc manager``."""

    stop_timeout = STOP_TIMEOUT

    def __init__(
        self, db: Path | str, args: Sequence[str] = (), *, listen: str = "127.0.0.1:0", metrics: bool = False
    ) -> None:
        argv = [sys.executable, "-m", "memsvc.cli", "manager", "--listen", listen, "--db", str(db), *args]
        if metrics:
            argv += ["--metrics-listen", "127.0.0.1:0"]
        super().__init__(argv, name="manager", new_session=False)
        self.db = Path(db)
        self.with_metrics = metrics
        self.address = ""
        self.metrics_url = ""
        self._channel: grpc.Channel | None = None
        self._stub: manager_grpc.MemoryManagerServiceStub | None = None

    def start(self) -> ManagerProcess:
        super().start()
        try:  # the metrics line, when asked for, comes before the address
            found = self.wait_lines(
                [_METRICS, _LISTENING] if self.with_metrics else [_LISTENING],
                READY_TIMEOUT,
                ManagerStartError,
                "listening",
            )
            self.address = found[-1]["address"]
            self.metrics_url = found[0]["url"] if self.with_metrics else ""
        except BaseException:
            self.kill()
            raise
        return self

    @property
    def stub(self) -> manager_grpc.MemoryManagerServiceStub:
        if self._stub is None:
            assert self.address, "manager is not started"
            self._channel = grpc.insecure_channel(self.address)
            self._stub = manager_grpc.MemoryManagerServiceStub(self._channel)
        return self._stub

    def health(self, service: str = MANAGER_SERVICE) -> int:
        """grpc.health.v1's status for ``service`` ("": the server)."""
        with grpc.insecure_channel(self.address) as ch:
            answer = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(answer.status)

    def leads(self) -> bool:
        """It serves MemoryManagerService: one manager always, a replica on a shared store once it leads."""
        try:
            return bool(self.health() == health_pb2.HealthCheckResponse.SERVING)
        except grpc.RpcError:
            return False

    def close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._stub = None

    def kill(self) -> None:
        """SIGKILL now (a crash), if it still runs; always safe to call."""
        self.close_channel()
        super().kill()

    def stop(self) -> int:
        """SIGTERM and wait; the exit code."""
        self.close_channel()
        try:
            return self.signal_and_wait(signal.SIGTERM)
        except ProcError as exc:
            raise AssertionError(str(exc)) from None

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """One scrape of /metrics: {(sample name, labels): value}."""
        assert self.metrics_url, "manager was started without --metrics-listen"
        with urllib.request.urlopen(self.metrics_url, timeout=10) as resp:
            text = resp.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, frozenset(s.labels.items()))] = s.value
        return out


class Cluster:
    """Every manager and worker a test starts; ``close()`` ends them all (workers first)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.managers: list[ManagerProcess] = []
        self.workers: list[WorkerProcess] = []
        self.scripted_workers: list[ScriptedWorker] = []

    def manager(
        self,
        args: Sequence[str] = (),
        *,
        db: Path | str | None = None,
        listen: str = "127.0.0.1:0",
        metrics: bool = False,
        lead: bool = True,
    ) -> ManagerProcess:
        """A started manager. On PostgreSQL a replica listens before it leads (and answers NO_LEADER
        until then): with ``lead`` this returns once it leads, as a SQLite manager does at its line."""
        db = db or self.tmp_path / "manager.db"
        mp = ManagerProcess(db, args, listen=listen, metrics=metrics)
        self.managers.append(mp)
        mp.start()
        if lead and str(db).startswith("postgresql://"):
            wait_for(mp.leads, bool, what="the manager to lead its database", timeout=60)
        return mp

    def worker_process(self, manager: str, worker_id: str, args: Sequence[str] = ()) -> WorkerProcess:
        """A not yet started worker that registers with ``manager`` as ``worker_id``."""
        flags = list(args)
        if "--host-capacity" not in flags:
            flags += ["--host-capacity", WORKER_CAPACITY]
        if "--model" not in flags:
            flags += ["--model", WORKER_MODEL]
        wp = WorkerProcess(["--manager", manager, "--worker-id", worker_id, *flags])
        self.workers.append(wp)
        return wp

    def workers_up(
        self,
        manager: ManagerProcess,
        ids: Iterable[str],
        args: Sequence[str] = (),
        state: common_pb.WorkerState.ValueType | None = common_pb.WORKER_STATE_AWAKE,
    ) -> list[WorkerProcess]:
        """Start workers in parallel; return once each is ready and, in the manager's view, in ``state``
        (``None``: registered and reachable, whatever its state)."""
        procs = [self.worker_process(manager.address, wid, args) for wid in ids]
        with ThreadPoolExecutor(len(procs)) as pool:
            for f in [pool.submit(p.start) for p in procs]:
                f.result()
        for p in procs:
            if state is None:
                wait_for(
                    functools.partial(get, manager.stub, p.worker_id),
                    lambda wk: wk.state not in (common_pb.WORKER_STATE_UNAVAILABLE, common_pb.WORKER_STATE_UNSPECIFIED),
                    what=f"{p.worker_id} to register and be reachable",
                )
            else:
                wait_state(manager.stub, p.worker_id, state)
        return procs

    def scripted(
        self, worker_id: str, state: common_pb.WorkerState.ValueType = common_pb.WORKER_STATE_ASLEEP
    ) -> ScriptedWorker:
        """An in-process :class:`ScriptedWorker` (not registered: the test calls RegisterWorker)."""
        sw = ScriptedWorker(worker_id, state)
        self.scripted_workers.append(sw)
        return sw

    def close(self) -> None:
        for sw in self.scripted_workers:
            sw.close()
        for wp in self.workers:
            wp.close()
        for mp in self.managers:
            mp.close()


# ---- a scripted worker, for orderings a real worker produces only by chance ----


class ScriptedWorker(worker_grpc.ModelWorkerServiceServicer):
    """A ModelWorkerService served from the test process, whose telemetry the test releases by hand.

    A real worker reports a transition twice, on two independent HTTP/2 streams: in the RPC's response
    and as telemetry events; which reaches the manager first is up to scheduling. This one answers
    Sleep/WakeUp at once and holds the matching telemetry events (stamped with the times they
    happened, before the response) until :meth:`release_events`, so the late-telemetry case is exact.
    """

    MiB = 1 << 20

    def __init__(self, worker_id: str, state: common_pb.WorkerState.ValueType = common_pb.WORKER_STATE_ASLEEP) -> None:
        self.worker_id = worker_id
        self.state = state
        self._stream: queue.Queue[worker_pb.StreamTelemetryResponse | None] = queue.Queue()
        self._held: list[worker_pb.StreamTelemetryResponse] = []
        self._seq = 0
        self._lock = threading.Lock()
        self.server = grpc.server(ThreadPoolExecutor(8))
        worker_grpc.add_ModelWorkerServiceServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    def close(self) -> None:
        self._stream.put(None)
        self.server.stop(0)

    def status(self) -> common_pb.WorkerStatus:
        awake = self.state == common_pb.WORKER_STATE_AWAKE
        st = common_pb.WorkerStatus(
            worker_id=self.worker_id,
            state=self.state,
            device=common_pb.DeviceInfo(
                backend="host",
                index=0,
                name="scripted",
                total_bytes=64 * self.MiB,
                free_bytes=(60 if awake else 64) * self.MiB,
            ),
            tags=[
                common_pb.TagMemory(
                    tag="kv_cache",
                    state=common_pb.TAG_STATE_AWAKE if awake else common_pb.TAG_STATE_DISCARDED,
                    mapped_bytes=2 * self.MiB if awake else 0,
                    allocated_bytes=2 * self.MiB,
                    discarded_bytes=0 if awake else 2 * self.MiB,
                    awake_bytes=2 * self.MiB,
                ),
                common_pb.TagMemory(
                    tag="weights",
                    state=common_pb.TAG_STATE_AWAKE if awake else common_pb.TAG_STATE_OFFLOADED,
                    mapped_bytes=2 * self.MiB if awake else 0,
                    allocated_bytes=self.MiB,
                    offloaded_bytes=0 if awake else self.MiB,
                    awake_bytes=2 * self.MiB,
                ),
            ],
        )
        st.update_time.GetCurrentTime()
        return st

    def _message(self, **event: Any) -> worker_pb.StreamTelemetryResponse:
        with self._lock:
            self._seq += 1
            msg = worker_pb.StreamTelemetryResponse(sequence_number=self._seq, **event)
        msg.time.GetCurrentTime()
        return msg

    def _transition(
        self, to: common_pb.WorkerState.ValueType, reason: str, busy: common_pb.WorkerState.ValueType, kind: str
    ) -> tuple[common_pb.WorkerStatus, common_pb.TransitionStats]:
        frm = self.state
        self._held.append(
            self._message(state_change=common_pb.StateChange(from_state=frm, to_state=busy, reason=reason))
        )
        self.state = to
        self._held.append(
            self._message(state_change=common_pb.StateChange(from_state=busy, to_state=to, reason=reason))
        )
        t = common_pb.TransitionStats(kind=kind, moved_bytes=self.MiB)
        t.end_time.GetCurrentTime()
        self._held.append(self._message(transition=t))
        return self.status(), t

    def release_events(self) -> None:
        """Send the held telemetry events now, in the order they happened."""
        held, self._held = self._held, []
        for msg in held:
            self._stream.put(msg)

    # ModelWorkerService
    def GetWorkerStatus(
        self, request: worker_pb.GetWorkerStatusRequest, context: grpc.ServicerContext
    ) -> worker_pb.GetWorkerStatusResponse:
        return worker_pb.GetWorkerStatusResponse(status=self.status())

    def StreamTelemetry(
        self, request: worker_pb.StreamTelemetryRequest, context: grpc.ServicerContext
    ) -> Iterator[worker_pb.StreamTelemetryResponse]:
        yield self._message(snapshot=self.status())
        while context.is_active():
            try:
                msg = self._stream.get(timeout=0.1)
            except queue.Empty:
                continue
            if msg is None:
                return
            yield msg

    def Sleep(self, request: worker_pb.SleepRequest, context: grpc.ServicerContext) -> worker_pb.SleepResponse:
        st, t = self._transition(common_pb.WORKER_STATE_ASLEEP, "Sleep", common_pb.WORKER_STATE_SLEEPING, "sleep")
        return worker_pb.SleepResponse(status=st, transition=t)

    def WakeUp(self, request: worker_pb.WakeUpRequest, context: grpc.ServicerContext) -> worker_pb.WakeUpResponse:
        st, t = self._transition(common_pb.WORKER_STATE_AWAKE, "WakeUp", common_pb.WORKER_STATE_WAKING, "wake")
        return worker_pb.WakeUpResponse(status=st, transition=t)

    # Not scripted: answered as the generated ModelWorkerServiceServicer answers them (UNIMPLEMENTED).
    def ReloadWeights(
        self, request: worker_pb.ReloadWeightsRequest, context: grpc.ServicerContext
    ) -> worker_pb.ReloadWeightsResponse:
        _unimplemented(context)

    def SwapBlocks(
        self, request: worker_pb.SwapBlocksRequest, context: grpc.ServicerContext
    ) -> worker_pb.SwapBlocksResponse:
        _unimplemented(context)

    def Generate(self, request: worker_pb.GenerateRequest, context: grpc.ServicerContext) -> worker_pb.GenerateResponse:
        _unimplemented(context)

    def GenerateStream(
        self, request: worker_pb.GenerateStreamRequest, context: grpc.ServicerContext
    ) -> Iterator[worker_pb.GenerateStreamResponse]:
        _unimplemented(context)

    def FreeSequence(
        self, request: worker_pb.FreeSequenceRequest, context: grpc.ServicerContext
    ) -> worker_pb.FreeSequenceResponse:
        _unimplemented(context)


def _unimplemented(context: grpc.ServicerContext) -> NoReturn:
    """What the generated servicer base class does for a method a subclass does not define."""
    context.set_code(grpc.StatusCode.UNIMPLEMENTED)
    context.set_details("Method not implemented!")
    raise NotImplementedError("Method not implemented!")


# ---- polling and views ----


def wait_for(
    probe: Callable[[], T], ok: Callable[[T], bool], timeout: float = 15.0, what: str = "", interval: float = 0.05
) -> T:
    """Call ``probe`` until ``ok(value)``; the value, or AssertionError with the last one after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = probe()
            last = value
            if ok(value):
                return value
        except grpc.RpcError as err:
            last = f"{err.code().name}: {err.details()}"
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.1f} s waiting for {what or ok}; last value:\n{last}")
        time.sleep(interval)


def name(worker_id: str) -> str:
    return worker_id if worker_id.startswith("workers/") else f"workers/{worker_id}"


def get(stub: manager_grpc.MemoryManagerServiceStub, worker_id: str) -> manager_pb.Worker:
    return stub.GetWorker(manager_pb.GetWorkerRequest(name=name(worker_id)), timeout=10).worker


def wait_state(
    stub: manager_grpc.MemoryManagerServiceStub,
    worker_id: str,
    state: common_pb.WorkerState.ValueType,
    timeout: float = 15.0,
    extra: Callable[[manager_pb.Worker], bool] = lambda wk: True,
) -> manager_pb.Worker:
    """Poll GetWorker until the worker is in ``state`` (and ``extra`` holds)."""
    return wait_for(
        lambda: get(stub, worker_id),
        lambda wk: wk.state == state and extra(wk),
        timeout,
        f"{worker_id} to be {common_pb.WorkerState.Name(state)}",
    )


def tags(worker: manager_pb.Worker) -> dict[str, common_pb.TagMemory]:
    return {t.tag: t for t in worker.status.tags}


def tag_states(worker: manager_pb.Worker) -> dict[str, str]:
    return {t.tag: common_pb.TagState.Name(t.state) for t in worker.status.tags}


def offloaded(worker: manager_pb.Worker) -> int:
    return sum(t.offloaded_bytes for t in worker.status.tags)


def mapped(worker: manager_pb.Worker) -> int:
    return sum(t.mapped_bytes for t in worker.status.tags)


def view(worker: manager_pb.Worker) -> tuple[Any, ...]:
    """What a bad request must not change: state, leases, address, and every tag's state and sizes."""
    return (
        worker.name,
        worker.address,
        common_pb.WorkerState.Name(worker.state),
        worker.lease_count,
        tuple(
            (
                t.tag,
                common_pb.TagState.Name(t.state),
                t.mapped_bytes,
                t.allocated_bytes,
                t.offloaded_bytes,
                t.discarded_bytes,
            )
            for t in sorted(worker.status.tags, key=lambda t: t.tag)
        ),
    )


def seconds(ts: Timestamp | Duration) -> float:
    """A Timestamp or Duration as float seconds."""
    return float(ts.ToNanoseconds()) / 1e9


__all__ = [
    "Cluster",
    "ManagerProcess",
    "ManagerStartError",
    "ScriptedWorker",
    "get",
    "mapped",
    "name",
    "offloaded",
    "seconds",
    "tag_states",
    "tags",
    "view",
    "wait_for",
    "wait_state",
]
