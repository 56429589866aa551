"""The ``memsvc`` command: every command put together, the one module that imports each service's
command (the worker's through worker/command.py alone). Beside it, only ``memsvc up`` reaches into
the services: its host file checks a policy as the manager does and writes it as the manager's
wire module does, and it asks the native layer whether there is a GPU (tests/test_package_layers.py).

memsvc up                      manager + one worker on this machine (embedded defaults)
memsvc manager | worker        the two services
memsvc status | sleep | wake | watch | leases | release | deregister | prune
                               operate a running manager (--manager or $MEMSVC_MANAGER)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from memsvc.runtime.flags import (
    EnvDefault,
    Parser,
    add_settings,
    duration,
    env_bools,
    listen_address,
    listen_or_none,
    non_negative_seconds,
    settings_from,
)
from memsvc.runtime.service_flags import (
    SERVICES,
    bytecode_flag,
    client_auth_flags,
    keep_bytecode_before_parsing,
    log_flags,
    security_from_args,
    security_kwargs,
    server_auth_flags,
    use_bytecode_cache,
)

if TYPE_CHECKING:  # the CLI imports these where a command needs them: --help stays fast
    from google.protobuf.message import Message
    from rich.console import Console
    from rich.table import Table

    from memsvc.client import ManagerClient
    from memsvc.runtime.auth import Security
    from memsvc.v1 import memory_manager_service_pb2 as manager_pb


def _gateway_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from memsvc.gateway import Settings

    p = sub.add_parser("gateway", help="serve the OpenAI-compatible HTTP API in front of a manager's workers")
    add_settings(p, Settings)  # Settings' fields
    client_auth_flags(p)
    log_flags(p)
    bytecode_flag(p)


def _manager_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from memsvc.manager.serve_settings import ServeSettings

    p = sub.add_parser("manager", help="serve MemoryManagerService")
    add_settings(p, ServeSettings)  # ServeSettings' fields
    server_auth_flags(p)
    log_flags(p)
    bytecode_flag(p)


def _manager_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--manager", default=None, help="manager address (default $MEMSVC_MANAGER or 127.0.0.1:50051)")


def _ops_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    for name, text in (("status", "list workers"), ("watch", "live table of workers")):
        p = sub.add_parser(name, help=text)
        _manager_flag(p)
        if name == "status":
            p.add_argument(
                "--json", action="store_true", help="ListWorkers as JSON (the proto JSON mapping, .proto field names)"
            )
        client_auth_flags(p)
    p = sub.add_parser("leases", help="list the live leases (an operator who lost a lease id finds it here)")
    p.add_argument("--worker", default="", help="only this worker's")
    p.add_argument("--json", action="store_true", help="ListLeases as JSON (the proto JSON mapping)")
    _manager_flag(p)
    client_auth_flags(p)
    p = sub.add_parser("release", help="end a lease now (ReleaseWorker)")
    p.add_argument("lease_id")
    _manager_flag(p)
    client_auth_flags(p)
    p = sub.add_parser(
        "deregister",
        help="forget a worker (DeregisterWorker): a stopped one's model stops being listed; refused while leased",
    )
    p.add_argument("worker", help="worker id (or workers/<id>)")
    _manager_flag(p)
    client_auth_flags(p)
    p = sub.add_parser("prune", help="deregister every unreachable worker (stale registrations of stopped workers)")
    p.add_argument(
        "--unavailable", action="store_true", help="the workers to prune: those UNAVAILABLE (required: says what goes)"
    )
    p.add_argument(
        "--older-than",
        type=duration,
        default=0.0,
        help="only those not seen for this long: 90s, 10m, 2h, 1d (default: every unavailable one)",
    )
    _manager_flag(p)
    client_auth_flags(p)
    p = sub.add_parser("sleep", help="put a worker to sleep")
    p.add_argument("worker")
    p.add_argument("--level", type=int, choices=[1, 2], default=None, help="default: the policy's tag actions")
    _manager_flag(p)
    client_auth_flags(p)
    p = sub.add_parser("wake", help="wake a worker")
    p.add_argument("worker")
    p.add_argument("--tags", nargs="*", default=[], help="wake only these tags")
    _manager_flag(p)
    client_auth_flags(p)
    p = sub.add_parser(
        "health", help="grpc.health.v1 check, or an HTTP GET; exit 0 when SERVING or 2xx (container health checks)"
    )
    p.add_argument("address", help="host:port (gRPC), or an http:// URL (the gateway's /healthz)")
    p.add_argument("--service", default="", help="service name ('' = the whole server)")
    p.add_argument("--timeout", type=non_negative_seconds, default=3.0, help="seconds to wait for the answer")
    client_auth_flags(p)
    p = sub.add_parser("up", help="run a manager, one worker and the OpenAI gateway on this machine")
    p.add_argument(
        "--manager-listen",
        type=listen_address,
        default="127.0.0.1:50051",
        help="host:port the manager serves gRPC on (the worker and the gateway dial it there)",
    )
    p.add_argument(
        "--worker-listen", type=listen_address, default="127.0.0.1:50061", help="host:port the worker serves gRPC on"
    )
    p.add_argument(
        "--metrics-listen",
        type=listen_or_none,
        default="127.0.0.1:9400",
        help="host:port of the manager's Prometheus /metrics ('': none)",
    )
    p.add_argument(
        "--gateway-listen",
        type=listen_or_none,
        default="127.0.0.1:8000",
        help="the OpenAI-compatible HTTP gateway ('': none)",
    )
    p.add_argument("--state-dir", default=".memsvc", help="where the manager keeps its database")
    p.add_argument(
        "--config",
        default=None,
        help="a host file (TOML or YAML) of models to serve, one worker each, with the policy and the "
        "manager's and gateway's addresses (docs/operations.md, 'One host, many models'); the flags above "
        "and --model, --backend and the idle timeouts are then the file's to say",
    )
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint dir or Hub id (default: synthetic:1b on a GPU, synthetic:small without)",
    )
    p.add_argument(
        "--backend",
        choices=["auto", "cuda", "host"],
        default="auto",
        help="the worker's: cuda, host (CPU memory), or auto: cuda when a GPU is present",
    )
    p.add_argument(
        "--idle-sleep-timeout",
        type=non_negative_seconds,
        default=300.0,
        help="seconds idle before a worker sleeps (tier 1, level 1; 0: never)",
    )
    p.add_argument(
        "--idle-deep-sleep-timeout",
        type=non_negative_seconds,
        default=3600.0,
        help="seconds idle before a sleeper drops to level 2 (tier 2; 0: never)",
    )
    log_flags(p)
    bytecode_flag(p)
    g = p.add_argument_group("auth (passed to both services; see memsvc manager --help)")
    g.add_argument("--token-file", default=None, help="bearer token file for both services and their channels")
    g.add_argument("--tls-cert", default=None, help="certificate (SAN 127.0.0.1) both services serve TLS with")
    g.add_argument("--tls-key", default=None, help="key of --tls-cert (PEM)")
    g.add_argument("--tls-ca", default=None, help="CA the manager and the worker verify each other with")
    g.add_argument(
        "--tls-client-ca",
        default=None,
        help="require client certificates (mTLS; --tls-cert is then the "
        "client certificate too, so it needs the clientAuth usage)",
    )


def _status_table(workers: Sequence[manager_pb.Worker], title: str = "memsvc workers") -> Table:
    from rich.table import Table

    from memsvc.client import human_bytes, state_name
    from memsvc.vocabulary import KV_CACHE, WEIGHTS

    table = Table(title=title)
    # waiting: AcquireWorker calls waiting for it to wake; paused: its Generate calls paused by a turn
    # given up (memsvc/manager/turns.py); turns: the turns it gave up
    left = ("worker", "state", "address")
    for col in (*left, "leases", "waiting", "paused", "turns", "weights", "kv cache", "offloaded", "device free"):
        table.add_column(col, justify="left" if col in left else "right")
    for wk in workers:
        tags = {t.tag: t for t in wk.status.tags}
        off = sum(t.offloaded_bytes for t in wk.status.tags)
        table.add_row(
            wk.name.removeprefix("workers/"),
            state_name(wk.state),
            wk.address,
            str(wk.lease_count),
            str(wk.waiting_acquires),
            str(wk.status.paused_generations),
            str(wk.turns_yielded),
            human_bytes(tags[WEIGHTS].mapped_bytes) if WEIGHTS in tags else "-",
            human_bytes(tags[KV_CACHE].mapped_bytes) if KV_CACHE in tags else "-",
            human_bytes(off),
            human_bytes(wk.status.device.free_bytes),
        )
    return table


def _up_child_vars(args: argparse.Namespace) -> dict[str, str]:
    """``memsvc up``'s auth and logging flags as the MEMSVC_* variables of every child."""
    return {
        **{
            f"MEMSVC_{name.upper()}": os.path.abspath(value)
            for name in ("token_file", "tls_cert", "tls_key", "tls_ca", "tls_client_ca")
            if (value := getattr(args, name))
        },
        "MEMSVC_LOG_LEVEL": args.log_level,
        "MEMSVC_LOG_FORMAT": args.log_format,
        "MEMSVC_BYTECODE_CACHE": args.bytecode_cache,
    }


def _print_json(message: Message) -> None:
    """``--json``: the message in the proto JSON mapping, with the .proto's field names."""
    import json

    from google.protobuf import json_format

    print(json.dumps(json_format.MessageToDict(message, preserving_proto_field_name=True), indent=2))


def _lease_table(leases: Sequence[manager_pb.Lease]) -> Table:
    import time

    from rich.table import Table

    table = Table(title="memsvc leases")
    for col in ("lease", "worker", "holder", "expires in"):
        table.add_column(col, justify="right" if col == "expires in" else "left", overflow="fold")
    now = time.time()
    for lease in leases:
        left = lease.expire_time.ToNanoseconds() / 1e9 - now
        table.add_row(lease.lease_id, lease.worker.removeprefix("workers/"), lease.holder, f"{max(left, 0):.0f} s")
    return table


def _already_there(command: str, tags: Sequence[str], worker: manager_pb.Worker) -> bool:
    """A refused ``memsvc sleep``/``wake`` whose worker is already where it asked: asleep (with no
    lease, which would be the refusal's reason), or awake, or every tag it named awake."""
    from memsvc.vocabulary import TagState, WorkerState

    state = WorkerState.of(worker.state)
    if command == "sleep":
        return state == WorkerState.ASLEEP and worker.lease_count == 0
    awake = {t.tag for t in worker.status.tags if t.state == TagState.AWAKE.proto}
    return state == WorkerState.AWAKE or (bool(tags) and set(tags) <= awake)


def _prune(client: ManagerClient, older_than_s: float, console: Console) -> int:
    """Deregister the UNAVAILABLE workers not seen for ``older_than_s``: a stopped worker stays
    registered (its model listed, the gateway answering 503 for it) until someone forgets it.
    Workers from the manager's config file are kept (they would come back with its next start);
    a leased one is refused by the manager and reported: exit 1 if any was."""
    import time

    from memsvc.errors import MemsvcError
    from memsvc.vocabulary import WorkerState

    now, failed, pruned = time.time(), 0, 0
    for wk in client.workers():
        if WorkerState.of(wk.state) != WorkerState.UNAVAILABLE:
            continue
        unseen = now - wk.last_seen_time.ToNanoseconds() / 1e9
        if unseen < older_than_s:
            continue
        if wk.configured:
            console.print(f"kept {wk.name}: it is in the manager's config file")
            continue
        try:
            client.deregister(wk.name)
        except MemsvcError as exc:
            console.print(f"[red]error[/red] ({exc.status_name}): {wk.name}: {exc}")
            failed += 1
            continue
        console.print(f"deregistered {wk.name} (unavailable, last seen {unseen:.0f} s ago)")
        pruned += 1
    if not pruned and not failed:
        console.print("nothing to prune: no unavailable worker" + (" that old" if older_than_s else ""))
    return 1 if failed else 0


def _ops(args: argparse.Namespace, sec: Security) -> int:
    from rich.console import Console

    from memsvc.client import ManagerClient, state_name, worker_name
    from memsvc.errors import MemsvcError, WrongState

    console = Console(width=None if sys.stdout.isatty() else 200)  # pipes and logs get whole addresses
    try:
        with ManagerClient(args.manager, security=sec) as client:
            if args.command == "status" and args.json:
                from memsvc.v1 import memory_manager_service_pb2 as manager_pb

                _print_json(manager_pb.ListWorkersResponse(workers=client.workers()))
            elif args.command == "status":
                workers = client.workers()
                if workers:
                    console.print(_status_table(workers))
                else:
                    console.print(f"no workers are registered with the manager at {client.address}")
            elif args.command == "leases":
                leases = client.leases(args.worker)
                if args.json:
                    from memsvc.v1 import memory_manager_service_pb2 as manager_pb

                    _print_json(manager_pb.ListLeasesResponse(leases=leases))
                else:
                    console.print(_lease_table(leases))
            elif args.command == "release":
                worker = client.release(args.lease_id)
                console.print(f"released {args.lease_id}: {worker.name} holds {worker.lease_count} lease(s) now")
            elif args.command == "deregister":
                client.deregister(args.worker)
                console.print(f"deregistered {worker_name(args.worker)}")
            elif args.command == "prune":
                return _prune(client, args.older_than, console)
            elif args.command in ("sleep", "wake"):
                try:
                    if args.command == "sleep":
                        done = client.sleep(args.worker, args.level or 0)
                        worker, t = done.worker, done.transition
                    else:
                        woke = client.wake(args.worker, args.tags)
                        worker, t = woke.worker, woke.transition
                except WrongState:
                    # Refused because it is already there (the RPCs say FAILED_PRECONDITION): done, as
                    # vLLM's /wake_up and Ollama's loads are; any other refusal stays an error.
                    current = client.worker(args.worker)
                    if not _already_there(args.command, getattr(args, "tags", []), current):
                        raise
                    console.print(f"{current.name}: already {state_name(current.state)}")
                    return 0
                console.print(
                    f"{worker.name}: {state_name(worker.state)} "
                    f"({t.moved_bytes} bytes in {t.duration.ToNanoseconds() / 1e9:.3f} s)"
                )
            elif args.command == "watch":
                from rich.live import Live

                latest: dict[str, manager_pb.Worker] = {}
                stream = client.watch()
                # Ctrl-C ends the stream, so the loop below ends and the table closes as it should
                previous = signal.signal(signal.SIGINT, lambda *_: stream.cancel())
                try:
                    with Live(_status_table([]), console=console, refresh_per_second=4) as live:
                        for event in stream:
                            latest[event.worker.name] = event.worker
                            live.update(_status_table(list(latest.values())))
                finally:
                    signal.signal(signal.SIGINT, previous)
    except MemsvcError as exc:
        console.print(f"[red]error[/red] ({exc.status_name}): {exc}")
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


def _health(address: str, service: str, timeout: float, sec: Security) -> int:
    if address.startswith(("http://", "https://")):
        return _http_health(address, timeout)
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from memsvc.runtime.auth import channel as auth_channel

    with auth_channel(address, sec) as channel:
        try:
            r = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as err:
            print(f"{address}: {err.code().name}", file=sys.stderr)
            return 1
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)}")
    return 0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1


def _http_health(url: str, timeout: float) -> int:
    """GET ``url``: 0 on a 2xx answer (the gateway's /healthz, which has no gRPC health service)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - an operator's own URL
            status = int(resp.status)
    except urllib.error.HTTPError as err:
        status = err.code
    except (urllib.error.URLError, OSError) as err:
        print(f"{url}: {getattr(err, 'reason', err)}", file=sys.stderr)
        return 1
    print(f"{url}: HTTP {status}")
    return 0 if 200 <= status < 300 else 1


def build_parser() -> argparse.ArgumentParser:
    """Every command's flags. Defaults from MEMSVC_* variables stay strings here and are converted
    with the flag's own type when its command is parsed, so a bad variable is that command's usage
    error (one line, exit 2), never a crash of every command (``--help`` included)."""
    parser = Parser(prog="memsvc", description="Sleep and wake LLM model workers.")
    parser.add_argument("--version", action=_VersionAction, nargs=0, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    from worker import command as worker_command  # here: importing memsvc.cli loads no worker (stubs-only installs)

    worker_command.add_parser(sub)
    _manager_parser(sub)
    _gateway_parser(sub)
    _ops_parsers(sub)
    return parser


_UNSET_WHEN_EMPTY = ("manager", "advertise")
"""Flags whose empty default (no variable set, or set to "") means "none": None to the services (the
worker's and the ops commands'; settings dataclasses say it with their flag's type, ``text_or_none``)."""


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    env_bools(args, parser)
    for dest, value in vars(args).items():
        if isinstance(value, EnvDefault):  # its variable was for --help: the services get plain values
            setattr(args, dest, None if value == "" and dest in _UNSET_WHEN_EMPTY else str(value))
    return args


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("memsvc")
    except PackageNotFoundError:
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """``--version``, looked up only when asked for: the lookup (importlib.metadata, a scan of the
    installed distributions) took 12-22 ms of every command's start, a worker's before its model
    layer's import begins."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(f"memsvc {_version()}")  # on stdout, as argparse's own version action writes it
        parser.exit()


EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "worker": ("worker", ("numpy", "torch", "safetensors", "tokenizers", "jinja2")),
    "up": ("worker,gateway", ("numpy", "torch", "safetensors", "tokenizers", "jinja2", "fastapi", "uvicorn")),
    "gateway": ("gateway", ("fastapi", "uvicorn")),
}
"""What each command imports beyond the stub-only install: the extra that brings it, and its modules."""


def _require_extra(parser: argparse.ArgumentParser, command: str) -> None:
    """A usage error naming the extra to install, instead of a ModuleNotFoundError from deep inside."""
    import importlib.util

    if command not in EXTRAS:
        return
    extra, modules = EXTRAS[command]
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken package
            found = False
        if not found:
            missing.append(name)
    if missing:
        parser.exit(
            2,
            f"memsvc {command}: error: this command needs the {extra!r} extra (missing: "
            f"{', '.join(missing)}): pip install 'memsvc[{extra}]'\n",
        )


def main(argv: Sequence[str] | None = None) -> int:
    kept = keep_bytecode_before_parsing(sys.argv[1:] if argv is None else argv)  # before the parser's imports
    parser = build_parser()
    args = parse(parser, argv)
    _require_extra(parser, args.command)
    if args.command in SERVICES:
        from memsvc.runtime.logs import configure

        configure(args.log_level, args.log_format)
    if args.command in SERVICES:  # memsvc up passes it to these, each says so
        use_bytecode_cache(args.bytecode_cache, kept)
    if args.command == "manager":
        from memsvc.manager.main import run as run_manager
        from memsvc.manager.serve_settings import ServeSettings

        sec = security_from_args(args, parser, server=True)
        return run_manager(ServeSettings(**settings_from(ServeSettings, args)), **security_kwargs(sec))
    if args.command == "gateway":
        from memsvc.gateway import Settings
        from memsvc.gateway import run as run_gateway

        return run_gateway(Settings(**settings_from(Settings, args), security=security_from_args(args, parser)))
    if args.command == "up" and args.config:
        from memsvc._host import run_host

        if args.model is not None:
            parser.error("up: --config names the models; leave --model out (or use it without --config)")

        return run_host(args.config, _up_child_vars(args))
    if args.command == "up":
        from memsvc._up import run as run_up

        return run_up(
            args.manager_listen,
            args.worker_listen,
            args.metrics_listen,
            args.state_dir,
            args.model,
            args.backend,
            args.idle_sleep_timeout,
            args.idle_deep_sleep_timeout,
            _up_child_vars(args),
            args.gateway_listen,
        )
    if args.command == "health":
        return _health(args.address, args.service, args.timeout, security_from_args(args, parser))
    if args.command == "prune" and not args.unavailable:
        parser.error("say what to prune: --unavailable (the workers the manager cannot reach)")
    if args.command in ("status", "sleep", "wake", "watch", "leases", "release", "deregister", "prune"):
        return _ops(args, security_from_args(args, parser))
    if args.command == "worker":
        from worker import command as worker_command

        return worker_command.main(parser, args, lambda argv: parse(parser, argv))
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
