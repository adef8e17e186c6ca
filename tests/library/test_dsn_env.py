"""Where the connection comes from: ``dsn``, ``PGQUEUE_DSN``, ``DATABASE_URL``, libpq's own
environment (``PGHOST``, ``PGSERVICE``, ``PGDATABASE``), else the embedded server; and
``describe_dsn`` saying which, in one line, with passwords masked."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from conftest import rows
from pgqueue import ConnectError, EmbeddedServer, Queue, Worker, connect
from pgqueue import server as server_module
from pgqueue.db import describe_dsn, resolve_dsn

SECRET = "S3cr3t-dsn-env-pw"
LIBPQ = (
    "PGHOST",
    "PGHOSTADDR",
    "PGPORT",
    "PGUSER",
    "PGDATABASE",
    "PGSERVICE",
    "PGSERVICEFILE",
    "PGPASSFILE",
    "PGPASSWORD",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """No DSN settings and no libpq variables; a default embedded home that does not
    exist yet (so any embedded server started by mistake shows up)."""
    for name in ("PGQUEUE_DSN", "DATABASE_URL", *LIBPQ):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "never-used-home"
    monkeypatch.setenv("PGQUEUE_HOME", str(home))
    monkeypatch.setattr(server_module, "_default", None)
    yield home
    assert not home.exists(), "an embedded server was started"


def libpq_env(monkeypatch: pytest.MonkeyPatch, dsn: str) -> dict[str, str]:
    """Set PGHOST, PGPORT, PGUSER, PGDATABASE (and PGPASSWORD) from ``dsn``."""
    params = conninfo_to_dict(dsn)
    env = {}
    for key, name in (
        ("host", "PGHOST"),
        ("port", "PGPORT"),
        ("user", "PGUSER"),
        ("dbname", "PGDATABASE"),
        ("password", "PGPASSWORD"),
    ):
        if params.get(key):
            env[name] = str(params[key])
            monkeypatch.setenv(name, env[name])
    return env


# -- the order --------------------------------------------------------------------------
def test_the_argument_then_pgqueue_dsn_then_database_url_then_libpq(
    monkeypatch: pytest.MonkeyPatch, clean_env: Path
) -> None:
    monkeypatch.setenv("PGHOST", "/libpq-host")
    monkeypatch.setenv("DATABASE_URL", "postgresql:///from-url")
    monkeypatch.setenv("PGQUEUE_DSN", "dbname=from-pgqueue-dsn")
    assert resolve_dsn("dbname=given") == "dbname=given"
    assert resolve_dsn() == "dbname=from-pgqueue-dsn"
    monkeypatch.delenv("PGQUEUE_DSN")
    assert resolve_dsn() == "postgresql:///from-url"
    monkeypatch.delenv("DATABASE_URL")
    assert resolve_dsn() == ""  # libpq reads PG* itself


@pytest.mark.parametrize("name", ["PGHOST", "PGSERVICE", "PGDATABASE", "PGHOSTADDR"])
def test_each_libpq_selector_means_libpq(
    monkeypatch: pytest.MonkeyPatch, clean_env: Path, name: str
) -> None:
    monkeypatch.setenv(name, "x")
    assert resolve_dsn() == ""
    assert describe_dsn().startswith("libpq environment: ")
    assert f"{name}=x" in describe_dsn()


# -- libpq's environment, against the real test server --------------------------------
def test_libpq_environment_reaches_the_server_it_names(
    monkeypatch: pytest.MonkeyPatch, clean_env: Path, dsn: str
) -> None:
    """PGHOST (the socket directory), PGPORT, PGUSER, PGDATABASE: a Queue() connects to
    that server and database, not to a new embedded server."""
    env = libpq_env(monkeypatch, dsn)
    assert resolve_dsn() == ""
    with psycopg.connect("", autocommit=True) as conn:  # what libpq does with ""
        assert conn.info.dbname == env["PGDATABASE"]
    with Queue() as q:
        assert q.conn.info.dbname == env["PGDATABASE"]
        assert q.conn.info.host == env["PGHOST"]
        job_id = q.enqueue({"via": "libpq env"})
    assert rows(dsn, "SELECT payload->>'via' FROM jobs WHERE id = %s", [job_id]) == [("libpq env",)]
    described = describe_dsn()
    assert described.startswith("libpq environment: ")
    assert f"PGHOST={env['PGHOST']}" in described
    assert f"PGDATABASE={env['PGDATABASE']}" in described


def test_a_worker_configured_the_libpq_way_drains_that_database(
    monkeypatch: pytest.MonkeyPatch, clean_env: Path, dsn: str
) -> None:
    libpq_env(monkeypatch, dsn)
    with Queue(dsn) as q:
        q.enqueue_many([{"n": i} for i in range(5)])
    seen: list[int] = []
    worker = Worker(lambda job: seen.append(job.payload["n"]), burst=True, poll_interval=0.1)
    assert worker.dsn == ""
    worker.start()
    worker.join(60)
    worker.stop()
    assert sorted(seen) == list(range(5))
    assert rows(dsn, "SELECT count(*) FROM jobs WHERE status = 'done'") == [(5,)]


def test_a_wrong_libpq_environment_fails_loudly_without_the_password(
    monkeypatch: pytest.MonkeyPatch, clean_env: Path
) -> None:
    monkeypatch.setenv("PGHOST", "/nonexistent-pgqueue-dir")
    monkeypatch.setenv("PGPASSWORD", SECRET)
    with pytest.raises(ConnectError, match="libpq environment") as info:
        connect()
    message = str(info.value)
    assert "PGHOST=/nonexistent-pgqueue-dir" in message
    assert SECRET not in message and "\n" not in message


# -- none of them: the embedded server ---------------------------------------------------
def test_without_any_setting_the_embedded_server_is_used(
    monkeypatch: pytest.MonkeyPatch, server: EmbeddedServer | None
) -> None:
    if server is None:
        pytest.skip("PGQUEUE_DSN names an external server; nothing embedded to check")
    for name in ("PGQUEUE_DSN", "DATABASE_URL", *LIBPQ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PGUSER", "someone")  # PGUSER or PGPORT alone do not mean libpq
    monkeypatch.setenv("PGPORT", "1")
    monkeypatch.setenv("PGQUEUE_HOME", str(server.home))
    monkeypatch.setattr(server_module, "_default", None)
    pid = (server.data / "postmaster.pid").read_text().split()[0]
    assert resolve_dsn() == server.dsn()
    assert describe_dsn() == describe_dsn(server.dsn())
    assert describe_dsn().startswith(f"embedded server at {server.socket_dir}")
    assert (server.data / "postmaster.pid").read_text().split()[0] == pid  # the same one


# -- describe_dsn -------------------------------------------------------------------------
def test_describe_dsn_names_the_source_and_masks_passwords(
    monkeypatch: pytest.MonkeyPatch, clean_env: Path
) -> None:
    kv = f"host=db.example user=app password={SECRET} dbname=jobs"
    url = f"postgresql://app:{SECRET}@db.example/jobs"
    given = describe_dsn(kv)
    assert given.startswith("DSN given: ")
    assert set(given.split()[2:]) == {"host=db.example", "user=app", "password=***", "dbname=jobs"}
    assert describe_dsn(url) == "DSN given: postgresql://app:***@db.example/jobs"
    monkeypatch.setenv("DATABASE_URL", url)
    assert describe_dsn() == "DATABASE_URL: postgresql://app:***@db.example/jobs"
    monkeypatch.setenv("PGQUEUE_DSN", kv)
    assert describe_dsn().startswith("PGQUEUE_DSN: ")
    assert "password=***" in describe_dsn()
    monkeypatch.delenv("PGQUEUE_DSN")
    monkeypatch.delenv("DATABASE_URL")
    for name, value in (
        ("PGHOST", "db.example"),
        ("PGPORT", "6543"),
        ("PGDATABASE", "jobs"),
        ("PGPASSWORD", SECRET),
    ):
        monkeypatch.setenv(name, value)
    described = describe_dsn()
    assert described == (
        "libpq environment: PGHOST=db.example PGPORT=6543 PGDATABASE=jobs PGPASSWORD=***"
    )
    for text in (described, describe_dsn(kv), describe_dsn(url)):
        assert SECRET not in text and "\n" not in text


def test_describe_dsn_of_the_embedded_server_starts_nothing(clean_env: Path) -> None:
    described = describe_dsn()
    expected = EmbeddedServer(clean_env)
    assert described.startswith(f"embedded server at {expected.socket_dir}")
    assert str(expected.data) in described
    assert "\n" not in described
    assert not os.path.exists(clean_env)  # not started, not even created
