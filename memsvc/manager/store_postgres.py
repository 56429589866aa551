"""The PostgreSQL store (memsvc/manager/store.py): one database, several manager replicas.

``--db postgresql://user:password@host:5432/dbname`` (libpq's URL; its query parameters, such as
``sslmode``, pass through). The tables are ``memsvc_*``, so the database may hold others.

**Leading.** One replica leads: the one whose connection holds the session-level advisory lock
:data:`LEADER_LOCK` (``pg_try_advisory_lock``), taken by :meth:`PostgresStore.try_lead`. The leader
writes its address to ``memsvc_leader`` beside its backend's pid, so the others find the address of
the session that holds the lock now, never a dead leader's (:meth:`PostgresStore.leader`).

**Fencing.** Every write goes through the connection that holds the lock. PostgreSQL ends the lock
only with its session, so a write that succeeds was made by the leader, and a replica that lost its
session (a network cut, ``pg_terminate_backend``, a server restart) can write nothing more: its
store is *lost* from then on (:attr:`PostgresStore.lost`) and the replica stops, for a follower to
take over (memsvc/manager/replicas.py). TCP keepalives on both ends (:data:`KEEPALIVES`) bound how
long a dead leader's host keeps the lock: about 5 + 3 × 2 = 11 s; a leader process that dies
(a crash, SIGKILL) closes its socket and frees the lock at once.

**Bounds.** Each statement is cut at :data:`STATEMENT_TIMEOUT_MS`, and connecting at
:data:`CONNECT_TIMEOUT_S`: both end as :class:`~memsvc.errors.Unavailable` naming the database, so a
slow database cannot hold the manager's event loop for long.

**Schema.** ``memsvc_schema`` holds the version; :data:`MIGRATIONS` bring it up to date in one
transaction under a second advisory lock, so replicas started together migrate once, and a
database written by a newer memsvc is refused with one line.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import psycopg
from psycopg import conninfo

from memsvc.errors import InvalidArgument, Unavailable
from memsvc.manager.store import Migration, StoredLease, StoredWorker, decode_fields, read_leases, read_workers

log = logging.getLogger("memsvc.manager.store")

LEADER_LOCK = (0x6D656D73, 0x76630001)
"""The advisory lock (two int4 keys) whose holder leads: ``pg_locks`` shows it as classid, objid."""
MIGRATION_LOCK = (0x6D656D73, 0x76630002)
"""Held for the length of a migration's transaction."""

CONNECT_TIMEOUT_S = 10
STATEMENT_TIMEOUT_MS = 10_000
KEEPALIVES = "keepalives=1 keepalives_idle=5 keepalives_interval=2 keepalives_count=3 tcp_user_timeout=10000"
"""Client-side TCP keepalives, and a bound on unacknowledged writes (libpq's parameters); the server
side's keepalives are set to the same by ``options``. Statements run inline on the manager's event
loop (memsvc/manager/store.py), so these also bound how long a silent network to the database can
hold it: about 11 s."""
_SERVER_OPTIONS = (
    f"-c statement_timeout={STATEMENT_TIMEOUT_MS} -c tcp_keepalives_idle=5 -c tcp_keepalives_interval=2 "
    "-c tcp_keepalives_count=3 -c idle_in_transaction_session_timeout=10000"
)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "The first schema: the SQLite store's tables at its schema 2, and the leader's row.",
        (
            "CREATE TABLE memsvc_policies (scope TEXT PRIMARY KEY, fields TEXT NOT NULL)",
            """CREATE TABLE memsvc_workers (
              worker_id TEXT PRIMARY KEY, address TEXT NOT NULL, host TEXT NOT NULL, configured INTEGER NOT NULL,
              registered_time DOUBLE PRECISION NOT NULL
            )""",
            """CREATE TABLE memsvc_leases (
              lease_id TEXT PRIMARY KEY, worker_id TEXT NOT NULL, expire_time DOUBLE PRECISION NOT NULL,
              holder TEXT NOT NULL, request_id TEXT NOT NULL DEFAULT '', keep_alive DOUBLE PRECISION
            )""",
            """CREATE TABLE memsvc_leader (
              id INTEGER PRIMARY KEY CHECK (id = 1), address TEXT NOT NULL, pid INTEGER NOT NULL,
              since TIMESTAMPTZ NOT NULL
            )""",
        ),
    ),
)
"""Every schema change, in order (``version`` = its index + 1)."""

SCHEMA_VERSION = len(MIGRATIONS)


def redacted(url: str) -> str:
    """``url`` without its password, for logs and errors."""
    try:
        params = conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://(unparsable URL)"
    user = f"{params['user']}@" if params.get("user") else ""
    port = f":{params['port']}" if params.get("port") else ""
    return f"postgresql://{user}{params.get('host', '')}{port}/{params.get('dbname', '')}"


class PostgresStore:
    """One connection to the database, migrated and checked when this returns."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.where = f"manager database {redacted(url)}"
        self.lost = ""
        """Why this store's session ended (the leader lock with it), or "" while it lives. A lost
        store refuses every call: a new session would not hold the lock the old one took."""
        self._lock = threading.Lock()
        self._leading = False
        self._db = self._connect()
        try:
            self._migrate()
        except BaseException:
            self._db.close()
            raise

    # ---- the session ----
    def _connect(self) -> psycopg.Connection[tuple[Any, ...]]:
        try:
            dsn = conninfo.make_conninfo(
                self.url, connect_timeout=CONNECT_TIMEOUT_S, options=_SERVER_OPTIONS, **_pairs(KEEPALIVES)
            )
            return psycopg.connect(dsn, autocommit=True)
        except psycopg.ProgrammingError as exc:  # a URL libpq cannot parse
            raise InvalidArgument(f"{self.where}: bad --db URL ({exc})", metadata={"db": redacted(self.url)}) from exc
        except psycopg.OperationalError as exc:
            raise InvalidArgument(
                f"{self.where}: cannot connect ({_one_line(exc)}): check the URL, the server and its credentials",
                metadata={"db": redacted(self.url)},
            ) from exc

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            if self.lost:
                raise Unavailable(f"{self.where}: {self.lost}", metadata={"db": redacted(self.url)})
            if self._db.closed and not self._leading:
                self._db = self._connect_again()
            try:
                cur = self._db.execute(sql, args)
                return cur.fetchall() if cur.description is not None else []
            except psycopg.OperationalError as exc:  # the database or the session, not the statement
                if self._db.closed or self._db.broken:
                    self._session_ended(exc)
                raise Unavailable(
                    f"{self.where} failed ({_one_line(exc)}): try again", metadata={"db": redacted(self.url)}
                ) from exc

    def _connect_again(self) -> psycopg.Connection[tuple[Any, ...]]:
        try:
            return self._connect()
        except InvalidArgument as exc:
            raise Unavailable(str(exc), metadata={"db": redacted(self.url)}) from exc

    def _session_ended(self, exc: BaseException) -> None:
        """A leader's session that ends takes the lock with it: this store is lost. A follower's
        connects again at its next call."""
        if self._leading:
            self.lost = f"the leader's session ended ({_one_line(exc)}); another replica leads from here"
            log.error("%s: %s", self.where, self.lost)
        else:
            self._db.close()

    def check(self) -> None:
        """Unavailable unless the session still lives (the leader asks this between writes)."""
        self._exec("SELECT 1")

    # ---- leading ----
    def try_lead(self, address: str) -> bool:
        """Take the leader lock if no session holds it, and publish ``address`` as the leader's."""
        if not self._exec("SELECT pg_try_advisory_lock(%s, %s)", LEADER_LOCK)[0][0]:
            return False
        self._leading = True
        self._exec(
            """INSERT INTO memsvc_leader (id, address, pid, since) VALUES (1, %s, pg_backend_pid(), now())
               ON CONFLICT (id) DO UPDATE SET address = excluded.address, pid = excluded.pid, since = excluded.since""",
            (address,),
        )
        return True

    def leader(self) -> str:
        """The address of the replica that holds the leader lock now ("" when none does)."""
        rows = self._exec(
            """SELECT l.address FROM memsvc_leader l JOIN pg_locks k ON k.pid = l.pid
               WHERE k.locktype = 'advisory' AND k.classid = %s AND k.objid = %s AND k.objsubid = 2 AND k.granted""",
            LEADER_LOCK,
        )
        return str(rows[0][0]) if rows else ""

    # ---- schema ----
    def _migrate(self) -> None:
        try:
            with self._lock, self._db.transaction():
                self._db.execute("SELECT pg_advisory_xact_lock(%s, %s)", MIGRATION_LOCK)
                self._db.execute("CREATE TABLE IF NOT EXISTS memsvc_schema (version INTEGER NOT NULL)")
                row = self._db.execute("SELECT max(version) FROM memsvc_schema").fetchone()
                version = int(row[0]) if row is not None and row[0] is not None else 0
                if version > SCHEMA_VERSION:
                    raise InvalidArgument(
                        f"{self.where} was written by a newer memsvc (schema {version}, this one knows up to "
                        f"{SCHEMA_VERSION}): run that memsvc version or a later one, or pass another --db",
                        metadata={"db": redacted(self.url)},
                    )
                for step in MIGRATIONS[version:]:
                    for statement in step.statements:
                        self._db.execute(statement)
                if version < SCHEMA_VERSION:
                    self._db.execute("DELETE FROM memsvc_schema")
                    self._db.execute("INSERT INTO memsvc_schema (version) VALUES (%s)", (SCHEMA_VERSION,))
                    log.info("%s: schema %d → %d", self.where, version, SCHEMA_VERSION)
        except psycopg.Error as exc:
            if isinstance(exc, psycopg.OperationalError):
                raise Unavailable(f"{self.where} failed ({_one_line(exc)})") from exc
            raise InvalidArgument(
                f"{self.where}: cannot create or migrate memsvc's tables ({_one_line(exc)}): does the user own the "
                "database, or may it create tables in it?",
                metadata={"db": redacted(self.url)},
            ) from exc

    # ---- policies ----
    def policy_fields(self, scope: str) -> object | None:
        rows = self._exec("SELECT fields FROM memsvc_policies WHERE scope = %s", (scope,))
        return decode_fields(rows[0][0]) if rows else None

    def policies(self) -> dict[str, object]:
        return {scope: decode_fields(text) for scope, text in self._exec("SELECT scope, fields FROM memsvc_policies")}

    def save_policy_fields(self, scope: str, fields: dict[str, Any]) -> None:
        self._exec(
            """INSERT INTO memsvc_policies (scope, fields) VALUES (%s, %s)
               ON CONFLICT (scope) DO UPDATE SET fields = excluded.fields""",
            (scope, json.dumps(fields)),
        )

    def delete_policy(self, scope: str) -> None:
        self._exec("DELETE FROM memsvc_policies WHERE scope = %s", (scope,))

    # ---- workers ----
    def workers(self) -> list[StoredWorker]:
        rows = self._exec(
            "SELECT worker_id, address, host, configured, registered_time FROM memsvc_workers ORDER BY worker_id"
        )
        return read_workers(rows, self._unreadable)

    def save_worker(self, w: StoredWorker) -> None:
        self._exec(
            """INSERT INTO memsvc_workers (worker_id, address, host, configured, registered_time)
               VALUES (%s, %s, %s, %s, %s)
               ON CONFLICT (worker_id) DO UPDATE SET address = excluded.address, host = excluded.host,
                 configured = excluded.configured, registered_time = excluded.registered_time""",
            (w.worker_id, w.address, w.host, int(w.configured), w.registered_time),
        )

    def delete_worker(self, worker_id: str) -> None:
        self._exec("DELETE FROM memsvc_workers WHERE worker_id = %s", (worker_id,))

    # ---- leases ----
    def leases(self) -> list[StoredLease]:
        rows = self._exec("SELECT lease_id, worker_id, expire_time, holder, request_id, keep_alive FROM memsvc_leases")
        return read_leases(rows, self._unreadable)

    def save_lease(self, lease: StoredLease) -> None:
        self._exec(
            """INSERT INTO memsvc_leases (lease_id, worker_id, expire_time, holder, request_id, keep_alive)
               VALUES (%s, %s, %s, %s, %s, %s)
               ON CONFLICT (lease_id) DO UPDATE SET worker_id = excluded.worker_id, expire_time = excluded.expire_time,
                 holder = excluded.holder, request_id = excluded.request_id, keep_alive = excluded.keep_alive""",
            (lease.lease_id, lease.worker_id, lease.expire_time, lease.holder, lease.request_id, lease.keep_alive),
        )

    def delete_lease(self, lease_id: str) -> None:
        self._exec("DELETE FROM memsvc_leases WHERE lease_id = %s", (lease_id,))

    def _unreadable(self, what: str, key: object, why: str, outcome: str) -> None:
        log.warning("%s: ignoring the stored %s %.100r (%s): %s", self.where, what, key, why, outcome)


def _pairs(text: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in text.split())


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


__all__ = ["LEADER_LOCK", "MIGRATIONS", "SCHEMA_VERSION", "PostgresStore", "redacted"]
