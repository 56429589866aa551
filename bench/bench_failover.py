"""Manager failover on loopback: how long the control plane is away when the leading replica dies.

Why: with ``--db postgresql://…`` several ``memsvc manager`` replicas share one database and one of
them leads (memsvc/manager/replicas.py); docs/operations.md states what a failover costs, and this
is where those numbers come from. It needs a PostgreSQL database it may fill (its ``memsvc_*``
tables are created; nothing else is touched).

Per round, with ``--replicas`` managers and ``--workers`` host-backend workers (synthetic model)
registered, and a lease granted:

1. the leader is ended, at a random point of the followers' poll interval, by one of ``--ways``:
   ``kill`` (SIGKILL: the process dies, its socket closes) or ``session`` (``pg_terminate_backend``
   of its database session: it must notice and stop);
2. from that moment: **leads**, until a replica's health says SERVING for MemoryManagerService;
   **acquire**, until a new AcquireWorker through a channel to every replica (``ipv4:a,b,…``, as
   a client with all addresses dials) is granted; **relearned**, until ListWorkers through that
   channel shows every worker AWAKE (its state re-learned from telemetry);
3. the leases granted before are all still there (checked: a round that loses one fails the run);
4. the ended replica is started again, as a follower, for the next round.

    python -m bench.bench_failover --db postgresql://memsvc@127.0.0.1:5432/bench --rounds 10 --out failover.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import psycopg
from google.protobuf.duration_pb2 import Duration
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import processes
from memsvc.manager.settings import ManagerSettings
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc

SERVICE = manager_pb.DESCRIPTOR.services_by_name["MemoryManagerService"].full_name
LISTENING = re.compile(r"^memsvc (manager|worker \S+) listening on (\S+)$")
BOUND_S = 60.0


def spawn(argv: list[str]) -> tuple[subprocess.Popen[str], str]:
    """Start ``python -m memsvc.cli ARGV``; the process and the address its ``listening on`` line names."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "memsvc.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        found = LISTENING.match(line.strip())
        if found:  # the rest is read and dropped, so that a full pipe never blocks the process
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, found.group(2)
    raise RuntimeError(f"{argv[0]} exited ({proc.wait()}) before listening")


def until(probe: Callable[[], bool], what: str) -> float:
    """Seconds (monotonic) at which ``probe`` first holds, polling every 10 ms; fails after BOUND_S."""
    give_up = time.monotonic() + BOUND_S
    while time.monotonic() < give_up:
        try:
            if probe():
                return time.monotonic()
        except grpc.RpcError:
            pass
        time.sleep(0.01)
    raise RuntimeError(f"{what}: not within {BOUND_S:.0f} s")


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=1)
    return bool(got.status == health_pb2.HealthCheckResponse.SERVING)


class Fleet:
    """The replicas and workers of a run, and a client channel to every replica."""

    def __init__(self, db: str, workers: int) -> None:
        self.db = db
        self.replicas: list[tuple[subprocess.Popen[str], str]] = []
        self.workers: list[subprocess.Popen[str]] = []
        self.names = [f"workers/bench-{i}" for i in range(workers)]
        self.channel: grpc.Channel | None = None
        self.stub: manager_grpc.MemoryManagerServiceStub | None = None

    def replica(self) -> tuple[subprocess.Popen[str], str]:
        return spawn(["manager", "--listen", "127.0.0.1:0", "--db", self.db])

    def start(self, replicas: int) -> None:
        self.replicas.append(self.replica())
        until(lambda: serving(self.replicas[0][1]), "the first replica to lead")
        self.replicas += [self.replica() for _ in range(replicas - 1)]
        for name in self.names:
            proc, _ = spawn(
                [
                    "worker",
                    "--backend",
                    "host",
                    "--model",
                    "synthetic:tiny",
                    "--host-capacity",
                    "64MiB",
                    "--listen",
                    "127.0.0.1:0",
                    "--manager",
                    self.replicas[0][1],
                    "--worker-id",
                    name.removeprefix("workers/"),
                ]
            )
            self.workers.append(proc)
        self.dial()
        until(self.all_awake, "every worker registered and awake")

    def dial(self) -> None:
        """A channel to every replica (``ipv4:a,b,…``), as a client with all the addresses dials."""
        if self.channel is not None:
            self.channel.close()
        self.channel = grpc.insecure_channel("ipv4:" + ",".join(address for _, address in self.replicas))
        self.stub = manager_grpc.MemoryManagerServiceStub(self.channel)

    @property
    def client(self) -> manager_grpc.MemoryManagerServiceStub:
        assert self.stub is not None
        return self.stub

    def all_awake(self) -> bool:
        listed = {w.name: w.state for w in self.client.ListWorkers(manager_pb.ListWorkersRequest(), timeout=2).workers}
        return all(listed.get(n) == common_pb.WORKER_STATE_AWAKE for n in self.names)

    def leases(self) -> set[str]:
        return {x.lease_id for x in self.client.ListLeases(manager_pb.ListLeasesRequest(), timeout=10).leases}

    def acquire(self, name: str, holder: str) -> bool:
        req = manager_pb.AcquireWorkerRequest(
            name=name, holder=holder, ttl=Duration(seconds=3600), request_id=uuid.uuid4().hex
        )
        self.client.AcquireWorker(req, timeout=30)
        return True

    def round(self, r: int, way: str) -> dict[str, Any]:
        """End the leader ``way``; the times (from then) to a new leader, a grant and every worker known."""
        name = self.names[r % len(self.names)]
        self.acquire(name, f"round-{r}")
        before = self.leases()
        index = next(i for i, (_, address) in enumerate(self.replicas) if _quiet(serving, address))
        proc = self.replicas[index][0]
        others = [a for i, (_, a) in enumerate(self.replicas) if i != index]
        # a follower tries for the lead every poll interval from its own start, and the one just started
        # would otherwise be ended at the same phase every round: end the leader at a random phase instead
        time.sleep(random.uniform(0, ManagerSettings().leader_poll_interval))
        ended = time.monotonic()
        if way == "kill":
            proc.kill()
        else:
            with psycopg.connect(self.db, autocommit=True) as db:
                db.execute("SELECT pg_terminate_backend(pid) FROM memsvc_leader")
        leads = until(lambda: any(_quiet(serving, a) for a in others), "a follower to take over")
        acquire = until(lambda: self.acquire(name, "probe"), "an AcquireWorker through the new leader")
        relearned = until(self.all_awake, "every worker's state re-learned")
        lost = before - self.leases()
        if lost:
            raise RuntimeError(f"round {r}: leases lost in the failover: {sorted(lost)}")
        exit_code = proc.wait(timeout=BOUND_S)
        self.replicas[index] = self.replica()  # back, as a follower
        self.dial()
        return {
            "way": way,
            "leads_s": leads - ended,
            "acquire_s": acquire - ended,
            "relearned_s": relearned - ended,
            "leases_kept": len(before),
            "ended_exit_code": exit_code,
        }

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        for proc in self.workers:
            processes.stop(proc, 30)
        for proc, _ in self.replicas:
            processes.stop(proc, 30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", required=True, help="postgresql:// URL of a database the bench may fill")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--ways", default="kill,session", help="how the leader is ended, in turn: kill, session")
    ap.add_argument("--out", default="failover.json")
    args = ap.parse_args(argv)
    ways = args.ways.split(",")
    fleet = Fleet(args.db, args.workers)
    rounds: list[dict[str, Any]] = []
    try:
        fleet.start(args.replicas)
        for r in range(args.rounds):
            x = fleet.round(r, ways[r % len(ways)])
            rounds.append(x)
            print(
                f"round {r} ({x['way']}): leads {x['leads_s']:.3f} s, acquire {x['acquire_s']:.3f} s, re-learned "
                f"{x['relearned_s']:.3f} s, {x['leases_kept']} leases kept, exit {x['ended_exit_code']}",
                flush=True,
            )
    finally:
        fleet.stop()

    keys = ("leads_s", "acquire_s", "relearned_s")
    summary = {
        way: {
            **{key: statistics.median(x[key] for x in rounds if x["way"] == way) for key in keys},
            "acquire_max_s": max(x["acquire_s"] for x in rounds if x["way"] == way),
        }
        for way in ways
        if any(x["way"] == way for x in rounds)
    }
    result = {
        "bench": "failover",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": os.environ.get("MEMSVC_COMMIT") or _git_commit(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "poll_interval_s": ManagerSettings().leader_poll_interval,
        "replicas": args.replicas,
        "workers": args.workers,
        "rounds": rounds,
        "median": summary,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("\n| ended by | a replica leads | AcquireWorker granted (max) | every worker re-learned |")
    print("| --- | --- | --- | --- |")
    for way, med in summary.items():
        print(
            f"| {way} | {med['leads_s']:.2f} s | {med['acquire_s']:.2f} s ({med['acquire_max_s']:.2f} s) "
            f"| {med['relearned_s']:.2f} s |"
        )
    return 0


def _quiet(probe: Callable[[str], bool], address: str) -> bool:
    try:
        return probe(address)
    except grpc.RpcError:
        return False


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


if __name__ == "__main__":
    sys.exit(main())
