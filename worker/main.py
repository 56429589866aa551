"""``memsvc worker``: serve one model on one device until SIGTERM, then drain and exit."""

from __future__ import annotations

import asyncio
import logging
import sys

from memsvc._auth import Security
from memsvc._serving import ignore_stop_signals, install_signal_handlers, start_server
from memsvc.errors import MemsvcError
from memsvc.v1 import model_worker_service_pb2 as w
from memsvc.v1 import model_worker_service_pb2_grpc as w_grpc
from worker.config import WorkerConfig
from worker.core import WorkerCore
from worker.servicer import ModelWorkerServicer

log = logging.getLogger("memsvc.worker")
SERVICE_NAME = w.DESCRIPTOR.services_by_name["ModelWorkerService"].full_name


async def serve(
    config: WorkerConfig,
    listen: str,
    manager: str | None = None,
    advertise: str | None = None,
    security: Security | None = None,
) -> int:
    sec = security or Security()
    loop = asyncio.get_running_loop()
    core = WorkerCore(config, loop)
    servicer = ModelWorkerServicer(core)
    srv = await start_server(
        listen, [lambda s: w_grpc.add_ModelWorkerServiceServicer_to_server(servicer, s)], [SERVICE_NAME], security=sec
    )
    await srv.set_serving(False)
    await srv.set_serving(False, SERVICE_NAME)
    print(f"memsvc worker {core.worker_id} listening on {srv.address}", flush=True)
    stop = asyncio.Event()
    install_signal_handlers(stop)
    try:
        await core.load()
    except MemsvcError as exc:  # the user's model or flags (no such directory, a config it cannot serve)
        print(f"memsvc worker: error: cannot load {config.model}: {exc}", file=sys.stderr, flush=True)
        await srv.stop(0)
        return 2
    except Exception:  # a bug: its traceback is what a report needs
        log.exception("loading the model failed")
        await srv.stop(0)
        return 1
    await srv.set_serving(True)
    await srv.set_serving(True, SERVICE_NAME)
    print(f"memsvc worker {core.worker_id} ready: {config.model} on {core.status().device['backend']}", flush=True)
    background: list[asyncio.Task[None]] = []
    if manager:
        from worker.registration import keep_registered

        background.append(asyncio.create_task(keep_registered(core, advertise or srv.address, manager, sec)))
    await stop.wait()
    log.info("draining: finishing in-flight calls (up to %.0f s)", config.drain_seconds)
    for task in background:
        task.cancel()
    core.telemetry.close()  # end telemetry streams now; the drain waits only for real work
    await srv.stop(config.drain_seconds)  # then cancels what still runs: a Generate stops at its next step
    await core.close()
    print(f"memsvc worker {core.worker_id} stopped", flush=True)
    return 0


def run(
    config: WorkerConfig,
    listen: str,
    manager: str | None,
    advertise: str | None = None,
    security: Security | None = None,
) -> int:
    try:
        return asyncio.run(serve(config, listen, manager, advertise, security))
    finally:
        ignore_stop_signals()
