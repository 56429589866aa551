"""What survives a manager restart, in one SQLite file: policies, worker registrations, leases.

Memory state is not stored: it is re-learned from the workers, which are the truth about their
own pools. Writes are small and rare, so they run inline on the event loop.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS policies (scope TEXT PRIMARY KEY, fields TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS workers (
  worker_id TEXT PRIMARY KEY, address TEXT NOT NULL, host TEXT NOT NULL, configured INTEGER NOT NULL,
  registered_time REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS leases (
  lease_id TEXT PRIMARY KEY, worker_id TEXT NOT NULL, expire_time REAL NOT NULL, holder TEXT NOT NULL
);
"""


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


class Store:
    DEFAULT_SCOPE = ""

    def __init__(self, path: str | Path) -> None:
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # policies
    def policy_fields(self, scope: str) -> dict[str, Any] | None:
        rows = self._exec("SELECT fields FROM policies WHERE scope = ?", (scope,))
        return json.loads(rows[0][0]) if rows else None

    def save_policy_fields(self, scope: str, fields: dict[str, Any]) -> None:
        self._exec("INSERT OR REPLACE INTO policies (scope, fields) VALUES (?, ?)", (scope, json.dumps(fields)))

    # workers
    def workers(self) -> list[StoredWorker]:
        rows = self._exec(
            "SELECT worker_id, address, host, configured, registered_time FROM workers ORDER BY worker_id"
        )
        return [StoredWorker(r[0], r[1], r[2], bool(r[3]), r[4]) for r in rows]

    def save_worker(self, w: StoredWorker) -> None:
        self._exec(
            "INSERT OR REPLACE INTO workers (worker_id, address, host, configured, registered_time) VALUES (?,?,?,?,?)",
            (w.worker_id, w.address, w.host, int(w.configured), w.registered_time),
        )

    # leases
    def leases(self) -> list[StoredLease]:
        rows = self._exec("SELECT lease_id, worker_id, expire_time, holder FROM leases")
        return [StoredLease(*r) for r in rows]

    def save_lease(self, lease: StoredLease) -> None:
        self._exec(
            "INSERT OR REPLACE INTO leases (lease_id, worker_id, expire_time, holder) VALUES (?,?,?,?)",
            (lease.lease_id, lease.worker_id, lease.expire_time, lease.holder),
        )

    def delete_lease(self, lease_id: str) -> None:
        self._exec("DELETE FROM leases WHERE lease_id = ?", (lease_id,))
