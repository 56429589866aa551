"""The one place where errors become gRPC statuses.

Servers install :class:`ErrorMappingInterceptor`; handlers just raise :class:`memsvc.errors.MemsvcError`
subclasses. Each becomes its canonical status code with a ``google.rpc.ErrorInfo`` detail
(reason, domain, metadata), per AIP-193. Anything else is a bug: it is logged with its traceback
and answered INTERNAL, so no stack trace leaks to clients and the server keeps running.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from memsvc.errors import InvalidArgument, MemsvcError, RelayedError, Unavailable

DOMAIN = "memsvc.dev"
log = logging.getLogger("memsvc.rpc")


MAX_MESSAGE = 1024
MAX_METADATA_VALUE = 256


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 14] + f"... ({len(text)} chars)"


def to_status(exc: BaseException) -> grpc.Status:
    """A MemsvcError (or any exception, as INTERNAL) as a rich gRPC status.

    Messages and metadata echo client input (names, ids), so both are clipped: the status travels in
    trailing metadata, and a client's 16 KiB limit would otherwise turn it into a bare
    RESOURCE_EXHAUSTED without the ErrorInfo.
    """
    retry: float | None = None
    if isinstance(exc, MemsvcError):
        code_name, reason, metadata, message = exc.status_name, exc.reason, exc.metadata, str(exc)
        retry = exc.retry_after_s
    else:
        code_name, reason, metadata, message = "INTERNAL", "INTERNAL", {}, f"internal error: {type(exc).__name__}"
    message = _clip(message, MAX_MESSAGE)
    metadata = {_clip(k, 64): _clip(v, MAX_METADATA_VALUE) for k, v in metadata.items()}
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata)
    details = [any_pb2.Any()]
    details[0].Pack(info)
    if retry is not None:
        delay = duration_pb2.Duration()
        delay.FromTimedelta(datetime.timedelta(seconds=retry))
        details.append(any_pb2.Any())
        details[1].Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    status = status_pb2.Status(code=code_pb2.Code.Value(code_name), message=message or reason, details=details)
    out: grpc.Status = rpc_status.to_status(status)
    return out


def error_info(err: grpc.aio.AioRpcError | grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo detail of a failed call, for clients and tests."""
    return _detail(err, error_details_pb2.ErrorInfo)


def retry_delay(err: grpc.aio.AioRpcError | grpc.RpcError) -> float | None:
    """The seconds a failed call's RetryInfo detail says to wait before the same call, if it has one."""
    info = _detail(err, error_details_pb2.RetryInfo)
    return info.retry_delay.ToTimedelta().total_seconds() if info is not None else None


_Detail = TypeVar("_Detail", error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo)


def _detail(err: grpc.aio.AioRpcError | grpc.RpcError, kind: type[_Detail]) -> _Detail | None:
    try:
        status = rpc_status.from_call(err)
    except ValueError:  # the status details disagree with the call's code or message: none to trust
        return None
    if status is None:
        return None
    for d in status.details:
        found = kind()
        if d.Unpack(found):
            return found
    return None


# Type aliases as strings: grpcio's runtime classes are not subscriptable, its stubs' are.
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
"""A method handler as grpc.aio servers use it: its behaviours are coroutines (the stubs type the
sync form, so code that wraps a behaviour treats it as ``Any``)."""
Continuation: TypeAlias = "Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]]"


async def _abort(context: Context, exc: BaseException, method: str) -> None:
    if not isinstance(exc, MemsvcError):
        log.exception("unexpected error in %s", method, exc_info=exc)
    await context.abort_with_status(to_status(exc))


class _Undecodable:
    """What a request that failed to decode becomes, so the handler can answer INVALID_ARGUMENT."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc


def undecodable(exc: Exception) -> InvalidArgument:
    """What a request body that is not its message is answered with (by every server of ours, and
    where a worker's RPC front and device process decode one themselves)."""
    return InvalidArgument(f"the request body is not a valid message: {exc}")


def _check_decoded(request: Any) -> None:
    if isinstance(request, _Undecodable):
        raise undecodable(request.exc)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every unary and server-streaming handler with the error mapping above.

    It also decodes requests itself: left to grpcio, a body that is not the request message fails
    before any of our code runs and reaches the client as a bare UNKNOWN without ErrorInfo.

    grpc.aio takes two kinds of server-streaming behaviour, so the wrapper must too: an async
    generator (our servicers) and a coroutine that sends with ``context.write()`` and returns None
    (grpcio-health-checking's ``Health/Watch``). The wrapper is a coroutine that awaits the second
    kind and writes out the items of the first (iterating a coroutine was a TypeError, which made
    Watch answer INTERNAL).
    """

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        decode = handler.request_deserializer

        def safe_decode(data: bytes) -> Any:
            try:
                return decode(data) if decode is not None else data
            except Exception as exc:  # noqa: BLE001 - any decoder failure is the client's bad input
                return _Undecodable(exc)

        if handler.unary_unary is not None:
            inner_uu: Any = handler.unary_unary

            async def unary_unary(request: Any, context: Context) -> Any:
                try:
                    _check_decoded(request)
                    return await inner_uu(request, context)
                except (MemsvcError, Exception) as exc:  # noqa: BLE001 - mapped, not swallowed
                    if isinstance(exc, grpc.aio.AbortError):
                        raise
                    await _abort(context, exc, method)

            return grpc.unary_unary_rpc_method_handler(unary_unary, safe_decode, handler.response_serializer)
        if handler.unary_stream is not None:
            inner_us: Any = handler.unary_stream

            async def unary_stream_writer(request: Any, context: Context) -> None:
                try:
                    _check_decoded(request)
                    result = inner_us(request, context)
                    if inspect.isawaitable(result):
                        result = await result
                    if inspect.isasyncgen(result):
                        async with contextlib.aclosing(result):  # its finally runs when the client leaves
                            async for item in result:
                                await context.write(item)
                except (MemsvcError, Exception) as exc:  # noqa: BLE001
                    if isinstance(exc, grpc.aio.AbortError):
                        raise
                    await _abort(context, exc, method)

            return grpc.unary_stream_rpc_method_handler(unary_stream_writer, safe_decode, handler.response_serializer)
        return handler


def _tree() -> list[type[MemsvcError]]:
    """Every class of the tree, parents before their subclasses (Unavailable before Loading)."""
    out: list[type[MemsvcError]] = []
    level = MemsvcError.__subclasses__()
    while level:
        out += [cls for cls in level if cls is not RelayedError]
        level = [sub for cls in level for sub in cls.__subclasses__()]
    return out


def _classes_by_code() -> dict[grpc.StatusCode, type[MemsvcError]]:
    """The class a bare status code stands for: the first class of the tree with that code (the
    reason picks among several, see :data:`_FROM_REASON`); INTERNAL has none of its own."""
    out: dict[grpc.StatusCode, type[MemsvcError]] = {}
    for cls in _tree():
        out.setdefault(grpc.StatusCode[cls.status_name], cls)
    out.pop(grpc.StatusCode.INTERNAL, None)
    out[grpc.StatusCode.DEADLINE_EXCEEDED] = Unavailable  # the peer did not answer in time
    return out


_FROM_CODE = _classes_by_code()
_FROM_REASON = {(cls.status_name, cls.reason): cls for cls in _tree()}
"""A peer's (code, ErrorInfo reason) picks the class when several share a code (OutOfMemory and
Overloaded are both RESOURCE_EXHAUSTED)."""


def from_rpc_error(err: grpc.RpcError, peer: str = "") -> MemsvcError:
    """A failed call to another memsvc service as our own exception: same status, same ErrorInfo.

    The one reverse mapping. The manager relays worker errors this way (a worker's
    FAILED_PRECONDITION reaches the manager's client as FAILED_PRECONDITION; an unreachable worker
    is UNAVAILABLE), and the client helpers raise these for failed calls. A code the tree has no
    class for is relayed as itself (:class:`RelayedError`), never relabelled.
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    prefix = f"worker {peer}: " if peer else ""
    message = prefix + (details or code.name)
    retry = retry_delay(err) if code == grpc.StatusCode.UNAVAILABLE else None
    # the transport's UNAVAILABLE and DEADLINE_EXCEEDED carry no detail of ours; a server's own
    # UNAVAILABLE with a retry delay (a loading worker's) does
    own = code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or retry is not None
    info = error_info(err) if own else None
    metadata = dict(info.metadata) if info else {}
    cls = _FROM_REASON.get((code.name, info.reason)) if info else None
    cls = cls or _FROM_CODE.get(code)
    if cls is not None:
        return cls(message, metadata=metadata, retry_after_s=retry)
    reason = info.reason if info else ""
    return RelayedError(code.name, message, reason=reason, metadata=metadata, retry_after_s=retry)
