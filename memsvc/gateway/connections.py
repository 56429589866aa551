"""The gateway's HTTP connections, bounded in number and in the time a client takes to send a request.

A client that opened connections and sent its requests a byte at a time (slowloris) held them open
for ever: 1,100 such connections under a 1,024-file limit left no file for a new one, and asyncio
logged every failed accept with its traceback, hundreds of thousands of them a minute. uvicorn bounds
a request head's size (h11's ``max_incomplete_event_size``) and a keep-alive connection's idle time
after a response (``timeout_keep_alive``), but not the time a head takes to arrive, nor the
connections held before any request has (``limit_concurrency`` is looked at only once a head is
complete: a 503 for that request, while the connections that never finish theirs stay).
:class:`BoundedH11` adds both bounds to uvicorn's h11 protocol, :func:`quiet_accept_errors` turns a
failed accept into one line every 10 s, and :func:`raise_fd_limit` / :func:`connection_bound` size
the bound from the open-files limit. The body's time bound is the app's (memsvc.gateway.app: the
body is read before any route runs).

The gateway names h11 itself: uvicorn's ``http="auto"`` takes httptools when it is installed, and
these hooks are h11's.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from memsvc.gateway.openai_api import GatewayError
from memsvc.runtime.limits import GATEWAY_HEADER_TIMEOUT_S, MAX_GATEWAY_CONNECTIONS

log = logging.getLogger("memsvc.gateway")

LOG_EVERY_S = 10.0
"""A recurring refusal (a failed accept, a connection past the bound) is logged at most this often."""
FD_RESERVE = 64
"""Open files the gateway keeps for itself (its gRPC channels to the manager and the workers, gRPC's
own, the listening socket, the log): about 20 at rest, and a channel for each worker it streams from."""
RETRY_AFTER_S = 2

_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def _raw_response(status: int, reason: str, error: GatewayError, extra: str = "") -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for the cases answered before h11 has a
    request to answer (its state machine refuses a response then)."""
    body = json.dumps(error.body()).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"{extra}connection: close\r\n\r\n"
    )
    return head.encode() + body


class Throttle:
    """One log line per ``every`` seconds for an event that may recur thousands of times a second:
    the first, then the next one once that time has passed, saying how many were left out between."""

    def __init__(self, logger: logging.Logger, every: float = LOG_EVERY_S) -> None:
        self.logger = logger
        self.every = every
        self._due = float("-inf")
        self._left_out = 0

    def log(self, level: int, message: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._due:
            self._left_out += 1
            return
        if self._left_out:
            message += f" ({self._left_out} more since the last such line)"
        self._due, self._left_out = now + self.every, 0
        self.logger.log(level, message, *args)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Report an accept that fails for want of files or memory as one line every LOG_EVERY_S.

    asyncio's accept loop (selector_events' ``_accept_connection``) hands such a failure to the loop's
    exception handler, whose default logs it with its traceback; CPython 3.11's goes on calling
    accept() in the same turn up to the listen backlog's count (uvicorn's 2048), each failing and
    each logged, and schedules as many retries a second later, which do the same. Each retry still
    scheduled when the listener closes fails too ("Invalid file descriptor: -1"): that is the gateway
    stopping, and is logged at debug. Everything else goes to the default handler."""
    throttle = Throttle(log)
    retry = getattr(loop, "_start_serving", None)

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_RESOURCES:
            throttle.log(logging.ERROR, "%s: %s", context.get("message", "out of resources"), exc)
        elif isinstance(exc, ValueError) and retry is not None and _callback(context) == retry:
            log.debug("a retry of accept() found its listener closed: %s", exc)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)


def _callback(context: dict[str, Any]) -> object:
    """The function a failed callback's handle ran (asyncio names it only in the message's text)."""
    return getattr(context.get("handle"), "_callback", None)


def raise_fd_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit, as servers do (the usual soft
    1024 is a default for programs that need few files); the soft limit then in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # a hard limit past the kernel's (nr_open): keep the soft one
            log.debug("could not raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return soft if soft != resource.RLIM_INFINITY else _UNLIMITED


_UNLIMITED = 1 << 20


def accept_batch(fd_limit: int) -> int:
    """The listen backlog, which asyncio's accept loop also takes as the most connections it accepts
    in one turn, before any of them reaches the bound (uvicorn's 2048, or a 16th of a smaller limit)."""
    return max(16, min(2048, fd_limit // 16))


def connection_bound(fd_limit: int) -> int:
    """The connections a gateway holds by default under ``fd_limit`` open files: what the limit
    leaves after the gateway's own files (FD_RESERVE) and the connections accepted but not yet
    refused (a refused one's file is closed a few turns of the loop after its accept, while each turn
    may accept an :func:`accept_batch`: four of them are kept free), at most MAX_GATEWAY_CONNECTIONS
    (each costs memory too): 4096 under 8192 files or more, 704 under the usual 1024."""
    return max(1, min(MAX_GATEWAY_CONNECTIONS, fd_limit - FD_RESERVE - 4 * accept_batch(fd_limit)))


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with two more bounds, set by :meth:`configured`: at most
    ``max_connections`` connections (one past it is answered 503 and closed at once, so it holds its
    file for no time), and ``header_timeout`` seconds for a complete request head, from the
    connection's start or from the response to its previous request (a keep-alive connection's next
    head: uvicorn's keep-alive timer stops at the first byte of it). A connection that is late is
    closed; one with a head begun gets a 408 first. The clock stops once a head is complete: the body
    and the response (a stream may run for minutes) are not bounded here."""

    header_timeout = GATEWAY_HEADER_TIMEOUT_S
    max_connections = MAX_GATEWAY_CONNECTIONS
    refusal = b""
    """The 503 a connection past the bound gets."""
    refusals = Throttle(log)

    @staticmethod
    def configured(header_timeout: float, max_connections: int) -> type[BoundedH11]:
        """The protocol class to give uvicorn (``Config(http=...)``), with these bounds."""

        class Configured(BoundedH11):
            pass

        Configured.header_timeout, Configured.max_connections = header_timeout, max_connections
        error = GatewayError(
            503,
            f"the gateway holds its limit of {max_connections} connections",
            "server_error",
            code="overloaded",
            retry_after=RETRY_AFTER_S,
        )
        Configured.refusal = _raw_response(503, "Service Unavailable", error, f"retry-after: {RETRY_AFTER_S}\r\n")
        Configured.refusals = Throttle(log)
        return Configured

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self._refused = True
            transport.write(self.refusal)
            transport.close()
            self.refusals.log(
                logging.WARNING,
                "refused a connection: the gateway holds its limit of %d (--max-connections)",
                self.max_connections,
            )
            return
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._stop_head_clock()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        self._await_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_head()

    def _await_head(self) -> None:
        """Start the head's clock when the connection waits for a request (none yet, or the last one
        answered) and it is not running; stop it once a request's head has arrived."""
        waiting = self.cycle is None or self.cycle.response_complete
        if not waiting or self.transport.is_closing():
            self._stop_head_clock()
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_overdue)

    def _stop_head_clock(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:  # a head begun: say why (best effort: the client may not read)
            self.transport.write(_HEAD_TIMEOUT)
        # abort, not close: close() waits to send what is buffered, for as long as the client reads nothing
        self.transport.abort()


_HEAD_TIMEOUT = _raw_response(408, "Request Timeout", GatewayError(408, "the request head did not arrive in time"))


__all__ = ["BoundedH11", "Throttle", "accept_batch", "connection_bound", "quiet_accept_errors", "raise_fd_limit"]
