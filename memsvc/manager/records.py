"""A worker as the manager knows it: where it is, what it last reported, who holds it; and
:class:`WorkerView`, the record as it stood at one moment, which every answer and watch event carries."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace

from memsvc.errors import InvalidArgument, Overloaded
from memsvc.manager.reports import Device, TagMemory, WorkerStatus
from memsvc.runtime.deadline import Deadline
from memsvc.runtime.limits import MAX_ID_BYTES, MAX_QUEUED_TRANSITIONS
from memsvc.vocabulary import BUSY_STATES, Action, TagState, WorkerState, wake_set

NAME_PREFIX = "workers/"


def worker_id_from_name(name: str) -> str:
    """The one rule for a worker's name in every request: ``workers/{id}`` (canonical, what responses
    carry), or the bare ``{id}`` (what operators type); the prefix is lower case, an id has no ``/``."""
    wid = name[len(NAME_PREFIX) :] if name.startswith(NAME_PREFIX) else name
    if not wid or len(wid.encode()) > MAX_ID_BYTES or "/" in wid or not wid.isprintable():
        raise InvalidArgument(
            f"bad worker name {name!r}: use workers/<id> or <id> (an id has no '/', at most {MAX_ID_BYTES} bytes)",
            metadata={"name": name},
        )
    return wid


@dataclass
class Lease:
    lease_id: str
    worker_id: str
    expire_time: float
    holder: str
    keep_alive: float | None = None
    """Seconds the worker may stay idle and awake after this lease, if it is the last to end (negative:
    no idle sleep); None: the policy's idle_sleep_timeout."""
    request_id: str = ""
    """The AcquireWorker request that granted it (stored: a retry after a failover gets it back)."""


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A worker as the manager showed it at one moment (the proto's ``Worker``): what GetWorker and
    ListWorkers answer, what a watch event carries, and what a transition returns. Frozen, because
    a retried SleepWorker gets the worker as the first call left it, not as it is now, and a watch
    event shows the worker as it was when the event happened."""

    worker_id: str
    address: str
    host: str
    state: WorkerState
    configured: bool
    status: WorkerStatus | None
    """None until the worker first reports."""
    lease_count: int
    last_seen: float
    """Wall-clock time it was last heard from; 0: never."""
    idle_since: float | None
    """Since when its idle clock counts; None while leased."""
    keep_alive: float | None
    waiting_acquires: int
    waiting_since: float | None
    """When the longest-waiting AcquireWorker began to wait; None when none waits."""
    turns_yielded: int

    @property
    def name(self) -> str:
        return NAME_PREFIX + self.worker_id

    def showing(self, state: WorkerState) -> WorkerView:
        """This view in ``state``: a watch event's worker shows the state its change led to."""
        return replace(self, state=state)


@dataclass
class WorkerRecord:
    worker_id: str
    address: str
    host: str
    configured: bool = False
    status: WorkerStatus | None = None
    reachable: bool = False
    last_seen: float = 0.0
    """Wall-clock time the worker was last heard from (for operators: ``last_seen_time``)."""
    heard: float = field(default_factory=time.monotonic)
    """Monotonic time of the same (for the manager's own clocks: silence, forgetting); the
    record's creation until the worker says something."""
    idle_since: float = field(default_factory=time.time)
    leases: dict[str, Lease] = field(default_factory=dict)
    status_time_ns: int = 0
    """When the applied status was true at the worker: older telemetry is ignored."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Serialises the manager's transitions on this worker (idle timer, budget, operator, lease)."""
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    """Notified on every status or availability change (AcquireWorker waits on it)."""
    queued: int = 0
    """Clients' transition calls waiting for ``lock`` or holding it (see :meth:`exclusive`)."""
    next_idle_attempt: float = 0.0
    """After a failed idle sleep: the idle timers try again no earlier than this (wall clock)."""
    keep_alive: float | None = None
    """The keep_alive of the last lease to end: its tier-1 idle timeout until the next lease ends."""
    cause: str = ""
    """While the manager runs a transition on the worker: why (the RPC or timer that started it),
    the reason its state changes carry instead of the worker's own RPC name."""
    sleeping: bool = False
    """A Sleep the manager sent is in flight (until its answer, or the settling after none, is
    applied): a wake short of room on the device waits for what it frees instead of refusing."""
    turn_start: float = 0.0
    """Wall-clock time the manager last woke it: its turn on the device runs from here (0: awake
    since before the manager woke it, a turn long over; see memsvc/manager/turns.py)."""
    waiting: list[float] = field(default_factory=list)
    """When each AcquireWorker now waiting for it to wake began to wait."""
    turns_yielded: int = 0
    """Turns it gave up: paused and put to sleep so another worker could wake on its device."""

    async def wait_changed(self, deadline: Deadline) -> None:
        """Until this worker's status next changes, at most a second or what is left of ``deadline``:
        the caller looks again either way (a change may come without a notification it can see)."""
        left = deadline.remaining()
        async with self.changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout=min(1.0, left) if left is not None else 1.0)

    @contextlib.contextmanager
    def caused_by(self, why: str) -> Iterator[None]:
        """``cause`` for the block. One slot is enough: every transition the manager runs on this
        worker holds ``lock``, so two never overlap."""
        self.cause = why
        try:
            yield
        finally:
            self.cause = ""

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """``lock``, for a client's SleepWorker or WakeWorker: Overloaded when MAX_QUEUED_TRANSITIONS
        calls already wait for this worker (a retry with the same request_id joins its first call)."""
        if self.queued >= MAX_QUEUED_TRANSITIONS:
            raise Overloaded(
                f"{self.queued} calls are waiting for {self.worker_id}'s transitions, the most it queues",
                metadata={"maxQueued": str(MAX_QUEUED_TRANSITIONS)},
            )
        self.queued += 1
        try:
            async with self.lock:
                yield
        finally:
            self.queued -= 1

    @property
    def idle_start(self) -> float:
        """The idle clock counts from the later of the last release and the worker's last traffic."""
        if self.status is not None and self.status.last_activity_ns is not None:
            return max(self.idle_since, self.status.last_activity_ns / 1e9)
        return self.idle_since

    @property
    def name(self) -> str:
        return NAME_PREFIX + self.worker_id

    @property
    def state(self) -> WorkerState:
        if not self.reachable:
            return WorkerState.UNAVAILABLE
        return self.status.state if self.status is not None else WorkerState.UNSPECIFIED

    @property
    def in_transition(self) -> bool:
        """The worker is loading, sleeping or waking, or has a transition accepted and not yet ended
        (one it was asked for directly, or one whose caller gave up): no other may start now."""
        return self.state in BUSY_STATES or (self.status is not None and self.status.transition_in_progress)

    @property
    def device_key(self) -> tuple[str, str, str]:
        """Workers with equal keys share one device (and its budget)."""
        d = self.device
        return (self.host, d.backend, d.uuid or str(d.index))

    @property
    def device(self) -> Device:
        """The device it last reported (an empty one before then)."""
        d = self.status.device if self.status is not None else None
        return d if d is not None else Device()

    def tags(self) -> tuple[TagMemory, ...]:
        return self.status.tags if self.status is not None else ()

    def tag_names(self) -> set[str]:
        """The tags the worker last reported (empty before its first status)."""
        return {t.tag for t in self.tags()}

    @property
    def mapped_bytes(self) -> int:
        return sum(t.mapped_bytes for t in self.tags())

    @property
    def offloaded_bytes(self) -> int:
        """Host bytes the worker's offloaded tags hold (what a host budget counts; not its disk tier)."""
        return sum(t.offloaded_bytes for t in self.tags())

    @property
    def disk_tier(self) -> bool:
        """The worker has a disk tier: its sleepers can move to disk and keep their bytes."""
        return self.status is not None and bool(self.status.offload_dir)

    def to_disk_actions(self) -> dict[str, Action]:
        """The demotion that frees this sleeper's host RAM and keeps its bytes: every offloaded tag to
        its disk tier."""
        return {t.tag: Action.OFFLOAD_DISK for t in self.tags() if t.state == TagState.OFFLOADED}

    def wake_need_bytes(self, tags: list[str] | None = None) -> int:
        """Device bytes a wake of ``tags`` (all sleeping tags when None; with the tags each wakes too,
        vocabulary.wake_set) would map."""
        asleep = [t for t in self.tags() if t.state != TagState.AWAKE]
        woken = set(wake_set(tags, [t.tag for t in asleep])) if tags is not None else None
        return sum(t.awake_bytes for t in asleep if woken is None or t.tag in woken)

    def unmap_bytes(self, actions: dict[str, Action]) -> int:
        """Device bytes a sleep with ``actions`` would free (mapped tags it offloads or discards)."""
        return sum(t.mapped_bytes for t in self.tags() if actions.get(t.tag, Action.KEEP) != Action.KEEP)

    def offload_need_bytes(self, actions: dict[str, Action]) -> int:
        """Host bytes a sleep with ``actions`` would add (awake tags that OFFLOAD)."""
        return sum(
            t.allocated_bytes for t in self.tags() if t.state == TagState.AWAKE and actions.get(t.tag) == Action.OFFLOAD
        )

    def view(self) -> WorkerView:
        """The record as it stands now, frozen."""
        return WorkerView(
            worker_id=self.worker_id,
            address=self.address,
            host=self.host,
            state=self.state,
            configured=self.configured,
            status=self.status,
            lease_count=len(self.leases),
            last_seen=self.last_seen,
            idle_since=None if self.leases else self.idle_start,
            keep_alive=self.keep_alive,
            waiting_acquires=len(self.waiting),
            waiting_since=min(self.waiting) if self.waiting else None,
            turns_yielded=self.turns_yielded,
        )

    @property
    def device_total_bytes(self) -> int:
        return self.device.total_bytes
