"""``memsvc manager``: serve MemoryManagerService until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys

from memsvc.errors import InvalidArgument, MemsvcError
from memsvc.manager.config import load_config
from memsvc.manager.controller import Manager
from memsvc.manager.links import grpc_links
from memsvc.manager.metrics import ManagerMetrics
from memsvc.manager.replicas import LeaderLock, Replica, advertised
from memsvc.manager.serve_settings import ServeSettings
from memsvc.manager.servicer import MemoryManagerServicer
from memsvc.manager.store import Store, open_store
from memsvc.runtime.auth import Security
from memsvc.runtime.logs import announce
from memsvc.runtime.serving import Server, install_signal_handlers, run_service, start_server
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.v1 import memory_manager_service_pb2_grpc as manager_grpc

log = logging.getLogger("memsvc.manager")
SERVICE_NAME = manager_pb.DESCRIPTOR.services_by_name["MemoryManagerService"].full_name


async def serve(settings: ServeSettings, security: Security | None = None) -> int:
    """Serve until SIGTERM; 0 after a clean stop, 2 when the manager refuses to start, 1 when a
    leading replica lost its database session (memsvc/manager/replicas.py: its supervisor starts it
    again, as a follower).

    A refusal (an unusable ``--db`` or ``--config``, a port it cannot listen on, a seed policy that
    breaks the policy rules) is the operator's to fix, not a bug: it is one line on stderr naming
    what and why, with whatever had started closed again, never a traceback.

    On a shared store (PostgreSQL) the server starts at once and forwards to the leader until this
    replica takes the lead; the manager itself is built only then, since building it writes.
    """
    sec = security or Security()
    try:
        cfg = load_config(settings.config)
        store = open_store(settings.db)
    except MemsvcError as exc:
        return _refuse(exc)
    stop = asyncio.Event()
    install_signal_handlers(stop)
    poll = cfg.settings.leader_poll_interval
    replica = Replica(store, "", SERVICE_NAME, poll, sec) if isinstance(store, LeaderLock) else None
    metrics = ManagerMetrics()
    servicer = MemoryManagerServicer()
    manager: Manager | None = None
    srv: Server | None = None
    try:
        if settings.metrics_listen:
            host, port = _serve_metrics(metrics, settings.metrics_listen, sec.token)  # /metrics behind the token too
            announce(f"memsvc manager metrics on http://{host or '0.0.0.0'}:{port}/metrics")
        srv = await start_server(
            settings.listen,
            [lambda s: manager_grpc.add_MemoryManagerServiceServicer_to_server(servicer, s)],
            [SERVICE_NAME],
            [replica.interceptor()] if replica else (),
            sec,
        )
        await srv.set_serving(True)
        await srv.set_serving(False, SERVICE_NAME)  # until it leads
        announce(f"memsvc manager listening on {srv.address}")
        if replica is not None:
            replica.advertise = advertised(srv.address, settings.advertise or "", socket.gethostname)
            announce(f"memsvc manager replica {replica.advertise} on {store.where}: following until it leads")
            if not await replica.follow_until_leading(stop):
                await _close(srv, None, replica, store)
                announce("memsvc manager stopped")
                return 0
        # the manager dials its workers with its own TLS identity and token
        policy = {**cfg.policy_fields, **settings.policy_seed()}
        manager = Manager(store, cfg.settings, policy, cfg.workers, grpc_links(sec), metrics)
        await manager.start()
        servicer.lead(manager)
        if replica is not None:
            replica.lead()
            announce(f"memsvc manager replica {replica.advertise} leads")
        metrics.leader.set(1)
        await srv.set_serving(True, SERVICE_NAME)
    except MemsvcError as exc:
        await _close(srv, manager, replica, store)
        return _refuse(exc)
    lost = ""  # why this replica stopped leading, or "" for a stop by signal
    if replica is not None:
        lost = await replica.hold(stop)
    else:
        await stop.wait()
    metrics.leader.set(0)
    manager.hub.close()
    await _close(srv, manager, replica, store, grace=0.0 if lost else 5.0)
    if lost:
        announce(f"memsvc manager: error: stopped leading: {lost}", sys.stderr)
        return 1
    announce("memsvc manager stopped")
    return 0


async def _close(
    srv: Server | None, manager: Manager | None, replica: Replica | None, store: Store, grace: float = 0.0
) -> None:
    if srv is not None:
        await srv.stop(grace)
    if manager is not None:
        await manager.close()
    if replica is not None:
        await replica.close()
    store.close()


def _serve_metrics(metrics: ManagerMetrics, listen: str, token: str = "") -> tuple[str, int]:
    """The Prometheus endpoint; a bad ``--metrics-listen`` is a refusal like a bad ``--listen``."""
    try:
        return metrics.serve(listen, token=token)
    except (OSError, ValueError, OverflowError) as exc:
        raise InvalidArgument(f"cannot serve metrics on {listen!r}: {exc}") from exc


def _refuse(exc: MemsvcError) -> int:
    announce(f"memsvc manager: error: {exc}", sys.stderr)
    return 2


def run(settings: ServeSettings, security: Security | None = None) -> int:
    return run_service(serve(settings, security))
