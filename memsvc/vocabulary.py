"""The words memsvc speaks, defined once: memory tags, tag actions and states, sleep levels, worker
states, copy methods and transition kinds.

Every module that names one of these imports it from here, so the worker, the manager, the CLI, the
allocator and the native extension cannot drift apart. Each enum wraps its proto enum in
``protos/memsvc/v1/common.proto``:

- where the API speaks numbers (tag actions, sleep levels, worker states) the members *are* the
  proto's numbers (``IntEnum``), so a member goes into a message, a database row or the native
  extension as it is (``msv_sleep`` switches on these action numbers);
- where the allocator API speaks names (tag states, copy methods) the members are those names
  (``StrEnum``) and ``.proto`` gives the number.

A new member is one line here plus its value in the proto. Bad input is refused here, once, with
INVALID_ARGUMENT: :meth:`Action.from_proto`, :meth:`Action.parse`, :meth:`SleepLevel.parse`,
:meth:`CopyMethod.from_proto`, :func:`check_tag`.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Mapping
from types import MappingProxyType
from typing import Any

from memsvc.errors import InvalidArgument
from memsvc.v1 import common_pb2 as common_pb

WEIGHTS = "weights"
"""The model's weights (offloaded, or reloaded from the checkpoint)."""
KV_CACHE = "kv_cache"
"""The paged KV cache's device pool."""
CUDA_GRAPHS = "cuda_graphs"
"""The engine's captured decode graphs: their inputs and activations, scratch between replays
(discarded by both sleep levels, mapped again at the same addresses on wake; CUDA only)."""
MAX_TAG_BYTES = 63
"""Longest tag name in UTF-8 bytes (the native table keeps 64 with the NUL)."""


def check_tag(tag: object) -> str:
    """A tag name: a string of 1 to 63 UTF-8 bytes without NUL (what the native table can hold)."""
    if not isinstance(tag, str) or not 0 < len(tag.encode()) <= MAX_TAG_BYTES or "\0" in tag:
        raise InvalidArgument(
            f"tag must be a string of 1 to {MAX_TAG_BYTES} bytes without NUL, got {tag!r}",
            metadata={"tag": str(tag)},
        )
    return tag


def check_known_tags(tags: Iterable[str], known: Collection[str]) -> None:
    """INVALID_ARGUMENT for a tag named twice or one the worker does not have (``known``; empty: not
    known yet, nothing to check against). The worker and the manager check a request the same way."""
    seen: set[str] = set()
    for tag in tags:
        if tag in seen:
            raise InvalidArgument(f"tag {tag!r} is named twice", metadata={"tag": tag})
        seen.add(tag)
        if known and tag not in known:
            raise InvalidArgument(f"unknown tag {tag!r}; this worker has {sorted(known)}", metadata={"tag": tag})


def _where(tag: str) -> tuple[str, dict[str, str] | None]:
    return (f"tag {tag!r}: ", {"tag": tag}) if tag else ("", None)


class Action(enum.IntEnum):
    """What happens to a tag's memory on sleep (proto ``TagAction``)."""

    OFFLOAD = common_pb.TAG_ACTION_OFFLOAD
    """Copy to page-locked host memory, restore byte for byte on wake."""
    DISCARD = common_pb.TAG_ACTION_DISCARD
    """Drop; weights are reloaded from their source on wake, a KV cache comes back empty."""
    KEEP = common_pb.TAG_ACTION_KEEP
    """Stay resident."""
    OFFLOAD_DISK = common_pb.TAG_ACTION_OFFLOAD_DISK
    """Write to a file of the worker's disk tier (``--offload-dir``), restore byte for byte on wake;
    given to an OFFLOADED tag, move its host copy to disk."""

    @property
    def label(self) -> str:
        """The name users write (``offload``): config files, the allocator API, messages."""
        return self.name.lower()

    @property
    def proto(self) -> common_pb.TagAction.ValueType:
        return common_pb.TagAction.ValueType(self.value)

    @classmethod
    def from_proto(cls, value: int, tag: str = "") -> Action:
        """A request's TagAction; INVALID_ARGUMENT for UNSPECIFIED and unknown values."""
        try:
            return cls(value)
        except ValueError:
            where, metadata = _where(tag)
            raise InvalidArgument(f"{where}action must be {_choices(cls)}, got {value}", metadata=metadata) from None

    @classmethod
    def parse(cls, value: Any, tag: str = "") -> Action:
        """An action given as a member or by name (``"offload"``, any case)."""
        if isinstance(value, Action):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        where, metadata = _where(tag)
        raise InvalidArgument(f"{where}unknown action {value!r}; use {_choices(cls).lower()}", metadata=metadata)


class SleepLevel(enum.IntEnum):
    """vLLM's sleep levels (proto ``SleepLevel``)."""

    LEVEL_1 = common_pb.SLEEP_LEVEL_1
    """Weights OFFLOAD, kv_cache and cuda_graphs DISCARD."""
    LEVEL_2 = common_pb.SLEEP_LEVEL_2
    """Every tag DISCARD; the weights are reloaded from their source on wake (host RAM freed too)."""

    @classmethod
    def parse(cls, value: int) -> SleepLevel | None:
        """A request's level: None for UNSPECIFIED, INVALID_ARGUMENT for an unknown one."""
        if value == common_pb.SLEEP_LEVEL_UNSPECIFIED:
            return None
        try:
            return cls(value)
        except ValueError:
            raise InvalidArgument(f"sleep level must be 1 or 2, got {value}", metadata={"level": str(value)}) from None

    @property
    def actions(self) -> Mapping[str, Action]:
        """The tag actions this level means."""
        return LEVEL_ACTIONS[self]

    @property
    def proto(self) -> common_pb.SleepLevel.ValueType:
        return common_pb.SleepLevel.ValueType(self.value)

    @staticmethod
    def proto_of(level: int) -> common_pb.SleepLevel.ValueType:
        """A level number as the proto field takes it (0: unspecified, after an explicit tag map)."""
        return common_pb.SleepLevel.ValueType(level)


LEVEL_ACTIONS: Mapping[SleepLevel, Mapping[str, Action]] = MappingProxyType(
    {
        SleepLevel.LEVEL_1: MappingProxyType(
            {WEIGHTS: Action.OFFLOAD, KV_CACHE: Action.DISCARD, CUDA_GRAPHS: Action.DISCARD}
        ),
        SleepLevel.LEVEL_2: MappingProxyType(
            {WEIGHTS: Action.DISCARD, KV_CACHE: Action.DISCARD, CUDA_GRAPHS: Action.DISCARD}
        ),
    }
)
"""What each sleep level does per tag; explicit tag actions override it."""


WAKES_WITH: Mapping[str, tuple[str, ...]] = MappingProxyType({KV_CACHE: (CUDA_GRAPHS,)})
"""Tags a wake of the key wakes too, when they sleep. The decode graphs read the KV cache and hold only
scratch between replays (both levels discard them), so vLLM's partial wake, ``weights`` and then
``kv_cache``, ends with the worker AWAKE and serving rather than PARTIALLY_AWAKE for want of a tag no
client thinks of."""


def wake_set(tags: Iterable[str], asleep: Collection[str]) -> list[str]:
    """The tags a WakeUp naming ``tags`` wakes: those, and their :data:`WAKES_WITH` companions among
    ``asleep`` (the worker's rule, which the in-memory worker and the manager's budget follow too)."""
    out = list(tags)
    for tag in list(out):
        out += [t for t in WAKES_WITH.get(tag, ()) if t in asleep and t not in out]
    return out


def plan_actions(level: SleepLevel | None, tag_actions: Mapping[str, Action]) -> dict[str, Action]:
    """Actions per tag for a sleep: the level's table, overridden by explicit tag actions."""
    plan = dict(level.actions) if level is not None else {}
    plan.update(tag_actions)
    return plan


UNNAMED_TAG_ACTION = Action.OFFLOAD
"""A policy's action for a tag it does not name and no level names either (an embedder's own pool):
its bytes come back on wake, since losing data is the one thing a default must never do."""


def policy_actions(tags: Iterable[str], named: Mapping[str, Action]) -> dict[str, Action]:
    """A policy's tier-1 actions for a worker with ``tags``: every one of them, so that an idle sleep
    leaves nothing mapped the policy forgot (``cuda_graphs`` beside a policy of weights and kv_cache).
    A tag the policy names gets its action; one it does not, its level-1 action (DISCARD for the
    rebuildable ``kv_cache`` and ``cuda_graphs``), else :data:`UNNAMED_TAG_ACTION`. Names the worker
    does not have are left out: the default policy speaks for every worker, and a tag another
    worker has is not this one's to act on."""
    level1 = LEVEL_ACTIONS[SleepLevel.LEVEL_1]
    return {t: named.get(t, level1.get(t, UNNAMED_TAG_ACTION)) for t in tags}


def actions_from_proto(tag_actions: Mapping[str, int]) -> dict[str, Action]:
    """A request's ``map<string, TagAction>``, each tag and action checked."""
    return {check_tag(tag): Action.from_proto(act, tag) for tag, act in tag_actions.items()}


class WorkerState(enum.IntEnum):
    """Lifecycle of a worker (proto ``WorkerState``)."""

    UNSPECIFIED = common_pb.WORKER_STATE_UNSPECIFIED
    """The manager has no status from the worker yet."""
    LOADING = common_pb.WORKER_STATE_LOADING
    AWAKE = common_pb.WORKER_STATE_AWAKE
    SLEEPING = common_pb.WORKER_STATE_SLEEPING
    ASLEEP = common_pb.WORKER_STATE_ASLEEP
    WAKING = common_pb.WORKER_STATE_WAKING
    PARTIALLY_AWAKE = common_pb.WORKER_STATE_PARTIALLY_AWAKE
    UNAVAILABLE = common_pb.WORKER_STATE_UNAVAILABLE
    """Only the manager says this: it cannot reach the worker."""

    @classmethod
    def of(cls, value: int) -> WorkerState:
        """A state from a message; a value this version does not know reads as UNSPECIFIED
        (the proto asks clients to treat unknown values as "not AWAKE")."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNSPECIFIED

    @property
    def label(self) -> str:
        """``awake``, ``partially_awake``, ...: the CLI's and the metrics' spelling."""
        return self.name.lower()

    @property
    def proto(self) -> common_pb.WorkerState.ValueType:
        return common_pb.WorkerState.ValueType(self.value)


RPC_FRONTS = ("inline", "process")
"""Where a worker's public gRPC server runs (``memsvc worker --rpc-front``): in its own process, or in
a child process of its own (worker/rpc_front.py)."""

AWAKE_STATES = frozenset({WorkerState.AWAKE, WorkerState.PARTIALLY_AWAKE})
"""States in which some tag is resident: an idle timer may put the worker to sleep."""
BUSY_STATES = frozenset({WorkerState.LOADING, WorkerState.SLEEPING, WorkerState.WAKING})
"""States a transition passes through: no other transition or KV work starts until they end. Every
other state is *settled*, and "to settle" means only this: to reach one (a worker whose transition
failed settles in the state its tags are in; the manager waits for a call in doubt to settle)."""

_WAKEFULNESS = {WorkerState.ASLEEP: 0, WorkerState.PARTIALLY_AWAKE: 1, WorkerState.AWAKE: 2}


def passed_through(old: WorkerState, new: WorkerState) -> WorkerState | None:
    """The transition state a worker went through between two settled states, when it changed from
    ``old`` to ``new`` without being seen in between: SLEEPING on the way down, WAKING on the way up.

    A worker only moves between settled states through one of those (its state machine has no
    direct edge), but the manager hears of a transition twice, over the telemetry stream and in the
    RPC's answer, on different connections: when the answer overtakes the stream, the stream's
    "WAKING" arrives after "AWAKE" and is rightly dropped as stale. Watchers are promised every
    change in order, so the manager reports the state the worker passed through itself."""
    if old not in _WAKEFULNESS or new not in _WAKEFULNESS or old == new:
        return None
    return WorkerState.WAKING if _WAKEFULNESS[new] > _WAKEFULNESS[old] else WorkerState.SLEEPING


class _NamedProtoEnum(enum.StrEnum):
    """A StrEnum whose members map by name onto a proto enum (``<PREFIX>_<MEMBER NAME>``)."""

    @classmethod
    def _prefix(cls) -> str:
        raise NotImplementedError

    def _proto_number(self) -> int:
        return int(getattr(common_pb, f"{self._prefix()}_{self.name}"))


class TagState(_NamedProtoEnum):
    """Where one tag's memory is (proto ``TagState``)."""

    AWAKE = "awake"
    OFFLOADED = "offloaded"
    DISCARDED = "discarded"
    ON_DISK = "on_disk"

    @classmethod
    def _prefix(cls) -> str:
        return "TAG_STATE"

    @classmethod
    def of(cls, value: int) -> TagState | None:
        """The state a message's number names; None for unspecified and for a value this version
        does not know (a newer worker's)."""
        return next((state for state in cls if state.proto == value), None)

    @property
    def proto(self) -> common_pb.TagState.ValueType:
        return common_pb.TagState.ValueType(self._proto_number())


def _sleep_rules() -> dict[tuple[TagState, Action], TagState | None]:
    awake, host, gone, disk = TagState.AWAKE, TagState.OFFLOADED, TagState.DISCARDED, TagState.ON_DISK
    after = {
        awake: (host, gone, awake, disk),
        host: (None, gone, host, disk),
        gone: (None, None, gone, None),
        disk: (None, gone, disk, None),
    }
    actions = (Action.OFFLOAD, Action.DISCARD, Action.KEEP, Action.OFFLOAD_DISK)
    return {(state, action): row[i] for state, row in after.items() for i, action in enumerate(actions)}


SLEEP_RULES: Mapping[tuple[TagState, Action], TagState | None] = MappingProxyType(_sleep_rules())
"""What a sleep does to a tag: its state after a sleep with an action, by its state before (the same
state: the sleep leaves it; None: the sleep is refused). An awake tag goes to sleep as its action
says; a sleeper only moves further down without waking: from host memory to disk, or from either to
DISCARD (level 1 to level 2). The worker's native layer decides by the same table (native/sleep.c's
``msv_sleep_rule``, exported as ``worker._native.sleep_rules()``); the manager, which has no native
layer, reads this copy, which tests/native/test_disk_tier.py holds to that one entry by entry."""
KEPT_IN: Mapping[Action, TagState] = MappingProxyType(
    {
        action: after
        for (state, action), after in SLEEP_RULES.items()
        if state == TagState.AWAKE and after not in (None, TagState.AWAKE, TagState.DISCARDED)
    }
)
"""The actions whose tag comes back byte for byte, and where its bytes wait meanwhile (every other
non-KEEP action discards)."""


def sleep_acts_on(state: TagState, action: Action) -> bool:
    """Whether a Sleep with ``action`` changes a tag in ``state`` (:data:`SLEEP_RULES`; the worker and
    the in-memory worker decide by it): refused and kept tags are left out of a sleep."""
    after = SLEEP_RULES[(state, action)]
    return after is not None and after != state


class CopyMethod(_NamedProtoEnum):
    """How a batched block copy moves bytes (see docs/benchmarks.md for the crossovers)."""

    AUTO = "auto"
    """Pick by block size (measured crossover)."""
    LOOP = "loop"
    """One cuMemcpyAsync per block."""
    BATCH = "batch"
    """One cuMemcpyBatchAsync (falls back to loop on drivers without it)."""
    KERNEL = "kernel"
    """One gather/scatter kernel through mapped host memory."""

    @classmethod
    def _prefix(cls) -> str:
        return "COPY_METHOD"

    @property
    def proto(self) -> common_pb.CopyMethod.ValueType:
        return common_pb.CopyMethod.ValueType(self._proto_number())

    @classmethod
    def from_proto(cls, value: int) -> CopyMethod:
        """A request's CopyMethod; UNSPECIFIED means AUTO, unknown values are INVALID_ARGUMENT."""
        if value == common_pb.COPY_METHOD_UNSPECIFIED:
            return cls.AUTO
        for member in cls:
            if member.proto == value:
                return member
        raise InvalidArgument(f"unknown copy method {value}")

    @classmethod
    def parse(cls, value: Any) -> CopyMethod:
        """A method given as a member or by name (the allocator API)."""
        try:
            return cls(value)
        except ValueError:
            raise InvalidArgument(f"unknown copy method {value!r}") from None


class FinishReason(enum.IntEnum):
    """Why a generation ended (proto ``FinishReason``)."""

    STOP = common_pb.FINISH_REASON_STOP
    """An end-of-sequence or stop token was generated (the last token returned)."""
    LENGTH = common_pb.FINISH_REASON_LENGTH
    """max_new_tokens were generated."""

    @property
    def label(self) -> str:
        """``stop``, ``length``: OpenAI's spelling."""
        return self.name.lower()

    @property
    def proto(self) -> common_pb.FinishReason.ValueType:
        return common_pb.FinishReason.ValueType(self.value)


class TransitionKind(enum.StrEnum):
    """What a finished transition was (``TransitionStats.kind``)."""

    LOAD = "load"
    SLEEP = "sleep"
    WAKE = "wake"
    RELOAD_WEIGHTS = "reload_weights"
    SWAP_BLOCKS = "swap_blocks"


def _choices(cls: type[enum.Enum]) -> str:
    """``OFFLOAD, DISCARD or KEEP``, for messages."""
    names = [m.name for m in cls]
    return ", ".join(names[:-1]) + " or " + names[-1]


__all__ = [
    "AWAKE_STATES",
    "BUSY_STATES",
    "RPC_FRONTS",
    "CUDA_GRAPHS",
    "KEPT_IN",
    "KV_CACHE",
    "LEVEL_ACTIONS",
    "SLEEP_RULES",
    "MAX_TAG_BYTES",
    "WEIGHTS",
    "Action",
    "CopyMethod",
    "FinishReason",
    "SleepLevel",
    "UNNAMED_TAG_ACTION",
    "WAKES_WITH",
    "TagState",
    "TransitionKind",
    "WorkerState",
    "actions_from_proto",
    "check_known_tags",
    "check_tag",
    "passed_through",
    "plan_actions",
    "policy_actions",
    "sleep_acts_on",
    "wake_set",
]
