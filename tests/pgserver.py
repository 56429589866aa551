"""A real PostgreSQL server for the tests of the manager's PostgreSQL store and its replicas.

The server is Debian's ``postgresql-15`` package, which ``make test`` unpacks into
``.venv/postgresql`` (PostgreSQL finds its share directory relative to its binaries, so it runs from
there); a ``pg_config``/``initdb`` on PATH serves too. One server per test session, on a free
loopback port, trust authentication, no fsync (the tests need its semantics, not its durability);
each test gets a database of its own (:func:`pg_url`), dropped afterwards.

PostgreSQL refuses to run as root, and CI runs as root: then the server runs as ``nobody``, its
directory given to that user. Readiness is a real connection, polled; never a fixed sleep.

psycopg is imported where a server is used, not here: tests/conftest.py serves these fixtures to
every test, and a machine without it (the GPU machine) runs the rest.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
USER = "memsvc"


def bin_dir() -> Path:
    """Where ``initdb`` and ``postgres`` are: the venv's unpacked package, else PATH's."""
    venv = Path(sys.executable).parent.parent / "postgresql"
    found = sorted(glob.glob(str(venv / "usr/lib/postgresql/*/bin/initdb")))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb") or next(iter(sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))), None)
    assert on_path, "PostgreSQL is missing: `make test` unpacks Debian's postgresql-15 into .venv/postgresql"
    return Path(on_path).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """One running server; :meth:`start` returns once it accepts connections."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = base / "postgres.log"
        self.user: int | None = None
        """The user the server runs as (None: this process's)."""
        self.group: int | None = None

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{dbname}"

    def start(self) -> PostgresServer:
        """A new cluster (initdb) on a free port, running."""
        if os.geteuid() == 0:  # PostgreSQL will not run as root
            nobody = pwd.getpwnam("nobody")
            self.user, self.group = nobody.pw_uid, nobody.pw_gid
            os.chown(self.base, nobody.pw_uid, nobody.pw_gid)
        done = subprocess.run(
            [
                str(bin_dir() / "initdb"),
                "-D",
                str(self.base / "data"),
                "-U",
                USER,
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT,
            user=self.user,
            group=self.group,
        )
        assert done.returncode == 0, f"initdb failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        self.port = _free_port()
        return self.run()

    def run(self) -> PostgresServer:
        """The server on its cluster and port, once it accepts connections (again, after :meth:`stop`)."""
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(bin_dir() / "postgres"),
                    "-D",
                    str(self.base / "data"),
                    "-k",
                    str(self.base),
                    "-p",
                    str(self.port),
                    "-c",
                    "listen_addresses=127.0.0.1",
                    "-c",
                    "fsync=off",
                    "-c",
                    "synchronous_commit=off",
                    "-c",
                    "full_page_writes=off",
                    "-c",
                    "max_connections=300",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                user=self.user,
                group=self.group,
            )
        import psycopg

        give_up = time.monotonic() + START_TIMEOUT
        while True:
            try:
                psycopg.connect(self.url(), connect_timeout=2).close()
                return self
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > give_up:
                    said = self.log.read_text(errors="replace")[-4000:]
                    raise AssertionError(f"PostgreSQL did not start:\n{said}") from None
                time.sleep(0.05)

    def create_database(self, name: str) -> str:
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url(), autocommit=True) as db:
            db.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def drop_database(self, name: str) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url(), autocommit=True) as db:
            db.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)  # "fast" shutdown: ends sessions, no waiting for clients
        try:
            self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One server for the session, in a directory of its own under the system's temp directory
    (pytest's is private to root, which the server's user could not enter)."""
    base = Path(tempfile.mkdtemp(prefix="memsvc-postgres-"))
    server = PostgresServer(base)
    try:
        yield server.start()
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_url(postgres_server: PostgresServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """A new, empty database for this test; its ``postgresql://`` URL."""
    name = "t_" + re.sub(r"[^a-z0-9]+", "_", request.node.name.lower())[:40] + f"_{os.getpid()}_{time.monotonic_ns()}"
    url = postgres_server.create_database(name[:63])
    yield url
    postgres_server.drop_database(name[:63])
