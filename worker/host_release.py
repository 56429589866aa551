"""Host staging memory freed after a wake only while the worker is idle, one chunk at a time.

A wake leaves the sleep's page-locked host chunks free; the allocator used to unpin and unmap them
at once on a thread of its own. On the H200 that takes ~0.4 s for 16 GB, and while the driver
unregisters memory the first request's kernel launches wait for it: the first Generate after a wake
cost 0.41 s instead of 0.04 s (docs/benchmarks.md). So the worker holds the chunks through the wake
(a raised host reserve) and gives them back once no Generate has run for
:data:`~worker.host_memory.IDLE_S`, one chunk per device-loop job, so a request that arrives
meanwhile waits for at most one chunk. A sleep before that reuses the chunks (its first copies need
no fresh pinning), then trims what it left. The prepin that pins them again after such a wake works
the same way (:class:`~worker.host_memory.BackgroundPrepin`).

A worker asleep with nothing awake (level 2, weights on its disk tier, or level 1 with the chunks
holding the backup) has no sleep ahead that the reserve could speed up, only a wake: so the reserve is
given back while it sleeps (:meth:`HostRelease.park`: host RAM for its neighbours, which the
manager's host budget cannot see held) and taken again after the wake (:meth:`HostRelease.unpark`:
its size, and the bytes the worker pre-pins again in the background, as after its load).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from worker.allocator import MemoryAllocator
from worker.device_loop import DeviceLoop
from worker.host_memory import IDLE_S, STEP_BYTES, until_idle

_HOLD = 1 << 62


class HostRelease:
    """The wake-time hold of host chunks and their release when idle (see the module docstring)."""

    def __init__(
        self,
        alloc: MemoryAllocator,
        device: DeviceLoop,
        loop: asyncio.AbstractEventLoop,
        last_busy: Callable[[], float],
    ) -> None:
        self._alloc = alloc
        self._device = device
        self._loop = loop
        self._last_busy = last_busy
        """Monotonic time of the last engine step (or now, while requests wait)."""
        self._target: int | None = None
        """The reserve to come back to, while it is raised."""
        self._reserve: int | None = None
        """The lowered reserve while chunks are being given back."""
        self._epoch = 0
        self._parked: int | None = None
        """The reserve given back while the worker sleeps with nothing awake (see the module)."""

    @property
    def parked(self) -> bool:
        """The reserve is given back while the worker sleeps with nothing awake."""
        return self._parked is not None

    @property
    def holding(self) -> bool:
        return self._target is not None

    def hold(self) -> None:
        """Before a wake (device loop): keep every chunk the wake frees."""
        if self._target is None:
            parked = self._parked
            self._target = self._alloc.stats().host_reserve_bytes if parked is None else parked
        self._epoch += 1
        self._reserve = None
        self._alloc.set_host_reserve(_HOLD)

    def release_when_idle(self) -> None:
        """After the wake (device loop): start giving chunks back once the worker is idle."""
        epoch = self._epoch
        self._loop.call_soon_threadsafe(self._loop.call_later, IDLE_S, self._tick, epoch)

    def set_base(self, nbytes: int) -> None:
        """On the device loop: the reserve to come back to is now ``nbytes`` (the automatic reserve
        given back while the host is short, or taken again: worker/host_memory.py)."""
        if self._target is not None:
            self._target = nbytes
        elif self._parked is not None:
            self._parked = nbytes
        else:
            self._alloc.set_host_reserve(nbytes)

    def park(self) -> None:
        """After a sleep that left no tag awake (device loop, after :meth:`restore_reserve`): give the
        reserve's free chunks back until :meth:`unpark`."""
        if self._parked is None:
            self._parked = self._alloc.stats().host_reserve_bytes
        self._alloc.set_host_reserve(0)

    def unpark(self) -> int:
        """After a wake (device loop, after :meth:`hold`, which already aims at the parked reserve):
        the bytes given back (0 when none were), for the worker to pre-pin again."""
        parked, self._parked = self._parked, None
        if parked is not None and self._target is None:
            self._alloc.set_host_reserve(parked)
        return parked or 0

    def restore_reserve(self) -> None:
        """After a sleep (device loop): the reserve is back where it was; free chunks beyond it go now."""
        if self._target is not None:
            target, self._target, self._reserve = self._target, None, None
            self._epoch += 1
            self._alloc.set_host_reserve(target)

    def _tick(self, epoch: int) -> None:
        """On the loop: queue one chunk's release if the worker is still idle, else look again later."""
        if epoch != self._epoch or self._target is None:
            return
        wait = until_idle(self._last_busy)
        if wait > 0:
            self._loop.call_later(wait, self._tick, epoch)
            return
        with contextlib.suppress(RuntimeError):  # shut down: the allocator's close frees everything
            self._device.submit(self._release_one, epoch)

    def _release_one(self, epoch: int) -> None:
        """On the device loop: lower the reserve by a chunk (the allocator trims to it)."""
        if epoch != self._epoch or self._target is None:
            return
        if until_idle(self._last_busy) > 0:  # a request came in while this was queued
            self._loop.call_soon_threadsafe(self._tick, epoch)
            return
        if self._reserve is None:  # start from every chunk held; free ones go once the reserve is below them
            self._reserve = self._alloc.stats().host_held_bytes
        self._reserve -= STEP_BYTES
        if self._reserve <= self._target:
            self.restore_reserve()
            return
        self._alloc.set_host_reserve(self._reserve)
        self._loop.call_soon_threadsafe(self._tick, epoch)


__all__ = ["HostRelease"]
