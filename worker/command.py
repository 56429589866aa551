"""``memsvc worker``: its flags and what the command does with them; the service itself is
worker/main.py, a standby's preparation worker/standby.py.

memsvc.cli, which puts every command together, imports this module and nothing else of the worker;
the flags of the model and how it is served are :class:`~worker.config.WorkerConfig`'s fields, the
rest are here. Importing it loads neither torch nor the native extension.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from memsvc.errors import InvalidArgument
from memsvc.runtime.flags import add_settings, env, listen_address, settings_from
from memsvc.runtime.logs import announce, configure
from memsvc.runtime.service_flags import (
    bytecode_flag,
    log_flags,
    security_from_args,
    security_kwargs,
    server_auth_flags,
)
from worker.config import WorkerConfig

Reparse = Callable[[Sequence[str]], argparse.Namespace]
"""Parses a whole ``memsvc`` command line as the CLI does (its ``MEMSVC_*`` defaults included): how a
standby reads the flags it is handed."""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``memsvc worker``'s flags, a subcommand of ``sub``."""
    p = sub.add_parser("worker", help="serve one model on one device (ModelWorkerService)")
    p.add_argument(
        "--listen",
        type=listen_address,
        default=env("WORKER_LISTEN", "127.0.0.1:50061"),
        help="host:port to serve on (0: any port)",
    )
    add_settings(p, WorkerConfig)  # the model and how it is served: WorkerConfig's fields
    p.add_argument("--manager", default=env("MANAGER", ""), help="manager address to register with (host:port)")
    p.add_argument(
        "--advertise",
        default=env("ADVERTISE", ""),
        help="address the manager should dial (default: the listen address)",
    )
    p.add_argument(
        "--standby",
        action="store_true",
        help="start before the model is known: import the model layer and make --device's CUDA context, then read "
        "this worker's flags (a JSON list, one line) from stdin and serve as if started with them; memsvc up's warm "
        "processes ([workers] standby = true)",
    )
    server_auth_flags(p, worker=True)
    log_flags(p)
    bytecode_flag(p)


def main(parser: argparse.ArgumentParser, args: argparse.Namespace, reparse: Reparse) -> int:
    """Run the command ``args`` (of ``parser``) says: a standby, prepared then handed its flags, or
    the worker; its exit code."""
    if args.standby:
        return _standby(parser, args, reparse)
    return _serve(parser, args)


def _standby(parser: argparse.ArgumentParser, args: argparse.Namespace, reparse: Reparse) -> int:
    """``memsvc worker --standby`` (worker/standby.py): prepared, then the worker its flags say."""
    from worker.standby import wait_for_flags

    try:
        flags = wait_for_flags(args.backend, args.device)
    except InvalidArgument as exc:
        announce(f"memsvc worker: error: {exc}", sys.stderr)
        return 2
    if flags is None:
        return 0
    handed = reparse(["worker", *flags])
    if (handed.backend, handed.device) != (args.backend, args.device):
        prepared, named = (f"--backend {a.backend} --device {a.device}" for a in (args, handed))
        announce(f"memsvc worker: error: this standby was prepared for {prepared}; its flags name {named}", sys.stderr)
        return 2
    configure(handed.log_level, handed.log_format)  # the worker's own, as its flags say
    return _serve(parser, handed)


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Its flags as a WorkerConfig, then the service until it stops."""
    from worker.main import run

    if args.max_step_tokens is not None and args.max_step_tokens < args.max_batch:
        parser.error("--max-step-tokens must be >= --max-batch (every running request feeds a token per step)")
    config = WorkerConfig(**settings_from(WorkerConfig, args))
    sec = security_from_args(args, parser, server=True)
    return run(config, args.listen, args.manager, args.advertise, **security_kwargs(sec))


__all__ = ["Reparse", "add_parser", "main"]
