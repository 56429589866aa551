"""A model whose worker stopped is "unavailable" (503 with Retry-After, naming it), not "does not
exist" (404): while the manager still knows the worker's model, and after a restart of the manager
that has not heard from the worker since (its registration is kept, its model unknown)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gateway_env import wait_for
from gatewayproc import GatewayProcess
from managerproc import ManagerProcess
from upproc import free_port
from workerproc import WorkerProcess

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb

openai = pytest.importorskip("openai")
MODEL = "synthetic:tiny"


def answer(client: Any) -> tuple[int, str, str | None]:
    """(HTTP status, error message, Retry-After) of a completion for MODEL."""
    try:
        client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
    except openai.APIStatusError as exc:
        return exc.status_code, str(exc.message), exc.response.headers.get("retry-after")
    return 200, "", None


def test_a_stopped_workers_model_is_unavailable_not_missing(tmp_path: Path) -> None:
    listen = f"127.0.0.1:{free_port()}"
    mp = ManagerProcess(tmp_path / "manager.db", listen=listen).start()
    wp = WorkerProcess(["--manager", mp.address, "--worker-id", "gone"]).start()
    gw = GatewayProcess(mp.address).start()
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        workers = lambda: mp.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers  # noqa: E731
        wait_for(
            workers, lambda ws: any(x.status.model.served_model_name == MODEL for x in ws), "registration", timeout=60
        )
        assert answer(client)[0] == 200
        wp.kill()
        wait_for(workers, lambda ws: ws[0].state == common_pb.WORKER_STATE_UNAVAILABLE, "the worker unavailable")
        status, message, retry = answer(client)
        assert (status, retry) == (503, "2") and MODEL in message and "unavailable" in message, message
        # a manager that restarts keeps the registration but not the model it never heard since
        mp.kill()
        mp = ManagerProcess(tmp_path / "manager.db", listen=listen).start()
        # (503 too while the gateway cannot reach the manager: wait for the new manager's answer)
        status, message, retry = wait_for(
            lambda: answer(client),
            lambda a: "registered worker" in a[1],
            "the gateway to reach the new manager",
            timeout=90,
        )
        assert (status, retry) == (503, "2") and MODEL in message and "1 registered worker" in message, message
        # once the stale registration is pruned, the model does not exist
        mp.stub.DeregisterWorker(manager_pb.DeregisterWorkerRequest(name="workers/gone"), timeout=10)
        assert answer(client)[0] == 404
    finally:
        gw.kill()
        wp.kill()
        mp.kill()
