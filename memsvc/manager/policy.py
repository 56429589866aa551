"""Tag policy: what the manager does with a worker's memory, and when.

A policy is a set of fields. The default policy holds all of them; a worker's override holds only
the fields an UpdatePolicy for that worker named, so changing the default later still reaches every
field a worker did not override. :class:`Policies` keeps both parsed in memory and writes them
through to the store; the manager reads a worker's effective policy on every timer tick.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from memsvc.errors import InvalidArgument
from memsvc.manager.store import Store
from memsvc.v1 import memory_manager_service_pb2 as m
from memsvc.vocabulary import KV_CACHE, WEIGHTS, Action, check_tag

FIELDS = ("tag_actions", "idle_sleep_timeout", "idle_deep_sleep_timeout", "device_budget_bytes", "host_budget_bytes")
MAX_TIMEOUT_S = 365 * 24 * 3600.0


@dataclass(frozen=True)
class Policy:
    """Effective policy of a worker (or the default)."""

    tag_actions: dict[str, Action] = field(default_factory=lambda: {WEIGHTS: Action.OFFLOAD, KV_CACHE: Action.DISCARD})
    """Tier-1 action per tag."""
    idle_sleep_timeout: float = 0.0
    """Seconds idle before tier 1; 0 = never."""
    idle_deep_sleep_timeout: float = 0.0
    """Seconds idle before tier 2 (level 2); 0 = never."""
    device_budget_bytes: int = 0
    """Device bytes awake workers may map per device; 0 = the device's capacity."""
    host_budget_bytes: int = 0
    """Host bytes offloaded workers may hold per host; 0 = unlimited."""

    def to_fields(self) -> dict[str, Any]:
        """Every field, as the store keeps them (JSON: actions as their proto numbers)."""
        return {f: (dict(v) if isinstance(v := getattr(self, f), dict) else v) for f in FIELDS}

    def with_fields(self, fields: dict[str, Any]) -> Policy:
        """This policy with ``fields`` (as :meth:`to_fields` writes them) replaced."""
        if "tag_actions" in fields:
            fields = {**fields, "tag_actions": {t: Action.from_proto(a, t) for t, a in fields["tag_actions"].items()}}
        return replace(self, **fields)

    def to_proto(self) -> m.Policy:
        p = m.Policy(device_budget_bytes=self.device_budget_bytes, host_budget_bytes=self.host_budget_bytes)
        p.tag_actions.update({t: a.proto for t, a in self.tag_actions.items()})
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
            out[f] = {check_tag(tag): Action.from_proto(act, tag) for tag, act in p.tag_actions.items()}
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
                out[key] = {check_tag(str(t)): Action.parse(a, str(t)) for t, a in dict(value).items()}
            except InvalidArgument as exc:
                raise InvalidArgument(f"config: {exc}") from None
        elif key in ("idle_sleep_timeout", "idle_deep_sleep_timeout"):
            out[key] = float(value)
        elif key in ("device_budget_bytes", "host_budget_bytes"):
            out[key] = int(value)
        else:
            raise InvalidArgument(f"config: unknown policy key {key!r}")
        if isinstance(out[key], int | float) and out[key] < 0:
            raise InvalidArgument(f"config: {key} must not be negative")
    return out


class Policies:
    """The default policy and every worker's overrides, parsed once and kept in memory; each change
    is written through to the store before it takes effect."""

    def __init__(self, store: Store, seed: dict[str, Any] | None = None) -> None:
        self._store = store
        stored = store.policy_fields(Store.DEFAULT_SCOPE)
        if stored is None:  # the config file seeds the default; later UpdatePolicy calls win
            stored = check(Policy().with_fields(seed or {})).to_fields()
            store.save_policy_fields(Store.DEFAULT_SCOPE, stored)
        self.default = Policy().with_fields(stored)
        self._overrides: dict[str, dict[str, Any]] = {}

    def overrides(self, scope: str) -> dict[str, Any]:
        """The fields a worker overrides (empty when none)."""
        if scope not in self._overrides:
            self._overrides[scope] = self._store.policy_fields(scope) or {}
        return self._overrides[scope]

    def effective(self, scope: str | None) -> Policy:
        """The default policy, or a worker's with its overrides applied."""
        if scope is None:
            return self.default
        override = self.overrides(scope)
        return self.default.with_fields(override) if override else self.default

    def update_default(self, fields: dict[str, Any], scopes: list[str]) -> Policy:
        """Change the default; refused if it would make any of ``scopes``' effective policies invalid."""
        new = check(self.default.with_fields(fields))
        for scope in scopes:  # every worker's effective policy must stay valid too
            override = self.overrides(scope)
            if override:
                try:
                    check(new.with_fields(override))
                except InvalidArgument as exc:
                    raise InvalidArgument(f"{scope}'s overrides would become invalid: {exc}") from None
        self._store.save_policy_fields(Store.DEFAULT_SCOPE, new.to_fields())
        self.default = new
        return new

    def update_override(self, scope: str, fields: dict[str, Any]) -> Policy:
        """Change some of a worker's overrides; returns its new effective policy."""
        stored = {k: (dict(v) if isinstance(v, dict) else v) for k, v in fields.items()}
        override = {**self.overrides(scope), **stored}
        new = check(self.default.with_fields(override))
        self._store.save_policy_fields(scope, override)
        self._overrides[scope] = override
        return new


__all__ = ["FIELDS", "Policies", "Policy", "check", "fields_from_config", "fields_from_proto"]
