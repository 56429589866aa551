"""What survives a manager restart, or the loss of a replica: policies, worker registrations, leases.

Two stores keep it, behind one interface (:class:`Store`):

- a SQLite file (memsvc/manager/store_sqlite.py), the default: one manager on one host;
- PostgreSQL (memsvc/manager/store_postgres.py), ``--db postgresql://…``: several manager replicas,
  of which the one holding the database's leader lock serves and the others forward to it
  (memsvc/manager/replicas.py).

Memory state is not stored: it is re-learned from the workers, which are the truth about their own
pools. Writes are small and rare, so they run inline on the event loop. A write the store cannot
make is :class:`~memsvc.errors.Unavailable` naming the database, not a bug's INTERNAL: a lease or a
deregistration is written before it changes what the manager holds in memory, so one that fails
changes nothing and the client may retry it.

Both stores check what they read the same way (:func:`bad_text`, :func:`bad_number`): a row no
manager could have written (a hand edit, another program) is left out with a warning, and left in
the database.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Protocol

from memsvc.errors import InvalidArgument

DEFAULT_SCOPE = ""
"""The default policy's scope in the policies table; a worker's overrides are under its name."""


@dataclass(frozen=True)
class Migration:
    """One schema change: the statements that take a database from ``version - 1`` to ``version``.
    Each store lists its own (the dialects differ); a released step is never edited, since databases
    in the field were made by it."""

    version: int
    why: str
    statements: tuple[str, ...]


@dataclass(frozen=True)
class StoredWorker:
    worker_id: str
    address: str
    host: str
    configured: bool
    registered_time: float


@dataclass(frozen=True)
class StoredLease:
    lease_id: str
    worker_id: str
    expire_time: float
    holder: str
    request_id: str = ""
    """The AcquireWorker request that granted it: a client retrying that request after a restart or
    a failover gets this lease back, not a second one."""
    keep_alive: float | None = None
    """As the lease asked (memsvc/manager/records.py ``Lease.keep_alive``); None: the policy's."""


class Store(Protocol):
    """The calls the manager makes on its store; each write is durable (or refused) when it returns."""

    where: str
    """``manager database <file or URL, no password>``: how log lines and errors name it."""

    def close(self) -> None: ...

    def policy_fields(self, scope: str) -> object | None:
        """One scope's stored fields (None: no row). What the store holds is returned as it is, not
        trusted: the policy module validates it."""
        ...

    def policies(self) -> dict[str, object]:
        """Every stored scope's fields, as :meth:`policy_fields` returns them."""
        ...

    def save_policy_fields(self, scope: str, fields: dict[str, Any]) -> None: ...

    def delete_policy(self, scope: str) -> None: ...

    def workers(self) -> list[StoredWorker]:
        """The stored registrations, in worker-id order; unreadable rows left out (see the module)."""
        ...

    def save_worker(self, w: StoredWorker) -> None: ...

    def delete_worker(self, worker_id: str) -> None: ...

    def leases(self) -> list[StoredLease]:
        """The stored leases; unreadable rows left out: their holders' renewals get NOT_FOUND."""
        ...

    def save_lease(self, lease: StoredLease) -> None: ...

    def delete_lease(self, lease_id: str) -> None: ...


def open_store(db: str) -> Store:
    """The store ``--db`` names: a ``postgresql://`` (or ``postgres://``) URL, else a SQLite file."""
    if db.startswith(("postgresql://", "postgres://")):
        try:  # psycopg: only where it is asked for
            from memsvc.manager.store_postgres import PostgresStore
        except ImportError as exc:
            raise InvalidArgument(
                f"--db {db.split('://')[0]}://… needs psycopg, which is not installed ({exc}): "
                "pip install 'memsvc[postgres]'"
            ) from exc
        return PostgresStore(db)
    from memsvc.manager.store_sqlite import SqliteStore

    return SqliteStore(db)


def bad_text(row: tuple[Any, ...], names: tuple[str | None, ...]) -> str:
    """Why a stored row's text columns (``names``, None for a column checked elsewhere) are not
    what memsvc writes (a non-empty string), or ""."""
    for value, name in zip(row, names, strict=False):
        if name is not None and (not isinstance(value, str) or not value):
            return f"{name} is {value!r:.100}, not a non-empty string"
    return ""


def bad_number(value: object, name: str) -> str:
    """Why a stored time is not one (memsvc writes finite seconds since the epoch), or ""."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return f"{name} is {value!r:.100}, not a number of seconds"
    return ""


def read_workers(rows: list[tuple[Any, ...]], skip: SkipRow) -> list[StoredWorker]:
    """Registrations from ``(worker_id, address, host, configured, registered_time)`` rows."""
    out = []
    for r in rows:
        why = bad_text(r, ("worker_id", "address")) or bad_number(r[4], "registered_time")
        if not why and not isinstance(r[2], str):  # "" is a host RegisterWorker accepts
            why = f"host is {r[2]!r:.100}, not a string"
        if not why and (isinstance(r[3], bool) or r[3] not in (0, 1)):
            why = f"configured is {r[3]!r:.100}, not 0 or 1"
        if why:
            skip("registration", r[0], why, "the worker is known again when it registers")
            continue
        out.append(StoredWorker(r[0], r[1], r[2], bool(r[3]), float(r[4])))
    return out


def read_leases(rows: list[tuple[Any, ...]], skip: SkipRow) -> list[StoredLease]:
    """Leases from ``(lease_id, worker_id, expire_time, holder, request_id, keep_alive)`` rows."""
    out = []
    for r in rows:
        why = bad_text(r, ("lease_id", "worker_id", None, "holder")) or bad_number(r[2], "expire_time")
        if not why and not isinstance(r[4], str):
            why = f"request_id is {r[4]!r:.100}, not a string"
        if not why and r[5] is not None:
            why = bad_number(r[5], "keep_alive")
        if why:
            skip("lease", r[0], why, "it is not restored")
            continue
        out.append(StoredLease(r[0], r[1], float(r[2]), r[3], r[4], None if r[5] is None else float(r[5])))
    return out


def decode_fields(text: object) -> object:
    """A policy row's JSON; text that is not JSON comes back as the text itself, so that to the policy
    module it is one more stored value that is not an object of fields, and is dropped with a warning."""
    if not isinstance(text, str | bytes):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


class SkipRow(Protocol):
    def __call__(self, what: str, key: object, why: str, outcome: str) -> None: ...


__all__ = [
    "DEFAULT_SCOPE",
    "Migration",
    "SkipRow",
    "Store",
    "StoredLease",
    "StoredWorker",
    "bad_number",
    "bad_text",
    "decode_fields",
    "open_store",
    "read_leases",
    "read_workers",
]
