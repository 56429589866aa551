"""The manager's two stores, for the tests that must pass on both (memsvc/manager/store.py): a SQLite
file in the test's directory, and a database of its own on the session's real PostgreSQL server
(tests/pgserver.py), which is started only when a PostgreSQL case runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from memsvc.manager.store import Store, open_store

STORE_KINDS = ("sqlite", "postgresql")
"""The ``params`` of a fixture that runs its tests on each store."""


def db_for(request: pytest.FixtureRequest, tmp_path: Path, name: str = "manager.db") -> str:
    """The ``--db`` of this case's store (``request.param``): a file in ``tmp_path``, or a new database."""
    if request.param == "postgresql":
        return str(request.getfixturevalue("pg_url"))
    return str(tmp_path / name)


def store_for(request: pytest.FixtureRequest, tmp_path: Path, name: str = "manager.db") -> Store:
    """This case's store, open."""
    return open_store(db_for(request, tmp_path, name))
