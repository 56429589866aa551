"""``memsvc gateway --processes N``: N gateway processes serving one port, for more streams than one
event loop can write.

One gateway process writes every token of every stream it serves through Python (the worker's
message read, the server-sent event built and written): on the H200 its one event loop tops out near
10,000 streamed tokens a second, below what one worker produces at 256 concurrent streams. Here N
children serve one port, as vLLM's ``--api-server-count`` and uvicorn's ``--workers`` do: the
supervisor reserves the port (bound with ``SO_REUSEPORT``, never listening), and each child listens
on a socket of its own bound to it, so the kernel spreads new connections evenly over the children
(one shared listening socket would let whichever child woke first take a whole burst). Each child is
a whole gateway (memsvc.gateway.serve) with leases of its own at the manager; ``--max-requests``
and an explicit ``--max-connections`` are shared out among them, and ``/metrics`` from any child
counts all of them (Prometheus' multiprocess mode, one directory the supervisor makes and removes).

The supervisor's life is theirs: SIGTERM or SIGINT to it stops every child (each drains its streams
as a single gateway does, refusing new connections meanwhile) and it exits 0 once all have; a child
that exits by itself stops the rest and the supervisor exits 1, so whatever runs the gateway
restarts all of it. A supervisor that dies without a word (SIGKILL) ends its children too: each
holds its stdin open, and its end stops them (after their drain).
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

from memsvc.gateway import Settings, at, serve
from memsvc.runtime.logs import announce, configure, current_logging

log = logging.getLogger("memsvc.gateway")

START_TIMEOUT_S = 60.0
"""How long a child has to start listening (it imports FastAPI, uvicorn and grpc)."""


def share(total: int, processes: int) -> int:
    """Each child's part of a bound on the whole gateway (rounded up: never 0)."""
    return max(math.ceil(total / processes), 1)


def _address(listen: str) -> tuple[int, Any]:
    """``listen``'s (family, sockaddr); a name that does not resolve is a clean exit."""
    host, _, port = listen.rpartition(":")
    try:
        found = socket.getaddrinfo(
            host.strip("[]") or "127.0.0.1", int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (OSError, ValueError) as exc:
        raise SystemExit(f"memsvc gateway: could not serve on {listen}: {exc}") from None
    family, _, _, _, address = found[0]
    return int(family), address


def bind_shared(family: int, address: Any, shared: bool = True) -> socket.socket:
    """A socket bound to ``address`` that other sockets of this user may bind too (``SO_REUSEPORT``):
    the kernel spreads a port's new connections over those of them that listen. ``shared`` False: the
    port is this socket's alone (a gateway of one process)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def bind_port(listen: str, shared: bool) -> socket.socket:
    """The gateway's port, bound before anything serves on it: one that cannot be had (taken, not
    this host's) is one line and exit 1, not a server's traceback."""
    family, address = _address(listen)
    try:
        return bind_shared(family, address, shared)
    except OSError as exc:
        raise SystemExit(f"memsvc gateway: could not serve on {listen}: {exc.strerror}") from None


def supervise(settings: Settings, processes: int) -> int:
    """Serve ``settings`` from ``processes`` child processes until SIGTERM/SIGINT; 0 when every child
    stopped cleanly on that signal."""
    from memsvc.runtime.serving import ignore_stop_signals

    reserved = bind_port(settings.listen, shared=True)  # holds the port (port 0: picks it) for the children
    family = reserved.family
    metrics_dir = tempfile.mkdtemp(prefix="memsvc-gateway-metrics-")
    try:
        return asyncio.run(_supervise(settings, processes, family, reserved.getsockname(), metrics_dir))
    finally:
        ignore_stop_signals()
        reserved.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


async def _supervise(settings: Settings, n: int, family: int, address: Any, metrics_dir: str) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    part = dataclasses.replace(
        settings,
        max_requests=share(settings.max_requests, n),
        max_connections=None if settings.max_connections is None else share(settings.max_connections, n),
    )
    level, fmt = current_logging()
    told = json.dumps(
        {
            "settings": dataclasses.asdict(part),
            "family": family,
            "address": list(address),
            "log_level": level,
            "log_format": fmt,
        }
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    children: list[asyncio.subprocess.Process] = []
    try:
        for _ in range(n):
            child = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "memsvc.gateway.processes",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=env,
            )
            children.append(child)
            assert child.stdin is not None
            child.stdin.write(told.encode() + b"\n")
        if not await _all_listening(children, stop):
            for child in children:  # none serves anyone yet: no drain to wait for
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
            await asyncio.gather(*(child.wait() for child in children))
            return 0 if stop.is_set() else 1
        log.info("%d gateway processes serve the port: %s", n, " ".join(str(c.pid) for c in children))
        announce(f"memsvc gateway listening on {at(address)}")
        exits = [asyncio.ensure_future(child.wait()) for child in children]
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([stopped, *exits], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        for child in children:
            if child.returncode is not None and not stop.is_set():
                log.error("gateway process %d exited with %d: stopping the others", child.pid, child.returncode)
        for child in children:  # each drains its streams, as a single gateway does
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)
        codes = await asyncio.gather(*exits)
        return 0 if stop.is_set() and not any(codes) else 1
    except BaseException:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
        raise


class _StartFailed(Exception):
    """A child exited, or said something else, before it said it listens."""


async def _all_listening(children: list[asyncio.subprocess.Process], stop: asyncio.Event) -> bool:
    """True once each child says it listens; False as soon as one fails to, if they stay silent past
    START_TIMEOUT_S, or if a stop signal comes meanwhile."""

    async def listening(child: asyncio.subprocess.Process) -> None:
        assert child.stdout is not None
        line = await child.stdout.readline()
        try:
            told = json.loads(line)
        except ValueError:
            told = None
        if not (isinstance(told, dict) and told.get("listening") is True):
            raise _StartFailed(f"gateway process {child.pid} did not start (it said {line[:200]!r})")

    waits = asyncio.gather(*(listening(c) for c in children))
    stopped = asyncio.ensure_future(stop.wait())
    either: list[asyncio.Future[Any]] = [waits, stopped]
    try:
        done, _ = await asyncio.wait(either, timeout=START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if waits not in done:
        waits.cancel()
        with contextlib.suppress(asyncio.CancelledError, _StartFailed):
            await waits
        if not stop.is_set():
            log.error("the gateway's processes did not all start listening within %.0f s", START_TIMEOUT_S)
        return False
    if (failed := waits.exception()) is not None:
        log.error("%s", failed)
        return False
    return True


def _from_json(fields: dict[str, Any]) -> Settings:
    from memsvc.runtime.auth import Security

    security = fields.pop("security")
    if security is not None:
        security["allowed_clients"] = tuple(security.get("allowed_clients", ()))
        security = Security(**security)
    return Settings(**fields, security=security)


async def _child(settings: Settings, sock: socket.socket) -> int:
    """One child: the gateway on its own socket of the shared port, stopped by SIGTERM/SIGINT or by
    the end of its stdin (the supervisor has gone)."""
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
    from memsvc.runtime.serving import run_service

    try:
        sock = bind_shared(told["family"], tuple(told["address"]))
    except OSError as exc:
        _tell({"error": f"could not bind {told['address']}: {exc.strerror}"})
        return 1
    return run_service(_child(_from_json(told["settings"]), sock))


if __name__ == "__main__":
    sys.exit(main())
