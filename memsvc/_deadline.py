"""When the manager stops waiting on a caller's behalf.

A call's deadline is its client's (gRPC propagates it). A call shared by several callers through one
request_id (memsvc/_replay.py) runs while any of them waits, so its deadline is the latest of theirs
(none, if one of them waits without a deadline): a retry with time to spare keeps a shared call alive
after the first caller's deadline passed.
"""

from __future__ import annotations

import time


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


NO_DEADLINE = Deadline()


class SharedDeadline(Deadline):
    """The latest deadline of the callers waiting for one shared call."""

    def __init__(self) -> None:
        super().__init__()
        self._callers: list[Deadline] = []

    def join(self, caller: Deadline) -> None:
        self._callers.append(caller)

    def leave(self, caller: Deadline) -> None:
        self._callers.remove(caller)

    def at(self) -> float | None:
        deadlines = [c.at() for c in self._callers]
        if not deadlines or None in deadlines:
            return None
        return max(d for d in deadlines if d is not None)


__all__ = ["NO_DEADLINE", "Deadline", "SharedDeadline"]
