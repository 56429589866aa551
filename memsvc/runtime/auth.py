"""Authentication for both services: an optional bearer token, TLS, and mutual TLS.

Everything is off by default (plaintext, no token), so a local ``memsvc up`` and the compose file
work unchanged. :class:`Security` holds one process's settings; the CLI fills it from flags and
``MEMSVC_*`` variables, and the same object configures the process's server *and* its clients
(manager -> worker links, worker -> manager registration, ``memsvc status/sleep/wake/watch/health``).

Server side (:class:`AuthInterceptor`, installed by :func:`memsvc.runtime.serving.start_server`):

* with a token, every call must carry ``authorization: Bearer <token>`` (compared with
  ``hmac.compare_digest``), except ``/grpc.health.v1.Health/*``: health stays readable without one,
  so container health checks need no secret. Reflection is *not* exempt (it exposes the schema).
  A missing or wrong token is ``UNAUTHENTICATED`` (the caller's identity is not established; RFC 6750
  "invalid_token" is a 401, not a 403), with ErrorInfo reason ``UNAUTHENTICATED``; for a method that
  does not exist as well (``UNIMPLEMENTED`` only with a valid token), so names cannot be probed.
* with ``--tls-cert/--tls-key`` the port is TLS; adding ``--tls-client-ca`` makes it mutual TLS:
  the handshake itself refuses clients without a certificate signed by that CA (health included).
* with ``--allowed-client NAME`` (worker, needs mTLS) the state-changing methods in
  :data:`TRANSITIONS` are accepted only from a client certificate whose common name or a subject
  alternative name is NAME; other authenticated clients get ``PERMISSION_DENIED`` (reason
  ``PERMISSION_DENIED``). Reads and the data plane (GetWorkerStatus, StreamTelemetry, Generate) stay
  open to every authenticated client.

Client side (:func:`channel`, :func:`aio_channel`): TLS when a CA is given (``--tls-ca``), presenting
``--tls-client-cert/--tls-client-key`` (default: the process's own ``--tls-cert/--tls-key``) for
mTLS; the token is attached by a client interceptor, on plaintext and TLS channels alike (grpc's call
credentials are only sent on secure channels).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from memsvc.errors import InvalidArgument, MemsvcError, PermissionDenied, Unauthenticated
from memsvc.runtime.rpc_errors import Context, Continuation, Handler, to_status

HEALTH_PREFIX = "/grpc.health.v1.Health/"
WORKER_SERVICE = "/memsvc.v1.ModelWorkerService/"
TRANSITIONS = frozenset(
    WORKER_SERVICE + name for name in ("Sleep", "WakeUp", "ReloadWeights", "SwapBlocks", "FreeSequence")
)
"""Worker methods that change its state: only ``--allowed-client`` identities may call them (mTLS)."""


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read {what} {path!r}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class Security:
    """One process's auth settings; the default (all empty) is plaintext without a token."""

    token: str = ""
    tls_cert: str = ""
    """server: certificate chain (PEM) of this process; also its client certificate by default"""
    tls_key: str = ""
    tls_client_ca: str = ""
    """server: CA that client certificates must chain to (turns on mTLS)"""
    tls_ca: str = ""
    """client: CA that verifies the servers this process dials (turns on TLS for its clients)"""
    tls_client_cert: str = ""
    tls_client_key: str = ""
    allowed_clients: tuple[str, ...] = field(default_factory=tuple)

    # ---- construction ----
    @classmethod
    def from_args(cls, args: Any, environ: dict[str, str] | None = None) -> Security:
        """From parsed CLI flags; a flag the command does not define falls back to its MEMSVC_* variable."""
        env = os.environ if environ is None else environ

        def get(name: str) -> str:
            value = getattr(args, name, None)
            if value is None:
                value = env.get(f"MEMSVC_{name.upper()}", "")
            return str(value or "")

        token_file = get("token_file")
        if token_file:
            raw = _read(token_file, "token file")
            token = (raw or b"").decode("utf-8", "replace").strip()
            if not token:
                raise InvalidArgument(f"token file {token_file!r} is empty")
        else:
            token = env.get("MEMSVC_TOKEN", "").strip()
        allowed = get("allowed_client")
        return cls(
            token=token,
            tls_cert=get("tls_cert"),
            tls_key=get("tls_key"),
            tls_client_ca=get("tls_client_ca"),
            tls_ca=get("tls_ca"),
            tls_client_cert=get("tls_client_cert"),
            tls_client_key=get("tls_client_key"),
            allowed_clients=tuple(a.strip() for a in allowed.split(",") if a.strip()),
        )

    @property
    def enabled(self) -> bool:
        return self != Security()

    def check_server(self) -> None:
        """Refuse combinations that would silently not protect anything."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidArgument("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
        if self.allowed_clients and not self.tls_client_ca:
            raise InvalidArgument("--allowed-client needs mTLS (--tls-client-ca, --tls-cert, --tls-key)")

    # ---- server side ----
    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls_cert:
            return None
        self.check_server()
        chain = _read(self.tls_cert, "TLS certificate") or b""
        key = _read(self.tls_key, "TLS key") or b""
        client_ca = _read(self.tls_client_ca, "TLS client CA")
        return grpc.ssl_server_credentials(
            [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        if not self.token and not self.allowed_clients:
            return []
        return [AuthInterceptor(self.token, self.allowed_clients)]

    # ---- client side ----
    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls_ca:
            return None
        cert = self.tls_client_cert or self.tls_cert
        key = self.tls_client_key or (self.tls_key if not self.tls_client_cert else "")
        if bool(cert) != bool(key):
            raise InvalidArgument("--tls-client-cert and --tls-client-key go together")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca, "TLS CA"),
            private_key=_read(key, "TLS client key"),
            certificate_chain=_read(cert, "TLS client certificate"),
        )

    def metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []


# ---------------------------------------------------------------------------------------------
# server


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` header, or None."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def peer_names(context: Context) -> list[str]:
    """Common name and subject alternative names of the client certificate (empty without mTLS)."""
    auth = context.auth_context() or {}
    names: list[str] = []
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for value in auth.get(key, ()):
            names.append(value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value))
    return names


def _deny(exc: MemsvcError) -> Handler:
    """A handler that only aborts with ``exc`` (ErrorInfo included), whatever the call type.

    On the wire every gRPC call is one HTTP/2 stream; the call type only says how many messages each
    side sends. A stream-stream behaviour starts without reading a request, and aborting before any
    message ends every kind of call with this status, so one handler refuses a known method of any
    kind and an unknown method, of which nothing is known. A handler of the method's own kind would
    not do: a unary-request one first waits for a request message, so a client stream that sends
    none would see its deadline instead of the refusal. No (de)serialisers: nothing is read or sent.
    """
    status = to_status(exc)

    async def deny(_requests: Any, context: Context) -> None:
        await context.abort_with_status(status)

    return grpc.stream_stream_rpc_method_handler(deny)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Bearer token on every method but health; client-certificate names on :data:`TRANSITIONS`.

    The token is checked before the method is looked up: without a valid token a method that exists
    and one that does not both answer UNAUTHENTICATED (grpc would answer UNIMPLEMENTED for the
    latter), so nobody learns the method names without the token. With a valid token an unknown
    method is UNIMPLEMENTED, as grpc answers a ``None`` handler.
    """

    def __init__(self, token: str, allowed_clients: Sequence[str] = (), guarded: frozenset[str] = TRANSITIONS):
        self._token = token.encode()
        self._allowed = tuple(allowed_clients)
        self._guarded = guarded

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        method = handler_call_details.method
        if method.startswith(HEALTH_PREFIX):
            return await continuation(handler_call_details)
        if self._token:
            given = bearer_token(handler_call_details.invocation_metadata)
            refusal = None
            if given is None:
                refusal = Unauthenticated(
                    "missing bearer token: send 'authorization: Bearer <token>'", metadata={"method": method}
                )
            elif not hmac.compare_digest(given.encode(), self._token):
                refusal = Unauthenticated("invalid bearer token", metadata={"method": method})
            if refusal is not None:
                return _deny(refusal)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if self._allowed and method in self._guarded:
            return self._check_peer(handler, method)
        return handler

    def _check_peer(self, handler: Handler, method: str) -> Handler:
        """Wrap a guarded (unary-unary) handler: the client certificate is only known per call."""
        inner: Any = handler.unary_unary
        if inner is None:  # every guarded method is unary today; refuse rather than skip the check
            return _deny(PermissionDenied(f"{method}: not callable with --allowed-client"))
        allowed = self._allowed

        async def checked(request: Any, context: Context) -> Any:
            names = peer_names(context)
            if not any(n in allowed for n in names):
                who = names[0] if names else "a client without a certificate"
                exc = PermissionDenied(
                    f"{method.rsplit('/', 1)[-1]} is only accepted from {', '.join(allowed)}, not {who}",
                    metadata={"method": method, "client": who},
                )
                await context.abort_with_status(to_status(exc))
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(checked, handler.request_deserializer, handler.response_serializer)


# ---------------------------------------------------------------------------------------------
# clients


class _SyncToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        self._md = metadata

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=[*(details.metadata or ()), *self._md])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)


def _aio_details(details: Any, md: list[tuple[str, str]]) -> Any:
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), *md))


class _AioUnaryUnaryToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        self._md = metadata

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_aio_details(details, self._md), request)


class _AioUnaryStreamToken(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        self._md = metadata

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_aio_details(details, self._md), request)


def channel(address: str, security: Security | None = None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A synchronous channel to ``address``: TLS when ``security`` has a CA, the token on every call."""
    sec = security or Security()
    creds = sec.channel_credentials()
    ch = grpc.secure_channel(address, creds, options=options) if creds else grpc.insecure_channel(address, options)
    md = sec.metadata()
    return grpc.intercept_channel(ch, _SyncToken(md)) if md else ch


def aio_channel(
    address: str, security: Security | None = None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """An asyncio channel to ``address``: TLS when ``security`` has a CA, the token on every call."""
    sec = security or Security()
    creds = sec.channel_credentials()
    md = sec.metadata()
    interceptors = [_AioUnaryUnaryToken(md), _AioUnaryStreamToken(md)] if md else None
    if creds:
        return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


__all__ = [
    "TRANSITIONS",
    "AuthInterceptor",
    "Security",
    "aio_channel",
    "bearer_token",
    "channel",
    "peer_names",
]
