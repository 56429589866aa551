"""One child process for the tests, the way every wrapper needs it: stdout read line by line on a
thread (so a test can wait for "listening on" / "ready" lines, and read all of it afterwards), stderr
kept in a temporary file for failure messages, and an end that is always safe to call.

:class:`Proc` is the base of :class:`workerproc.WorkerProcess` and :class:`managerproc.ManagerProcess`,
and runs ``memsvc up`` and the compose services' commands in :mod:`upproc`. With ``new_session`` it
runs in its own session, so ``kill()`` ends it *and* the children it started (``memsvc up`` starts a
manager and a worker) through its process group.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 120.0
STOP_TIMEOUT = 60.0


class ProcError(RuntimeError):
    """A process exited or did not print what was expected in time; the message carries its output."""


class Proc:
    """One child process (and, with ``new_session``, everything it starts)."""

    stop_timeout = STOP_TIMEOUT

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path = REPO_ROOT,
        name: str = "",
        new_session: bool = True,
        stdin: bool = False,
    ) -> None:
        self.argv = list(argv)
        self.stdin = stdin
        """A pipe for :meth:`write_stdin` (else /dev/null)."""
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.name = name or Path(self.argv[0]).name
        self.new_session = new_session
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        """Every stdout line so far (all of them once :meth:`wait` returned)."""
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader: threading.Thread | None = None
        self._stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")  # noqa: SIM115

    def start(self) -> Proc:
        self.proc = subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.PIPE if self.stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            bufsize=1,
            start_new_session=self.new_session,
        )
        self._reader = threading.Thread(target=self._read, name=f"{self.name}-stdout", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_lines(
        self,
        patterns: Sequence[re.Pattern[str]],
        timeout: float = START_TIMEOUT,
        error: type[ProcError] = ProcError,
        awaited: str = "printing every expected line",
    ) -> list[re.Match[str]]:
        """Wait until each pattern has matched a stdout line (in any order); the matches, in pattern
        order. ``error`` (a :class:`ProcError`) when the process exits first ("<name> exited with
        code N before <awaited>") or the time runs out."""
        found: dict[int, re.Match[str]] = {}
        for line in list(self.lines):
            self._match(line, patterns, found)
        deadline = time.monotonic() + timeout
        while len(found) < len(patterns):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [p.pattern for i, p in enumerate(patterns) if i not in found]
                raise error(self.failure(f"no line matching {missing} within {timeout:.0f} s"))
            try:
                got = self._queue.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if got is None:
                rc = self.wait(self.stop_timeout)
                raise error(self.failure(f"{self.name} exited with code {rc} before {awaited}"))
            self._match(got, patterns, found)
        return [found[i] for i in range(len(patterns))]

    @staticmethod
    def _match(line: str, patterns: Sequence[re.Pattern[str]], found: dict[int, re.Match[str]]) -> None:
        for i, p in enumerate(patterns):
            if i not in found and (mt := p.match(line)):
                found[i] = mt

    def write_stdin(self, text: str, close: bool = True) -> None:
        """Write ``text`` to the process's input (``stdin=True``), then close it unless told not to."""
        assert self.proc is not None and self.proc.stdin is not None, f"{self.name} has no input pipe"
        self.proc.stdin.write(text)
        self.proc.stdin.flush()
        if close:
            self.proc.stdin.close()

    def stderr_text(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        text = self._stderr.read()
        self._stderr.seek(0, os.SEEK_END)
        return text

    def failure(self, what: str) -> str:
        return (
            f"{what}\ncommand ({self.name}): {self.argv}\n--- stdout ---\n"
            + "\n".join(self.lines[-200:])
            + f"\n--- stderr ---\n{self.stderr_text()[-8000:]}"
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit; its code. Every stdout line is in :attr:`lines` afterwards."""
        assert self.proc is not None, f"{self.name} was never started"
        rc = self.proc.wait(timeout=self.stop_timeout if timeout is None else timeout)
        if self._reader is not None:
            self._reader.join(timeout=self.stop_timeout if timeout is None else timeout)
        return rc

    def signal_and_wait(self, sig: int, timeout: float | None = None) -> int:
        """Send ``sig`` to the process itself (not its group) and wait for its exit code; on a
        timeout kill it and raise :class:`ProcError`."""
        assert self.proc is not None, f"{self.name} was never started"
        timeout = self.stop_timeout if timeout is None else timeout
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise ProcError(self.failure(f"still running {timeout:.0f} s after {signal.Signals(sig).name}")) from None

    def kill(self) -> None:
        """SIGKILL the process (its whole group with ``new_session``) now; always safe to call."""
        if self.proc is None:
            return
        if self.new_session:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        elif self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=self.stop_timeout)
        if self._reader is not None:
            self._reader.join(timeout=5)

    def close(self) -> None:
        self.kill()
        for stream in (self.proc.stdout, self.proc.stdin) if self.proc is not None else ():
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.close()
        self._stderr.close()

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["REPO_ROOT", "START_TIMEOUT", "STOP_TIMEOUT", "Proc", "ProcError"]
