"""Tag policy: what the manager does with a worker's memory, and when.

A policy is a set of fields. The default policy holds all of them; a worker's override holds only
the fields an UpdatePolicy for that worker named, so changing the default later still reaches every
field a worker did not override.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from memsvc.errors import InvalidArgument
from memsvc.v1 import common_pb2 as c
from memsvc.v1 import memory_manager_service_pb2 as m

FIELDS = ("tag_actions", "idle_sleep_timeout", "idle_deep_sleep_timeout", "device_budget_bytes", "host_budget_bytes")
ACTION_NAMES = {"offload": c.TAG_ACTION_OFFLOAD, "discard": c.TAG_ACTION_DISCARD, "keep": c.TAG_ACTION_KEEP}
MAX_TIMEOUT_S = 365 * 24 * 3600.0


@dataclass(frozen=True)
class Policy:
    """Effective policy of a worker (or the default)."""

    tag_actions: dict[str, int] = field(
        default_factory=lambda: {"weights": c.TAG_ACTION_OFFLOAD, "kv_cache": c.TAG_ACTION_DISCARD}
    )
    """Tier-1 action per tag (memsvc.v1.TagAction values)."""
    idle_sleep_timeout: float = 0.0
    """Seconds idle before tier 1; 0 = never."""
    idle_deep_sleep_timeout: float = 0.0
    """Seconds idle before tier 2 (level 2); 0 = never."""
    device_budget_bytes: int = 0
    """Device bytes awake workers may map per device; 0 = the device's capacity."""
    host_budget_bytes: int = 0
    """Host bytes offloaded workers may hold per host; 0 = unlimited."""

    def to_fields(self) -> dict[str, Any]:
        return {f: (dict(v) if isinstance(v := getattr(self, f), dict) else v) for f in FIELDS}

    def with_fields(self, fields: dict[str, Any]) -> Policy:
        return replace(self, **fields)

    def to_proto(self) -> m.Policy:
        p = m.Policy(device_budget_bytes=self.device_budget_bytes, host_budget_bytes=self.host_budget_bytes)
        p.tag_actions.update(self.tag_actions)
        p.idle_sleep_timeout.FromNanoseconds(int(self.idle_sleep_timeout * 1e9))
        p.idle_deep_sleep_timeout.FromNanoseconds(int(self.idle_deep_sleep_timeout * 1e9))
        return p


def fields_from_proto(p: m.Policy, paths: list[str]) -> dict[str, Any]:
    """The fields of ``p`` named by an update mask (all fields when ``paths`` is empty), validated."""
    unknown = [x for x in paths if x not in FIELDS]
    if unknown:
        raise InvalidArgument(
            f"unknown policy field(s) in update_mask: {', '.join(unknown)}; known: {', '.join(FIELDS)}"
        )
    out: dict[str, Any] = {}
    for f in paths or FIELDS:
        if f == "tag_actions":
            actions = dict(p.tag_actions)
            for tag, act in actions.items():
                if not tag or len(tag.encode()) > 63:
                    raise InvalidArgument(f"bad tag name {tag!r}: 1 to 63 bytes")
                if act not in (c.TAG_ACTION_OFFLOAD, c.TAG_ACTION_DISCARD, c.TAG_ACTION_KEEP):
                    raise InvalidArgument(
                        f"tag {tag!r}: action must be OFFLOAD, DISCARD or KEEP", metadata={"tag": tag}
                    )
            out[f] = actions
        elif f in ("idle_sleep_timeout", "idle_deep_sleep_timeout"):
            d = getattr(p, f)
            if d.seconds < 0 or d.nanos < 0:
                raise InvalidArgument(f"{f} must not be negative", metadata={"field": f})
            seconds = d.ToNanoseconds() / 1e9
            if seconds > MAX_TIMEOUT_S:
                raise InvalidArgument(f"{f} must be at most one year", metadata={"field": f})
            out[f] = seconds
        else:
            v = int(getattr(p, f))
            if v < 0:
                raise InvalidArgument(f"{f} must not be negative", metadata={"field": f})
            out[f] = v
    return out


def check(p: Policy) -> Policy:
    """Cross-field rules of an effective policy."""
    if p.idle_sleep_timeout and p.idle_deep_sleep_timeout and p.idle_deep_sleep_timeout < p.idle_sleep_timeout:
        raise InvalidArgument("idle_deep_sleep_timeout must be at least idle_sleep_timeout (tier 2 follows tier 1)")
    return p


def fields_from_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Policy fields from a config file's [policy] table (seconds, byte counts, action names)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "tag_actions":
            try:
                out[key] = {str(t): ACTION_NAMES[str(a).lower()] for t, a in dict(value).items()}
            except KeyError as exc:
                raise InvalidArgument(f"config: unknown tag action {exc}; use offload, discard or keep") from None
        elif key in ("idle_sleep_timeout", "idle_deep_sleep_timeout"):
            out[key] = float(value)
        elif key in ("device_budget_bytes", "host_budget_bytes"):
            out[key] = int(value)
        else:
            raise InvalidArgument(f"config: unknown policy key {key!r}")
        if isinstance(out[key], int | float) and out[key] < 0:
            raise InvalidArgument(f"config: {key} must not be negative")
    return out
