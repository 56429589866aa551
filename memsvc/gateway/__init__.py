"""The OpenAI-compatible HTTP gateway (``memsvc gateway``): see memsvc/gateway/app.py.

Importing this package loads nothing heavy; :func:`run` imports FastAPI and uvicorn (the
``gateway`` extra).
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from memsvc.runtime.limits import (
    GATEWAY_BODY_TIMEOUT_S,
    GATEWAY_HEADER_TIMEOUT_S,
    GATEWAY_IDLE_TIMEOUT_S,
    MAX_GATEWAY_REQUESTS,
    MAX_HTTP_HEAD_BYTES,
)

if TYPE_CHECKING:
    from memsvc.runtime.auth import Security


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one gateway process serves with: :func:`run`'s arguments, less the process count."""

    listen: str
    manager: str
    security: Security | None = None
    acquire_timeout: float = 300.0
    queue_timeout: float = 30.0
    max_requests: int = MAX_GATEWAY_REQUESTS
    header_timeout: float = GATEWAY_HEADER_TIMEOUT_S
    body_timeout: float = GATEWAY_BODY_TIMEOUT_S
    idle_timeout: int = GATEWAY_IDLE_TIMEOUT_S
    max_connections: int | None = None
    lease_ttl: float | None = None


def run(
    listen: str, manager: str, security: Security | None = None, acquire_timeout: float = 300.0,
    queue_timeout: float = 30.0, max_requests: int = MAX_GATEWAY_REQUESTS, *,
    header_timeout: float = GATEWAY_HEADER_TIMEOUT_S, body_timeout: float = GATEWAY_BODY_TIMEOUT_S,
    idle_timeout: int = GATEWAY_IDLE_TIMEOUT_S, max_connections: int | None = None,
    lease_ttl: float | None = None, processes: int = 1,
) -> int:  # fmt: skip
    """Serve the gateway on ``listen`` (host:port; port 0 picks one) until SIGINT/SIGTERM.

    ``max_connections`` None: as many as the open-files limit leaves room for, at most
    MAX_GATEWAY_CONNECTIONS (memsvc.gateway.connections.connection_bound). ``processes`` > 1: that
    many processes serve the one port (memsvc/gateway/processes.py), each an event loop of its own,
    with ``max_requests`` and ``max_connections`` shared out among them."""
    if max_requests < 1:
        raise SystemExit(f"memsvc gateway: --max-requests must be at least 1, got {max_requests}")
    if processes < 1:
        raise SystemExit(f"memsvc gateway: --processes must be at least 1, got {processes}")
    settings = Settings(
        listen, manager, security, acquire_timeout, queue_timeout, max_requests, header_timeout, body_timeout,
        idle_timeout, max_connections, lease_ttl,
    )  # fmt: skip
    from memsvc.runtime.logs import announce
    from memsvc.runtime.serving import run_service

    if processes > 1:
        from memsvc.gateway.processes import supervise

        code = supervise(settings, processes)
    else:
        from memsvc.gateway.processes import bind_port

        def listening(where: str) -> None:
            announce(f"memsvc gateway listening on {where}")

        code = run_service(serve(settings, listening=listening, sock=bind_port(listen, shared=False)))
    announce("memsvc gateway stopped")
    return code


def at(sockname: tuple[str, int] | tuple[str, int, int, int]) -> str:
    """A bound socket's host:port as the "listening on" line says it ([host]:port for IPv6)."""
    host, port = sockname[0], sockname[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve(settings: Settings, listening: Callable[[str], None], sock: socket.socket | None = None) -> int:
    """One gateway process until SIGINT/SIGTERM (or ``should_exit`` set on its server by the caller's
    own means); ``listening`` is told the bound host:port once it accepts connections. ``sock``: a socket
    already bound to the port (one of the ``--processes`` children's, memsvc/gateway/processes.py) to
    listen on instead of binding ``settings.listen``."""
    import asyncio
    import contextlib
    import logging
    import signal
    from collections.abc import Iterator

    import uvicorn

    from memsvc.gateway.app import create_app
    from memsvc.gateway.backends import Backends
    from memsvc.gateway.connections import (
        BoundedH11,
        accept_batch,
        connection_bound,
        quiet_accept_errors,
        raise_fd_limit,
    )

    s = settings
    host, _, port = s.listen.rpartition(":")
    log = logging.getLogger("memsvc.gateway")
    fd_limit = raise_fd_limit()
    room = connection_bound(fd_limit)
    if s.max_connections is not None and s.max_connections > room:
        log.warning("--max-connections %d is more than the open-files limit of %d leaves room for (%d): past it, "
                    "accepts fail (logged once per 10 s) and new connections wait unanswered", s.max_connections,
                    fd_limit, room)  # fmt: skip
    bound = room if s.max_connections is None else s.max_connections
    log.info("serving at most %d connections (open-files limit %d)", bound, fd_limit)

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # ours below: uvicorn's would re-raise the signal after the shutdown, and the process
            # would end killed by it instead of exiting 0 as the other memsvc services do
            yield

    backends = Backends(s.manager, s.security, s.lease_ttl)
    app = create_app(backends, s.security.token if s.security else "", s.acquire_timeout, s.queue_timeout,
                     s.max_requests, s.body_timeout)  # fmt: skip
    # log_config=None: uvicorn's loggers go through the process's handler (memsvc.runtime.logs)
    level = logging.getLevelName(logging.getLogger().level).lower()
    config = uvicorn.Config(
        app, host=host or "127.0.0.1", port=int(port), log_level=level, access_log=False, log_config=None,
        http=BoundedH11.configured(s.header_timeout, bound), timeout_keep_alive=s.idle_timeout,
        h11_max_incomplete_event_size=MAX_HTTP_HEAD_BYTES, backlog=accept_batch(fd_limit),
    )  # fmt: skip
    server = Server(config)
    loop = asyncio.get_running_loop()
    quiet_accept_errors(loop)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))

    task = asyncio.create_task(server.serve(sockets=None if sock is None else [sock]))
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            listening(at(server.servers[0].sockets[0].getsockname()))
        await task
    finally:
        await backends.close()
    if not server.started:
        raise SystemExit(f"memsvc gateway: could not serve on {s.listen}")
    return 0


__all__ = ["Settings", "at", "run", "serve"]
