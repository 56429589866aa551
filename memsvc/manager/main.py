"""``memsvc manager``: serve MemoryManagerService until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

from memsvc._auth import Security
from memsvc._logging import announce
from memsvc._serving import Server, install_signal_handlers, run_service, start_server
from memsvc.errors import InvalidArgument, MemsvcError
from memsvc.manager.config import load_config
from memsvc.manager.controller import Manager
from memsvc.manager.links import grpc_links
from memsvc.manager.servicer import MemoryManagerServicer
from memsvc.manager.store import Store
from memsvc.v1 import memory_manager_service_pb2 as m
from memsvc.v1 import memory_manager_service_pb2_grpc as m_grpc

log = logging.getLogger("memsvc.manager")
SERVICE_NAME = m.DESCRIPTOR.services_by_name["MemoryManagerService"].full_name


async def serve(
    listen: str,
    db: str,
    config: str | None,
    metrics_listen: str | None,
    policy: dict[str, Any],
    security: Security | None = None,
) -> int:
    """Serve until SIGTERM; 0 after a clean stop, 2 when the manager refuses to start.

    A refusal (an unusable ``--db`` or ``--config``, a port it cannot listen on, a seed policy that
    breaks the policy rules) is the operator's to fix, not a bug: it is one line on stderr naming
    what and why, with whatever had started closed again, never a traceback.
    """
    sec = security or Security()
    try:
        cfg = load_config(config)
        store = Store(db)
    except MemsvcError as exc:
        return _refuse(exc)
    manager: Manager | None = None
    srv: Server | None = None
    try:
        # the manager dials its workers with its own TLS identity and token
        manager = Manager(store, cfg.settings, {**cfg.policy_fields, **policy}, cfg.workers, grpc_links(sec))
        await manager.start()
        servicer = MemoryManagerServicer(manager)
        srv = await start_server(listen, [lambda s: m_grpc.add_MemoryManagerServiceServicer_to_server(servicer, s)],
                                 [SERVICE_NAME], security=sec)  # fmt: skip
        await srv.set_serving(True)
        await srv.set_serving(True, SERVICE_NAME)
        if metrics_listen:
            host, port = _serve_metrics(manager, metrics_listen, sec.token)  # /metrics behind the token too
            announce(f"memsvc manager metrics on http://{host or '0.0.0.0'}:{port}/metrics")
    except MemsvcError as exc:
        if srv is not None:
            await srv.stop(0)
        if manager is not None:
            await manager.close()
        store.close()
        return _refuse(exc)
    announce(f"memsvc manager listening on {srv.address}")
    stop = asyncio.Event()
    install_signal_handlers(stop)
    await stop.wait()
    manager.hub.close()
    await srv.stop(5.0)
    await manager.close()
    store.close()
    announce("memsvc manager stopped")
    return 0


def _serve_metrics(manager: Manager, listen: str, token: str = "") -> tuple[str, int]:
    """The Prometheus endpoint; a bad ``--metrics-listen`` is a refusal like a bad ``--listen``."""
    try:
        return manager.metrics.serve(listen, token=token)
    except (OSError, ValueError, OverflowError) as exc:
        raise InvalidArgument(f"cannot serve metrics on {listen!r}: {exc}") from exc


def _refuse(exc: MemsvcError) -> int:
    announce(f"memsvc manager: error: {exc}", sys.stderr)
    return 2


def run(
    listen: str,
    db: str,
    config: str | None,
    metrics_listen: str | None,
    policy: dict[str, Any],
    security: Security | None = None,
) -> int:
    return run_service(serve(listen, db, config, metrics_listen, policy, security))
