"""``memsvc gateway --processes N``: N gateway processes serving one port, for more streams than one
event loop can write.

One gateway process writes every token of every stream it serves through Python (the worker's
message read, the server-sent event built and written): on the H200 its one event loop tops out near
10,000 streamed tokens a second, below what one worker produces at 256 concurrent streams. Here a
supervisor binds the port once and starts N children that accept on that one listening socket (the
kernel hands each new connection to one of them), as vLLM's ``--api-server-count`` and uvicorn's
``--workers`` do. Each child is a whole gateway (memsvc.gateway.serve) with leases of its own at the
manager; ``--max-requests`` and ``--max-connections`` are shared out among them, and ``/metrics``
from any child counts all of them (Prometheus' multiprocess mode, one directory the supervisor makes
and removes).

The supervisor's life is theirs: SIGTERM or SIGINT to it stops every child (each drains its streams
as a single gateway does) and it exits 0 once all have; a child that exits by itself stops the rest
and the supervisor exits 1, so whatever runs the gateway restarts all of it. A supervisor that dies
without a word (SIGKILL) ends its children too: each holds its stdin open, and its end stops them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import Any

from memsvc._logging import announce, configure, current_logging
from memsvc.gateway import Settings, serve

log = logging.getLogger("memsvc.gateway")

START_TIMEOUT_S = 60.0
"""How long a child has to start listening (it imports FastAPI, uvicorn and grpc)."""


def share(total: int, processes: int) -> int:
    """Each child's part of a bound on the whole gateway (rounded up: never 0)."""
    return max(math.ceil(total / processes), 1)


def _bind(listen: str, backlog: int) -> socket.socket:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    family, kind, proto, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]  # fmt: skip
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise SystemExit(f"memsvc gateway: could not serve on {listen}: {exc.strerror}") from None
    return sock


def supervise(settings: Settings, processes: int) -> int:
    """Serve ``settings`` from ``processes`` child processes until SIGTERM/SIGINT; 0 when every child
    stopped cleanly on that signal."""
    from memsvc._serving import ignore_stop_signals
    from memsvc.gateway.connections import accept_batch, raise_fd_limit

    sock = _bind(settings.listen, accept_batch(raise_fd_limit()))
    metrics_dir = tempfile.mkdtemp(prefix="memsvc-gateway-metrics-")
    try:
        return asyncio.run(_supervise(settings, processes, sock, metrics_dir))
    finally:
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        ignore_stop_signals()


async def _supervise(settings: Settings, n: int, sock: socket.socket, metrics_dir: str) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    part = dataclasses.replace(
        settings, max_requests=share(settings.max_requests, n),
        max_connections=None if settings.max_connections is None else share(settings.max_connections, n),
    )  # fmt: skip
    level, fmt = current_logging()
    told = json.dumps({"settings": _to_json(part), "fd": sock.fileno(), "log_level": level, "log_format": fmt})
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    children: list[asyncio.subprocess.Process] = []
    try:
        for _ in range(n):
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "memsvc.gateway.processes", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, pass_fds=(sock.fileno(),), env=env,
            )  # fmt: skip
            children.append(child)
            assert child.stdin is not None
            child.stdin.write(told.encode() + b"\n")
        started = await _all_listening(children, stop)
        if started:
            host, port = sock.getsockname()[:2]
            log.info("%d gateway processes serve the port: %s", n, " ".join(str(c.pid) for c in children))
            announce(f"memsvc gateway listening on {host}:{port}")
            exits = [asyncio.ensure_future(child.wait()) for child in children]
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait([stopped, *exits], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            for child in children:
                if child.returncode is not None and not stop.is_set():
                    log.error("gateway process %d exited with %d: stopping the others", child.pid, child.returncode)
        return await _stop_all(children, clean=stop.is_set())
    except BaseException:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
        raise


async def _all_listening(children: list[asyncio.subprocess.Process], stop: asyncio.Event) -> bool:
    """True once each child says it listens; False if one exits first, stays silent past
    START_TIMEOUT_S, or a stop signal comes meanwhile."""

    async def listening(child: asyncio.subprocess.Process) -> bool:
        assert child.stdout is not None
        line = await child.stdout.readline()
        with contextlib.suppress(ValueError):
            return bool(json.loads(line).get("listening"))
        return False

    waits = asyncio.gather(*(listening(c) for c in children))
    stopped = asyncio.ensure_future(stop.wait())
    either: list[asyncio.Future[Any]] = [waits, stopped]
    try:
        done, _ = await asyncio.wait(either, timeout=START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if waits not in done:
        waits.cancel()
        if not stop.is_set():
            log.error("the gateway's processes did not all start listening within %.0f s", START_TIMEOUT_S)
        return False
    return all(waits.result())


async def _stop_all(children: list[asyncio.subprocess.Process], clean: bool) -> int:
    for child in children:
        if child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
    codes = [await child.wait() for child in children]
    return 0 if clean and not any(codes) else 1


def _to_json(settings: Settings) -> dict[str, Any]:
    fields = dataclasses.asdict(settings)
    if settings.security is not None:
        fields["security"] = dataclasses.asdict(settings.security)
    return fields


def _from_json(fields: dict[str, Any]) -> Settings:
    from memsvc._auth import Security

    security = fields.pop("security")
    if security is not None:
        security["allowed_clients"] = tuple(security.get("allowed_clients", ()))
        security = Security(**security)
    return Settings(**fields, security=security)


async def _child(settings: Settings, sock: socket.socket) -> int:
    """One child: the gateway on the supervisor's socket, stopped by SIGTERM/SIGINT or by the end of
    its stdin (the supervisor has gone)."""
    loop = asyncio.get_running_loop()

    class Ended(asyncio.Protocol):
        def connection_lost(self, exc: Exception | None) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # serve's own handler drains and stops

    await loop.connect_read_pipe(Ended, sys.stdin)
    return await serve(settings, lambda _at: _tell({"listening": True}), sock)


def _tell(line: dict[str, Any]) -> None:
    with contextlib.suppress(BrokenPipeError):  # the supervisor has gone: the end of stdin stops this one
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()


def main() -> int:
    line = sys.stdin.readline()
    if not line:  # the supervisor stopped before it said what to serve
        return 0
    told = json.loads(line)
    configure(told["log_level"], told["log_format"])
    from memsvc._serving import run_service

    sock = socket.socket(fileno=told["fd"])
    return run_service(_child(_from_json(told["settings"]), sock))


if __name__ == "__main__":
    sys.exit(main())
