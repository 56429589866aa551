"""When the manager stops waiting on a caller's behalf.

A call's deadline is its client's (gRPC propagates it). A call shared by several callers through one
request_id (memsvc/runtime/replay.py) runs while any of them waits, so its deadline is the latest of theirs
(none, if one of them waits without a deadline): a retry with time to spare keeps a shared call alive
after the first caller's deadline passed.
"""

from __future__ import annotations

import time
from typing import Protocol


class Deadline:
    """One caller's deadline on the monotonic clock, or none."""

    def __init__(self, at: float | None = None) -> None:
        self._at = at

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        """``seconds`` from now (None: no deadline)."""
        return cls(None if seconds is None else time.monotonic() + seconds)

    def at(self) -> float | None:
        return self._at

    def remaining(self) -> float | None:
        """Seconds left (negative once passed), or None without a deadline."""
        at = self.at()
        return None if at is None else at - time.monotonic()

    def passed(self) -> bool:
        left = self.remaining()
        return left is not None and left <= 0


NO_DEADLINE = Deadline()


class _CallContext(Protocol):
    def time_remaining(self) -> float | None: ...


def caller_deadline(context: _CallContext) -> Deadline:
    """The deadline of the gRPC call being served (its client's, propagated)."""
    return Deadline.after(context.time_remaining())


class SharedDeadline(Deadline):
    """The latest deadline of the callers waiting for one shared call; passed once they all left."""

    def __init__(self) -> None:
        super().__init__()
        self._callers: list[Deadline] = []
        self._joined = False

    def join(self, caller: Deadline) -> None:
        self._callers.append(caller)
        self._joined = True

    def leave(self, caller: Deadline) -> None:
        self._callers.remove(caller)

    def at(self) -> float | None:
        deadlines = [c.at() for c in tuple(self._callers)]  # read from the worker's device thread too
        if not deadlines and self._joined:
            return 0.0  # every caller left: passed (a job about to start must not)
        if not deadlines or None in deadlines:
            return None
        return max(d for d in deadlines if d is not None)


__all__ = ["NO_DEADLINE", "Deadline", "SharedDeadline", "caller_deadline"]
