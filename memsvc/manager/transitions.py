"""Transitions an operator or service asks for: SleepWorker, WakeWorker, SwapWorkerBlocks.

Each holds the worker's lock while it runs, so timers, budget evictions, operators and leases never
race on one worker, and a retried ``request_id`` returns the first call's result. At most
MAX_QUEUED_TRANSITIONS calls wait for one worker (WorkerRecord.exclusive).
"""

from __future__ import annotations

import time

from memsvc.errors import OutOfMemory, WrongState
from memsvc.manager.budgets import Budgets
from memsvc.manager.calls import WorkerCalls
from memsvc.manager.records import WorkerRecord, WorkerView
from memsvc.manager.registry import Registry
from memsvc.manager.reports import Transition
from memsvc.runtime.deadline import Deadline
from memsvc.runtime.replay import ReplayCache
from memsvc.v1 import model_worker_service_pb2 as worker_pb
from memsvc.vocabulary import Action, SleepLevel, check_known_tags, plan_actions


def _name_worker(exc: WrongState, rec: WorkerRecord) -> None:
    """A refused transition's ErrorInfo names the worker (``workerId``): a client that sleeps many
    workers, or the CLI's "already asleep", tells from the detail alone which one was in that state,
    whether the manager refused (a lease) or relayed the worker's own refusal."""
    exc.metadata.setdefault("workerId", rec.worker_id)


class Transitions:
    def __init__(self, registry: Registry, calls: WorkerCalls, budgets: Budgets, replay: ReplayCache) -> None:
        self._registry = registry
        self._calls = calls
        self._budgets = budgets
        self._replay = replay

    async def sleep_worker(
        self,
        name: str,
        level: SleepLevel | None,
        tag_actions: dict[str, Action],
        request_id: str,
        deadline: Deadline,
    ) -> tuple[WorkerView, Transition]:
        """The worker as the sleep left it, and the transition. A retry with the same request_id gets
        both as the first call returned them (not the worker's status of now)."""
        rec = self._registry.get(name)
        check_known_tags(tag_actions, rec.tag_names())  # before any neighbour is demoted

        async def sleep(shared: Deadline) -> tuple[WorkerView, Transition]:
            try:
                t = await self._sleep(rec, level, tag_actions, request_id, shared)
            except WrongState as exc:
                _name_worker(exc, rec)
                raise
            return rec.view(), t

        return await self._replay.run(request_id, "SleepWorker", sleep, rec.worker_id, deadline)

    async def _sleep(
        self,
        rec: WorkerRecord,
        level: SleepLevel | None,
        tag_actions: dict[str, Action],
        request_id: str,
        deadline: Deadline,
    ) -> Transition:
        async with rec.exclusive():
            self._registry.link(rec)  # in the lock: a deregistration it waited behind may have run
            if rec.leases:
                raise WrongState(
                    f"worker {rec.worker_id} holds {len(rec.leases)} lease(s); it sleeps after they are released",
                    metadata={"leaseCount": str(len(rec.leases))},
                )
            if level is None and not tag_actions:
                t = await self._budgets.sleep_tier1(rec, deadline, "SleepWorker", request_id)
            else:
                need = rec.offload_need_bytes(plan_actions(level, tag_actions))
                if not await self._budgets.make_host_room(rec, need, deadline):
                    raise OutOfMemory(
                        f"host budget: offloading {need} bytes does not fit and no sleeper can be demoted",
                        metadata={"neededBytes": str(need)},
                    )
                t = await self._calls.sleep(rec, level, tag_actions, request_id, deadline, "SleepWorker")
        return t

    async def wake_worker(
        self, name: str, tags: list[str], request_id: str, deadline: Deadline
    ) -> tuple[WorkerView, Transition]:
        """The worker as the wake left it, and the transition (a retry gets the first call's both)."""
        rec = self._registry.get(name)
        check_known_tags(tags, rec.tag_names())  # before any neighbour is evicted

        async def wake(shared: Deadline) -> tuple[WorkerView, Transition]:
            async with rec.exclusive():
                self._registry.link(rec)  # before any neighbour is evicted for a forgotten worker
                try:
                    t = await self._budgets.wake_with_room(
                        rec, tags or None, shared, lambda: self._calls.wake(rec, tags, request_id, shared, "WakeWorker")
                    )
                except WrongState as exc:
                    _name_worker(exc, rec)
                    raise
                rec.idle_since = time.time()
                rec.keep_alive = None  # an operator's wake starts an idle period of the policy's
                return rec.view(), t

        return await self._replay.run(request_id, "WakeWorker", wake, rec.worker_id, deadline)

    async def swap_blocks(
        self, name: str, request: worker_pb.SwapBlocksRequest, deadline: Deadline
    ) -> worker_pb.SwapBlocksResponse:
        """Forwarded as the worker's message (see WorkerLink.swap_blocks)."""
        return await self._calls.swap_blocks(self._registry.get(name), request, deadline)


__all__ = ["Transitions"]
