"""``memsvc worker``: serve one model on one device until SIGTERM, then drain and exit.

Start-up order, for the time to serving: nothing this module imports loads torch (the model layer
is imported on first use, see worker/model/__init__.py), so the server listens at once and answers
health (NOT_SERVING) and GetWorkerStatus (LOADING) while the model loads. The model layer's imports
(torch, Triton, safetensors, tokenizers: seconds on a GPU host) start on a thread of their own before
the server does, and run while the load creates the allocator and its CUDA context and stages the
checkpoint in device memory (worker/staging.py), which the native layer does without holding the GIL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import importlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from memsvc.errors import Cancelled, InvalidArgument, MemsvcError
from memsvc.runtime.auth import Security
from memsvc.runtime.logs import announce, current_logging
from memsvc.runtime.serving import Server, install_signal_handlers, run_service, start_server
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.v1 import model_worker_service_pb2_grpc as worker_grpc
from worker.config import WorkerConfig
from worker.core import WorkerCore
from worker.model import first_products
from worker.model.text_source import TextInfo
from worker.prefetch import CheckpointPrefetch
from worker.rpc_front import FrontConfig, FrontProcess, drop_ahead
from worker.servicer import ModelWorkerServicer
from worker.token_mux import TokenMux

log = logging.getLogger("memsvc.worker")
EXIT_GRACE_S = 10.0
"""After SIGTERM the worker exits within its drain (``--drain-timeout``) plus this: device work that
never returns (a read of a hung network mount: a thread inside it cannot be stopped) would otherwise
hold the exit for ever, so the process then exits without it (exit code 1, one error line)."""
FRONT_WAIT_LOG_S = 30.0
"""While the worker waits for its RPC front to say it serves (a moment, normally), a warning this often."""
SERVICE_NAME = worker_pb.DESCRIPTOR.services_by_name["ModelWorkerService"].full_name
MODEL_LAYER = ("worker.model.runner", "worker.model.weights", "worker.model.paged_attention")
"""What the load imports (worker/core.py's _load): torch, numpy, safetensors (not the text's tokenizers and jinja2:
worker/model/text_source.py)."""
STARTUP_SWITCH_INTERVAL_S = 0.0005
"""The GIL's switch interval while the model layer imports (Python's default: 5 ms); see import_model_layer."""


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while the model layer imports, and everything made so far
    frozen after (``gc.freeze``: out of the collector's passes for good); the collector as it was then.

    Why: importing torch and the model layer makes some 175,000 objects, nearly all kept for the
    process's life. The collector's passes over them during the imports (3 full and 32 middle ones on
    a development machine: 0.14 s of a 1.3 s import) are on the start's critical path, and every full
    pass afterwards, a pause while serving, would scan them again. The collector is off for every
    thread meanwhile (the server's and the load's too, for the seconds the imports take), and the
    freeze takes whatever is alive then; what is garbage in cycles at that moment stays, once."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def import_model_layer(config: WorkerConfig, prefetch: CheckpointPrefetch | None = None) -> threading.Thread:
    """Import the model layer (and Triton, where the worker may use it) on a thread, now; the
    checkpoint's read-ahead (``prefetch``) stops once the model layer is in, when the load's own reads
    begin (worker/prefetch.py). Triton's hashes, which its first launch of each kernel would make on
    the device thread, are made meanwhile: its own on a second thread from the moment torch is in
    (read back where an earlier start kept it), the kernels' after the imports, while the weights load
    (worker/model/kernels.py's ``hash_ahead``). On CUDA, once torch is in, a third thread makes
    cuBLAS's first products of the model's shapes (worker/model/first_products.py).

    Why Triton's own hash waits for torch: reading it back is mostly importing Triton, which holds the
    GIL as ``import torch`` does, so beside it the two took turns and torch's import, the start's
    longest part, ended later (0.1-0.35 s on an H100 host, docs/benchmarks.md). After it, the hash runs
    while the load waits for cuBLAS's first products, which hold the GIL little. Where the key is not
    kept yet (the first start after Triton is installed or upgraded), making it then comes after
    torch's import too, and that start's warm-up may wait for it.

    The load imports the same modules and waits for this thread's imports where they are still
    running (Python's per-module import locks), so a failure here changes nothing: the load's own
    import raises it, with the message it always had.
    """

    hashing = None
    switch_interval = sys.getswitchinterval()
    if config.backend != "host":  # cuda, or auto, which is cuda where a GPU is
        # Beside the imports, which hold the GIL, threads that mostly run without it but take it back
        # often wait up to the switch interval (5 ms) each time: Triton's own hash where it is not
        # kept yet (worker/triton_key.py; it takes the GIL back twice per MB of a ~400 MB file) and
        # cuBLAS's first products (worker/model/first_products.py; several takes per product), both
        # from torch's import on, up to seconds in all. A shorter one while this thread runs lets
        # them finish beside it; put back when it ends.
        sys.setswitchinterval(STARTUP_SWITCH_INTERVAL_S)
        if importlib.util.find_spec("triton") is not None:
            hashing = threading.Thread(target=_hash_triton, name="memsvc-triton-hash", daemon=True)

    def run() -> None:
        t0 = time.perf_counter()
        try:
            try:
                with collector_paused():
                    if config.backend != "host":
                        importlib.import_module("torch")
                        if hashing is not None:
                            hashing.start()
                        _first_products(config)  # beside the rest of the imports, where there is a GPU
                    for name in MODEL_LAYER:
                        importlib.import_module(name)
            finally:
                if prefetch is not None:
                    prefetch.stop()
            t1 = time.perf_counter()
            log.info("model layer imported in %.2f s", t1 - t0)
            if hashing is not None:  # Triton is there, and the worker may use it (torch imported: started)
                importlib.import_module("triton")  # the hashing thread has it in already, or is importing it
                log.info("triton imported in %.2f s", time.perf_counter() - t1)
                t2 = time.perf_counter()
                from worker.model.kernels import load_ahead

                hashing.join()  # Triton's own hash, made beside the imports: its cache then holds it
                t3 = time.perf_counter()
                # the kernels' own, then those an earlier start of the model compiled, loaded while
                # the load waits for cuBLAS's first products (worker/model/kept_kernels.py)
                load_ahead(_model_key(config), config.device, waited=t3 - t2)
        except BaseException:  # noqa: BLE001 - the load's import (or the first kernel launch) reports it
            log.debug("importing the model layer failed; the load reports it", exc_info=True)
        finally:
            # this thread's end is the whole import's (serve() joins it before exiting)
            if hashing is not None and hashing.ident is not None:  # (not started where torch failed)
                hashing.join()
            first_products.settle()
            sys.setswitchinterval(switch_interval)

    thread = threading.Thread(target=run, name="memsvc-import", daemon=True)
    thread.start()
    return thread


def _first_products(config: WorkerConfig) -> None:
    """cuBLAS's first products of the model's shapes, on a thread from now (worker/model/first_products.py),
    at the row counts the warm-up's steps use: the CUDA graphs' buckets."""
    from worker.allocator import resolve_backend
    from worker.model.hub import cached_dir
    from worker.model.step_limits import WARM_UP_PROMPT, bucket_sizes, graph_rows, step_tokens

    if resolve_backend(config.backend) != "cuda":  # auto on a host without a GPU
        return
    if config.cuda_graphs:
        rows = bucket_sizes(
            config.max_batch, graph_rows(config.max_batch, step_tokens(config.max_batch, config.max_step_tokens))
        )
    else:  # the warm-up's generation alone: its prompt's step, then one-row decodes
        rows = (len(WARM_UP_PROMPT), 1)
    first_products.start(cached_dir(config.model), config.device, rows)


def _model_key(config: WorkerConfig) -> bytes | None:
    """What names the model's kept kernels (worker/model/kept_kernels.py): its ``config.json``, or a
    synthetic model's spec. None without a GPU, or where the model is not here yet (a Hub id whose
    snapshot the load will download)."""
    from worker.allocator import resolve_backend
    from worker.model.hub import cached_dir
    from worker.model.weights import SYNTHETIC_PREFIX

    if resolve_backend(config.backend) != "cuda":
        return None
    if config.model.startswith(SYNTHETIC_PREFIX):
        return config.model.encode()
    folder = cached_dir(config.model)
    try:
        return (folder / "config.json").read_bytes() if folder is not None else None
    except OSError:
        return None


def _hash_triton() -> None:
    """Triton's key of its own files (worker/model/kernels.py's hash_ahead says why) beside the model
    layer's imports once torch is in, read where an earlier start kept it (worker/triton_key.py), else
    made: it needs Triton alone (importing Triton's modules, whose import locks the import thread waits
    on if it comes to them first), and making it is mostly reading and hashing Triton's shared library."""
    t0 = time.perf_counter()
    try:
        from worker.triton_key import keep_triton_key

        how = "read back" if keep_triton_key() else "made"
        log.info("triton: its own hash %s in %.2f s", how, time.perf_counter() - t0)
    except Exception:  # noqa: BLE001 - moved or broken: the first kernel launch makes it, or reports it
        log.debug("triton's own hash was not made ahead", exc_info=True)


async def serve(
    config: WorkerConfig,
    listen: str,
    manager: str | None = None,
    advertise: str | None = None,
    security: Security | None = None,
) -> int:
    try:
        config.check_paths()  # before anything starts: "listening on" means the flags were accepted
    except MemsvcError as exc:
        announce(f"memsvc worker: error: {exc}", sys.stderr)
        return 2
    # A standby's start (worker/standby.py) has the model layer in, so the load reads at once: the
    # read-ahead and the staging (worker/staging.py), there to fill the import's wait, would only
    # stand between it and the page cache (staging 16 GB took 0.6 s, the load alone 0.45 s).
    imported = all(name in sys.modules for name in MODEL_LAYER)
    if imported and config.checkpoint_staging:
        log.info("checkpoint staging: none (the model layer was imported before this start)")
        config = dataclasses.replace(config, checkpoint_staging=False)
    importer = import_model_layer(config, None if imported else CheckpointPrefetch(config.model).start())
    try:
        return await _serve(config, listen, manager, advertise, security or Security())
    finally:
        # Not past interpreter exit (a worker that cannot listen or load exits at once): a daemon
        # thread stopped inside torch's import while the interpreter tears torch down may crash it.
        importer.join()


async def _serve(config: WorkerConfig, listen: str, manager: str | None, advertise: str | None, sec: Security) -> int:
    loop = asyncio.get_running_loop()
    in_front = config.rpc_front == "process"
    core = WorkerCore(config, loop, text_in_front=in_front)
    servicer = ModelWorkerServicer(core)
    sockets = tempfile.mkdtemp(prefix="memsvc-worker-") if in_front else ""
    # A stop signal from here on is a stop, not a kill: the load may already be reading.
    stop = asyncio.Event()
    install_signal_handlers(stop)
    # The load from now, beside the server's start (0.3 s: the RPC front's process starts and says it
    # serves): the allocator's CUDA context and the checkpoint's staging need neither, and the staging
    # must be done by the time the model layer's import is (worker/staging.py).
    load = asyncio.ensure_future(core.load())
    try:
        try:
            srv, front, address = await _listen(servicer, config, listen, sec, sockets)
        except BaseException as exc:
            await _end_load(core, load)
            if isinstance(exc, InvalidArgument):  # the address is taken or malformed: the user's, not a bug
                announce(f"memsvc worker: error: {exc}", sys.stderr)
                return 2
            raise
        relay = asyncio.ensure_future(_text_through(core, front)) if front is not None else None
        try:
            return await _run(core, load, stop, srv, front, address, config, manager, advertise, sec)
        finally:
            if relay is not None:
                relay.cancel()
    finally:
        if sockets:
            shutil.rmtree(sockets, ignore_errors=True)


async def _text_through(core: WorkerCore, front: FrontProcess) -> None:
    """The model's text through the RPC front (worker/front_text.py): where it is, to the front as
    soon as the load knows; what the front found there, to the load, which waits for it; then the
    decoding the front wrote for the engine, whenever it says."""
    try:
        where = await asyncio.wrap_future(core.text_source)
    except asyncio.CancelledError:
        if core.text_source.cancelled():  # the load ended before it knew: nothing to read
            return
        raise
    front.tell_text(where)
    found: TextInfo | BaseException
    try:
        found = await front.text_found()
    except MemsvcError as exc:
        found = exc
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # the load was cancelled meanwhile
        if isinstance(found, BaseException):
            core.text_found.set_exception(found)
        else:
            core.text_found.set_result(found)
    if not isinstance(found, BaseException):
        core.decode_with(await front.decoding_written())


async def _listen(
    servicer: ModelWorkerServicer, config: WorkerConfig, listen: str, sec: Security, sockets: str
) -> tuple[Server, FrontProcess | None, str]:
    """The servers: this process's on ``listen``, or, with the RPC front in a process of its own
    (``sockets`` its socket's directory), this one's on a unix socket and the front's on ``listen``.
    The servers and the address clients dial."""
    register: list[Callable[[grpc.aio.Server], None]] = [
        lambda s: worker_grpc.add_ModelWorkerServiceServicer_to_server(servicer, s)
    ]
    if not sockets:
        drop_ahead()  # a standby's front, started ahead for a worker that turned out to serve inline
        srv = await start_server(listen, register, [SERVICE_NAME], security=sec)
        return srv, None, srv.address
    inner = f"unix:{sockets}/device.sock"
    srv = await start_server(inner, [*register, TokenMux(servicer).register], [SERVICE_NAME])
    try:
        front = await FrontProcess.start(
            FrontConfig(
                listen, inner, config.drain_seconds, dataclasses.asdict(sec), *current_logging(), sockets, os.getpid()
            )
        )
    except BaseException:
        await srv.stop(0)
        raise
    return srv, front, front.address


async def _end_load(core: WorkerCore, load: asyncio.Future[None]) -> None:
    """Stop the load, which the worker will not serve (it is stopping, or its server did not start):
    its reads end at their next poll; whatever it made is released, if it ends within the waits here
    (both waits together: three quarters of :data:`EXIT_GRACE_S`)."""
    core.cancel_loads()
    await asyncio.wait({load}, timeout=EXIT_GRACE_S / 2)
    if load.done():  # (it may have ended loaded, in the race with the stop): release what it made
        failed = None if load.cancelled() else load.exception()
        if failed is not None and not isinstance(failed, Cancelled):
            log.debug("the load, ended unserved, had failed: %s", failed)
        await asyncio.wait({asyncio.ensure_future(core.close())}, timeout=EXIT_GRACE_S / 4)


async def _run(
    core: WorkerCore,
    load: asyncio.Future[None],
    stop: asyncio.Event,
    srv: Server,
    front: FrontProcess | None,
    address: str,
    config: WorkerConfig,
    manager: str | None,
    advertise: str | None,
    sec: Security,
) -> int:
    async def stop_servers(grace: float) -> None:
        if front is not None:  # first: its calls in flight are served here until they end
            await front.stop(grace)
        await srv.stop(grace)

    await srv.set_serving(False)
    await srv.set_serving(False, SERVICE_NAME)
    announce(f"memsvc worker {core.worker_id} listening on {address}")
    front_lost: list[int] = []
    if front is not None:

        def lost(exited: asyncio.Future[int]) -> None:
            if not stop.is_set():
                log.error("the RPC front exited (code %s) while serving; stopping", exited.result())
                front_lost.append(1)
                stop.set()

        asyncio.ensure_future(front.wait()).add_done_callback(lost)
    stopping = asyncio.ensure_future(stop.wait())
    either: set[asyncio.Future[Any]] = {load, stopping}
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if not load.done():  # stopped while loading: the load stops at its next read (or is left behind)
        _exit_by(EXIT_GRACE_S)
        log.info("stopping while the model loads")
        await _end_load(core, load)
        await stop_servers(0)
        announce(f"memsvc worker {core.worker_id} stopped")
        return 1 if front_lost else 0
    stopping.cancel()
    try:
        load.result()
    except MemsvcError as exc:  # the user's model or flags (no such directory, a config it cannot serve)
        announce(f"memsvc worker: error: cannot load {config.model}: {exc}", sys.stderr)
        await stop_servers(0)
        return 2
    except Exception:  # a bug: its traceback is what a report needs
        log.exception("loading the model failed")
        await stop_servers(0)
        return 1
    await srv.set_serving(True)
    await srv.set_serving(True, SERVICE_NAME)
    background: list[asyncio.Task[None]] = []
    if front is None or await _front_serving(front, stop):
        device = core.status().device  # the load made it: the model serves
        announce(
            f"memsvc worker {core.worker_id} ready: {config.model} on {device.backend if device else config.backend}"
        )
        if manager:
            from worker.registration import keep_registered

            background.append(asyncio.create_task(keep_registered(core, advertise or address, manager, sec)))
    await stop.wait()
    _exit_by(config.drain_seconds + EXIT_GRACE_S)
    log.info("draining: finishing in-flight calls (up to %.0f s)", config.drain_seconds)
    for task in background:
        task.cancel()
    core.telemetry.close()  # end telemetry streams now; the drain waits only for real work
    await core.end_paused()  # paused requests would wait the whole drain for a wake
    await stop_servers(config.drain_seconds)  # then cancels what still runs: a Generate stops at its next step
    core.cancel_loads()  # a reload or a level-2 wake still reading stops at its next read
    await core.close()
    announce(f"memsvc worker {core.worker_id} stopped")
    return 1 if front_lost else 0


async def _front_serving(front: FrontProcess, stop: asyncio.Event) -> bool:
    """Wait until the RPC front answers health checks with SERVING (it mirrors this process's health a
    moment after this process sets it): True then; False if the stop came first or the front exited
    (its end stops this process too). Logged every :data:`FRONT_WAIT_LOG_S` while it waits."""
    mirrored = asyncio.ensure_future(front.serving())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        while not mirrored.done() and not stopping.done():
            await asyncio.wait({mirrored, stopping}, timeout=FRONT_WAIT_LOG_S, return_when=asyncio.FIRST_COMPLETED)
            if not mirrored.done() and not stopping.done():
                log.warning("the RPC front has not said it serves yet; waiting for it")
    finally:
        stopping.cancel()
        mirrored.cancel()
    return mirrored.done() and not mirrored.cancelled() and mirrored.result() and not stop.is_set()


def _exit_by(seconds: float) -> None:
    """Exit the process ``seconds`` from now if it has not exited by then (see :data:`EXIT_GRACE_S`)."""

    def force() -> None:
        msg = f"memsvc worker: error: still running {seconds:.0f} s after the stop signal (device work that does"
        announce(f"{msg} not return, e.g. a read of a hung mount); exiting without it", sys.stderr)
        os._exit(1)

    timer = threading.Timer(seconds, force)
    timer.daemon = True  # the process's normal exit does not wait for it
    timer.start()


def run(
    config: WorkerConfig,
    listen: str,
    manager: str | None,
    advertise: str | None = None,
    security: Security | None = None,
) -> int:
    return run_service(serve(config, listen, manager, advertise, security))
