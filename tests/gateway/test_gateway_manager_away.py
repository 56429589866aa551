"""The gateway while the manager is away (memsvc/gateway/backends.py), with real processes: a manager on
a fixed address and SQLite file (killed, then started again on both), two workers, ``memsvc gateway``
and the OpenAI SDK.

- The model whose worker is awake is served, streamed and not, without a lease (each request sent so
  counted in ``memsvc_gateway_unleased``); /v1/models lists both models from the last list; /readyz says
  ``degraded``.
- The model whose worker sleeps gets a 503 with Retry-After: only the manager wakes it. So does the
  awake one once its worker went to sleep behind the gateway's back (a direct Sleep).
- Once the manager is back, requests take leases again, and none is left over or counted twice.

The same with manager replicas on PostgreSQL: a gateway dialling a follower whose leader died (and no
replica took over yet) meets NO_LEADER, which it treats as the manager being away; once a replica
leads, the follower forwards to it and leases resume.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from gatewayproc import GatewayProcess
from managerproc import ManagerProcess, wait_for
from upproc import free_port
from workerproc import WorkerProcess

from memsvc.manager.store_postgres import LEADER_LOCK
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import model_worker_service_pb2 as worker_pb

openai = pytest.importorskip("openai")


class Stack:
    """A manager (on ``db``: by default a SQLite file), two workers and a gateway, all dialling the manager."""

    def __init__(self, tmp_path: Path, db: str | Path | None = None, args: Sequence[str] = ()) -> None:
        self.db = db or tmp_path / "manager.db"
        self.listen = f"127.0.0.1:{free_port()}"
        self.manager = ManagerProcess(self.db, args, listen=self.listen).start()
        self.others: list[ManagerProcess] = []
        """Other replicas on the same database (the test's), ended with the stack."""
        self.workers = {
            name: WorkerProcess(["--manager", self.manager.address, "--worker-id", name, "--served-model-name", name])
            for name in ("alpha", "beta")
        }
        for wp in self.workers.values():
            wp.start()
        self.gateway = GatewayProcess(self.manager.address).start()
        self.client = openai.OpenAI(base_url=f"{self.gateway.url}/v1", api_key="unused", max_retries=0, timeout=60)
        wait_for(
            self.states,
            lambda s: s == {"alpha": common_pb.WORKER_STATE_AWAKE, "beta": common_pb.WORKER_STATE_AWAKE},
            what="both registered awake",
            timeout=60,
        )

    def states(self) -> dict[str, int]:
        ws = self.manager.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers
        return {x.name.removeprefix("workers/"): x.state for x in ws if x.status.model.served_model_name}

    def leases(self) -> int:
        return len(self.manager.stub.ListLeases(manager_pb.ListLeasesRequest(), timeout=10).leases)

    def answer(self, model: str, stream: bool = False) -> tuple[int, str, str | None]:
        """(HTTP status, the text or the error message, Retry-After) of a completion."""
        try:
            if stream:
                chunks = self.client.completions.create(model=model, prompt="a b", max_tokens=4, stream=True)
                return 200, "".join(ch.choices[0].text for ch in chunks if ch.choices), None
            r = self.client.completions.create(model=model, prompt="a b", max_tokens=4)
            return 200, r.choices[0].text, None
        except openai.APIStatusError as exc:
            return exc.status_code, str(exc.message), exc.response.headers.get("retry-after")

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(f"{self.gateway.url}{path}", timeout=30) as r:
                body = r.read().decode()
                return r.status, json.loads(body) if path != "/metrics" else body
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read().decode())

    def unleased(self, model: str) -> float:
        _, text = self.get("/metrics")
        for line in text.splitlines():
            if line.startswith(f'memsvc_gateway_unleased_total{{model="{model}"}}'):
                return float(line.split()[-1])
        return 0.0

    def serves_without_the_manager(self) -> None:
        """alpha (awake) is answered without a lease, streamed and not; beta (asleep) gets a 503 with
        Retry-After; /readyz says degraded."""
        for stream in (False, True):
            status, text, _ = self.answer("alpha", stream)
            assert status == 200 and text, (stream, status, text)
        assert self.unleased("alpha") == 2
        status, message, retry = self.answer("beta")
        assert status == 503 and retry is not None and int(retry) >= 1, (status, message, retry)
        code, ready = self.get("/readyz")
        assert code == 200 and ready["status"] == "degraded", ready

    def close(self) -> None:
        self.gateway.kill()
        for wp in self.workers.values():
            wp.kill()
        for mp in [self.manager, *self.others]:
            mp.kill()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.close()


def test_awake_models_are_served_without_the_manager_and_leases_resume_when_it_is_back(stack: Stack) -> None:
    s = stack
    s.manager.stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/beta"), timeout=60)
    awake = s.answer("alpha")
    assert awake[0] == 200 and awake[1], awake  # the gateway's list of workers: alpha awake, beta asleep
    assert s.get("/readyz") == (200, {"status": "ok"})
    assert s.leases() == 0

    s.manager.kill()
    s.serves_without_the_manager()
    assert sorted(x["id"] for x in s.get("/v1/models")[1]["data"]) == ["alpha", "beta"]

    # alpha's worker put to sleep behind the gateway's back: a 503 too, not the worker's 400
    alpha = s.workers["alpha"]
    alpha.stub.Sleep(worker_pb.SleepRequest(level=common_pb.SLEEP_LEVEL_1), timeout=60)
    status, message, retry = s.answer("alpha")
    assert status == 503 and "asleep" in message and retry is not None, (status, message)
    alpha.stub.WakeUp(worker_pb.WakeUpRequest(), timeout=60)
    assert s.answer("alpha")[0] == 200

    s.manager = ManagerProcess(s.db, listen=s.listen).start()  # on the same address and database
    wait_for(s.states, lambda st: st.get("alpha") == common_pb.WORKER_STATE_AWAKE, what="alpha known again", timeout=60)
    assert s.leases() == 0, "a request served while the manager was away left a lease"
    # the gateway's next call reaches it (its channel reconnects within MANAGER_RECONNECT_MAX_MS)
    wait_for(lambda: s.get("/readyz"), lambda r: r == (200, {"status": "ok"}), what="the gateway ready", timeout=60)
    for model in ("beta", "alpha"):  # beta woken by its lease, through the manager again
        status, text, _ = s.answer(model, stream=True)
        assert status == 200 and text, (model, status, text)
    assert s.unleased("alpha") == 4 and s.unleased("beta") == 0  # the one that met it asleep included
    wait_for(s.leases, lambda n: n == 0, what="every lease given back")


def test_a_gateway_on_a_follower_serves_awake_models_while_no_replica_leads(tmp_path: Path, pg_url: str) -> None:
    leader = ManagerProcess(pg_url).start()
    wait_for(leader.leads, bool, what="the first replica to lead")
    slow = tmp_path / "slow.toml"  # this follower tries for the lead only when a call finds no leader
    slow.write_text("[manager]\nleader_poll_interval = 3600\n")
    s = Stack(tmp_path, db=pg_url, args=["--config", str(slow)])  # the gateway and workers dial the follower
    s.others.append(leader)
    holder = psycopg.connect(pg_url, autocommit=True)
    try:
        s.manager.stub.SleepWorker(manager_pb.SleepWorkerRequest(name="workers/beta"), timeout=60)
        assert s.answer("alpha")[0] == 200 and s.leases() == 0

        with ThreadPoolExecutor(1) as pool:  # the test's session queues for the leader lock, and gets it
            taken = pool.submit(holder.execute, "SELECT pg_advisory_lock(%s, %s)", LEADER_LOCK)
            leader.kill()  # as the leader's session ends: no replica can lead now
            taken.result(timeout=60)
        s.serves_without_the_manager()  # the follower answers NO_LEADER

        holder.close()  # the lock is free: the follower (at a call that finds no leader) or a new replica leads
        again = ManagerProcess(pg_url).start()
        s.others.append(again)
        wait_for(lambda: again.leads() or s.manager.leads(), bool, what="a replica to lead", timeout=60)
        wait_for(
            s.states, lambda st: st.get("alpha") == common_pb.WORKER_STATE_AWAKE, what="alpha known again", timeout=60
        )
        wait_for(lambda: s.get("/readyz"), lambda r: r == (200, {"status": "ok"}), what="the gateway ready", timeout=60)
        for model in ("beta", "alpha"):
            status, text, _ = s.answer(model, stream=True)
            assert status == 200 and text, (model, status, text)
        assert s.unleased("alpha") == 2 and s.unleased("beta") == 0
        wait_for(s.leases, lambda n: n == 0, what="every lease given back")
    finally:
        holder.close()
        s.close()
