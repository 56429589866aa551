"""Bounded load test of the manager and its workers, on loopback only (CPU, host backend).

One manager and several host-backend workers (``synthetic:tiny``) run as processes on 127.0.0.1; N
client threads mix AcquireWorker/ReleaseWorker (short TTLs, some leases left to expire),
Generate on the acquired worker, GetWorker/ListWorkers and SleepWorker/WakeWorker, while a few
long-lived WatchWorkers streams follow everything. The manager's idle timers are short, and the
set of workers that get leases rotates (one is left cold per phase), so tier 1 and tier 2 fire
during the run. The run stops by itself after ``--duration`` seconds (or ``--max-requests``).

Reported per RPC: calls, errors by status code, split into expected (e.g. FAILED_PRECONDITION for
SleepWorker on a leased or already sleeping worker) and unexpected, and p50/p99 latency. Checks:
no unexpected error, every lease drained afterwards, the manager's view of each worker matches the
worker's own, the idle timers fired, every process still runs.

    python -m bench.bench_load --out load.json [--clients 32] [--workers 3] [--duration 60]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests"))

from managerproc import Cluster, ManagerProcess  # noqa: E402

from memsvc.v1 import common_pb2 as common_pb  # noqa: E402
from memsvc.v1 import memory_manager_service_pb2 as manager_pb  # noqa: E402
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc  # noqa: E402
from memsvc.v1 import model_worker_service_pb2 as worker_pb  # noqa: E402
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc  # noqa: E402

CALL_TIMEOUT = 30.0
"""Deadline of every unary call: far above any latency seen here, so DEADLINE_EXCEEDED means a hang."""

FP = "FAILED_PRECONDITION"
EXPECTED: dict[str, frozenset[str]] = {
    # a lease on the worker (another client holds it), or every tag already asleep
    "SleepWorker": frozenset({FP}),
    # nothing asleep (another client or the manager woke it first)
    "WakeWorker": frozenset({FP}),
}
"""Status codes that are a correct answer to a racing client. Anything else is unexpected; in
particular Generate on a worker whose lease we hold must succeed, and ReleaseWorker of a live
lease must find it (NOT_FOUND is expected only once the lease's TTL has passed, decided per call)."""
SLEEP_LEVELS = [
    common_pb.SLEEP_LEVEL_UNSPECIFIED,
    common_pb.SLEEP_LEVEL_1,
    common_pb.SLEEP_LEVEL_1,
    common_pb.SLEEP_LEVEL_2,
]
"""What an operator's SleepWorker asks for: the policy's tag actions (unspecified), level 1 more often, level 2."""

R = TypeVar("R")


@dataclass
class LoadConfig:
    clients: int = 32
    workers: int = 3
    watchers: int = 4
    duration: float = 60.0
    max_requests: int = 0
    """Stop after this many client calls in total (0: only the duration counts)."""
    lease_ttl: float = 10.0
    abandon_ttl: float = 0.5
    """TTL of the leases a client deliberately never releases (they must expire)."""
    idle_sleep_timeout: float = 1.0
    idle_deep_sleep_timeout: float = 2.0
    phase: float = 5.0
    """Every ``phase`` seconds another worker is left cold (no leases, no operator calls)."""
    tick_interval: float = 0.05
    seed: int = 0


@dataclass
class RpcStats:
    calls: int = 0
    ok: int = 0
    expected: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    unexpected: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    latencies: list[float] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)


class Recorder:
    """Per-RPC counts, error codes and latencies, shared by every client thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rpcs: dict[str, RpcStats] = defaultdict(RpcStats)

    def record(self, method: str, seconds: float, code: str | None, expected: bool, detail: str = "") -> None:
        with self.lock:
            s = self.rpcs[method]
            s.calls += 1
            s.latencies.append(seconds)
            if code is None:
                s.ok += 1
            elif expected:
                s.expected[code] += 1
            else:
                s.unexpected[code] += 1
                if len(s.samples) < 5:
                    s.samples.append(f"{code}: {detail}")

    @property
    def total_calls(self) -> int:
        with self.lock:
            return sum(s.calls for s in self.rpcs.values())

    def call(
        self,
        method: str,
        fn: Callable[..., R],
        request: Any,
        expected: frozenset[str] = frozenset(),
        expect: Any = None,
    ) -> R | None:
        """Call ``fn(request)``; record the outcome; return the response or None on error.

        ``expect(code, elapsed)`` may decide per call whether an error code is expected."""
        t0 = time.perf_counter()
        try:
            resp = fn(request, timeout=CALL_TIMEOUT)
        except grpc.RpcError as err:
            dt = time.perf_counter() - t0
            code = err.code().name
            ok = code in expected or (expect is not None and expect(code, dt))
            self.record(method, dt, code, ok, str(err.details()))
            return None
        self.record(method, time.perf_counter() - t0, None, True)
        return resp


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def proc_counts(pid: int) -> dict[str, int]:
    """Open fds and threads of a process (Linux /proc)."""
    try:
        return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": len(os.listdir(f"/proc/{pid}/task"))}
    except OSError:
        return {"fds": -1, "threads": -1}


class Client(threading.Thread):
    """One client: its own channels, a random mix of calls until told to stop."""

    def __init__(
        self,
        idx: int,
        cfg: LoadConfig,
        mgr_address: str,
        names: list[str],
        addresses: dict[str, str],
        rec: Recorder,
        stop: threading.Event,
        t_start: float,
    ) -> None:
        super().__init__(name=f"load-client-{idx}", daemon=True)
        self.cfg = cfg
        self.rng = random.Random(cfg.seed * 1000 + idx)
        self.channel = grpc.insecure_channel(mgr_address)
        self.mgr = manager_grpc.MemoryManagerServiceStub(self.channel)
        self.names = names
        self.addresses = addresses
        self.rec = rec
        self.stop = stop
        self.t_start = t_start
        self.worker_stubs: dict[str, tuple[grpc.Channel, worker_grpc.ModelWorkerServiceStub]] = {}
        self.abandoned: list[tuple[str, float]] = []
        self.error: BaseException | None = None

    def roles(self) -> tuple[list[str], list[str]]:
        """(lease targets, operator targets) of this phase. With three workers or more, each phase
        one worker is left cold (its idle timers fire), one gets the operator's Sleep/Wake calls
        and the rest get the leases; the roles rotate every ``phase`` seconds."""
        n = len(self.names)
        if n < 3:
            return self.names, self.names
        k = int((time.monotonic() - self.t_start) / self.cfg.phase)
        operated = self.names[(k + 1) % n]
        leased = [x for i, x in enumerate(self.names) if i not in (k % n, (k + 1) % n)]
        return leased, [operated]

    def lease_target(self) -> str:
        leased, operated = self.roles()
        return self.rng.choice(operated if self.rng.random() < 0.1 else leased)  # 10 %: race the operator

    def operator_target(self) -> str:
        leased, operated = self.roles()
        return self.rng.choice(leased if self.rng.random() < 0.2 else operated)  # 20 %: a leased worker

    def worker_stub(self, name: str) -> worker_grpc.ModelWorkerServiceStub:
        if name not in self.worker_stubs:
            ch = grpc.insecure_channel(self.addresses[name])
            self.worker_stubs[name] = (ch, worker_grpc.ModelWorkerServiceStub(ch))
        return self.worker_stubs[name][1]

    def run(self) -> None:
        ops = [
            (self.lease_cycle, 35),
            (self.abandon_lease, 3),
            (self.get_worker, 20),
            (self.list_workers, 15),
            (self.sleep_worker, 12),
            (self.wake_worker, 12),
        ]
        fns, weights = zip(*ops, strict=True)
        try:
            while not self.stop.is_set():
                if self.cfg.max_requests and self.rec.total_calls >= self.cfg.max_requests:
                    self.stop.set()
                    break
                self.rng.choices(fns, weights)[0]()
                self.release_expired(False)
            self.release_expired(True)
        except BaseException as exc:  # a bug in the bench, not an RPC error: surface it
            self.error = exc
            self.stop.set()
        finally:
            for ch, _ in self.worker_stubs.values():
                ch.close()
            self.channel.close()

    def acquire(self, name: str, ttl: float) -> manager_pb.AcquireWorkerResponse | None:
        req = manager_pb.AcquireWorkerRequest(name=name, holder=self.name)
        req.ttl.FromNanoseconds(int(ttl * 1e9))
        return self.rec.call("AcquireWorker", self.mgr.AcquireWorker, req)

    def lease_cycle(self) -> None:
        name = self.lease_target()
        t0 = time.monotonic()
        resp = self.acquire(name, self.cfg.lease_ttl)
        if resp is None:
            return
        stub = self.worker_stub(name)
        for _ in range(self.rng.randint(1, 2)):
            req = worker_pb.GenerateRequest(
                prompt_token_ids=[self.rng.randrange(1, 100) for _ in range(4)], max_new_tokens=4
            )
            # a held lease keeps the worker awake: any error here is unexpected, unless the lease
            # itself ran out (the call came after its TTL)
            self.rec.call(
                "Generate",
                stub.Generate,
                req,
                expect=lambda code, dt, t0=t0: time.monotonic() - t0 > self.cfg.lease_ttl,
            )
        self.release(resp.lease.lease_id, t0, self.cfg.lease_ttl)

    def release(self, lease_id: str, t_acquired: float, ttl: float) -> None:
        # NOT_FOUND is right only if the TTL passed since the acquire was sent
        self.rec.call(
            "ReleaseWorker",
            self.mgr.ReleaseWorker,
            manager_pb.ReleaseWorkerRequest(lease_id=lease_id),
            expect=lambda code, dt: code == "NOT_FOUND" and time.monotonic() - t_acquired > ttl,
        )

    def abandon_lease(self) -> None:
        name = self.rng.choice(self.roles()[0])
        t0 = time.monotonic()
        resp = self.acquire(name, self.cfg.abandon_ttl)
        if resp is not None:
            self.abandoned.append((resp.lease.lease_id, t0))

    def release_expired(self, all_of_them: bool) -> None:
        """Release abandoned leases once their TTL (plus a margin) passed: NOT_FOUND is the answer."""
        now = time.monotonic()
        keep = []
        for lease_id, t0 in self.abandoned:
            if all_of_them or now - t0 > self.cfg.abandon_ttl + 1.0:
                self.rec.call(
                    "ReleaseWorker(expired)",
                    self.mgr.ReleaseWorker,
                    manager_pb.ReleaseWorkerRequest(lease_id=lease_id),
                    expect=lambda code, dt, t0=t0: code == "NOT_FOUND" and time.monotonic() - t0 > self.cfg.abandon_ttl,
                )
            else:
                keep.append((lease_id, t0))
        self.abandoned = keep

    def get_worker(self) -> None:
        self.rec.call("GetWorker", self.mgr.GetWorker, manager_pb.GetWorkerRequest(name=self.rng.choice(self.names)))

    def list_workers(self) -> None:
        self.rec.call(
            "ListWorkers", self.mgr.ListWorkers, manager_pb.ListWorkersRequest(page_size=self.rng.choice([0, 1, 2]))
        )

    def sleep_worker(self) -> None:
        req = manager_pb.SleepWorkerRequest(name=self.operator_target(), level=self.rng.choice(SLEEP_LEVELS))
        self.rec.call("SleepWorker", self.mgr.SleepWorker, req, EXPECTED["SleepWorker"])

    def wake_worker(self) -> None:
        req = manager_pb.WakeWorkerRequest(name=self.operator_target(), tags=self.rng.choice([[], [], ["weights"]]))
        self.rec.call("WakeWorker", self.mgr.WakeWorker, req, EXPECTED["WakeWorker"])


class Watcher(threading.Thread):
    """A long-lived WatchWorkers stream; counts events by kind until cancelled."""

    def __init__(self, idx: int, mgr_address: str, rec: Recorder) -> None:
        super().__init__(name=f"load-watcher-{idx}", daemon=True)
        self.channel = grpc.insecure_channel(mgr_address)
        self.stub = manager_grpc.MemoryManagerServiceStub(self.channel)
        self.rec = rec
        self.events: dict[str, int] = defaultdict(int)
        self.reasons: dict[str, int] = defaultdict(int)
        self.call: Any = None
        self.started = threading.Event()
        self.cancelled = False

    def run(self) -> None:
        t0 = time.perf_counter()
        first = True
        try:
            self.call = self.stub.WatchWorkers(manager_pb.WatchWorkersRequest())
            self.started.set()
            for msg in self.call:
                if first:  # latency of a watch: until its first message (the snapshot)
                    self.rec.record("WatchWorkers", time.perf_counter() - t0, None, True)
                    first = False
                kind = msg.WhichOneof("event") or "?"
                self.events[kind] += 1
                if kind == "state_change":
                    self.reasons[msg.state_change.reason] += 1
            if not self.cancelled:  # the server ended the stream by itself
                self.rec.record("WatchWorkers", time.perf_counter() - t0, "ended early", False, "stream ended")
        except grpc.RpcError as err:
            code = err.code().name
            if not (self.cancelled and code == "CANCELLED"):
                self.rec.record("WatchWorkers", time.perf_counter() - t0, code, False, str(err.details()))
        finally:
            self.started.set()
            self.channel.close()

    def cancel(self) -> None:
        self.cancelled = True
        if self.call is not None:
            self.call.cancel()


def _metrics(mp: ManagerProcess) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (sample, labels), value in mp.metrics().items():
        lab = dict(labels)
        if sample == "memsvc_idle_sleeps_total":
            out[f"idle_sleeps_tier{lab['tier']}"] += value
        elif sample in (
            "memsvc_leases_granted_total",
            "memsvc_leases_expired_total",
            "memsvc_budget_evictions_total",
            "memsvc_host_demotions_total",
        ):
            out[sample.removeprefix("memsvc_").removesuffix("_total")] += value
        elif sample == "memsvc_worker_transitions_total":
            out[f"transitions_{lab['kind']}"] += value
    return dict(out)


def _wait(probe: Any, timeout: float) -> tuple[bool, Any]:
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = probe()
            if last is True or (isinstance(last, tuple) and last[0]):
                return True, last
        except grpc.RpcError as err:
            last = f"{err.code().name}: {err.details()}"
        if time.monotonic() > deadline:
            return False, last
        time.sleep(0.1)


def _git_commit() -> str:
    """Short commit, with "+dirty" when tracked files differ from it (the figures then include them)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=REPO_ROOT
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "commit": _git_commit(),
        "date": time.strftime("%Y-%m-%d"),
    }


def run_load(cfg: LoadConfig, tmp: Path | None = None) -> dict[str, Any]:
    """Start the processes, run the load, check the aftermath; the result as a dict (JSON-able)."""
    with tempfile.TemporaryDirectory(prefix="memsvc-load-") as td:
        tmp = tmp or Path(td)
        conf = tmp / "manager.toml"
        conf.write_text(
            f"[manager]\ntick_interval = {cfg.tick_interval}\nretry_backoff = 0.5\n"
            f"[policy]\nidle_sleep_timeout = {cfg.idle_sleep_timeout}\n"
            f"idle_deep_sleep_timeout = {cfg.idle_deep_sleep_timeout}\n"
        )
        cluster = Cluster(tmp)
        try:
            return _run(cfg, cluster, conf)
        finally:
            cluster.close()


def _run(cfg: LoadConfig, cluster: Cluster, conf: Path) -> dict[str, Any]:
    mp = cluster.manager(["--config", str(conf)], metrics=True)
    assert mp.address.startswith("127.0.0.1:"), mp.address
    ids = [f"load{i}" for i in range(cfg.workers)]
    # Registered and reachable is enough: with a 0.5 s idle timeout the manager may put a worker to
    # sleep before a slow (loaded) machine polls it awake, and the clients wake them on demand.
    wps = cluster.workers_up(mp, ids, state=None)
    names = [f"workers/{i}" for i in ids]
    addresses = {f"workers/{wp.worker_id}": wp.address for wp in wps}
    assert all(a.startswith("127.0.0.1:") for a in addresses.values()), addresses
    pids = {"manager": mp.proc.pid, **{wp.worker_id: wp.proc.pid for wp in wps}}  # type: ignore[union-attr]
    procs_before = {k: proc_counts(p) for k, p in pids.items()}

    rec = Recorder()
    stop = threading.Event()
    watchers = [Watcher(i, mp.address, rec) for i in range(cfg.watchers)]
    for wt in watchers:
        wt.start()
    for wt in watchers:
        wt.started.wait(10)
    t_start = time.monotonic()
    clients = [Client(i, cfg, mp.address, names, addresses, rec, stop, t_start) for i in range(cfg.clients)]
    for cl in clients:
        cl.start()
    stop.wait(cfg.duration)
    stop.set()
    for cl in clients:
        cl.join(CALL_TIMEOUT * 4)
    elapsed = time.monotonic() - t_start
    hung = [cl.name for cl in clients if cl.is_alive()]
    bench_errors = [f"{cl.name}: {cl.error!r}" for cl in clients if cl.error is not None]

    # aftermath: every lease released or expired, the manager agrees with each worker
    stub = mp.stub
    drained, drained_last = _wait(
        lambda: (
            all(
                x.lease_count == 0 and x.state != common_pb.WORKER_STATE_UNAVAILABLE
                for x in stub.ListWorkers(manager_pb.ListWorkersRequest(page_size=100), timeout=10).workers
            ),
            [
                (x.name, x.lease_count, common_pb.WorkerState.Name(x.state))
                for x in stub.ListWorkers(manager_pb.ListWorkersRequest(page_size=100), timeout=10).workers
            ],
        ),
        timeout=cfg.abandon_ttl + 15,
    )

    def agree() -> tuple[bool, list[tuple[str, str, str]]]:
        views = []
        for wp in wps:
            mine = wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest(), timeout=10).status.state
            theirs = stub.GetWorker(
                manager_pb.GetWorkerRequest(name=f"workers/{wp.worker_id}"), timeout=10
            ).worker.state
            views.append((wp.worker_id, common_pb.WorkerState.Name(mine), common_pb.WorkerState.Name(theirs)))
        return all(v[1] == v[2] for v in views), views

    consistent, consistent_last = _wait(agree, timeout=15)
    metrics = _metrics(mp)
    for wt in watchers:
        wt.cancel()
    for wt in watchers:
        wt.join(10)
    procs_after = {k: proc_counts(p) for k, p in pids.items()}
    alive = {"manager": mp.running, **{wp.worker_id: wp.running for wp in wps}}

    rpcs = {}
    for method, s in sorted(rec.rpcs.items()):
        rpcs[method] = {
            "calls": s.calls,
            "ok": s.ok,
            "expected_errors": dict(s.expected),
            "unexpected_errors": dict(s.unexpected),
            "p50_ms": percentile(s.latencies, 50) * 1e3,
            "p99_ms": percentile(s.latencies, 99) * 1e3,
            "max_ms": max(s.latencies, default=0.0) * 1e3,
            "unexpected_samples": s.samples,
        }
    watch_events: dict[str, int] = defaultdict(int)
    watch_reasons: dict[str, int] = defaultdict(int)
    for wt in watchers:
        for k, v in wt.events.items():
            watch_events[k] += v
        for k, v in wt.reasons.items():
            watch_reasons[k] += v
    unexpected = {k: v["unexpected_errors"] for k, v in rpcs.items() if v["unexpected_errors"]}
    wanted = {"AcquireWorker", "ReleaseWorker", "Generate", "GetWorker", "ListWorkers", "SleepWorker", "WakeWorker"}
    if cfg.watchers:
        wanted.add("WatchWorkers")
    checks = {
        "no_unexpected_errors": not unexpected and not bench_errors and not hung,
        "every_rpc_exercised": wanted <= {k for k, v in rpcs.items() if v["calls"]},
        "leases_drained": drained,
        "manager_agrees_with_workers": consistent,
        "idle_timers_fired": metrics.get("idle_sleeps_tier1", 0) + metrics.get("idle_sleeps_tier2", 0) > 0,
        "all_processes_alive": all(alive.values()),
    }
    return {
        "bench": "load",
        "machine": machine(),
        "config": asdict(cfg),
        "elapsed_s": elapsed,
        "total_calls": rec.total_calls,
        "calls_per_s": rec.total_calls / elapsed if elapsed else 0.0,
        "rpcs": rpcs,
        "watch_events": dict(watch_events),
        "watch_state_change_reasons": dict(watch_reasons),
        "manager_metrics": metrics,
        "processes_before": procs_before,
        "processes_after": procs_after,
        "aftermath": {"leases": drained_last, "states": consistent_last},
        "bench_errors": bench_errors,
        "hung_clients": hung,
        "checks": checks,
        "passed": all(checks.values()),
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{'rpc':<24}{'calls':>8}{'ok':>8}  {'expected errors':<28}{'unexpected errors':<28}{'p50 ms':>8}{'p99 ms':>8}"
    ]
    for method, r in result["rpcs"].items():
        exp = ", ".join(f"{k} {v}" for k, v in r["expected_errors"].items()) or "-"
        unx = ", ".join(f"{k} {v}" for k, v in r["unexpected_errors"].items()) or "-"
        lines.append(
            f"{method:<24}{r['calls']:>8}{r['ok']:>8}  {exp:<28}{unx:<28}{r['p50_ms']:>8.1f}{r['p99_ms']:>8.1f}"
        )
    lines.append(f"{result['total_calls']} calls in {result['elapsed_s']:.1f} s ({result['calls_per_s']:.0f}/s)")
    lines.append(f"watch events: {result['watch_events']}")
    lines.append(f"manager metrics: {result['manager_metrics']}")
    lines.append(f"processes before: {result['processes_before']}")
    lines.append(f"processes after:  {result['processes_after']}")
    for k, v in result["checks"].items():
        lines.append(f"check {k}: {'ok' if v else 'FAILED'}")
    for method, r in result["rpcs"].items():
        for s in r["unexpected_samples"]:
            lines.append(f"  unexpected {method}: {s}")
    if not result["checks"]["leases_drained"] or not result["checks"]["manager_agrees_with_workers"]:
        lines.append(f"aftermath: {result['aftermath']}")
    lines.extend(result["bench_errors"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    d = LoadConfig()
    p.add_argument("--clients", type=int, default=d.clients)
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--watchers", type=int, default=d.watchers)
    p.add_argument("--duration", type=float, default=d.duration, help="seconds of load")
    p.add_argument("--max-requests", type=int, default=d.max_requests, help="stop after this many calls (0: none)")
    p.add_argument("--lease-ttl", type=float, default=d.lease_ttl)
    p.add_argument("--abandon-ttl", type=float, default=d.abandon_ttl)
    p.add_argument("--idle-sleep-timeout", type=float, default=d.idle_sleep_timeout)
    p.add_argument("--idle-deep-sleep-timeout", type=float, default=d.idle_deep_sleep_timeout)
    p.add_argument("--phase", type=float, default=d.phase, help="seconds before another worker is left cold")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=None, help="write the result as JSON here")
    a = p.parse_args(argv)
    cfg = LoadConfig(
        clients=a.clients,
        workers=a.workers,
        watchers=a.watchers,
        duration=a.duration,
        max_requests=a.max_requests,
        lease_ttl=a.lease_ttl,
        abandon_ttl=a.abandon_ttl,
        idle_sleep_timeout=a.idle_sleep_timeout,
        idle_deep_sleep_timeout=a.idle_deep_sleep_timeout,
        phase=a.phase,
        seed=a.seed,
    )
    result = run_load(cfg)
    print(format_table(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
