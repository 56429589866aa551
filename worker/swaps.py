"""SwapBlocks pipelining: the next swap is checked and enqueued while the one before it copies.

Calls are begun on the device loop in the order they arrive (so their copies run in that order on
one stream). With another call queued behind, a waiter thread waits for this copy while the device
thread begins the next; alone, the device loop waits itself (one thread fewer on the way).
Whichever waits resolves the caller's future: one wake-up of the event loop per call. A call whose
caller left before the device loop began it never runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memsvc.vocabulary import CopyMethod, TransitionKind
from worker.device_loop import DeviceLoop, Ticket, resolve_future
from worker.status import Transition

if TYPE_CHECKING:
    from worker.model.kv_cache import PendingSwap  # imports torch: only where a model is loaded

BeginSwap = Callable[[str, Any, Any, CopyMethod], "PendingSwap"]
"""Check a swap and enqueue its copy (on the device loop): direction, src ids, dst ids, method."""


class SwapPipeline:
    COPY_WAITERS = 4
    """Threads that wait for SwapBlocks copies to finish: swaps in flight beyond this wait in turn."""

    def __init__(self, device: DeviceLoop, begin: BeginSwap, finish: Callable[[Transition], Transition]) -> None:
        self._device = device
        self._begin = begin
        self._finish = finish
        self._submitted = 0
        """Calls sent to the device loop (written on the event loop only)."""
        self._started = 0
        """Calls the device loop has begun (written on the device loop only)."""
        self._waiters = concurrent.futures.ThreadPoolExecutor(self.COPY_WAITERS, thread_name_prefix="memsvc-copywait")

    async def swap(self, direction: str, src: Any, dst: Any, method: CopyMethod) -> Transition:
        """Queue the swap behind the device work before it; return once its copy is done."""
        result: asyncio.Future[Transition] = self._device.loop.create_future()
        ticket = Ticket()
        self._submitted += 1
        self._device.submit(self._job, ticket, direction, src, dst, method, result)
        try:
            return await asyncio.shield(result)
        except asyncio.CancelledError:
            # The caller left: a swap still queued never runs (the block table stays as the caller
            # last saw it); one already begun finishes, since its copy is in flight on the stream.
            ticket.abandon()
            raise

    def shutdown(self) -> None:
        self._waiters.shutdown(wait=True)

    def _job(
        self,
        ticket: Ticket,
        direction: str,
        src: Any,
        dst: Any,
        method: CopyMethod,
        result: asyncio.Future[Transition],
    ) -> None:
        self._started += 1
        if not ticket.start():
            return  # its caller left while it was queued
        loop = self._device.loop
        try:
            t0 = time.perf_counter()
            pending = self._begin(direction, src, dst, method)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            loop.call_soon_threadsafe(resolve_future, result, None, exc)
            return
        if self._submitted > self._started:  # each count has one writer thread
            try:
                self._waiters.submit(self._wait, pending, t0, result)
                return
            except RuntimeError:  # the waiters are shut down (worker closing): wait here
                pass
        self._wait(pending, t0, result)

    def _wait(self, pending: PendingSwap, t0: float, result: asyncio.Future[Transition]) -> None:
        loop = self._device.loop
        try:
            pending.wait()
            t = self._finish(Transition(TransitionKind.SWAP_BLOCKS, pending.moved_bytes, time.perf_counter() - t0))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            loop.call_soon_threadsafe(resolve_future, result, None, exc)
            return
        loop.call_soon_threadsafe(resolve_future, result, t, None)


__all__ = ["BeginSwap", "SwapPipeline"]
