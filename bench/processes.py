"""The benches' child processes (memsvc services, baselines), stopped the way a supervisor stops a
memsvc service: SIGTERM, so it drains its calls, and a kill only when it does not end."""

from __future__ import annotations

import signal
import subprocess
from typing import Any


def stop(proc: subprocess.Popen[Any], timeout: float) -> int:
    """SIGTERM ``proc`` (if it still runs), wait up to ``timeout`` s, then kill it; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)
    return int(proc.returncode)


__all__ = ["stop"]
