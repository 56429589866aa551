"""What a worker reports, as the manager holds it (its status, a finished transition, a state change,
one telemetry message), and the transitions the manager asks of it (:class:`SleepCall`,
:class:`WakeCall`, each answered with an :class:`Answer`).

The manager's decisions (budgets, turns, idle timers, metrics) read these typed values; only the
link to the worker and the servicer speak protos, both through :mod:`memsvc.manager.wire`. A status
is relayed to clients field for field (GetWorker's ``Worker.status``), so it keeps everything the
worker said that this version knows, the parts the manager never reads too, and which parts the
worker sent at all: a part that is ``None`` here was absent from the message, one that is empty was
sent empty, and the relayed message shows the difference as the worker's did. (A field or an enum
number only a newer worker knows does not cross: memsvc/manager/wire.py.) Times are whole nanoseconds since the
epoch, as the worker's timestamps have them, so nothing is rounded on the way through.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from memsvc.vocabulary import Action, SleepLevel, TagState, WorkerState


@dataclass(frozen=True, slots=True)
class Device:
    """The device a worker serves on, and how full it is (the proto's ``DeviceInfo``)."""

    backend: str = ""
    """``cuda``, ``host``, or ``inmemory`` (memsvc/manager/inmemory.py)."""
    index: int = 0
    name: str = ""
    uuid: str = ""
    """Empty where the backend has none: the index names the device then."""
    total_bytes: int = 0
    free_bytes: int = 0


@dataclass(frozen=True, slots=True)
class TagMemory:
    """One tag's memory on a worker (the proto's ``TagMemory``)."""

    tag: str
    state: TagState | None = None
    """None: the worker named no state this version knows."""
    mapped_bytes: int = 0
    """On the device now."""
    allocated_bytes: int = 0
    offloaded_bytes: int = 0
    """In the worker's host memory (what a host budget counts)."""
    discarded_bytes: int = 0
    allocation_count: int = 0
    awake_bytes: int = 0
    """On the device once awake (what a wake of the tag maps)."""
    disk_bytes: int = 0


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The model a worker serves (the proto's ``ModelInfo``): the manager reads only its served
    name (a metric label) and relays the rest."""

    source: str = ""
    family: str = ""
    parameter_count: int = 0
    weights_bytes: int = 0
    vocab_size: int = 0
    layer_count: int = 0
    context_length: int = 0
    eos_token_ids: tuple[int, ...] = ()
    has_tokenizer: bool = False
    has_chat_template: bool = False
    served_model_name: str = ""


@dataclass(frozen=True, slots=True)
class KvCache:
    """A worker's paged KV cache (the proto's ``KvCacheInfo``): relayed, never read by the manager."""

    block_bytes: int = 0
    block_size_tokens: int = 0
    device_block_count: int = 0
    device_free_block_count: int = 0
    host_block_count: int = 0
    host_free_block_count: int = 0
    sequence_count: int = 0
    recomputed_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Transition:
    """What one finished transition moved, and how fast (the proto's ``TransitionStats``): what
    SleepWorker and WakeWorker answer, a watch event, the transition metrics."""

    kind: str = ""
    """A :class:`~memsvc.vocabulary.TransitionKind` as the worker spelled it (empty: none yet)."""
    moved_bytes: int = 0
    duration_ns: int | None = None
    gigabytes_per_second: float = 0.0
    verified_bytes: int = 0
    end_time_ns: int | None = None

    @property
    def seconds(self) -> float:
        return (self.duration_ns or 0) / 1e9


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A worker's status as it reported it (GetWorkerStatus, a Sleep or WakeUp answer, a telemetry
    snapshot), or as the manager moved it on from a state change the stream told of."""

    worker_id: str = ""
    state: WorkerState = WorkerState.UNSPECIFIED
    device: Device | None = None
    model: ServedModel | None = None
    tags: tuple[TagMemory, ...] = ()
    kv_cache: KvCache | None = None
    last_transition: Transition | None = None
    host_pinned_bytes: int = 0
    update_time_ns: int | None = None
    """When this status was true at the worker: an older one arriving later is stale."""
    sleep_level: int = 0
    """The level of the sleep the worker is in (0: awake, or asleep by explicit tag actions)."""
    last_activity_ns: int | None = None
    """The worker's last traffic: the idle clocks count from it."""
    transition_in_progress: bool = False
    offload_dir: str = ""
    """The worker's disk tier; empty without one."""
    disk_bytes: int = 0
    paused_generations: int = 0


@dataclass(frozen=True, slots=True)
class StateChange:
    """A worker's state changed, and why (the RPC or timer that changed it)."""

    old: WorkerState
    new: WorkerState
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Telemetry:
    """One message of a worker's telemetry stream: a snapshot of its status, a state change, or a
    finished transition (``event``; None: a kind this version does not know, ignored)."""

    time_ns: int
    """When the worker sent it: a state change was true then."""
    event: WorkerStatus | StateChange | Transition | None


@dataclass(frozen=True, slots=True)
class SleepCall:
    """A Sleep the manager sends a worker."""

    level: SleepLevel | None
    """None: ``actions`` alone say what sleeps."""
    actions: Mapping[str, Action]
    """Explicit tag actions, over the level's."""
    request_id: str = ""
    """A retry with the same id gets the first call's answer from the worker."""
    pause_generations: bool = False
    """Pause the running generations instead of waiting for them (a turn given up)."""


@dataclass(frozen=True, slots=True)
class WakeCall:
    """A WakeUp the manager sends a worker."""

    tags: tuple[str, ...]
    """The tags to wake (with those they wake too); empty: every sleeping tag."""
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class Answer:
    """A worker's answer to a Sleep or WakeUp: its status after the transition, and the transition."""

    status: WorkerStatus
    transition: Transition


__all__ = [
    "Answer",
    "Device",
    "KvCache",
    "ServedModel",
    "SleepCall",
    "StateChange",
    "TagMemory",
    "Telemetry",
    "Transition",
    "WakeCall",
    "WorkerStatus",
]
