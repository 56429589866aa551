"""``memsvc manager``: serve MemoryManagerService until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

from memsvc._auth import Security
from memsvc._serving import install_signal_handlers, start_server
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
    sec = security or Security()
    cfg = load_config(config)
    Path(db).parent.mkdir(parents=True, exist_ok=True)
    store = Store(db)
    # the manager dials its workers with its own TLS identity and token
    manager = Manager(store, cfg.settings, {**cfg.policy_fields, **policy}, cfg.workers, grpc_links(sec))
    await manager.start()
    servicer = MemoryManagerServicer(manager)
    srv = await start_server(listen, [lambda s: m_grpc.add_MemoryManagerServiceServicer_to_server(servicer, s)],
                             [SERVICE_NAME], security=sec)  # fmt: skip
    await srv.set_serving(True)
    await srv.set_serving(True, SERVICE_NAME)
    if metrics_listen:
        host, port = manager.metrics.serve(metrics_listen)
        print(f"memsvc manager metrics on http://{host or '0.0.0.0'}:{port}/metrics", flush=True)
    print(f"memsvc manager listening on {srv.address}", flush=True)
    stop = asyncio.Event()
    install_signal_handlers(stop)
    await stop.wait()
    manager.hub.close()
    await srv.stop(5.0)
    await manager.close()
    store.close()
    print("memsvc manager stopped", flush=True)
    return 0


def run(
    listen: str,
    db: str,
    config: str | None,
    metrics_listen: str | None,
    policy: dict[str, Any],
    security: Security | None = None,
) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(listen, db, config, metrics_listen, policy, security))
