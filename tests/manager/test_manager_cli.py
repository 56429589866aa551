"""The operator commands against a real manager: ``memsvc status``, ``memsvc sleep``, ``memsvc wake``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf.duration_pb2 import Duration
from managerproc import Cluster, ManagerProcess, get, tags, wait_state
from workerproc import REPO_ROOT

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb


@pytest.fixture(scope="module")
def mgr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagerProcess]:
    cl = Cluster(tmp_path_factory.mktemp("manager-cli"))
    try:
        mp = cl.manager()
        cl.workers_up(mp, ["cli-a", "cli-b"])
        yield mp
    finally:
        cl.close()


def memsvc(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memsvc.cli", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def test_status_lists_every_worker_with_its_state(mgr: ManagerProcess) -> None:
    r = memsvc("status", "--manager", mgr.address)
    assert r.returncode == 0, r.stderr
    lines = {ln.split("│")[1].strip(): ln for ln in r.stdout.splitlines() if ln.count("│") > 2}
    assert "cli-a" in lines and "cli-b" in lines, r.stdout
    assert "awake" in lines["cli-a"] and get(mgr.stub, "cli-a").address in lines["cli-a"]


def test_status_shows_memory_in_human_units_and_json_for_machines(mgr: ManagerProcess) -> None:
    """The table's sizes carry their IEC unit (a tiny worker is not "0.00 GiB"); --json is the
    ListWorkers response in the proto's JSON mapping, byte counts exact."""
    import json

    r = memsvc("status", "--manager", mgr.address)
    assert r.returncode == 0, r.stderr
    row = next(ln for ln in r.stdout.splitlines() if "cli-a" in ln)
    assert re.search(r"\d(\.\d+)? (B|KiB|MiB|GiB)", row) and "0.00" not in row, row
    r = memsvc("status", "--json", "--manager", mgr.address)
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)
    by_name = {x["name"]: x for x in listed["workers"]}
    assert set(by_name) >= {"workers/cli-a", "workers/cli-b"}
    a = get(mgr.stub, "cli-a")
    assert by_name["workers/cli-a"]["state"] == "WORKER_STATE_AWAKE"
    weights = next(t for t in by_name["workers/cli-a"]["status"]["tags"] if t["tag"] == "weights")
    assert int(weights["mapped_bytes"]) == next(t.mapped_bytes for t in a.status.tags if t.tag == "weights")


def test_status_reads_the_manager_address_from_the_environment(mgr: ManagerProcess) -> None:
    r = memsvc("status", env={"MEMSVC_MANAGER": mgr.address})
    assert r.returncode == 0, r.stderr
    assert "cli-a" in r.stdout and "cli-b" in r.stdout


def test_sleep_and_wake_change_the_state(mgr: ManagerProcess) -> None:
    r = memsvc("sleep", "cli-a", "--manager", mgr.address)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "workers/cli-a" in r.stdout and "asleep" in r.stdout
    wk = wait_state(mgr.stub, "cli-a", common_pb.WORKER_STATE_ASLEEP)
    assert tags(wk)["weights"].state == common_pb.TAG_STATE_OFFLOADED  # the policy's tier-1 actions
    assert get(mgr.stub, "cli-b").state == common_pb.WORKER_STATE_AWAKE  # only the named worker

    r = memsvc("status", "--manager", mgr.address)
    assert r.returncode == 0 and "asleep" in r.stdout

    r = memsvc("wake", "workers/cli-a", "--manager", mgr.address)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "awake" in r.stdout
    wait_state(mgr.stub, "cli-a", common_pb.WORKER_STATE_AWAKE)

    r = memsvc("sleep", "cli-b", "--level", "2", "--manager", mgr.address)
    assert r.returncode == 0, r.stdout + r.stderr
    wk = wait_state(mgr.stub, "cli-b", common_pb.WORKER_STATE_ASLEEP)
    assert tags(wk)["weights"].state == common_pb.TAG_STATE_DISCARDED
    assert memsvc("wake", "cli-b", "--manager", mgr.address).returncode == 0
    wait_state(mgr.stub, "cli-b", common_pb.WORKER_STATE_AWAKE)


@pytest.mark.parametrize(
    "args, code",
    [
        (["sleep", "nobody"], "NOT_FOUND"),
        (["wake", "nobody"], "NOT_FOUND"),
        (["sleep", "a/b"], "INVALID_ARGUMENT"),
        (["wake", "cli-a", "--tags", "no-such-tag"], "INVALID_ARGUMENT"),
    ],
)
def test_a_refused_command_exits_1_with_the_status_and_changes_nothing(
    mgr: ManagerProcess, args: list[str], code: str
) -> None:
    before = [get(mgr.stub, w).state for w in ("cli-a", "cli-b")]
    r = memsvc(*args, "--manager", mgr.address)
    assert r.returncode == 1, r.stdout + r.stderr
    assert code in r.stdout and "Traceback" not in r.stdout + r.stderr
    assert [get(mgr.stub, w).state for w in ("cli-a", "cli-b")] == before


def test_sleep_and_wake_of_a_worker_already_there_are_done_not_errors(mgr: ManagerProcess) -> None:
    """As vLLM's /wake_up and Ollama's loads are: the RPC still refuses (FAILED_PRECONDITION), the
    command sees the worker is where it asked and exits 0 saying so, changing nothing."""
    r = memsvc("wake", "cli-a", "--manager", mgr.address)
    assert r.returncode == 0 and "workers/cli-a: already awake" in r.stdout, r.stdout + r.stderr
    r = memsvc("wake", "cli-a", "--tags", "weights", "--manager", mgr.address)
    assert r.returncode == 0 and "already awake" in r.stdout, r.stdout + r.stderr
    assert memsvc("sleep", "cli-a", "--manager", mgr.address).returncode == 0
    wait_state(mgr.stub, "cli-a", common_pb.WORKER_STATE_ASLEEP)
    try:
        before = get(mgr.stub, "cli-a")
        r = memsvc("sleep", "cli-a", "--manager", mgr.address)
        assert r.returncode == 0 and "workers/cli-a: already asleep" in r.stdout, r.stdout + r.stderr
        after = get(mgr.stub, "cli-a")
        assert after.state == common_pb.WORKER_STATE_ASLEEP and tags(after) == tags(before)
    finally:
        assert memsvc("wake", "cli-a", "--manager", mgr.address).returncode == 0
        wait_state(mgr.stub, "cli-a", common_pb.WORKER_STATE_AWAKE)


def test_sleep_of_a_leased_worker_is_refused(mgr: ManagerProcess) -> None:
    req = manager_pb.AcquireWorkerRequest(name="workers/cli-b", ttl=Duration(seconds=60))
    lease = mgr.stub.AcquireWorker(req, timeout=30).lease
    try:
        r = memsvc("sleep", "cli-b", "--manager", mgr.address)
        assert r.returncode == 1 and "FAILED_PRECONDITION" in r.stdout, r.stdout + r.stderr
        assert get(mgr.stub, "cli-b").state == common_pb.WORKER_STATE_AWAKE
    finally:
        mgr.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease.lease_id), timeout=10)


def test_commands_without_a_reachable_manager_fail_cleanly(tmp_path: Path) -> None:
    r = memsvc("status", "--manager", "127.0.0.1:1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "UNAVAILABLE" in r.stdout and "Traceback" not in r.stdout + r.stderr


def test_leases_lists_them_and_release_ends_one(mgr: ManagerProcess) -> None:
    """An operator who lost a lease id finds it with `memsvc leases` and ends it with `memsvc release`
    instead of waiting out its TTL; ListLeases pages and filters by worker."""
    import json

    held = [
        mgr.stub.AcquireWorker(
            manager_pb.AcquireWorkerRequest(name=f"workers/{w}", holder=f"ops-{w}", ttl=Duration(seconds=600)),
            timeout=60,
        ).lease
        for w in ("cli-a", "cli-b")
    ]
    try:
        r = memsvc("leases", "--manager", mgr.address)
        assert r.returncode == 0, r.stderr
        for lease in held:
            assert lease.lease_id in r.stdout and lease.holder in r.stdout, r.stdout
        r = memsvc("leases", "--worker", "cli-a", "--json", "--manager", mgr.address)
        only_a = json.loads(r.stdout)["leases"]
        assert [x["lease_id"] for x in only_a] == [held[0].lease_id], only_a
        first = mgr.stub.ListLeases(manager_pb.ListLeasesRequest(page_size=1), timeout=10)
        assert len(first.leases) == 1 and first.next_page_token
        rest = mgr.stub.ListLeases(
            manager_pb.ListLeasesRequest(page_size=1, page_token=first.next_page_token), timeout=10
        )
        assert {first.leases[0].lease_id, rest.leases[0].lease_id} == {x.lease_id for x in held}
        assert not rest.next_page_token
        r = memsvc("release", held[0].lease_id, "--manager", mgr.address)
        assert r.returncode == 0 and "released" in r.stdout, r.stdout + r.stderr
        assert get(mgr.stub, "cli-a").lease_count == 0
        r = memsvc("release", held[0].lease_id, "--manager", mgr.address)
        assert r.returncode == 1 and "NOT_FOUND" in r.stdout, r.stdout
    finally:
        for lease in held[1:]:
            mgr.stub.ReleaseWorker(manager_pb.ReleaseWorkerRequest(lease_id=lease.lease_id), timeout=10)


def test_status_of_a_manager_without_workers_says_so(tmp_path: Path) -> None:
    """Not an empty table: one line a newcomer can read."""
    cl = Cluster(tmp_path)
    try:
        alone = cl.manager()
        r = memsvc("status", "--manager", alone.address)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.strip() == f"no workers are registered with the manager at {alone.address}", r.stdout
    finally:
        cl.close()


def test_stale_registrations_of_stopped_workers_are_pruned_from_the_cli(tmp_path: Path) -> None:
    """A stopped worker stays registered, UNAVAILABLE, forever (forget_after 0 = never), its model
    listed by the gateway: `memsvc deregister` forgets one, `memsvc prune --unavailable` every
    unreachable one (not seen for --older-than), and a reachable worker is left alone."""
    cl = Cluster(tmp_path)
    try:
        mp = cl.manager()
        gone_a, gone_b, alive = cl.workers_up(mp, ["gone-a", "gone-b", "alive"])
        for wp in (gone_a, gone_b):
            wp.kill()
            wait_state(mp.stub, wp.worker_id, common_pb.WORKER_STATE_UNAVAILABLE)
        addr = ["--manager", mp.address]

        def names() -> list[str]:
            return [x.name for x in mp.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers]

        assert names() == ["workers/alive", "workers/gone-a", "workers/gone-b"]
        # bad input is a usage error and forgets nothing
        for bad in (["prune"], ["prune", "--unavailable", "--older-than", "soon"], ["deregister"]):
            r = memsvc(*bad, *addr)
            assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        r = memsvc("deregister", "nobody", *addr)
        assert r.returncode == 1 and "NOT_FOUND" in r.stdout, r.stdout + r.stderr
        r = memsvc("prune", "--unavailable", "--older-than", "1h", *addr)
        assert r.returncode == 0 and "nothing to prune" in r.stdout, r.stdout + r.stderr
        assert len(names()) == 3

        r = memsvc("deregister", "gone-a", *addr)
        assert r.returncode == 0 and "deregistered workers/gone-a" in r.stdout, r.stdout + r.stderr
        assert names() == ["workers/alive", "workers/gone-b"]
        r = memsvc("prune", "--unavailable", *addr)
        assert r.returncode == 0 and "deregistered workers/gone-b" in r.stdout, r.stdout + r.stderr
        assert "alive" not in r.stdout
        assert names() == ["workers/alive"]
        assert get(mp.stub, "alive").state == common_pb.WORKER_STATE_AWAKE
        assert alive.proc is not None and alive.proc.poll() is None
    finally:
        cl.close()
