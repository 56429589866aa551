"""The default host reserve: how much page-locked host memory a worker keeps, and giving it back
when the host runs short.

A sleep copies into page-locked host chunks. Fresh ones must be faulted and page-locked on the
sleep's path, which on the H200 host made a default worker's first sleep of 16 GB take 3.9 s
(4 GB/s) and its later ones 0.55 s, against 0.30 s once chunks are reused (docs/benchmarks.md). So
by default (``auto``, on the cuda backend) a worker pre-pins the size of its weights pool in the
background once loaded, while no request runs (:class:`BackgroundPrepin`), and keeps that much
between sleeps: the first sleep and every later one run at line rate. The cost is host RAM held,
locked, while the worker is awake (while it sleeps the same chunks hold its weights' backup): at
most :data:`HOST_RAM_FRACTION` of the host's memory, none when the host is already short, and given
back (the reserve drops to 0, free chunks are unpinned) whenever the host's available memory falls
below :func:`short_threshold` (a prepin still running stops), to come back once it recovers: the
reserve's size, not its chunks, which later sleeps pin afresh. ``status``'s ``host_pinned_bytes``
and the manager's ``memsvc_worker_host_pinned_bytes`` show what is held. Explicit
``--host-reserve`` and ``--host-prepin`` values are the operator's and are never changed. The host
backend has nothing to page-lock (its copies are memcpy), so ``auto`` means 0 there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from memsvc.errors import InvalidArgument, MemsvcError
from memsvc.vocabulary import WEIGHTS

if TYPE_CHECKING:
    from worker.allocator import MemoryAllocator

log = logging.getLogger("memsvc.worker")

IDLE_S = 0.5
"""No Generate for this long: the worker is idle, and page-locks host memory or gives it back, a
piece at a time (page-locking and unlocking hold up the kernel launches and copies beside them)."""
STEP_BYTES = 256 << 20
"""Bytes page-locked or given back per piece (the host pool's default chunk)."""


def until_idle(last_busy: Callable[[], float]) -> float:
    """Seconds until no Generate will have run for :data:`IDLE_S` (0 or less: the worker is idle);
    ``last_busy`` is the engine's."""
    return IDLE_S - (time.monotonic() - last_busy())


AUTO = "auto"
HOST_RAM_FRACTION = 0.25
"""The most of the host's memory one worker's automatic reserve takes."""
CHECK_S = 2.0
"""How often the guard reads the host's available memory."""
GiB = 1 << 30


@dataclass(frozen=True)
class HostMemory:
    """``MemTotal`` and ``MemAvailable`` of ``/proc/meminfo``, in bytes."""

    total: int
    available: int


def read_host_memory(path: str | Path = "/proc/meminfo") -> HostMemory:
    fields: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    if "MemTotal" not in fields or "MemAvailable" not in fields:
        raise InvalidArgument(f"{path}: no MemTotal/MemAvailable")
    return HostMemory(fields["MemTotal"], fields["MemAvailable"])


def short_threshold(total: int) -> int:
    """Available host memory below this is short: a tenth of it, at least 2 GiB (the page cache and
    everything else on the host need room too)."""
    return max(total // 10, 2 * GiB)


def auto_reserve(weights_bytes: int, mem: HostMemory) -> int:
    """The automatic reserve: the weights pool (what a level-1 sleep offloads), at most
    :data:`HOST_RAM_FRACTION` of the host, and none if holding it would leave the host short."""
    want = min(weights_bytes, int(mem.total * HOST_RAM_FRACTION))
    return want if mem.available - want >= short_threshold(mem.total) else 0


def parse_reserve(value: int | str, what: str) -> int | str:
    """A byte count >= 0 or ``auto`` (what ``--host-reserve`` takes)."""
    if value == AUTO or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise InvalidArgument(f"{what} must be a byte count >= 0 or '{AUTO}', got {value!r}")


def parse_prepin(value: int | str) -> int | str:
    """A byte count >= 0, ``weights`` (the weights pool) or ``auto`` (what ``--host-prepin`` takes)."""
    if value in (WEIGHTS, AUTO) or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise InvalidArgument(f"host_prepin must be a byte count >= 0, '{WEIGHTS}' or '{AUTO}', got {value!r}")


class HostReserveGuard:
    """Keeps an automatic reserve while the host has room and drops it while it is short (see the
    module docstring). ``apply`` sets the reserve the allocator keeps (the worker passes
    :meth:`~worker.host_release.HostRelease.set_base` run on its device loop)."""

    def __init__(
        self, reserve: int, apply: Callable[[int], None], read: Callable[[], HostMemory] = read_host_memory
    ) -> None:
        self.reserve = reserve
        """The reserve while the host has room."""
        self._apply = apply
        self._read = read
        self.released = False
        """The reserve is given back for now (the host ran short)."""
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    def check(self) -> None:
        """One look at the host: give the reserve back if it is short, take it again once there is
        room for it above the threshold (so one check's answer does not flip the next)."""
        try:
            mem = self._read()
        except (OSError, InvalidArgument) as exc:
            log.debug("host memory unreadable: %s", exc)
            return
        threshold = short_threshold(mem.total)
        if not self.released and mem.available < threshold:
            self.released = True
            log.warning(
                "host memory short (%.1f GiB available): host reserve of %.1f GiB given back; sleeps pin afresh",
                mem.available / GiB,
                self.reserve / GiB,
            )
            self._apply_safely(0)
        elif self.released and mem.available >= threshold + self.reserve:
            self.released = False
            log.info(
                "host memory recovered (%.1f GiB available): host reserve back to %.1f GiB",
                mem.available / GiB,
                self.reserve / GiB,
            )
            self._apply_safely(self.reserve)

    def _apply_safely(self, nbytes: int) -> None:
        try:
            self._apply(nbytes)
        except RuntimeError as exc:  # the worker is shutting down (its device loop is gone)
            log.debug("host reserve not changed: %s", exc)

    def start(self) -> None:
        """Check every :data:`CHECK_S` on the running loop until :meth:`stop`."""
        if self.reserve > 0 and self._task is None and not self._stopped:  # a stop may come first
            self._task = asyncio.get_running_loop().create_task(self._run(), name="memsvc-host-reserve")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            self.check()

    async def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


class BackgroundPrepin:
    """The worker's one thread that page-locks host memory in the background: after the load, and
    after a wake that takes back a reserve the sleep gave up (worker/host_release.py). The worker
    serves meanwhile; a sleep that comes first takes the chunks ready so far and makes the rest
    itself. One thread for the worker's life, idle on a queue between requests, so sleeps and wakes
    do not change the process's thread count (the leak checks count threads).

    It pins :data:`STEP_BYTES` at a time, each piece only once no Generate has run for
    :data:`IDLE_S`: page-locking holds up the kernel launches and copies of the steps beside it (an
    8B model's first request after ready took 0.54 s instead of 0.11 s while its 16 GB were pinned
    at once, docs/benchmarks.md), so a request that comes meanwhile waits for one piece at most, and
    a worker under load pins nothing until it idles. Nor does it start sooner than IDLE_S after it
    was asked: the request a client sends as soon as the worker is ready (or awake again) runs
    before any piece, not behind one."""

    def __init__(self, alloc: MemoryAllocator, last_busy: Callable[[], float] = lambda: 0.0) -> None:
        self._alloc = alloc
        self._last_busy = last_busy
        self._queue: queue.SimpleQueue[tuple[int, Callable[[], bool], Callable[[], None], float] | None] = (
            queue.SimpleQueue()
        )
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memsvc-prepin", daemon=True)
        self._thread.start()

    def request(
        self, nbytes: int, wanted: Callable[[], bool] = lambda: True, unwanted: Callable[[], None] = lambda: None
    ) -> None:
        """Page-lock ``nbytes`` more when the thread gets to it (0: nothing), as long as ``wanted()``
        says so; when it no longer does once the prepin ended (the worker gave its reserve back
        meanwhile: a sleep with nothing awake), ``unwanted()`` is called to give back what it pinned."""
        if nbytes > 0:
            self._queue.put((nbytes, wanted, unwanted, time.monotonic()))

    def stop(self) -> None:
        """Take no more requests: the piece running now is the last (the allocator's close stops it
        at its next chunk)."""
        self._stopped.set()
        self._queue.put(None)

    def join(self, timeout: float) -> bool:
        """After :meth:`stop`: False when the thread did not end within ``timeout`` (it may be
        inside the driver)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _idle(self, asked: float) -> bool:
        """Wait until no Generate has run for IDLE_S, nor for IDLE_S since ``asked``; False once stopped."""
        while (wait := until_idle(lambda: max(self._last_busy(), asked))) > 0:
            if self._stopped.wait(wait):
                return False
        return not self._stopped.is_set()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None and not self._stopped.is_set():
            nbytes, wanted, unwanted, asked = item
            t0 = time.perf_counter()
            done = 0
            try:
                while done < nbytes and self._idle(asked) and wanted():
                    done = min(done + STEP_BYTES, nbytes)
                    self._alloc.prepin_host(done)  # until `done` bytes of free chunks are ready
            except MemsvcError as exc:
                log.warning("host prepin of %.2f GiB stopped: %s", nbytes / GiB, exc)
                continue
            finally:
                if done and not wanted():
                    unwanted()
            dt = time.perf_counter() - t0
            log.info("host prepin: %.2f of %.2f GiB page-locked in %.2f s", done / GiB, nbytes / GiB, dt)


__all__ = [
    "BackgroundPrepin",
    "AUTO",
    "IDLE_S",
    "STEP_BYTES",
    "until_idle",
    "HOST_RAM_FRACTION",
    "HostMemory",
    "HostReserveGuard",
    "auto_reserve",
    "parse_prepin",
    "parse_reserve",
    "read_host_memory",
    "short_threshold",
]
