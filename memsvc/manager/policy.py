"""Tag policy: what the manager does with a worker's memory, and when.

A policy is a set of fields. The default policy holds all of them; a worker's override holds only
the fields an UpdatePolicy for that worker named, so changing the default later still reaches every
field a worker did not override. :class:`Policies` keeps both parsed in memory and writes them
through to the store; the manager reads a worker's effective policy on every timer tick.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeGuard

from memsvc.errors import InvalidArgument
from memsvc.manager.store import DEFAULT_SCOPE, Store
from memsvc.runtime.limits import MAX_POLICY_TAGS
from memsvc.vocabulary import KV_CACHE, WEIGHTS, Action, check_tag

log = logging.getLogger("memsvc.manager.policy")

FIELDS = (
    "tag_actions",
    "idle_sleep_timeout",
    "idle_deep_sleep_timeout",
    "device_budget_bytes",
    "host_budget_bytes",
    "device_swap_headroom_bytes",
    "time_slice",
    "start_timeout",
)
MAX_TIMEOUT_S = 365 * 24 * 3600.0
DEFAULT_TIME_SLICE_S = 2.0
"""A busy worker's turn when another waits for its device. Against a swap of an 8B model on the H200
(about 0.3 s each way, overlapped: docs/benchmarks.md) the swaps take about a seventh of two busy
models' time, and a request for a sleeping model waits at most a slice and a swap."""
DURATION_FIELDS = ("idle_sleep_timeout", "idle_deep_sleep_timeout", "time_slice", "start_timeout")
"""The fields that are durations (seconds here, ``Duration`` on the wire)."""
_INT64 = 1 << 63


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
    device_swap_headroom_bytes: int = 0
    """Device bytes above the budget a wake may use while its eviction still runs; 0 = none."""
    time_slice: float = DEFAULT_TIME_SLICE_S
    """Seconds a busy worker keeps its device, from its wake, once another waits to wake there
    (memsvc/manager/turns.py); 0 = until its leases end."""
    start_timeout: float = 0.0
    """Seconds an AcquireWorker waits for the worker, unavailable, to be reachable again (a process
    started on demand, or restarted); 0 = refuse at once."""

    def to_fields(self) -> dict[str, Any]:
        """Every field, as the store keeps them (JSON: actions as their proto numbers)."""
        return {f: (dict(v) if isinstance(v := getattr(self, f), dict) else v) for f in FIELDS}

    def with_fields(self, fields: dict[str, Any]) -> Policy:
        """This policy with ``fields`` (as :meth:`to_fields` writes them) replaced."""
        if "tag_actions" in fields:
            fields = {**fields, "tag_actions": {t: Action.from_proto(a, t) for t, a in fields["tag_actions"].items()}}
        return replace(self, **fields)


def field_value(name: str, value: Any) -> Any:
    """One field of a request or the store, checked as the policy's rules have it: ``tag_actions`` a
    map of tag to action number, a duration in whole nanoseconds, a byte count. The field's value
    as :class:`Policy` holds it (actions as :class:`Action`, durations in seconds)."""
    if name == "tag_actions":
        if len(value) > MAX_POLICY_TAGS:
            raise InvalidArgument(
                f"tag_actions names {len(value)} tags, at most {MAX_POLICY_TAGS}",
                metadata={"field": name, "maxTags": str(MAX_POLICY_TAGS)},
            )
        return {check_tag(tag): Action.from_proto(act, tag) for tag, act in value.items()}
    if name in DURATION_FIELDS:
        if value < 0:
            raise InvalidArgument(f"{name} must not be negative", metadata={"field": name})
        seconds = value / 1e9
        if seconds > MAX_TIMEOUT_S:
            raise InvalidArgument(f"{name} must be at most one year", metadata={"field": name})
        return seconds
    v = int(value)
    if v < 0:
        raise InvalidArgument(f"{name} must not be negative", metadata={"field": name})
    return v


def check_clear(clear: Sequence[str], for_worker: bool) -> None:
    """An UpdatePolicy's ``clear_fields``: only a worker's overrides can be cleared, and only fields
    that exist (``*``: all)."""
    if clear and not for_worker:
        raise InvalidArgument(
            "clear_fields applies to a worker's overrides; the default policy has none",
            metadata={"field": "clear_fields"},
        )
    unknown = sorted(set(clear) - {*FIELDS, "*"})
    if unknown:
        raise InvalidArgument(
            f"unknown policy field(s) in clear_fields: {', '.join(unknown)}; known: {', '.join(FIELDS)} or *",
            metadata={"field": "clear_fields"},
        )


def check_change(fields: dict[str, Any], clear: Sequence[str]) -> None:
    """No field is both changed and cleared by one UpdatePolicy."""
    both = sorted(set(fields) & set(clear)) if "*" not in clear else sorted(fields)
    if both:
        raise InvalidArgument(f"{', '.join(both)}: both changed and cleared", metadata={"field": "clear_fields"})


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
        elif key in FIELDS:
            kind = float if key in DURATION_FIELDS else int
            try:
                out[key] = kind(value)
            except (TypeError, ValueError):
                raise InvalidArgument(f"config: {key} must be a number, got {value!r}") from None
        else:
            raise InvalidArgument(f"config: unknown policy key {key!r}")
        if isinstance(out[key], int | float) and out[key] < 0:
            raise InvalidArgument(f"config: {key} must not be negative")
    return out


def _stored_value(name: str, value: object) -> Any:
    """A stored field in the form :func:`field_value` takes, as an UpdatePolicy message could have
    carried it, so that one set of rules judges requests and the store.

    TypeError, ValueError or OverflowError for a value no request could carry (a string, a bool,
    NaN, a number out of the proto's range).
    """
    if name == "tag_actions":
        if not isinstance(value, dict) or not all(_is_int(a) for a in value.values()):
            raise TypeError(f"{value!r:.100} is not a map of tag to action number")
        return value
    if name in DURATION_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{value!r:.100} is not a number of seconds")
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a number of seconds")
        ns = round(value * 1e9)
        if not -_INT64 <= ns // 1_000_000_000 < _INT64:  # a Duration's seconds are an int64
            raise ValueError(f"{value!r} is out of range")
        return ns
    if not _is_int(value):
        raise TypeError(f"{value!r:.100} is not a byte count")
    if not -_INT64 <= value < _INT64:  # the byte counts are int64
        raise ValueError(f"{value!r} is out of range")
    return value


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def fields_from_store(raw: object, where: str, fallback: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """One stored scope's fields, each validated as UpdatePolicy validates it: (usable, unknown).

    The file may have been written by a newer memsvc (a field this one does not know) or edited by
    hand (a wrong type, a negative timeout, an action number that does not exist). Neither may stop
    the manager or make GetPolicy fail, so each such field is left out with a warning naming
    ``where`` (the file and scope) and the field; ``fallback`` says what applies instead. Unknown
    fields come back separately so that a later write keeps them for the version that knows them.
    """
    if not isinstance(raw, dict):
        log.warning("%s: the stored fields are not a JSON object (%.100r), ignored; %s", where, raw, fallback)
        return {}, {}
    usable: dict[str, Any] = {}
    unknown: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in FIELDS:
            log.warning("%s: ignoring unknown field %r (written by a newer memsvc?); it stays in the file", where, name)
            unknown[name] = value
            continue
        try:
            usable[name] = field_value(name, _stored_value(name, value))
        except (InvalidArgument, TypeError, ValueError, OverflowError) as exc:
            log.warning("%s: dropping stored %s (%s); %s", where, name, exc, fallback)
    return usable, unknown


def consistent_fields(base: Policy, fields: dict[str, Any], where: str, fallback: str) -> dict[str, Any]:
    """``fields`` less the stored timeouts that make ``base`` with them fail :func:`check` (tier 2
    before tier 1), so that a hand-edited or older file cannot make a policy GetPolicy would show
    but UpdatePolicy would refuse. Tier 2's timeout goes first, as the deeper and costlier sleep;
    ``base`` (the built-in policy, or the effective default) is valid, so dropping both always ends
    with a valid policy."""
    fields = dict(fields)
    for name in ("idle_deep_sleep_timeout", "idle_sleep_timeout"):
        try:
            check(base.with_fields(fields))
            return fields
        except InvalidArgument as exc:
            if name in fields:
                log.warning("%s: dropping stored %s (%s); %s", where, name, exc, fallback)
                del fields[name]
    check(base.with_fields(fields))
    return fields


class Policies:
    """The default policy and every worker's overrides, parsed once and kept in memory; each change
    is written through to the store before it takes effect."""

    def __init__(self, store: Store, seed: dict[str, Any] | None = None) -> None:
        self._store = store
        self._unknown: dict[str, dict[str, Any]] = {}
        """Per scope, the stored fields this version does not know: written back with its own."""
        stored = store.policies()  # all of them now, so that what is wrong with the file is logged at start
        if DEFAULT_SCOPE in stored:
            fields = self._load(Policy(), DEFAULT_SCOPE, stored.pop(DEFAULT_SCOPE))
            self.default = Policy().with_fields(fields)
        else:  # the config file seeds the default; later UpdatePolicy calls win
            self.default = check(Policy().with_fields(seed or {}))
            store.save_policy_fields(DEFAULT_SCOPE, self.default.to_fields())
        self._overrides: dict[str, dict[str, Any]] = {
            scope: self._load(self.default, scope, raw) for scope, raw in stored.items()
        }

    def _load(self, base: Policy, scope: str, raw: object) -> dict[str, Any]:
        """The usable fields of one stored scope (the file itself is left as it is)."""
        if scope == DEFAULT_SCOPE:
            where = f"{self._store.where}: the default policy"
            fallback = "the built-in value applies until UpdatePolicy sets it"
        else:
            where = f"{self._store.where}: {scope}'s policy override"
            fallback = "the default policy's value applies"
        fields, self._unknown[scope] = fields_from_store(raw, where, fallback)
        return consistent_fields(base, fields, where, fallback)

    def _save(self, scope: str, fields: dict[str, Any]) -> None:
        self._store.save_policy_fields(scope, {**self._unknown.get(scope, {}), **fields})

    def overrides(self, scope: str) -> dict[str, Any]:
        """The fields a worker overrides (empty when none)."""
        if scope not in self._overrides:
            raw = self._store.policy_fields(scope)
            self._overrides[scope] = {} if raw is None else self._load(self.default, scope, raw)
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
        self._save(DEFAULT_SCOPE, new.to_fields())
        self.default = new
        return new

    def forget(self, scope: str) -> None:
        """A deregistered worker's overrides go with it (stored and cached): a worker registering
        under the name again starts from the default policy."""
        self._store.delete_policy(scope)
        self._overrides.pop(scope, None)
        self._unknown.pop(scope, None)

    def update_override(self, scope: str, fields: dict[str, Any], clear: Sequence[str] = ()) -> Policy:
        """Change some of a worker's overrides and remove those named in ``clear`` (``*``: all);
        returns its new effective policy."""
        stored = {k: (dict(v) if isinstance(v, dict) else v) for k, v in fields.items()}
        kept = {} if "*" in clear else {k: v for k, v in self.overrides(scope).items() if k not in clear}
        override = {**kept, **stored}
        new = check(self.default.with_fields(override))
        self._save(scope, override)
        self._overrides[scope] = override
        return new


__all__ = [
    "DURATION_FIELDS",
    "FIELDS",
    "Policies",
    "Policy",
    "check",
    "check_change",
    "check_clear",
    "consistent_fields",
    "field_value",
    "fields_from_config",
    "fields_from_store",
]
