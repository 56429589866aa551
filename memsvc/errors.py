"""The project's one exception tree.

Every error memsvc raises on purpose derives from :class:`MemsvcError`; the native extension raises
these same classes. Each class names the gRPC status it maps to (``status_name``) so that one place
(the servicers' error interceptor) can turn any of them into a status code with an ErrorInfo detail,
without this module importing grpc.
"""

from __future__ import annotations


class MemsvcError(Exception):
    """Root of all memsvc errors.

    ``metadata`` carries the dynamic values of the message (lowerCamel keys) into the ErrorInfo
    detail, so clients can act on them without parsing text. ``retry_after_s``, where set, says when
    the same call may succeed: it travels as a ``google.rpc.RetryInfo`` detail (AIP-194) and becomes
    the gateway's Retry-After.
    """

    status_name = "INTERNAL"
    reason = "INTERNAL"

    def __init__(
        self, message: str = "", *, metadata: dict[str, str] | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.metadata: dict[str, str] = dict(metadata or {})
        self.retry_after_s = retry_after_s


class InvalidArgument(MemsvcError):
    """The request is malformed: bad tag, size, level, block list. Nothing was changed."""

    status_name = "INVALID_ARGUMENT"
    reason = "INVALID_ARGUMENT"


class NotFound(MemsvcError):
    """An unknown tag, allocation, worker or lease."""

    status_name = "NOT_FOUND"
    reason = "NOT_FOUND"


class WrongState(MemsvcError):
    """The operation does not fit the current state (sleeping twice, copying from a slept tag)."""

    status_name = "FAILED_PRECONDITION"
    reason = "WRONG_STATE"


class TransitionInProgress(MemsvcError):
    """Another sleep or wake is running; retry after it finishes."""

    status_name = "ABORTED"
    reason = "TRANSITION_IN_PROGRESS"


class OutOfMemory(MemsvcError):
    """Device or host memory is short. Offloaded data is kept, so a later wake can succeed."""

    status_name = "RESOURCE_EXHAUSTED"
    reason = "OUT_OF_MEMORY"


class Overloaded(MemsvcError):
    """Too many calls of this kind are queued; retry after a backoff. Nothing was changed."""

    status_name = "RESOURCE_EXHAUSTED"
    reason = "OVERLOADED"


class Cancelled(MemsvcError):
    """The caller left (cancelled, or its deadline passed): the work stopped and kept nothing."""

    status_name = "CANCELLED"
    reason = "CANCELLED"


class IntegrityError(MemsvcError):
    """Restored data failed its checksum: the message names the allocation. Never silent."""

    status_name = "DATA_LOSS"
    reason = "CHECKSUM_MISMATCH"


class Unavailable(MemsvcError):
    """A backend, driver, method or peer cannot be used here."""

    status_name = "UNAVAILABLE"
    reason = "UNAVAILABLE"


class Loading(Unavailable):
    """The worker is loading its model and serves once the load ends: the same call succeeds then.
    Carries a retry delay; a client that can wait watches health for SERVING instead."""

    reason = "LOADING"


class NoLeader(Unavailable):
    """A manager replica that does not lead knows no leader it can reach (the last one was lost and
    no replica has taken over yet). Carries a retry delay: a replica takes over within seconds."""

    reason = "NO_LEADER"


class Unauthenticated(MemsvcError):
    """The call carries no valid credentials (a missing or wrong bearer token)."""

    status_name = "UNAUTHENTICATED"
    reason = "UNAUTHENTICATED"


class PermissionDenied(MemsvcError):
    """The caller is authenticated but may not call this method (e.g. not the worker's --allowed-client)."""

    status_name = "PERMISSION_DENIED"
    reason = "PERMISSION_DENIED"


class BackendError(MemsvcError):
    """A driver or OS call failed unexpectedly."""

    status_name = "INTERNAL"
    reason = "BACKEND_ERROR"


class RelayedError(MemsvcError):
    """A peer's error whose status code no class above stands for (UNIMPLEMENTED, UNKNOWN,
    ALREADY_EXISTS, ...): relayed with that same code and the peer's ErrorInfo reason, not relabelled as a
    driver failure."""

    def __init__(
        self,
        status_name: str,
        message: str = "",
        *,
        reason: str = "",
        metadata: dict[str, str] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, metadata=metadata, retry_after_s=retry_after_s)
        self.status_name = status_name
        self.reason = reason or status_name


__all__ = [
    "BackendError",
    "Cancelled",
    "IntegrityError",
    "InvalidArgument",
    "Loading",
    "MemsvcError",
    "NoLeader",
    "NotFound",
    "OutOfMemory",
    "Overloaded",
    "PermissionDenied",
    "RelayedError",
    "TransitionInProgress",
    "Unauthenticated",
    "Unavailable",
    "WrongState",
]
