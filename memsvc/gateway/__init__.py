"""The OpenAI-compatible HTTP gateway (``memsvc gateway``): see memsvc/gateway/app.py.

Importing this package loads nothing heavy; :func:`run` imports FastAPI and uvicorn (the
``gateway`` extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memsvc._auth import Security


def run(
    listen: str, manager: str, security: Security | None = None, acquire_timeout: float = 300.0,
    queue_timeout: float = 30.0,
) -> int:  # fmt: skip
    """Serve the gateway on ``listen`` (host:port; port 0 picks one) until SIGINT/SIGTERM."""
    import asyncio
    import logging

    import uvicorn

    from memsvc.gateway.app import create_app
    from memsvc.gateway.backends import Backends

    host, _, port = listen.rpartition(":")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def serve() -> None:
        backends = Backends(manager, security)
        app = create_app(backends, security.token if security else "", acquire_timeout, queue_timeout)
        config = uvicorn.Config(app, host=host or "127.0.0.1", port=int(port), log_level="info", access_log=True)
        server = uvicorn.Server(config)

        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.05)
            bound = server.servers[0].sockets[0].getsockname() if server.servers else (host, port)
            print(f"memsvc gateway listening on {bound[0]}:{bound[1]}", flush=True)

        try:
            await asyncio.gather(server.serve(), announce())
        finally:
            await backends.close()

    asyncio.run(serve())
    return 0


__all__ = ["run"]
