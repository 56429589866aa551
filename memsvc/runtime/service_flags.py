"""The flags every service command shares (auth, logging, compiled modules) and what a command does
with them before its service starts. memsvc.cli's manager and gateway commands and the worker's own
(worker/command.py) build on it, so each flag is written once.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from memsvc.runtime.bytecode import default_dir as default_bytecode_dir
from memsvc.runtime.flags import env

if TYPE_CHECKING:
    from memsvc.runtime.auth import Security


def client_auth_flags(p: argparse.ArgumentParser) -> None:
    """How this command dials a memsvc server (memsvc.runtime.auth; off by default)."""
    g = p.add_argument_group("auth (client side)")
    g.add_argument(
        "--token-file",
        default=env("TOKEN_FILE", ""),
        help="file holding the bearer token (default $MEMSVC_TOKEN_FILE, else the token in $MEMSVC_TOKEN)",
    )
    g.add_argument("--tls-ca", default=env("TLS_CA", ""), help="CA (PEM) that verifies servers: dial with TLS")
    g.add_argument(
        "--tls-client-cert", default=env("TLS_CLIENT_CERT", ""), help="client certificate for mTLS servers (PEM)"
    )
    g.add_argument("--tls-client-key", default=env("TLS_CLIENT_KEY", ""), help="key of --tls-client-cert (PEM)")


def server_auth_flags(p: argparse.ArgumentParser, worker: bool = False) -> None:
    """Token and TLS of a server; the same settings configure its outgoing channels."""
    client_auth_flags(p)
    g = p.add_argument_group("auth (server side)")
    g.add_argument("--tls-cert", default=env("TLS_CERT", ""), help="serve TLS with this certificate chain (PEM)")
    g.add_argument("--tls-key", default=env("TLS_KEY", ""), help="key of --tls-cert (PEM)")
    g.add_argument(
        "--tls-client-ca",
        default=env("TLS_CLIENT_CA", ""),
        help="require client certificates signed by this CA (mTLS)",
    )
    if worker:
        g.add_argument(
            "--allowed-client",
            default=env("ALLOWED_CLIENT", ""),
            help="with mTLS: the only client certificate name(s) (CN or SAN, comma-separated) allowed to call "
            "Sleep, WakeUp, ReloadWeights, SwapBlocks, FreeSequence (e.g. the manager's CN)",
        )


def log_flags(p: argparse.ArgumentParser) -> None:
    """How a service logs (memsvc.runtime.logs)."""
    from memsvc.runtime.logs import FORMATS, LEVELS

    p.add_argument("--log-level", choices=LEVELS, default=env("LOG_LEVEL", "info"), help="least severe level logged")
    p.add_argument(
        "--log-format",
        choices=FORMATS,
        default=env("LOG_FORMAT", "text"),
        help="stderr as text lines, or one JSON object per line (time, level, logger, message, exception)",
    )


def _bytecode_default() -> str:
    """``--bytecode-cache``'s default: ``$MEMSVC_BYTECODE_CACHE``, else memsvc.runtime.bytecode's."""
    return env("BYTECODE_CACHE", default_bytecode_dir())


def bytecode_flag(p: argparse.ArgumentParser) -> None:
    """Where a service keeps its compiled modules when the installation keeps none (memsvc.runtime.bytecode)."""
    p.add_argument(
        BYTECODE_FLAG,
        default=_bytecode_default(),
        help="directory for the byte-code of modules installed without it that this interpreter may not write "
        "beside them (PYTHONDONTWRITEBYTECODE, a read-only site-packages): later starts import from it; 'off': "
        "compile at every start",
    )


def security_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser, server: bool = False) -> Security:
    """The command's token and TLS settings, its files read now: a bad path or a server without its key
    is a usage error (one line, exit 2), not a retry loop."""
    from memsvc.errors import MemsvcError
    from memsvc.runtime.auth import Security

    try:
        sec = Security.from_args(args)
        if server:
            sec.check_server()
        sec.channel_credentials()  # reads the client files now: a bad path is a usage error, not a retry loop
    except MemsvcError as exc:
        parser.error(str(exc))
    return sec


def security_kwargs(sec: Security) -> dict[str, Security]:
    """``security=`` only when some auth is on, so run() functions keep their plain signature otherwise."""
    return {"security": sec} if sec.enabled else {}


BYTECODE_FLAG = "--bytecode-cache"
SERVICES = ("manager", "worker", "gateway")
"""The commands that run a service: each takes these flags (:data:`BYTECODE_FLAG` among them)."""


def bytecode_cache_before_parsing(argv: Sequence[str]) -> str | None:
    """The ``--bytecode-cache`` a service's command line asks for, read before its parser is built: its
    flag's value, else ``$MEMSVC_BYTECODE_CACHE``, else the default. None for another command, or where
    only the parser can tell (a prefix of the flag, which argparse accepts, or the flag twice).

    Why: building the parser imports what the flags' choices come from (protobuf's runtime through
    the vocabulary's enums, the services' settings), and where the installation has no byte-code for
    them (``PYTHONDONTWRITEBYTECODE``, ``pip install --no-compile``) they were compiled at every start
    before the cache applied: a worker's, before its model layer's import begins."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in SERVICES:
        return None
    values = [a.partition("=")[2] for a in argv if a.startswith(BYTECODE_FLAG + "=")]
    values += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == BYTECODE_FLAG]
    named = [a for a in argv if a.startswith("--by")]
    if len(named) > 1 or len(named) > len(values):  # twice, a prefix, or the flag last without its value
        return None
    if values:
        return values[0]
    return str(_bytecode_default())


def keep_bytecode_before_parsing(argv: Sequence[str]) -> str | None:
    """For a service's command line: its compiled modules kept (memsvc.runtime.bytecode) from before
    its parser is built, where :func:`bytecode_cache_before_parsing` can tell the directory. Returns
    the directory kept, for :func:`use_bytecode_cache` to report once logging is set up."""
    from memsvc.runtime import bytecode

    directory = bytecode_cache_before_parsing(argv)
    return None if directory is None else bytecode.keep_bytecode(directory)


def use_bytecode_cache(directory: str, kept_before: str | None = None) -> None:
    """Before a service's imports: its compiled modules kept between starts where the installation keeps
    none (already, in ``kept_before``, where :func:`keep_bytecode_before_parsing` kept them)."""
    import logging

    from memsvc.runtime import bytecode

    kept = kept_before or bytecode.keep_bytecode(directory)
    if kept is not None:
        logging.getLogger("memsvc").info(
            "compiled modules are kept in %s: the installed packages have none and this interpreter does not write "
            "them beside their sources (--bytecode-cache)",
            kept,
        )


__all__ = [
    "BYTECODE_FLAG",
    "SERVICES",
    "bytecode_cache_before_parsing",
    "bytecode_flag",
    "keep_bytecode_before_parsing",
    "client_auth_flags",
    "use_bytecode_cache",
    "log_flags",
    "security_from_args",
    "security_kwargs",
    "server_auth_flags",
]
