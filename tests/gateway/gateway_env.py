"""What the gateway's suites share: the served model's name and a prompt, a manager and a worker
serving the tiny text model (tests/hf_models.py) as that name, and a poll for a condition. Import
``gateway_env`` to use them (the suites in this directory do)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from hf_models import text_model
from managerproc import ManagerProcess
from workerproc import WorkerProcess

from memsvc.v1 import memory_manager_service_pb2 as manager_pb

MODEL = "text-model"
PROMPT = "the quick brown fox"
T = TypeVar("T")


def wait_for(get: Callable[[], T], ok: Callable[[T], bool], what: str, timeout: float = 30.0) -> T:
    """Call ``get`` until ``ok(value)``; the value, or AssertionError with the last one after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = get()
        if ok(value):
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}; last: {value!r}"
        time.sleep(0.05)


@contextlib.contextmanager
def text_model_served(root: Path, worker_id: str) -> Iterator[tuple[ManagerProcess, WorkerProcess, Path]]:
    """A manager and a worker serving :func:`text_model` as MODEL (registered), in ``root``."""
    path, _ = text_model(root)
    mp = ManagerProcess(root / "manager.db", ["--idle-sleep-timeout", "0"]).start()
    try:
        with WorkerProcess(["--model", str(path), "--manager", mp.address, "--worker-id", worker_id]) as wp:
            wait_for(
                lambda: mp.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers,
                lambda ws: any(x.status.model.served_model_name == MODEL for x in ws),
                "registration",
            )
            yield mp, wp, path
    finally:
        mp.kill()
