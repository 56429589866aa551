"""Timing of the manager: the config file's ``[manager]`` table."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ManagerSettings:
    """Timing of the manager (the config file's [manager] table)."""

    heartbeat_interval: float = 2.0
    """Workers re-register this often."""
    tick_interval: float = 0.1
    """How often idle timers and lease expiry are checked."""
    default_lease_ttl: float = 60.0
    max_lease_ttl: float = 24 * 3600.0
    rpc_timeout: float = 600.0
    """Longest call to a worker (a sleep of a large model included)."""
    retry_backoff: float = 5.0
    """After a failed idle sleep, wait this long before trying that worker again."""
    unavailable_after: float = 0.0
    """A worker silent this long (no telemetry, no heartbeat) is UNAVAILABLE; 0 = 3 heartbeats, at
    least 3 s (telemetry snapshots come every second)."""

    forget_after: float = 0.0
    """A self-registered worker unreachable this long (and not leased) is deregistered: its record and
    stored registration go, as by DeregisterWorker. 0 = never. Configured workers are never forgotten."""

    leader_poll_interval: float = 0.5
    """Replicas on a shared store (PostgreSQL): how often a follower tries for the lead and the leader
    checks its database session; a dead leader is replaced within about this plus the new leader's
    start (memsvc/manager/replicas.py)."""

    @property
    def silence_limit(self) -> float:
        return self.unavailable_after or max(3.0, 3 * self.heartbeat_interval)


__all__ = ["ManagerSettings"]
