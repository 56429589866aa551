"""A real ``memsvc worker`` process for service-level tests.

:class:`WorkerProcess` starts ``python -m memsvc.cli worker`` (host backend, port 0 unless the
arguments say otherwise), reads the bound address from the "listening on" line of its stdout, waits
for the "ready" line, and hands out a gRPC channel and stub to it. ``stop()`` is the graceful path
(SIGTERM, wait, exit code 0); leaving the ``with`` block, or ``kill()``, ends the process whatever
happened in between, so a failing test never leaks a worker.

    with WorkerProcess(["--model", "synthetic:tiny"]) as wp:
        wp.stub.GetWorkerStatus(w.GetWorkerStatusRequest())
        wp.stop()
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from memsvc.v1 import model_worker_service_pb2_grpc as w_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT = 120.0
STOP_TIMEOUT = 60.0

_LISTENING = re.compile(r"^memsvc worker (?P<id>\S+) listening on (?P<address>\S+)$")
_READY = re.compile(r"^memsvc worker (?P<id>\S+) ready: ")


class WorkerStartError(RuntimeError):
    """The worker exited or did not report "ready" in time; the message carries its output."""


class WorkerProcess:
    """One worker process. ``args`` are the flags after ``memsvc worker``.

    ``--listen 127.0.0.1:0`` and ``--backend host`` are added unless ``args`` names them; ``--model``
    defaults to the CLI's own default (``synthetic:tiny``).
    """

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
        self.argv = [sys.executable, "-m", "memsvc.cli", "worker", *args]
        self.ready_timeout = ready_timeout
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self.worker_id = ""
        self.stdout_lines: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader: threading.Thread | None = None
        self._stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")  # noqa: SIM115
        self._channel: grpc.Channel | None = None
        self._stub: w_grpc.ModelWorkerServiceStub | None = None

    # ---- lifecycle ----
    def start(self) -> WorkerProcess:
        """Start the process and return once it printed "ready" (WorkerStartError otherwise)."""
        self.proc = subprocess.Popen(
            self.argv,
            cwd=REPO_ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            bufsize=1,
        )
        self._reader = threading.Thread(target=self._read_stdout, name="worker-stdout", daemon=True)
        self._reader.start()
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.stdout_lines.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerStartError(self._failure(f"no 'ready' line within {self.ready_timeout:.0f} s"))
            try:
                line = self._lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                assert self.proc is not None
                rc = self.proc.wait(timeout=STOP_TIMEOUT)
                raise WorkerStartError(self._failure(f"worker exited with code {rc} before 'ready'"))
            m = _LISTENING.match(line)
            if m:
                self.address, self.worker_id = m["address"], m["id"]
                continue
            if _READY.match(line):
                if not self.address:
                    raise WorkerStartError(self._failure("'ready' came before a 'listening on' line"))
                return

    def stderr_text(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        text = self._stderr.read()
        self._stderr.seek(0, os.SEEK_END)
        return text

    def _failure(self, what: str) -> str:
        stdout = "\n".join(self.stdout_lines)
        return f"{what}\ncommand: {self.argv}\n--- stdout ---\n{stdout}\n--- stderr ---\n{self.stderr_text()[-8000:]}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """Send SIGTERM and return at once (the channel stays open, so in-flight calls can finish)."""
        assert self.proc is not None, "worker was never started"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = STOP_TIMEOUT) -> int:
        """Wait for the process to exit; its exit code."""
        assert self.proc is not None, "worker was never started"
        rc = self.proc.wait(timeout=timeout)
        if self._reader is not None:
            self._reader.join(timeout=timeout)
        return rc

    def stop(self, timeout: float = STOP_TIMEOUT) -> str:
        """SIGTERM, wait for the exit, assert exit code 0; returns everything the worker printed on stdout."""
        assert self.proc is not None, "worker was never started"
        self.close_channel()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(self._failure(f"worker did not exit within {timeout:.0f} s of SIGTERM")) from None
        if self._reader is not None:
            self._reader.join(timeout=timeout)
        assert rc == 0, self._failure(f"worker exited with code {rc} after SIGTERM")
        return "\n".join(self.stdout_lines)

    def kill(self) -> None:
        """End the process now (SIGKILL) if it still runs; always safe to call."""
        self.close_channel()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_TIMEOUT)
        if self.proc is not None and self.proc.stdout is not None:
            if self._reader is not None:
                self._reader.join(timeout=5)
            with contextlib.suppress(Exception):
                self.proc.stdout.close()

    def close(self) -> None:
        self.kill()
        self._stderr.close()

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---- clients ----
    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            assert self.address, "worker is not ready"
            self._channel = grpc.insecure_channel(self.address)
        return self._channel

    @property
    def stub(self) -> w_grpc.ModelWorkerServiceStub:
        if self._stub is None:
            self._stub = w_grpc.ModelWorkerServiceStub(self.channel)
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
