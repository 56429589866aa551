"""The OpenAI-compatible HTTP gateway (``memsvc gateway``): see memsvc/gateway/app.py.

Importing this package loads nothing heavy; :func:`run` imports FastAPI and uvicorn (the
``gateway`` extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memsvc._limits import MAX_GATEWAY_REQUESTS

if TYPE_CHECKING:
    from memsvc._auth import Security


def run(
    listen: str, manager: str, security: Security | None = None, acquire_timeout: float = 300.0,
    queue_timeout: float = 30.0, max_requests: int = MAX_GATEWAY_REQUESTS,
) -> int:  # fmt: skip
    """Serve the gateway on ``listen`` (host:port; port 0 picks one) until SIGINT/SIGTERM."""
    import asyncio
    import contextlib
    import logging
    import signal
    from collections.abc import Iterator

    import uvicorn

    from memsvc._logging import announce
    from memsvc.gateway.app import create_app
    from memsvc.gateway.backends import Backends

    if max_requests < 1:
        raise SystemExit(f"memsvc gateway: --max-requests must be at least 1, got {max_requests}")
    host, _, port = listen.rpartition(":")

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # ours below: uvicorn's would re-raise the signal after the shutdown, and the process
            # would end killed by it instead of exiting 0 as the other memsvc services do
            yield

    async def serve() -> None:
        backends = Backends(manager, security)
        app = create_app(backends, security.token if security else "", acquire_timeout, queue_timeout, max_requests)
        # log_config=None: uvicorn's loggers go through the process's handler (memsvc._logging)
        level = logging.getLevelName(logging.getLogger().level).lower()
        config = uvicorn.Config(
            app, host=host or "127.0.0.1", port=int(port), log_level=level, access_log=False, log_config=None
        )
        server = Server(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))

        task = asyncio.create_task(server.serve())
        try:
            while not server.started and not task.done():
                await asyncio.sleep(0.05)
            if server.started:
                bound = server.servers[0].sockets[0].getsockname()
                announce(f"memsvc gateway listening on {bound[0]}:{bound[1]}")
            await task
        finally:
            await backends.close()
        if not server.started:
            raise SystemExit(f"memsvc gateway: could not serve on {listen}")

    from memsvc._serving import run_service

    run_service(serve())
    announce("memsvc gateway stopped")
    return 0


__all__ = ["run"]
