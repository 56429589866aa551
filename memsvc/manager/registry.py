"""Which workers the manager knows: their records, one link each, registration and lookup."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

from memsvc.errors import InvalidArgument, NotFound, Overloaded, Unavailable, WrongState
from memsvc.manager.background import Background
from memsvc.manager.links import LinkFactory, WorkerLink
from memsvc.manager.paging import page_of
from memsvc.manager.policy import Policies
from memsvc.manager.records import NAME_PREFIX, WorkerRecord, worker_id_from_name
from memsvc.manager.reports import Telemetry
from memsvc.manager.store import Store, StoredWorker
from memsvc.manager.telemetry import TelemetryIngest
from memsvc.runtime.limits import MAX_ADDRESS_BYTES, MAX_HOST_BYTES, MAX_WORKERS, check_length

log = logging.getLogger("memsvc.manager")


class Registry:
    def __init__(
        self, store: Store, links: LinkFactory, ingest: TelemetryIngest, background: Background, policies: Policies
    ) -> None:
        self._store = store
        self._policies = policies
        self._make_link = links
        self._ingest = ingest
        self._background = background
        self.workers: dict[str, WorkerRecord] = {}
        self.links: dict[str, WorkerLink] = {}

    def __iter__(self) -> Iterator[WorkerRecord]:
        return iter(list(self.workers.values()))

    def add(self, worker_id: str, address: str, host: str, configured: bool) -> WorkerRecord:
        """The worker's record, created or updated, with a started link to its address."""
        rec = self.workers.get(worker_id)
        if rec is None:
            rec = self.workers[worker_id] = WorkerRecord(worker_id, address, host, configured)
            self._ingest.publish_snapshot(rec)
        elif rec.address != address:
            rec.address = address
            old = self.links.pop(worker_id, None)
            if old is not None:
                self._background.spawn(old.close(), f"close link {worker_id}")
        rec.host = host or rec.host
        rec.configured = rec.configured or configured
        if worker_id not in self.links:

            async def on_message(msg: Telemetry, r: WorkerRecord = rec) -> None:
                await self._ingest.on_telemetry(r, msg)

            async def on_down(why: str, r: WorkerRecord = rec) -> None:
                await self._ingest.on_down(r, why)

            link = self.links[worker_id] = self._make_link(worker_id, address, on_message, on_down)
            link.start()
        self._ingest.update_metrics(rec)
        return rec

    async def close(self) -> None:
        links = list(self.links.values())
        results = await asyncio.gather(*(link.close() for link in links), return_exceptions=True)
        for link, result in zip(links, results, strict=True):
            if isinstance(result, Exception):
                log.error("closing the link to %s failed", link.address, exc_info=result)

    def register(self, worker_id: str, address: str, host: str) -> WorkerRecord:
        """RegisterWorker: a worker announces itself (at start and as its heartbeat). Every field it
        makes the manager keep is bounded (memsvc/runtime/limits.py), and so is the number of records. Its
        status comes from its telemetry stream, which the link opens."""
        worker_id = worker_id_from_name(worker_id)
        check_length(address, MAX_ADDRESS_BYTES, "address")
        check_length(host, MAX_HOST_BYTES, "host")
        host_part, _, port = address.rpartition(":")
        if not host_part or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(
                f"address must be host:port with a port in 1..65535, got {address!r}", metadata={"address": address}
            )
        known = worker_id in self.workers
        if not known and len(self.workers) >= MAX_WORKERS:
            raise Overloaded(
                f"the manager keeps {MAX_WORKERS} workers, its most; deregister one first",
                metadata={"maxWorkers": str(MAX_WORKERS)},
            )
        rec = self.add(worker_id, address, host, False)
        self._store.save_worker(StoredWorker(worker_id, address, rec.host, rec.configured, time.time()))
        rec.last_seen, rec.heard = time.time(), time.monotonic()
        if not rec.reachable:
            self.links[worker_id].poke()
        if not known:
            log.info("worker %s registered at %s", worker_id, address)
        return rec

    async def deregister(self, name: str) -> WorkerRecord:
        """Forget a worker: its record, stored registration, policy overrides and link. Refused while
        leased (that would break the lease); a worker that registers again is known again."""
        rec = self.get(name)
        if rec.leases:
            raise WrongState(
                f"worker {rec.worker_id} holds {len(rec.leases)} lease(s); release them first",
                metadata={"leaseCount": str(len(rec.leases))},
            )
        async with rec.lock:  # no transition of the manager's is running on it
            if self.workers.get(rec.worker_id) is not rec:
                raise NotFound(f"worker {rec.worker_id} was deregistered meanwhile", metadata={"name": name})
            if rec.leases:
                raise WrongState(f"worker {rec.worker_id} was leased meanwhile", metadata={"leaseCount": "1"})
            # the store first: a deletion it refuses (memsvc/manager/store.py) leaves the worker known
            self._store.delete_worker(rec.worker_id)
            self._policies.forget(rec.name)
            del self.workers[rec.worker_id]
            link = self.links.pop(rec.worker_id, None)
            self._ingest.forget(rec)
        if link is not None:
            await link.close()
        log.info("worker %s deregistered", rec.worker_id)
        return rec

    def get(self, name: str) -> WorkerRecord:
        wid = worker_id_from_name(name)
        rec = self.workers.get(wid)
        if rec is None:
            canonical = NAME_PREFIX + wid  # one wording, however the caller spelled the name
            raise NotFound(f"no worker {canonical!r}", metadata={"name": canonical})
        return rec

    def registered(self, rec: WorkerRecord) -> None:
        """NOT_FOUND once ``rec`` was deregistered (a call that began before then)."""
        if self.workers.get(rec.worker_id) is not rec:
            raise NotFound(f"worker {rec.worker_id} was deregistered", metadata={"name": rec.name})

    def link(self, rec: WorkerRecord) -> WorkerLink:
        """The link to call ``rec`` through; NOT_FOUND once it was deregistered (a call that began
        before then), UNAVAILABLE while the worker cannot be reached."""
        self.registered(rec)
        if not rec.reachable:
            raise Unavailable(f"worker {rec.worker_id} is unavailable", metadata={"name": rec.name})
        return self.links[rec.worker_id]

    def page(self, page_size: int, page_token: str) -> tuple[list[WorkerRecord], str]:
        """ListWorkers: one page in worker-id order, and the token of the next ("" on the last)."""
        ids, token = page_of(self.workers, page_size, page_token, worker_id_from_name)
        return [self.workers[i] for i in ids], token


__all__ = ["Registry"]
