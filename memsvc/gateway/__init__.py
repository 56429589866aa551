"""The OpenAI-compatible HTTP gateway (``memsvc gateway``): see memsvc/gateway/app.py.

Importing this package loads nothing heavy; :func:`run` imports FastAPI and uvicorn (the
``gateway`` extra). It builds on the shared layer alone (``memsvc.errors``, ``memsvc.vocabulary``,
``memsvc.runtime``, the stubs), never on the worker or the manager, which it reaches over gRPC; only
``memsvc.cli`` (its command) imports it (tests/test_package_layers.py).
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from memsvc.runtime.flags import (
    count_or_auto,
    int_at_least,
    lease_ttl_seconds,
    listen_address,
    non_negative_seconds,
    setting,
    some_seconds_up_to_an_hour,
)
from memsvc.runtime.limits import (
    GATEWAY_BODY_TIMEOUT_S,
    GATEWAY_HEADER_TIMEOUT_S,
    GATEWAY_IDLE_TIMEOUT_S,
    MAX_GATEWAY_CONNECTIONS,
    MAX_GATEWAY_REQUESTS,
    MAX_HTTP_HEAD_BYTES,
)

if TYPE_CHECKING:
    from memsvc.runtime.auth import Security


LEASE_TTL_S = 30.0
"""A request's lease at the manager by default, renewed every third of it (memsvc/gateway/backends.py)."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the gateway serves with: each field but ``security`` is a ``memsvc gateway`` flag and a
    MEMSVC_* variable (memsvc/runtime/flags.py), this its one definition."""

    listen: str = setting("127.0.0.1:8000", "host:port to serve HTTP on", parse=listen_address, env="GATEWAY_LISTEN")
    manager: str = setting("127.0.0.1:50051", "the manager's address")
    acquire_timeout: float = setting(
        300.0,
        "seconds a request waits for its model's worker to be leased (and woken)",
        parse=non_negative_seconds,
        flag="--wake-timeout",
        text="300",
    )
    queue_timeout: float = setting(
        30.0,
        "seconds a request waits for room on its model's device while every other worker there is busy "
        "(then 503 with Retry-After)",
        parse=non_negative_seconds,
        text="30",
    )
    lease_ttl: float = setting(
        LEASE_TTL_S,
        "seconds each request's lease lasts at the manager, renewed every third of it while the request "
        "runs; what a gateway that dies leaves its workers held awake for",
        parse=lease_ttl_seconds,
        text=f"{LEASE_TTL_S:g}",
        env="GATEWAY_LEASE_TTL",
    )
    max_requests: int = setting(
        MAX_GATEWAY_REQUESTS,
        "completions served at once, streaming or queued for room (then 503 with Retry-After)",
        parse=int_at_least(1),
        env="GATEWAY_MAX_REQUESTS",
    )
    max_connections: int | None = setting(
        None,
        "HTTP connections held at once; past it a new one gets 503 with Retry-After and is closed (auto: what "
        f"the open-files limit, raised to its hard limit at start, leaves room for, at most {MAX_GATEWAY_CONNECTIONS})",
        parse=count_or_auto,
        text="auto",
        env="GATEWAY_MAX_CONNECTIONS",
    )
    """memsvc.gateway.connections.connection_bound sizes ``auto``."""
    header_timeout: float = setting(
        GATEWAY_HEADER_TIMEOUT_S,
        "seconds a connection has to send a whole request head, from its start or its previous response; "
        "then it is closed (a 408 first when a head was begun)",
        parse=some_seconds_up_to_an_hour,
        text=f"{GATEWAY_HEADER_TIMEOUT_S:g}",
        env="GATEWAY_HEADER_TIMEOUT",
    )
    body_timeout: float = setting(
        GATEWAY_BODY_TIMEOUT_S,
        "seconds a request's body has to arrive in full, from its head; then 408 and the connection is "
        "closed, before any lease is taken",
        parse=some_seconds_up_to_an_hour,
        text=f"{GATEWAY_BODY_TIMEOUT_S:g}",
        env="GATEWAY_BODY_TIMEOUT",
    )
    idle_timeout: int = setting(
        GATEWAY_IDLE_TIMEOUT_S,
        "whole seconds a keep-alive connection may sit idle after a response before it is closed "
        "(--header-timeout bounds it too)",
        parse=int_at_least(1),
        env="GATEWAY_IDLE_TIMEOUT",
    )
    processes: int = setting(
        1,
        "processes serving the one port, each an event loop of its own that takes a share of the new "
        "connections: one writes about 10,000 streamed tokens a second; --max-requests and --max-connections "
        "are shared out among them",
        parse=int_at_least(1),
        env="GATEWAY_PROCESSES",
    )
    """Above 1: memsvc/gateway/processes.py starts that many children, each serving with these settings."""
    security: Security | None = None
    """TLS and the token (memsvc/runtime/auth.py): the auth flags every command shares."""


def run(settings: Settings) -> int:
    """Serve the gateway on ``settings.listen`` (host:port; port 0 picks one) until SIGINT/SIGTERM:
    in this process, or with ``processes`` > 1 in that many (memsvc/gateway/processes.py), with
    ``max_requests`` and ``max_connections`` shared out among them."""
    if settings.max_requests < 1:
        raise SystemExit(f"memsvc gateway: --max-requests must be at least 1, got {settings.max_requests}")
    if settings.processes < 1:
        raise SystemExit(f"memsvc gateway: --processes must be at least 1, got {settings.processes}")
    from memsvc.runtime.logs import announce
    from memsvc.runtime.serving import run_service

    if settings.processes > 1:
        from memsvc.gateway.processes import supervise

        code = supervise(settings, settings.processes)
    else:
        from memsvc.gateway.processes import bind_port

        def listening(where: str) -> None:
            announce(f"memsvc gateway listening on {where}")

        code = run_service(serve(settings, listening=listening, sock=bind_port(settings.listen, shared=False)))
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
        log.warning(
            "--max-connections %d is more than the open-files limit of %d leaves room for (%d): past it, "
            "accepts fail (logged once per 10 s) and new connections wait unanswered",
            s.max_connections,
            fd_limit,
            room,
        )
    bound = room if s.max_connections is None else s.max_connections
    log.info("serving at most %d connections (open-files limit %d)", bound, fd_limit)

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # ours below: uvicorn's would re-raise the signal after the shutdown, and the process
            # would end killed by it instead of exiting 0 as the other memsvc services do
            yield

    backends = Backends(s.manager, s.security, s.lease_ttl)
    app = create_app(
        backends,
        s.security.token if s.security else "",
        s.acquire_timeout,
        s.queue_timeout,
        s.max_requests,
        s.body_timeout,
    )
    # log_config=None: uvicorn's loggers go through the process's handler (memsvc.runtime.logs)
    level = logging.getLevelName(logging.getLogger().level).lower()
    config = uvicorn.Config(
        app,
        host=host or "127.0.0.1",
        port=int(port),
        log_level=level,
        access_log=False,
        log_config=None,
        http=BoundedH11.configured(s.header_timeout, bound),
        timeout_keep_alive=s.idle_timeout,
        h11_max_incomplete_event_size=MAX_HTTP_HEAD_BYTES,
        backlog=accept_batch(fd_limit),
    )
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
