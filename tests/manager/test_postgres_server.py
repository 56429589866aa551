"""The tests' PostgreSQL server itself (tests/pgserver.py, its fixtures served by conftest): that it is a
real server, that each test's database is its own, and the two server behaviours the manager's
PostgreSQL store and its replicas rely on: a terminated session fails its next statement, and a
session-level advisory lock is one session's until that session ends."""

from __future__ import annotations

import os
import time

import psycopg
import pytest
from pgserver import PostgresServer

LOCK = (0x6D656D, 42)
"""An advisory lock key of these tests alone (memsvc's leader lock is another)."""


def connect(url: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(url, autocommit=True, connect_timeout=10)


def test_the_server_answers_on_loopback(postgres_server: PostgresServer, pg_url: str) -> None:
    assert pg_url.startswith(f"postgresql://memsvc@127.0.0.1:{postgres_server.port}/")
    with connect(pg_url) as db:
        assert db.execute("SELECT 1").fetchone() == (1,)
        (version,) = db.execute("SHOW server_version_num").fetchone() or ("0",)
        assert int(str(version)) >= 150000
    if os.geteuid() == 0:
        assert postgres_server.user is not None and postgres_server.user != 0, "PostgreSQL refuses root"


def test_each_database_is_its_own(postgres_server: PostgresServer, pg_url: str) -> None:
    other = f"other_{os.getpid()}"
    other_url = postgres_server.create_database(other)
    try:
        with connect(pg_url) as db:
            db.execute("CREATE TABLE t (x int)")
            db.execute("INSERT INTO t VALUES (1)")
        with connect(other_url) as db:
            assert db.execute("SELECT to_regclass('t')").fetchone() == (None,)
            assert db.execute("SELECT current_database()").fetchone() == (other,)
    finally:
        postgres_server.drop_database(other)


def test_a_terminated_session_fails_its_next_statement(pg_url: str) -> None:
    with connect(pg_url) as victim, connect(pg_url) as admin:
        (pid,) = victim.execute("SELECT pg_backend_pid()").fetchone() or (0,)
        assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
        with pytest.raises(psycopg.OperationalError):
            victim.execute("SELECT 1")
        assert victim.closed or victim.broken


def test_a_session_advisory_lock_is_one_sessions_until_it_ends(pg_url: str) -> None:
    first, second = connect(pg_url), connect(pg_url)
    try:
        assert first.execute("SELECT pg_try_advisory_lock(%s, %s)", LOCK).fetchone() == (True,)
        assert second.execute("SELECT pg_try_advisory_lock(%s, %s)", LOCK).fetchone() == (False,)
        first.close()  # the server releases the lock as it ends the session, just after close() returns
        give_up = time.monotonic() + 10
        while second.execute("SELECT pg_try_advisory_lock(%s, %s)", LOCK).fetchone() != (True,):
            assert time.monotonic() < give_up, "the closed session's advisory lock was never released"
            time.sleep(0.01)
    finally:
        first.close()
        second.close()
