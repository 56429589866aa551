"""The SQLite store (memsvc/manager/store.py): one file, one manager.

The file must stay the one the manager opened. SQLite keeps writing to its open descriptor after the
path was deleted or replaced (an operator's ``rm``, a restore copied over it, a volume remounted), so
every call would still succeed and all of it would be gone at the next start. Before each write the
path's device and inode are compared with the open file's; while they differ the write is refused
with :class:`~memsvc.errors.Unavailable` naming the file (and one error line in the log), and
writes resume once the file is back at its path. A statement SQLite cannot run (the file locked by
another process past the busy timeout, a full disk, a file system gone read-only) is Unavailable too.

The file is checked before anything is trusted or written: a file that is not SQLite, is truncated
or fails ``PRAGMA quick_check``, or was written by a newer memsvc, is refused with one
:class:`~memsvc.errors.InvalidArgument` that names the file and what to do, because a manager that
started on a damaged file would silently forget every registration, lease and policy override. The
schema carries its version in ``PRAGMA user_version`` and is brought up to date by
:data:`MIGRATIONS`, in one transaction, so an older file is upgraded in place or not at all.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

from memsvc.errors import InvalidArgument, Unavailable
from memsvc.manager.store import Migration, StoredLease, StoredWorker, decode_fields, read_leases, read_workers

log = logging.getLogger("memsvc.manager.store")


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "The first schema. memsvc before schema versions created these same tables and left user_version at 0: "
        "IF NOT EXISTS adopts such a file as it is, and creates the tables in a new one.",
        (
            "CREATE TABLE IF NOT EXISTS policies (scope TEXT PRIMARY KEY, fields TEXT NOT NULL)",
            """CREATE TABLE IF NOT EXISTS workers (
              worker_id TEXT PRIMARY KEY, address TEXT NOT NULL, host TEXT NOT NULL, configured INTEGER NOT NULL,
              registered_time REAL NOT NULL
            )""",
            """CREATE TABLE IF NOT EXISTS leases (
              lease_id TEXT PRIMARY KEY, worker_id TEXT NOT NULL, expire_time REAL NOT NULL, holder TEXT NOT NULL
            )""",
        ),
    ),
    Migration(
        2,
        "A lease keeps the AcquireWorker request_id that granted it, so that a retry after a restart gets it "
        "back, and its keep_alive (NULL: the policy's).",
        (
            "ALTER TABLE leases ADD COLUMN request_id TEXT NOT NULL DEFAULT ''",
            "ALTER TABLE leases ADD COLUMN keep_alive REAL",
        ),
    ),
)
"""Every schema change, in order; the next one is one more entry (``version`` = its index + 1). A
step must never be edited once released: databases in the field were made by it."""

SCHEMA_VERSION = len(MIGRATIONS)
"""The schema this code reads and writes (``PRAGMA user_version``)."""

_HEADER = b"SQLite format 3\x00"


class SqliteStore:
    """The open file. Opening it runs every check and migration above, so a store that exists is
    one the manager can trust and write."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.where = f"manager database {self.path}"
        was_empty = self.path.is_file() and self.path.stat().st_size == 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            why = f"cannot create its directory ({exc.strerror or exc})"
            raise _unusable(self.path, why, "check the path, or pass another --db") from exc
        _check_header(self.path)
        try:
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        except sqlite3.Error as exc:
            raise _sqlite_unusable(self.path, exc) from exc
        self._lock = threading.Lock()
        try:
            fresh = _open(self._db, self.path)
        except BaseException as exc:
            self._db.close()
            if isinstance(exc, sqlite3.Error):
                raise _sqlite_unusable(self.path, exc) from exc
            raise
        self._identity = _identity(self.path)
        """The device and inode of the file opened, which the path must still name for a write."""
        self._lost = ""
        """Why writes are refused now (the path no longer names the open file), or "" while it does."""
        if was_empty and fresh:
            log.warning(
                "manager database %s was an empty file (0 bytes): starting with no worker registrations, leases "
                "or policy overrides (if it was not meant to be empty, stop the manager and restore it from a copy)",
                self.path,
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _exec(self, sql: str, args: tuple[Any, ...] = (), write: bool = False) -> list[tuple[Any, ...]]:
        with self._lock:
            if write:
                self._check_same_file()
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.OperationalError as exc:  # the file, not the statement (a bug stays INTERNAL)
                raise Unavailable(
                    f"manager database {self.path} failed ({exc}): try again",
                    metadata={"path": str(self.path)},
                ) from exc

    def _check_same_file(self) -> None:
        """Unavailable unless the path still names the file this store has open (see the module).
        The first refusal is logged as an error, once until the file is back."""
        try:
            now = _identity(self.path)
            why = "" if now == self._identity else "was replaced by another file"
        except FileNotFoundError:
            why = "was deleted"
        except OSError as exc:
            why = f"cannot be checked ({exc.strerror or exc})"
        if not why:
            if self._lost:
                log.warning("manager database %s is back at its path: writes resume", self.path)
                self._lost = ""
            return
        message = (
            f"manager database {self.path} {why} while the manager runs: nothing more is written to it, "
            "as it would be lost at the next start; put the file back, or restart the manager"
        )
        if self._lost != why:
            log.error("%s", message)
            self._lost = why
        raise Unavailable(message, metadata={"path": str(self.path)})

    # policies
    def policy_fields(self, scope: str) -> object | None:
        rows = self._exec("SELECT fields FROM policies WHERE scope = ?", (scope,))
        return decode_fields(rows[0][0]) if rows else None

    def policies(self) -> dict[str, object]:
        return {scope: decode_fields(text) for scope, text in self._exec("SELECT scope, fields FROM policies")}

    def save_policy_fields(self, scope: str, fields: dict[str, Any]) -> None:
        self._exec(
            "INSERT OR REPLACE INTO policies (scope, fields) VALUES (?, ?)", (scope, json.dumps(fields)), write=True
        )

    def delete_policy(self, scope: str) -> None:
        self._exec("DELETE FROM policies WHERE scope = ?", (scope,), write=True)

    # workers
    def workers(self) -> list[StoredWorker]:
        rows = self._exec(
            "SELECT worker_id, address, host, configured, registered_time FROM workers ORDER BY worker_id"
        )
        return read_workers(rows, self._unreadable)

    def save_worker(self, w: StoredWorker) -> None:
        self._exec(
            "INSERT OR REPLACE INTO workers (worker_id, address, host, configured, registered_time) VALUES (?,?,?,?,?)",
            (w.worker_id, w.address, w.host, int(w.configured), w.registered_time),
            write=True,
        )

    def delete_worker(self, worker_id: str) -> None:
        self._exec("DELETE FROM workers WHERE worker_id = ?", (worker_id,), write=True)

    # leases
    def leases(self) -> list[StoredLease]:
        rows = self._exec("SELECT lease_id, worker_id, expire_time, holder, request_id, keep_alive FROM leases")
        return read_leases(rows, self._unreadable)

    def _unreadable(self, what: str, key: object, why: str, outcome: str) -> None:
        log.warning("manager database %s: ignoring the stored %s %.100r (%s): %s", self.path, what, key, why, outcome)

    def save_lease(self, lease: StoredLease) -> None:
        self._exec(
            "INSERT OR REPLACE INTO leases (lease_id, worker_id, expire_time, holder, request_id, keep_alive) "
            "VALUES (?,?,?,?,?,?)",
            (lease.lease_id, lease.worker_id, lease.expire_time, lease.holder, lease.request_id, lease.keep_alive),
            write=True,
        )

    def delete_lease(self, lease_id: str) -> None:
        self._exec("DELETE FROM leases WHERE lease_id = ?", (lease_id,), write=True)


def _identity(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


# ---- opening: check, then migrate, then switch to WAL ----


def _open(db: sqlite3.Connection, path: Path) -> bool:
    """Check the file, bring its schema up to date; whether it held no tables (a new database).

    Nothing is written before the checks pass, so a refused file is left exactly as it was; WAL
    (a change of the file's header) comes last for the same reason.
    """
    problems = [str(row[0]) for row in db.execute("PRAGMA quick_check(20)").fetchall()]
    if problems != ["ok"]:
        said = " ".join("; ".join(problems).replace("*** in database main ***", "").split())  # one line
        raise _unusable(path, f"is damaged (quick_check: {said[:300]})")
    fresh = not db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    version = _user_version(db)
    if version > SCHEMA_VERSION:
        raise _newer(path, version)
    if version < SCHEMA_VERSION:
        _migrate(db, path, fresh)
    else:
        _check_tables(db, path)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    return fresh


def _user_version(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def _migrate(db: sqlite3.Connection, path: Path, fresh: bool) -> None:
    """Run every step the file has not seen, and the new ``user_version``, as one transaction.

    ``BEGIN IMMEDIATE`` takes the write lock first and the version is read again under it, so two
    managers started on one file at once cannot both migrate it.
    """
    db.execute("BEGIN IMMEDIATE")
    try:
        version = _user_version(db)
        if version > SCHEMA_VERSION:
            raise _newer(path, version)
        found = _columns(db)
        if version == 0 and found and not set(found) & set(_expected_columns()):
            _not_ours(path, f"it holds only other tables: {', '.join(sorted(found))[:200]}")
        for step in MIGRATIONS[version:]:
            for statement in step.statements:
                db.execute(statement)
        _check_tables(db, path)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    if fresh:
        log.info("manager database %s created (schema %d)", path, SCHEMA_VERSION)
    else:
        log.info("manager database %s migrated from schema %d to %d", path, version, SCHEMA_VERSION)


@cache
def _expected_columns() -> dict[str, frozenset[str]]:
    """The tables and columns the migrations make, found by running them on an empty database, so
    the check below can never disagree with :data:`MIGRATIONS`."""
    db = sqlite3.connect(":memory:")
    try:
        for step in MIGRATIONS:
            for statement in step.statements:
                db.execute(statement)
        return _columns(db)
    finally:
        db.close()


def _columns(db: sqlite3.Connection) -> dict[str, frozenset[str]]:
    tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    return {t: frozenset(r[0] for r in db.execute("SELECT name FROM pragma_table_info(?)", (t,))) for t in tables}


def _check_tables(db: sqlite3.Connection, path: Path) -> None:
    """Refuse a SQLite file whose tables of our names lack our columns: another program's database
    (a wrong --db), not one memsvc wrote; writing to it would fail later, mid-request."""
    found = _columns(db)
    for table, want in _expected_columns().items():
        if table not in found:
            _not_ours(path, f"it has no table {table!r}")
        if missing := want - found[table]:
            _not_ours(path, f"its table {table!r} lacks column(s) {', '.join(sorted(missing))}")


def _not_ours(path: Path, why: str) -> NoReturn:
    raise _unusable(path, f"is not a memsvc manager database ({why})", "pass the manager's own --db, or a new file")


def _check_header(path: Path) -> None:
    """Catch a truncated file that ``quick_check`` can pass: SQLite reads the missing end of the last
    page as zeros, so a cut inside a page loses data without a complaint.

    SQLite writes whole pages, and after a checkpoint the file holds as many pages as its header
    says. The second rule is skipped while a write-ahead log is present: a crash in the middle of a
    checkpoint leaves a short file that the log completes on the next open.
    """
    try:
        with path.open("rb") as f:
            header = f.read(100)
        size = path.stat().st_size
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _unusable(
            path, f"cannot be read ({exc.strerror or exc})", "check the path and its permissions, or pass another --db"
        ) from exc
    if not header.startswith(_HEADER):
        return  # empty, or not SQLite at all: SQLite itself says which
    if len(header) < 100:
        raise _unusable(path, f"is truncated ({size} bytes, shorter than the 100-byte SQLite header)")
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    if page_size < 512 or size % page_size:
        raise _unusable(path, f"is truncated ({size} bytes is not a whole number of {page_size}-byte pages)")
    pages = int.from_bytes(header[28:32], "big")
    counted = header[24:28] == header[92:96]  # the header's page count is only valid when these agree
    wal = path.with_name(path.name + "-wal")
    if counted and size < pages * page_size and not (wal.is_file() and wal.stat().st_size > 0):
        raise _unusable(path, f"is truncated ({size} bytes; its header says {pages} pages of {page_size} bytes)")


# ---- one clear line per refusal ----

_MOVE_ASIDE = (
    "stop anything using it, move it aside together with any {name}-wal and {name}-shm next to it (the manager "
    "then starts with no registrations, leases or policy overrides), or pass another --db"
)


def _unusable(path: Path, what: str, todo: str | None = None) -> InvalidArgument:
    """A refusal that names the file, what is wrong with it and what to do, on one line."""
    todo = _MOVE_ASIDE.format(name=path.name) if todo is None else todo
    return InvalidArgument(f"manager database {path} {what}: {todo}", metadata={"path": str(path)})


def _newer(path: Path, version: int) -> InvalidArgument:
    return _unusable(
        path,
        f"was written by a newer memsvc (schema {version}, this one knows up to {SCHEMA_VERSION})",
        "run that memsvc version or a later one, or pass another --db",
    )


def _sqlite_unusable(path: Path, exc: sqlite3.Error) -> InvalidArgument:
    """SQLite's error, said in the operator's terms."""
    name = str(getattr(exc, "sqlite_errorname", ""))
    if name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")):
        return _unusable(path, f"is not a SQLite database, or is damaged ({exc})")
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return _unusable(path, f"is locked by another process ({exc})", "is another manager running on this --db?")
    return _unusable(path, f"cannot be used ({exc})", "check the path and its permissions, or pass another --db")
