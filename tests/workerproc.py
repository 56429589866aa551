"""A real ``memsvc worker`` process for service-level tests.

:class:`WorkerProcess` starts ``python -m memsvc.cli worker`` (host backend, port 0 unless the
arguments say otherwise), reads the bound address from the "listening on" line of its stdout, waits
for the "ready" line, and hands out a gRPC channel and stub to it. ``stop()`` is the graceful path
(SIGTERM, wait, exit code 0); leaving the ``with`` block, or ``kill()``, ends the process whatever
happened in between, so a failing test never leaks a worker.

    with WorkerProcess(["--model", "synthetic:tiny"]) as wp:
        wp.stub.GetWorkerStatus(worker_pb.GetWorkerStatusRequest())
        wp.stop()
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Sequence
from typing import Any

import grpc
from childproc import REPO_ROOT, Proc, ProcError
from grpc_health.v1 import health_pb2_grpc

from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc

READY_TIMEOUT = 120.0
STOP_TIMEOUT = 60.0

_LISTENING = re.compile(r"^memsvc worker (?P<id>\S+) listening on (?P<address>\S+)$")
_READY = re.compile(r"^memsvc worker (?P<id>\S+) ready: ")


class WorkerStartError(ProcError):
    """The worker exited or did not report "ready" in time; the message carries its output."""


class WorkerProcess(Proc):
    """One worker process. ``args`` are the flags after ``memsvc worker``.

    ``--listen 127.0.0.1:0`` and ``--backend host`` are added unless ``args`` names them; ``--model``
    defaults to the CLI's own default (``synthetic:tiny``).
    """

    stop_timeout = STOP_TIMEOUT

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        ready_timeout: float = READY_TIMEOUT,
        env: dict[str, str] | None = None,
    ) -> None:
        args = list(args)
        if "--listen" not in args:
            args += ["--listen", "127.0.0.1:0"]
        if "--backend" not in args:
            args += ["--backend", "host"]
        argv = [sys.executable, "-m", "memsvc.cli", "worker", *args]
        super().__init__(argv, env={**os.environ, **(env or {})}, name="worker", new_session=False)
        self.ready_timeout = ready_timeout
        self.address = ""
        self.worker_id = ""
        self._channel: grpc.Channel | None = None
        self._stub: worker_grpc.ModelWorkerServiceStub | None = None

    # ---- lifecycle ----
    def start(self) -> WorkerProcess:
        """Start the process and return once it printed "ready" (WorkerStartError otherwise)."""
        super().start()
        try:
            listening, ready = self.wait_lines([_LISTENING, _READY], self.ready_timeout, WorkerStartError, "'ready'")
            if self.lines.index(listening.string) > self.lines.index(ready.string):
                raise WorkerStartError(self.failure("'ready' came before a 'listening on' line"))
            self.address, self.worker_id = listening["address"], listening["id"]
        except BaseException:
            self.kill()
            raise
        return self

    def terminate(self) -> None:
        """Send SIGTERM and return at once (the channel stays open, so in-flight calls can finish)."""
        assert self.proc is not None, "worker was never started"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = STOP_TIMEOUT) -> str:
        """SIGTERM, wait for the exit, assert exit code 0; returns everything the worker printed on stdout."""
        self.close_channel()
        try:
            rc = self.signal_and_wait(signal.SIGTERM, timeout)
        except ProcError as exc:
            raise AssertionError(str(exc)) from None
        assert rc == 0, self.failure(f"worker exited with code {rc} after SIGTERM")
        return "\n".join(self.lines)

    def kill(self) -> None:
        """End the process now (SIGKILL) if it still runs; always safe to call."""
        self.close_channel()
        super().kill()

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- clients ----
    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            assert self.address, "worker is not ready"
            self._channel = grpc.insecure_channel(self.address)
        return self._channel

    @property
    def stub(self) -> worker_grpc.ModelWorkerServiceStub:
        if self._stub is None:
            self._stub = worker_grpc.ModelWorkerServiceStub(self.channel)
        return self._stub

    @property
    def health(self) -> Any:
        """A grpc.health.v1.Health stub on the same channel."""
        return health_pb2_grpc.HealthStub(self.channel)

    def new_channel(self) -> grpc.Channel:
        """A separate channel (its own connection), e.g. for calls that must run concurrently; caller closes."""
        assert self.address, "worker is not ready"
        return grpc.insecure_channel(self.address)

    def close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._stub = None


__all__ = ["REPO_ROOT", "WorkerProcess", "WorkerStartError"]
