"""The oldest PostgreSQL we claim to support: a core subset against Debian's PostgreSQL 15.

The embedded wheel is PostgreSQL 18, so everything else runs on 18. The schema needs 14
(``CREATE OR REPLACE TRIGGER``); 15 is the oldest packaged here (Debian 12), so it is the
oldest tested. The cluster is a throwaway one in a temporary directory, on a unix socket
only, run as an unprivileged user when we are root (as ``pgqueue.server`` does).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from pgqueue import Queue, Worker, fenced_write
from pgqueue.server import _ensure_server_user

BIN = Path("/usr/lib/postgresql/15/bin")
PORT = 5432  # names the socket file only: no TCP

pytestmark = pytest.mark.skipif(
    not (BIN / "initdb").exists(),
    reason="install Debian's postgresql-15 to test the oldest supported server",
)


def _run(*cmd: str, ids: dict) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    result = subprocess.run(
        cmd,
        **ids,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        cwd="/",
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, (cmd, result.stdout, result.stderr)


@pytest.fixture(scope="module")
def admin_dsn() -> Iterator[str]:
    """A PostgreSQL 15 cluster of this module's own; its maintenance database's DSN."""
    base = Path(tempfile.mkdtemp(prefix="pgqueue-pg15-"))
    base.chmod(0o755)  # as root the server user must reach it
    data, run = base / "data", base / "run"
    ids: dict = {}
    for path in (data, run):
        path.mkdir(mode=0o700)
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        uid, gid = _ensure_server_user()
        ids = {"user": uid, "group": gid, "extra_groups": []}
        for path in (data, run):
            os.chown(path, uid, gid)
    # PostgreSQL 15's initdb has no -c: write the settings before the first start (and
    # pass listen_addresses='' on the command line too), so it never listens on TCP.
    _run(
        str(BIN / "initdb"),
        "-D",
        str(data),
        "-U",
        "postgres",
        "--auth-local=trust",
        "--auth-host=reject",
        "--encoding=UTF8",
        "--locale=C",
        "--no-instructions",
        ids=ids,
    )
    with open(data / "postgresql.conf", "a", encoding="utf-8") as conf:
        conf.write(
            f"listen_addresses = ''\nunix_socket_directories = '{run}'\n"
            "unix_socket_permissions = 0700\nfsync = off\nsynchronous_commit = off\n"
            "full_page_writes = off\nmax_connections = 50\n"
        )
    log = data / "server.log"
    pg_ctl = str(BIN / "pg_ctl")
    try:
        _run(
            pg_ctl,
            *("start", "-w", "-t", "60", "-D", str(data), "-l", str(log)),
            *("-o", f"-p {PORT} -c listen_addresses=''"),
            ids=ids,
        )
        yield f"host={run} port={PORT} user=postgres dbname=postgres"
    finally:
        subprocess.run(
            [pg_ctl, "stop", "-w", "-t", "60", "-m", "immediate", "-D", str(data)],
            **ids,
            capture_output=True,
            cwd="/",
            check=False,
        )
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def dsn(admin_dsn: str) -> Iterator[str]:
    """A fresh database on the PostgreSQL 15 cluster, schema installed twice."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    target = make_conninfo(admin_dsn, dbname=name)
    for _ in range(2):  # install is idempotent
        with Queue(target) as q:
            q.install()
    yield target
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def test_the_server_is_postgresql_15_on_a_socket_only(admin_dsn: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        assert conn.info.server_version // 10000 == 15
        assert conn.execute("SHOW listen_addresses").fetchone() == ("",)


def test_install_twice_creates_the_table_and_trigger(dsn: str) -> None:
    with Queue(dsn) as q:
        assert q.install().changed == []  # 15 spells index definitions as 18 does
        q.check()
        triggers = q.conn.execute(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = 'jobs'::regclass AND NOT tgisinternal"
        ).fetchall()
    assert ("jobs_notify_insert",) in triggers


def test_install_upgrades_a_first_release_table_concurrently(admin_dsn: str) -> None:
    from test_install import FIRST_RELEASE

    name = f"u_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    target = make_conninfo(admin_dsn, dbname=name)
    try:
        with psycopg.connect(target, autocommit=True) as conn:
            conn.execute(FIRST_RELEASE)
        with Queue(target) as q:
            done = q.install()
            assert "built jobs_ready_idx concurrently" in done.changed
            assert "validated the status check" in done.changed
            assert q.install().changed == []
            invalid = q.conn.execute(
                "SELECT count(*) FROM pg_index WHERE indrelid = 'jobs'::regclass AND NOT indisvalid"
            ).fetchone()
            assert invalid == (0,)
            assert q.claim("q")[0].payload == {"n": 1}
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def test_enqueue_claim_heartbeat_complete_fail_reap_stats(dsn: str) -> None:
    with Queue(dsn) as q:
        first = q.enqueue({"n": 0})
        more = q.enqueue_many([{"n": i} for i in range(1, 4)])
        assert len(more) == 3 and first < min(more)

        job = q.claim(lease=30)[0]
        assert job.id == first and job.payload == {"n": 0}
        assert q.heartbeat(job, lease=30) is True
        assert q.complete(job) is True

        job = q.claim(lease=30)[0]
        assert q.fail(job, "boom", backoff=0.0)
        status, attempts, error = q.conn.execute(
            "SELECT status, attempts, last_error FROM jobs WHERE id = %s", [job.id]
        ).fetchone()
        assert (status, attempts, error) == ("ready", 1, "boom")

        held = q.claim(limit=10, lease=0.2)
        assert len(held) == 3
        time.sleep(0.5)
        reaped = q.reap()
        assert sorted(r.id for r in reaped) == sorted(j.id for j in held)
        assert {r.status for r in reaped} == {"ready"}
        assert q.complete(held[0]) is False  # its lease ran out: a stale holder
        assert held[0].lost

        counts = {(row["queue"], row["status"]): row["jobs"] for row in q.stats()}
        assert counts[("default", "ready")] == 3
        assert ("default", "running") not in counts
        done = q.conn.execute("SELECT count(*) FROM jobs WHERE status = 'done'").fetchone()
        assert done == (1,)


def test_a_per_group_limit_claims_by_slot(dsn: str) -> None:
    """claim_limited's SQL on 15: slots under the partial unique index, a full group passed
    over, a slot freed by completion."""
    with Queue(dsn) as q:
        a = q.enqueue_many([{"a": i} for i in range(3)], queue="q", group="a", priority=1)
        b = q.enqueue({"b": 0}, queue="q", group="b")
        q.limit("q", per_group=2)
        held = q.claim("q", limit=10)
        assert [j.id for j in held] == [a[0], a[1], b]
        assert q.claim("q") == []
        assert q.complete(held[0])
        assert [j.id for j in q.claim("q")] == [a[2]]
        slots = q.conn.execute(
            "SELECT group_key, slot FROM jobs WHERE status = 'running' ORDER BY 1, 2"
        ).fetchall()
        assert slots == [("a", 1), ("a", 2), ("b", 1)]


def test_enqueue_many_takes_the_copy_path(dsn: str) -> None:
    with Queue(dsn) as q:
        ids = q.enqueue_many([{"i": i} for i in range(2500)], queue="bulk")
        assert len(ids) == 2500 and ids == sorted(ids) and len(set(ids)) == 2500
        stored = q.conn.execute(
            "SELECT count(*), min((payload->>'i')::int), max((payload->>'i')::int) "
            "FROM jobs WHERE queue = 'bulk'"
        ).fetchone()
        assert stored == (2500, 0, 2499)
        first = q.conn.execute("SELECT payload FROM jobs WHERE id = %s", [ids[0]]).fetchone()
        assert first == ({"i": 0},)


def test_a_worker_with_two_threads_drains_200_jobs(dsn: str) -> None:
    with Queue(dsn) as q:
        q.enqueue_many([{"n": i} for i in range(200)])
    seen: list[int] = []
    lock = threading.Lock()

    def handler(job: object) -> None:
        with lock:
            seen.append(job.payload["n"])  # type: ignore[attr-defined]

    worker = Worker(handler, dsn=dsn, concurrency=2, burst=True, poll_interval=0.1)
    worker.start()
    worker.join(120)
    worker.stop()
    assert sorted(seen) == list(range(200))
    with Queue(dsn) as q:
        done = q.conn.execute("SELECT count(*) FROM jobs WHERE status = 'done'").fetchone()
    assert done == (200,)


def test_fenced_write(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE reports (id int PRIMARY KEY, body text, fence bigint)")
        assert fenced_write(conn, "reports", {"id": 1}, {"body": "new"}, fence=2)
        assert not fenced_write(conn, "reports", {"id": 1}, {"body": "stale"}, fence=1)
        assert fenced_write(conn, "reports", {"id": 1}, {"body": "newer"}, fence=3)
        assert conn.execute("SELECT body, fence FROM reports").fetchall() == [("newer", 3)]
