"""The manager's store interface (memsvc/manager/store.py), the same tests on both stores: a SQLite
file and a real PostgreSQL database (tests/pgserver.py). Then what only PostgreSQL has: the leader
lock, a lost session, its URL's refusals and concurrent migration.

The SQLite file's own checks (header, quick_check, a deleted path) are in tests/manager/test_manager_store.py.
"""

from __future__ import annotations

import logging
import socket
import sqlite3
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest
from managerproc import wait_for
from stores import STORE_KINDS, db_for

from memsvc.errors import InvalidArgument, Unavailable
from memsvc.manager.store import DEFAULT_SCOPE, Store, StoredLease, StoredWorker, open_store
from memsvc.manager.store_postgres import SCHEMA_VERSION, PostgresStore, redacted


@pytest.fixture(params=STORE_KINDS)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return db_for(request, tmp_path)


@pytest.fixture
def store(db: str) -> Iterator[Store]:
    s = open_store(db)
    yield s
    s.close()


def raw(db: str, sql: str) -> None:
    """A statement on the store's database behind its back (another program, a hand edit)."""
    if db.startswith("postgresql://"):
        with psycopg.connect(db, autocommit=True) as pg:
            pg.execute(sql.replace("INTO ", "INTO memsvc_").encode())
        return
    lite = sqlite3.connect(db, isolation_level=None)
    try:
        lite.execute(sql)
    finally:
        lite.close()


def test_what_is_saved_is_read_back_replaced_and_deleted(store: Store) -> None:
    assert store.policies() == {} and store.workers() == [] and store.leases() == []
    store.save_policy_fields(DEFAULT_SCOPE, {"idle_sleep_timeout": 60.0})
    store.save_policy_fields("workers/a", {"tag_actions": {"weights": "offload"}})
    store.save_policy_fields("workers/a", {"idle_deep_sleep_timeout": 600.0})  # replaces the scope's row
    assert store.policies() == {
        DEFAULT_SCOPE: {"idle_sleep_timeout": 60.0},
        "workers/a": {"idle_deep_sleep_timeout": 600.0},
    }
    assert store.policy_fields("workers/b") is None
    store.delete_policy("workers/a")
    assert store.policy_fields("workers/a") is None

    store.save_worker(StoredWorker("b", "127.0.0.1:2", "h2", True, 2.5))
    store.save_worker(StoredWorker("a", "127.0.0.1:1", "", False, 1.5))  # an empty host is one RegisterWorker takes
    store.save_worker(StoredWorker("b", "127.0.0.1:3", "h3", False, 3.5))
    assert store.workers() == [
        StoredWorker("a", "127.0.0.1:1", "", False, 1.5),
        StoredWorker("b", "127.0.0.1:3", "h3", False, 3.5),
    ]
    store.delete_worker("a")
    assert [w.worker_id for w in store.workers()] == ["b"]

    kept = [
        StoredLease("l1", "b", 4e9, "me"),
        StoredLease("l2", "b", 4.5e9, "you", request_id="r-2", keep_alive=-1.0),
        StoredLease("l3", "b", 1.0e9 + 0.123456, "them", request_id="r-3", keep_alive=120.0),
    ]
    for lease in kept:
        store.save_lease(lease)
    store.save_lease(StoredLease("l1", "b", 5e9, "me"))  # a renewal
    assert sorted(store.leases(), key=lambda x: x.lease_id) == [StoredLease("l1", "b", 5e9, "me"), *kept[1:]]
    store.delete_lease("l2")
    store.delete_lease("no-such")  # deleting what is gone is not an error: a retried release
    assert {x.lease_id for x in store.leases()} == {"l1", "l3"}


def test_a_store_opened_again_holds_what_the_first_wrote(db: str) -> None:
    first = open_store(db)
    first.save_worker(StoredWorker("a", "127.0.0.1:1", "h", False, 1.0))
    first.save_lease(StoredLease("l1", "a", 4e9, "me", request_id="r", keep_alive=30.0))
    first.save_policy_fields("workers/a", {"idle_sleep_timeout": 5.0})
    first.close()
    second = open_store(db)  # also: migrating an up-to-date database changes nothing
    assert second.workers() == [StoredWorker("a", "127.0.0.1:1", "h", False, 1.0)]
    assert second.leases() == [StoredLease("l1", "a", 4e9, "me", request_id="r", keep_alive=30.0)]
    assert second.policy_fields("workers/a") == {"idle_sleep_timeout": 5.0}
    second.close()


def test_rows_no_manager_wrote_are_left_out_with_a_warning_and_left_in_place(
    db: str, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    store.save_worker(StoredWorker("a", "127.0.0.1:1", "h", False, 1.0))
    store.save_lease(StoredLease("good", "a", 4e9, "me"))
    raw(db, "INSERT INTO leases (lease_id, worker_id, expire_time, holder) VALUES ('forever', 'a', 'Infinity', 'me')")
    raw(db, "INSERT INTO leases (lease_id, worker_id, expire_time, holder) VALUES ('nobody', 'a', 4e9, '')")
    raw(db, "INSERT INTO workers VALUES ('', '127.0.0.1:2', 'h', 0, 1.0)")
    raw(db, "INSERT INTO workers VALUES ('c', '127.0.0.1:3', 'h', 7, 1.0)")
    assert store.leases() == [StoredLease("good", "a", 4e9, "me")]
    assert store.workers() == [StoredWorker("a", "127.0.0.1:1", "h", False, 1.0)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 4, warnings
    assert any("'forever'" in w and "expire_time is" in w for w in warnings)
    assert any("configured is 7" in w for w in warnings)


# ---- PostgreSQL only ----


def test_one_session_holds_the_leader_lock_and_names_its_address(pg_url: str) -> None:
    a, b = PostgresStore(pg_url), PostgresStore(pg_url)
    try:
        assert a.leader() == "" and b.leader() == ""
        assert a.try_lead("10.0.0.1:50051")
        assert not b.try_lead("10.0.0.2:50051")
        assert b.leader() == "10.0.0.1:50051" and a.leader() == "10.0.0.1:50051"
        a.close()  # the lock goes with the session, once the server has ended it
        wait_for(b.leader, lambda leader: leader == "", what="a dead leader's row to name no leader")
        assert b.try_lead("10.0.0.2:50051") and b.leader() == "10.0.0.2:50051"
    finally:
        a.close()
        b.close()


def test_a_leader_whose_session_ends_is_lost_and_writes_nothing_more(pg_url: str) -> None:
    leader, other = PostgresStore(pg_url), PostgresStore(pg_url)
    try:
        assert leader.try_lead("10.0.0.1:50051")
        leader.save_policy_fields("workers/a", {"idle_sleep_timeout": 1.0})
        with psycopg.connect(pg_url, autocommit=True) as db:
            db.execute("SELECT pg_terminate_backend(pid) FROM memsvc_leader")
        with pytest.raises(Unavailable, match="failed"):
            leader.check()
        assert "the leader's session ended" in leader.lost
        with pytest.raises(Unavailable, match="the leader's session ended"):
            leader.save_policy_fields("workers/a", {"idle_sleep_timeout": 2.0})
        assert other.policy_fields("workers/a") == {"idle_sleep_timeout": 1.0}, "nothing was written after the loss"
        assert other.try_lead("10.0.0.2:50051")
    finally:
        leader.close()
        other.close()


def test_a_follower_whose_session_ends_connects_again(pg_url: str) -> None:
    follower = PostgresStore(pg_url)
    try:
        with psycopg.connect(pg_url, autocommit=True) as db:
            db.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                "AND datname = current_database()"
            )
        with pytest.raises(Unavailable):
            follower.leader()  # the call that finds the session gone
        assert follower.leader() == "" and not follower.lost, "the next call has a new session"
    finally:
        follower.close()


def test_replicas_started_together_migrate_the_database_once(pg_url: str) -> None:
    with ThreadPoolExecutor(4) as pool:  # an error in any of them is raised here
        opened = list(pool.map(lambda _: PostgresStore(pg_url), range(4)))
    for store in opened:
        store.close()
    with psycopg.connect(pg_url) as db:
        assert db.execute("SELECT version FROM memsvc_schema").fetchall() == [(SCHEMA_VERSION,)]


def test_a_database_from_a_newer_memsvc_is_refused_and_left_alone(pg_url: str) -> None:
    PostgresStore(pg_url).close()
    with psycopg.connect(pg_url, autocommit=True) as db:
        db.execute("UPDATE memsvc_schema SET version = %s", (SCHEMA_VERSION + 1,))
    with pytest.raises(InvalidArgument) as err:
        PostgresStore(pg_url)
    assert f"written by a newer memsvc (schema {SCHEMA_VERSION + 1}" in str(err.value) and "\n" not in str(err.value)


def test_an_unreachable_server_or_a_bad_url_is_one_line_without_the_password() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(InvalidArgument) as err:
        open_store(f"postgresql://memsvc:s3cret@127.0.0.1:{port}/memsvc")
    said = str(err.value)
    assert "cannot connect" in said and f"postgresql://memsvc@127.0.0.1:{port}/memsvc" in said
    assert "s3cret" not in said and "\n" not in said
    with pytest.raises(InvalidArgument, match="bad --db URL"):
        open_store("postgresql://memsvc@127.0.0.1:5432/db?nosuchoption=1")
    assert redacted("postgresql://u:pw@db.example:5433/x?sslmode=require") == "postgresql://u@db.example:5433/x"
