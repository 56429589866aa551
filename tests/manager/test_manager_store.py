"""The manager's SQLite file (``--db``) when it is not what this memsvc wrote: older, newer, empty,
damaged, someone else's, or holding policy fields this version cannot use.

A manager that started on such a file as if it were fine would silently forget every registration,
lease and policy override, or fail later, mid-request (GetPolicy answering INTERNAL). So the file is
checked at start: what cannot be trusted is refused with one line that names the file and what to
do (exit code 2), an empty file starts with a warning, and a stored policy field that this version
does not know or cannot use is left out with a warning while the manager starts.

The unit tests open :class:`SqliteStore` and :class:`Policies` on real files in ``tmp_path``; the last
ones start real ``memsvc manager`` processes on such files.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from childproc import REPO_ROOT
from google.protobuf.duration_pb2 import Duration
from google.protobuf.field_mask_pb2 import FieldMask
from managerproc import Cluster, seconds

from memsvc.errors import InvalidArgument, Unavailable
from memsvc.manager.policy import Policies, Policy
from memsvc.manager.store import DEFAULT_SCOPE, StoredLease, StoredWorker
from memsvc.manager.store_sqlite import MIGRATIONS, SCHEMA_VERSION, SqliteStore
from memsvc.manager.wire import policy_pb
from memsvc.v1 import common_pb2 as common_pb
from memsvc.v1 import memory_manager_service_pb2 as manager_pb
from memsvc.vocabulary import Action

SCHEMA_0 = """
CREATE TABLE IF NOT EXISTS policies (scope TEXT PRIMARY KEY, fields TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS workers (
  worker_id TEXT PRIMARY KEY, address TEXT NOT NULL, host TEXT NOT NULL, configured INTEGER NOT NULL,
  registered_time REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS leases (
  lease_id TEXT PRIMARY KEY, worker_id TEXT NOT NULL, expire_time REAL NOT NULL, holder TEXT NOT NULL
);
"""
"""Word for word what memsvc wrote before schema versions (store.py's SCHEMA), leaving user_version 0."""

DEFAULT_FIELDS = {
    "tag_actions": {"weights": common_pb.TAG_ACTION_OFFLOAD, "kv_cache": common_pb.TAG_ACTION_DISCARD},
    "idle_sleep_timeout": 600.0,
    "idle_deep_sleep_timeout": 7200.0,
    "device_budget_bytes": 0,
    "host_budget_bytes": 1 << 30,
}
"""A stored default policy, as Policy.to_fields writes it."""


def schema0_db(path: Path, rows: bool = True) -> Path:
    """A database as memsvc before schema versions left it: WAL, the three tables, user_version 0."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(SCHEMA_0)
    if rows:
        db.execute("INSERT INTO policies VALUES ('', ?)", (json.dumps(DEFAULT_FIELDS),))
        db.execute("INSERT INTO policies VALUES ('workers/gpu0', ?)", (json.dumps({"idle_sleep_timeout": 60.0}),))
        db.execute("INSERT INTO workers VALUES ('gpu0', '127.0.0.1:1', 'h1', 0, 1.5)")
        db.execute("INSERT INTO leases VALUES ('l1', 'gpu0', 4e9, 'me')")
    db.close()
    return path


def user_version(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        return int(db.execute("PRAGMA user_version").fetchone()[0])
    finally:
        db.close()


def set_policy_rows(path: Path, rows: dict[str, Any]) -> None:
    """Write policy rows behind the store's back (values that are not str are JSON-encoded)."""
    db = sqlite3.connect(path, isolation_level=None)
    for scope, fields in rows.items():
        text = fields if isinstance(fields, str) else json.dumps(fields)
        db.execute("INSERT OR REPLACE INTO policies (scope, fields) VALUES (?, ?)", (scope, text))
    db.close()


def policy_rows(path: Path) -> dict[str, str]:
    db = sqlite3.connect(path)
    try:
        return dict(db.execute("SELECT scope, fields FROM policies").fetchall())
    finally:
        db.close()


def current_db(path: Path) -> Path:
    """A database this memsvc wrote, closed (its WAL checkpointed into the file)."""
    store = SqliteStore(path)
    store.save_policy_fields(DEFAULT_SCOPE, DEFAULT_FIELDS)
    for i in range(200):  # several pages, so damage in the middle hits a b-tree page
        store.save_worker(StoredWorker(f"worker-{i:04d}", f"10.0.0.{i % 250}:50061", "h" * 40, False, float(i)))
    store.close()
    return path


def messages(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


# ---- schema versions ----


def test_migrations_are_numbered_in_order() -> None:
    assert [step.version for step in MIGRATIONS] == list(range(1, len(MIGRATIONS) + 1))
    assert SCHEMA_VERSION == len(MIGRATIONS) == 2


def test_a_new_file_is_created_at_the_current_schema(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "sub" / "new.db"
    store = SqliteStore(path)
    store.close()
    assert user_version(path) == SCHEMA_VERSION
    assert not messages(caplog), "a new file is not a problem"
    db = sqlite3.connect(path)
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()
    assert tables == {"policies", "workers", "leases"}


def test_a_schema_0_file_is_migrated_in_place_and_keeps_everything(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="memsvc.manager.store")
    path = schema0_db(tmp_path / "old.db")
    assert user_version(path) == 0
    store = SqliteStore(path)
    assert store.workers() == [StoredWorker("gpu0", "127.0.0.1:1", "h1", False, 1.5)]
    assert store.leases() == [StoredLease("l1", "gpu0", 4e9, "me")]
    assert store.policy_fields(DEFAULT_SCOPE) == DEFAULT_FIELDS
    assert store.policy_fields("workers/gpu0") == {"idle_sleep_timeout": 60.0}
    store.close()
    assert user_version(path) == SCHEMA_VERSION
    assert any(f"migrated from schema 0 to {SCHEMA_VERSION}" in msg for msg in messages(caplog, logging.INFO))
    assert not messages(caplog), "migrating is not a warning"
    store = SqliteStore(path)  # once migrated, opening again changes nothing
    assert store.workers() == [StoredWorker("gpu0", "127.0.0.1:1", "h1", False, 1.5)]
    store.close()
    assert user_version(path) == SCHEMA_VERSION


def test_a_schema_1_file_gains_the_leases_request_id_and_keep_alive_and_keeps_its_leases(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="memsvc.manager.store")
    path = schema0_db(tmp_path / "one.db")
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA user_version = 1")  # schema 1 made the same tables as the files before versions
    db.close()
    store = SqliteStore(path)
    assert store.leases() == [StoredLease("l1", "gpu0", 4e9, "me", request_id="", keep_alive=None)]
    store.save_lease(StoredLease("l2", "gpu0", 5e9, "you", request_id="r-2", keep_alive=-1.0))
    store.close()
    assert any("migrated from schema 1 to 2" in msg for msg in messages(caplog, logging.INFO))
    store = SqliteStore(path)
    assert sorted(store.leases(), key=lambda x: x.lease_id) == [
        StoredLease("l1", "gpu0", 4e9, "me"),
        StoredLease("l2", "gpu0", 5e9, "you", request_id="r-2", keep_alive=-1.0),
    ]
    store.close()


def test_a_file_from_a_newer_memsvc_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = current_db(tmp_path / "newer.db")
    db = sqlite3.connect(path, isolation_level=None)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    before = path.read_bytes()
    with pytest.raises(InvalidArgument) as err:
        SqliteStore(path)
    msg = str(err.value)
    assert f"written by a newer memsvc (schema {SCHEMA_VERSION + 1}, this one knows up to {SCHEMA_VERSION})" in msg
    assert str(path) in msg and "\n" not in msg
    assert path.read_bytes() == before


# ---- files that cannot be trusted ----


def _random_bytes(path: Path) -> None:
    path.write_bytes(os.urandom(10_000))


def _text(path: Path) -> None:
    path.write_text("[manager]\nheartbeat_interval = 2.0\n")


def _header_only(path: Path) -> None:
    current_db(path)
    with path.open("r+b") as f:
        f.truncate(60)


def _cut_inside_a_page(path: Path) -> None:
    """One byte short: SQLite's quick_check passes this file, but the last page's end is lost."""
    current_db(path)
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 1)


def _cut_whole_pages(path: Path) -> None:
    current_db(path)
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2 // 4096 * 4096)


def _damaged_page(path: Path) -> None:
    """Garbage over the middle of the file (b-tree pages), the header intact."""
    current_db(path)
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.seek(size // 2)
        f.write(b"\xa5" * 3000)


CORRUPTIONS = [_random_bytes, _text, _header_only, _cut_inside_a_page, _cut_whole_pages, _damaged_page]


@pytest.mark.parametrize("damage", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_a_damaged_file_is_refused_with_one_line_and_left_alone(tmp_path: Path, damage: Any) -> None:
    path = tmp_path / "bad.db"
    damage(path)
    before = path.read_bytes()
    with pytest.raises(InvalidArgument) as err:
        SqliteStore(path)
    msg = str(err.value)
    assert msg.startswith(f"manager database {path} ") and "\n" not in msg
    assert "move it aside" in msg and "--db" in msg
    assert err.value.metadata == {"path": str(path)}
    assert path.read_bytes() == before, "a refused file is never written"


def test_another_programs_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("CREATE TABLE accounts (id INTEGER PRIMARY KEY, owner TEXT)")
    db.close()
    with pytest.raises(InvalidArgument, match="is not a memsvc manager database .*accounts"):
        SqliteStore(path)
    db = sqlite3.connect(path)
    assert {r[0] for r in db.execute("SELECT name FROM sqlite_master")} == {"accounts"}, "nothing was added"
    assert db.execute("PRAGMA user_version").fetchone()[0] == 0
    db.close()


def test_a_table_of_our_name_without_our_columns_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "clash.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("CREATE TABLE workers (name TEXT)")
    db.close()
    with pytest.raises(InvalidArgument, match="its table 'workers' lacks column"):
        SqliteStore(path)
    assert user_version(path) == 0, "the failed migration was rolled back"


def test_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(InvalidArgument, match=r"manager database .*dir\.db .*--db"):
        SqliteStore(tmp_path / "dir.db")


def test_an_empty_file_starts_empty_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "empty.db"
    path.touch()
    store = SqliteStore(path)
    assert store.workers() == [] and store.leases() == [] and store.policies() == {}
    store.close()
    assert user_version(path) == SCHEMA_VERSION
    (msg,) = messages(caplog)
    assert str(path) in msg and "empty" in msg
    assert "no worker registrations, leases or policy overrides" in msg


# ---- stored policies this version cannot use ----

BAD_VALUES: list[tuple[str, Any]] = [
    ("idle_sleep_timeout", "soon"),
    ("idle_sleep_timeout", -5.0),
    ("idle_sleep_timeout", True),
    ("idle_sleep_timeout", None),
    ("idle_sleep_timeout", math.nan),
    ("idle_sleep_timeout", 400 * 24 * 3600.0),  # more than UpdatePolicy's one year
    ("idle_deep_sleep_timeout", [1, 2]),
    ("device_budget_bytes", -1),
    ("device_budget_bytes", 1.5),
    ("device_budget_bytes", "8GiB"),
    ("host_budget_bytes", 1 << 70),
    ("tag_actions", {"weights": 99}),  # no such TagAction
    ("tag_actions", {"weights": common_pb.TAG_ACTION_UNSPECIFIED}),
    ("tag_actions", {"weights": "offload"}),
    ("tag_actions", {"": common_pb.TAG_ACTION_KEEP}),  # not a tag name
    ("tag_actions", {"x" * 64: common_pb.TAG_ACTION_KEEP}),
    ("tag_actions", ["weights"]),
]


def _policies(path: Path, rows: dict[str, Any]) -> Policies:
    store = SqliteStore(path)
    store.close()
    set_policy_rows(path, rows)
    return Policies(SqliteStore(path))


@pytest.mark.parametrize(("field", "value"), BAD_VALUES, ids=[f"{f}={v!r:.20}" for f, v in BAD_VALUES])
def test_a_bad_stored_override_is_dropped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, field: str, value: Any
) -> None:
    path = tmp_path / "m.db"
    override = {"host_budget_bytes": 5 << 20, field: value}
    policies = _policies(path, {"": DEFAULT_FIELDS, "workers/gpu0": override})
    want = Policy().with_fields(DEFAULT_FIELDS)
    got = policies.effective("workers/gpu0")
    assert getattr(got, field) == getattr(want, field), "the default's value applies"
    if field != "host_budget_bytes":
        assert got.host_budget_bytes == 5 << 20, "the override's other fields stay"
    policy_pb(got)  # what GetPolicy answers with
    (msg,) = messages(caplog)
    assert "workers/gpu0" in msg and field in msg and str(path) in msg
    assert policy_rows(path)["workers/gpu0"] == json.dumps(override), "the file keeps what it held"


@pytest.mark.parametrize(("field", "value"), BAD_VALUES, ids=[f"{f}={v!r:.20}" for f, v in BAD_VALUES])
def test_a_bad_stored_default_field_takes_the_built_in_value(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, field: str, value: Any
) -> None:
    policies = _policies(tmp_path / "m.db", {"": {**DEFAULT_FIELDS, field: value}})
    assert getattr(policies.default, field) == getattr(Policy(), field)
    policy_pb(policies.default)  # what GetPolicy answers with
    (msg,) = messages(caplog)
    assert "default policy" in msg and field in msg


def test_unknown_stored_fields_are_ignored_with_a_warning_and_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "m.db"
    default = {**DEFAULT_FIELDS, "idle_hibernate_timeout": 86400.0}
    override = {
        "idle_sleep_timeout": 0.123456789,
        "tag_actions": {"weights": common_pb.TAG_ACTION_KEEP},
        "wake_priority": 3,
    }
    policies = _policies(path, {"": default, "workers/gpu0": override})
    assert policies.default == Policy().with_fields(DEFAULT_FIELDS), "the known fields load exactly"
    got = policies.effective("workers/gpu0")
    assert got.idle_sleep_timeout == 0.123456789 and got.tag_actions == {"weights": Action.KEEP}
    warnings = messages(caplog)
    assert len(warnings) == 2
    assert "default policy" in warnings[0] and "'idle_hibernate_timeout'" in warnings[0]
    assert "workers/gpu0" in warnings[1] and "'wake_priority'" in warnings[1]
    # A later write by this version keeps them, for the version that knows them.
    policies.update_override("workers/gpu0", {"device_budget_bytes": 1 << 30})
    policies.update_default({"idle_sleep_timeout": 300.0}, ["workers/gpu0"])
    rows = {scope: json.loads(text) for scope, text in policy_rows(path).items()}
    assert rows["workers/gpu0"] == {**override, "device_budget_bytes": 1 << 30}
    assert rows[""]["idle_hibernate_timeout"] == 86400.0 and rows[""]["idle_sleep_timeout"] == 300.0


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '"fields"', "null"])
def test_a_stored_row_that_is_not_an_object_of_fields_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str
) -> None:
    policies = _policies(tmp_path / "m.db", {"": DEFAULT_FIELDS, "workers/gpu0": text})
    assert policies.effective("workers/gpu0") == policies.default == Policy().with_fields(DEFAULT_FIELDS)
    (msg,) = messages(caplog)
    assert "workers/gpu0" in msg and "not a JSON object" in msg


def test_stored_tiers_out_of_order_drop_tier_2(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """UpdatePolicy refuses tier 2 before tier 1; a file holding it loses the tier-2 timeout."""
    policies = _policies(
        tmp_path / "m.db",
        {
            "": {**DEFAULT_FIELDS, "idle_sleep_timeout": 600.0, "idle_deep_sleep_timeout": 60.0},
            "workers/a": {"idle_deep_sleep_timeout": 300.0},  # before the default's tier 1
            "workers/b": {"idle_sleep_timeout": 900.0, "idle_deep_sleep_timeout": 800.0},
        },
    )
    assert (policies.default.idle_sleep_timeout, policies.default.idle_deep_sleep_timeout) == (600.0, 0.0)
    a, b = policies.effective("workers/a"), policies.effective("workers/b")
    assert (a.idle_sleep_timeout, a.idle_deep_sleep_timeout) == (600.0, 0.0)
    assert (b.idle_sleep_timeout, b.idle_deep_sleep_timeout) == (900.0, 0.0)
    warnings = messages(caplog)
    assert len(warnings) == 3 and all("idle_deep_sleep_timeout" in w for w in warnings)
    assert "default policy" in warnings[0] and "workers/a" in warnings[1] and "workers/b" in warnings[2]


# ---- real manager processes ----

RUN_TIMEOUT = 60.0


def run_manager(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``memsvc manager`` that is expected to refuse to start (it would otherwise run until the timeout)."""
    argv = [sys.executable, "-m", "memsvc.cli", "manager", "--listen", "127.0.0.1:0", *args]
    return subprocess.run(
        argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL
    )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cl = Cluster(tmp_path)
    yield cl
    cl.close()


@pytest.mark.parametrize("damage", [_random_bytes, _cut_inside_a_page], ids=lambda f: f.__name__.strip("_"))
def test_manager_on_a_damaged_file_exits_2_with_one_line(tmp_path: Path, damage: Any) -> None:
    path = tmp_path / "bad.db"
    damage(path)
    r = run_manager(tmp_path, "--db", str(path))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"memsvc manager: error: manager database {path} ") and "--db" in line
    assert "listening" not in r.stdout


def test_manager_on_a_newer_file_exits_2_with_one_line(tmp_path: Path) -> None:
    path = current_db(tmp_path / "newer.db")
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA user_version = 99")
    db.close()
    r = run_manager(tmp_path, "--db", str(path))
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert f"written by a newer memsvc (schema 99, this one knows up to {SCHEMA_VERSION})" in line


def test_manager_with_a_missing_config_exits_2_with_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    r = run_manager(tmp_path, "--db", str(tmp_path / "m.db"), "--config", str(missing))
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("memsvc manager: error: cannot read config") and str(missing) in line


def test_manager_on_an_empty_file_starts_with_a_warning(cluster: Cluster) -> None:
    path = cluster.tmp_path / "empty.db"
    path.touch()
    mgr = cluster.manager(db=path)
    assert list(mgr.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers) == []
    log = mgr.stderr_text()
    assert f"manager database {path} was an empty file" in log and "WARNING" in log
    assert user_version(path) == SCHEMA_VERSION


def test_manager_on_unusable_stored_policies_starts_and_get_policy_answers(cluster: Cluster) -> None:
    """What used to stop the manager (an unknown field) or make GetPolicy answer INTERNAL (a string
    where seconds belong), in a file memsvc wrote before schema versions."""
    path = schema0_db(cluster.tmp_path / "m.db")
    set_policy_rows(
        path,
        {
            "": {**DEFAULT_FIELDS, "idle_hibernate_timeout": 86400.0},
            "workers/gpu0": {"idle_sleep_timeout": "soon", "host_budget_bytes": 5 << 20},
        },
    )
    mgr = cluster.manager(db=path)
    try:
        worker = mgr.stub.GetPolicy(manager_pb.GetPolicyRequest(name="workers/gpu0"), timeout=10).policy
        default = mgr.stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy
    except grpc.RpcError as err:
        pytest.fail(f"GetPolicy: {err.code().name}: {err.details()}\n{mgr.stderr_text()}")
    assert seconds(default.idle_sleep_timeout) == 600 and default.host_budget_bytes == 1 << 30
    assert seconds(worker.idle_sleep_timeout) == 600, "the default's value replaces the unusable one"
    assert worker.host_budget_bytes == 5 << 20
    log = mgr.stderr_text()
    assert "'idle_hibernate_timeout'" in log and "default policy" in log
    assert "workers/gpu0's policy override: dropping stored idle_sleep_timeout" in log
    assert "Traceback" not in log
    assert user_version(path) == SCHEMA_VERSION


# ---- the file deleted or replaced under a running manager; rows it cannot read ----


def test_a_write_to_a_deleted_or_replaced_file_is_refused_until_it_is_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLite writes on through its open descriptor after the path is gone: every call would succeed
    and be lost at the next start. The store compares the path's inode with the open file's first."""
    path = tmp_path / "m.db"
    store = SqliteStore(path)
    store.save_policy_fields("workers/a", {"idle_sleep_timeout": 60.0})
    aside = tmp_path / "aside.db"
    os.rename(path, aside)
    writes: list[Callable[[], None]] = [
        lambda: store.save_policy_fields("workers/a", {"idle_sleep_timeout": 1.0}),
        lambda: store.save_lease(StoredLease("l1", "a", 4e9, "me")),
        lambda: store.delete_worker("a"),
    ]
    refused = re.escape(f"manager database {path} was deleted while the manager runs")
    for write in writes:
        with pytest.raises(Unavailable, match=refused) as err:
            write()
        assert err.value.metadata["path"] == str(path)
    errors = messages(caplog, logging.ERROR)
    assert len(errors) == 1 and str(path) in errors[0], "one error line, not one per refused write"
    assert store.policy_fields("workers/a") == {"idle_sleep_timeout": 60.0}, "reads go on; nothing was written"

    os.rename(aside, path)  # put back: writes resume
    store.save_policy_fields("workers/a", {"idle_sleep_timeout": 5.0})
    assert "is back at its path" in caplog.text

    copy = tmp_path / "copy.db"
    copy.write_bytes(path.read_bytes())
    os.replace(copy, path)  # a restore copied over it: another inode
    with pytest.raises(Unavailable, match="was replaced by another file"):
        store.save_policy_fields("workers/a", {"idle_sleep_timeout": 7.0})
    store.close()


def _bad_rows(path: Path) -> Path:
    """A database memsvc wrote, then rows it would never write, added by hand."""
    store = SqliteStore(path)
    store.save_worker(StoredWorker("gpu0", "127.0.0.1:1", "h1", False, 1.5))
    store.save_lease(StoredLease("good", "gpu0", 4e9, "me"))
    store.close()
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("INSERT INTO leases VALUES ('text-expiry', 'gpu0', 'tomorrow', 'me', '', NULL)")
    db.execute("INSERT INTO leases VALUES ('never', 'gpu0', 9e999, 'me', '', NULL)")  # infinity: never ends
    db.execute("INSERT INTO leases VALUES ('blob-holder', 'gpu0', 4e9, x'00ff', '', NULL)")
    db.execute("INSERT INTO leases VALUES ('text-keep-alive', 'gpu0', 4e9, 'me', 'r', 'forever')")
    db.execute("INSERT INTO workers VALUES ('gpu1', x'2a', 'h1', 0, 1.5)")
    db.execute("INSERT INTO workers VALUES ('gpu2', '127.0.0.1:2', 'h1', 'yes', 1.5)")
    db.execute("INSERT INTO workers VALUES ('gpu3', '127.0.0.1:3', 'h1', 0, 'noon')")
    db.close()
    return path


def test_unreadable_lease_and_registration_rows_are_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _bad_rows(tmp_path / "m.db")
    store = SqliteStore(path)
    assert store.leases() == [StoredLease("good", "gpu0", 4e9, "me")]
    assert store.workers() == [StoredWorker("gpu0", "127.0.0.1:1", "h1", False, 1.5)]
    store.close()
    warnings = messages(caplog)
    assert len(warnings) == 7 and all(str(path) in w for w in warnings)
    assert any("lease 'text-expiry'" in w and "expire_time is 'tomorrow'" in w for w in warnings)
    assert any("lease 'text-keep-alive'" in w and "keep_alive is 'forever'" in w for w in warnings)
    assert any("registration 'gpu3'" in w and "registered_time is 'noon'" in w for w in warnings)
    db = sqlite3.connect(path)
    assert db.execute("SELECT count(*) FROM leases").fetchone()[0] == 5, "loading leaves the file as it is"
    db.close()


def test_manager_on_unreadable_rows_starts_and_keeps_the_rest(cluster: Cluster) -> None:
    """A lease row with a text expire_time used to stop the manager with a traceback at start."""
    path = _bad_rows(cluster.tmp_path / "m.db")
    mgr = cluster.manager(db=path)
    workers = mgr.stub.ListWorkers(manager_pb.ListWorkersRequest(), timeout=10).workers
    assert [w.name for w in workers] == ["workers/gpu0"] and workers[0].lease_count == 1
    log = mgr.stderr_text()
    assert "Traceback" not in log
    assert "ignoring the stored lease 'text-expiry'" in log and "ignoring the stored registration 'gpu3'" in log


def test_manager_whose_file_is_deleted_refuses_writes_with_unavailable(cluster: Cluster) -> None:
    """Before, every call went on succeeding, and the lease and policy were gone after a restart."""
    path = cluster.tmp_path / "m.db"
    mgr = cluster.manager(db=path)
    update = manager_pb.UpdatePolicyRequest(
        policy=manager_pb.Policy(idle_sleep_timeout=Duration(seconds=120)),
        update_mask=FieldMask(paths=["idle_sleep_timeout"]),
    )
    mgr.stub.UpdatePolicy(update, timeout=10)
    path.unlink()
    update.policy.idle_sleep_timeout.seconds = 30
    for call in (
        lambda: mgr.stub.UpdatePolicy(update, timeout=10),
        lambda: mgr.stub.RegisterWorker(
            manager_pb.RegisterWorkerRequest(worker_id="w1", address="127.0.0.1:1"), timeout=10
        ),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert f"manager database {path} was deleted" in str(err.value.details())
    policy = mgr.stub.GetPolicy(manager_pb.GetPolicyRequest(), timeout=10).policy
    assert seconds(policy.idle_sleep_timeout) == 120, "the refused update changed nothing"
    errors = [line for line in mgr.stderr_text().splitlines() if "ERROR" in line]
    assert len(errors) == 1 and f"manager database {path} was deleted" in errors[0], errors
