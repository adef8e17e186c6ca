"""Fixtures: a real PostgreSQL (embedded, or PGQUEUE_DSN) and a fresh database per test.

Each test gets its own database cloned from a template that already holds the schema
(CREATE DATABASE ... TEMPLATE), which takes milliseconds and isolates state fully.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from pgqueue import EmbeddedServer, Queue
from pgqueue.testing import Databases

TEMPLATE = "pgqueue_test_template"


@pytest.fixture(scope="session")
def server() -> Iterator[EmbeddedServer | None]:
    """The embedded test server (fsync off), or None when PGQUEUE_DSN names a server."""
    if os.environ.get("PGQUEUE_DSN"):
        yield None
        return
    home = Path(tempfile.mkdtemp(prefix="pgqueue-test-"))
    home.chmod(0o755)  # as root, the server runs as another user that must reach it
    srv = EmbeddedServer(home, durable=False)
    srv.start()
    yield srv
    srv.stop()
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def admin_dsn(server: EmbeddedServer | None) -> str:
    """A DSN for the maintenance database, where test databases are created."""
    return server.dsn() if server else os.environ["PGQUEUE_DSN"]


@pytest.fixture(scope="session")
def template(admin_dsn: str) -> str:
    """A database with the pgqueue schema installed, cloned by every test."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(TEMPLATE))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(TEMPLATE)))
    with Queue(make_conninfo(admin_dsn, dbname=TEMPLATE)) as q:
        q.install()
    return TEMPLATE


@pytest.fixture
def dsn(admin_dsn: str, template: str) -> Iterator[str]:
    """A DSN for a fresh database of this test's own, with the schema installed."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        )
    yield make_conninfo(admin_dsn, dbname=name)
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture
def empty_dsn(admin_dsn: str) -> Iterator[str]:
    """A DSN for a fresh database without the pgqueue schema."""
    name = f"e_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield make_conninfo(admin_dsn, dbname=name)
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture
def queue(dsn: str) -> Iterator[Queue]:
    """A Queue on this test's database."""
    with Queue(dsn) as q:
        yield q


def rows(dsn: str, query: str, params: object = None) -> list[tuple]:
    """Run a query on its own connection and return all rows (for assertions)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()  # type: ignore[arg-type]


def wait_for(check: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """Poll ``check`` until it returns something truthy, and return that; fail the test
    after ``timeout`` seconds (a bound for a broken run, not a timing that is asserted)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="session")
def pgqueue_databases(admin_dsn: str) -> Iterator[Databases]:
    """pgqueue.testing's databases on this session's test server (the plugin would start
    an embedded server of its own): tests/library/test_testing_helpers.py uses its fixtures."""
    with Databases(admin_dsn) as databases:
        yield databases
