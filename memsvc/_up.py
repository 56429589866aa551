"""``memsvc up``: a manager, one worker and the OpenAI gateway on this machine, with embedded defaults.

Where there is no GPU the worker uses the host backend and a small synthetic model, so it runs
anywhere. All are child processes; SIGINT/SIGTERM stops them all, and if one dies the others are
stopped too. The gateway dials the manager with the same auth settings (the MEMSVC_* variables).

Auth (``--token-file``, ``--tls-cert/--tls-key``, ``--tls-ca``, ``--tls-client-ca``) and logging
(``--log-level``, ``--log-format``) reach every child as its MEMSVC_* variables: they serve with the
same token and certificate and dial each other with the same CA (the certificate needs a SAN for the
listen host, e.g. 127.0.0.1).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memsvc.runtime.logs import announce

MEMSVC = [sys.executable, "-m", "memsvc.cli"]
"""How ``memsvc up`` starts its children: this interpreter, memsvc's command line."""
STOP_S = 40.0
"""How long the children get to stop after SIGTERM, before SIGKILL."""


def stop_children(procs: Sequence[subprocess.Popen[Any]], timeout: float = STOP_S) -> None:
    """SIGTERM to each of ``procs`` that still runs, in order; then wait for them all, ``timeout`` in
    all; SIGKILL (and reap) those left."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def default_model() -> str:
    from worker._native import cuda_device_count

    return "synthetic:1b" if cuda_device_count() > 0 else "synthetic:small"


def run(
    manager_listen: str,
    worker_listen: str,
    metrics_listen: str,
    state_dir: str,
    model: str | None,
    backend: str,
    idle_sleep_timeout: float,
    idle_deep_sleep_timeout: float,
    child_vars: dict[str, str] | None = None,
    gateway_listen: str = "127.0.0.1:8000",
) -> int:
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    child_env = {**os.environ, **(child_vars or {})}
    exe = MEMSVC
    manager = subprocess.Popen(
        [
            *exe,
            "manager",
            "--listen",
            manager_listen,
            "--db",
            str(Path(state_dir) / "manager.db"),
            "--metrics-listen",
            metrics_listen,
            "--idle-sleep-timeout",
            str(idle_sleep_timeout),
            "--idle-deep-sleep-timeout",
            str(idle_deep_sleep_timeout),
        ],
        env=child_env,
    )
    worker = subprocess.Popen(
        [
            *exe,
            "worker",
            "--listen",
            worker_listen,
            "--manager",
            manager_listen,
            "--backend",
            backend,
            "--worker-id",
            "local0",
            "--model",
            model or default_model(),
        ],
        env=child_env,
    )
    children = [manager, worker]
    if gateway_listen:  # the OpenAI-compatible front door (memsvc gateway)
        children.append(
            subprocess.Popen([*exe, "gateway", "--listen", gateway_listen, "--manager", manager_listen], env=child_env)
        )
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping and all(p.poll() is None for p in children):
        time.sleep(0.2)
    ended = [p for p in children if p.poll() is not None]  # on their own: the cause, unless we are stopping
    stop_children(children[::-1])
    names = ["manager", "worker", "gateway"]
    for name, p in zip(names, children, strict=False):
        # One we stopped may die of the SIGTERM if it had not yet set up its handler: not a failure.
        if p.returncode and (p in ended or p.returncode != -signal.SIGTERM):
            announce(f"memsvc up: the {name} exited with {p.returncode}", sys.stderr)
    if stopping and all(p.returncode in (0, -signal.SIGTERM) for p in children):
        return 0
    # The exit status of the child that ended first on its own: 2 for its usage error (a bad
    # MEMSVC_* variable, one line naming it above), as the command itself would.
    first = next((p.returncode for p in ended if p.returncode), None)
    return first if first is not None and first > 0 else 1


if __name__ == "__main__":
    sys.exit(
        run(
            "127.0.0.1:50051",
            "127.0.0.1:50061",
            "127.0.0.1:9400",
            os.path.expanduser("~/.memsvc"),
            None,
            "auto",
            300,
            3600,
        )
    )
