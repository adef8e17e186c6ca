"""pgqueue behind a real PgBouncer in transaction pooling mode (issue #15, item 1).

PgBouncer (Debian's package; ``.ci/run`` installs it) is started in front of the test
server, listening on a unix socket in a private directory only, with a pool of
``POOL`` server connections per database and ``pool_mode = transaction``: each
transaction may run on another server connection, so a statement prepared on one is
missing (or already there under the same name, prepared by another client) on the next.
PgBouncer before 1.21 does not track prepared statements; from 1.21 on the test turns
that tracking off (``max_prepared_statements = 0``) so every version behaves like the
1.18 of the issue.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from conftest import rows, wait_for
from pgqueue import Queue

PGQUEUE = str(Path(sys.executable).parent / "pgqueue")
ROOT = Path(__file__).resolve().parents[2]
PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
PORT = 6432  # names the socket file only: PgBouncer listens on no TCP port here
POOL = 3  # server connections per database behind PgBouncer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.access(PGBOUNCER, os.X_OK),
        reason="PgBouncer is not installed (Debian: apt-get install pgbouncer; .ci/run "
        "installs it): the transaction-pooling tests need a real one",
    ),
]

WARNING = "behind PgBouncer LISTEN needs a direct connection"


def _version() -> tuple[int, ...]:
    out = subprocess.run([PGBOUNCER, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"PgBouncer (\d+)\.(\d+)", out)
    return tuple(int(part) for part in found.groups()) if found else (0, 0)


def _ids() -> tuple[dict[str, Any], tuple[int, int] | None]:
    """How to run PgBouncer: it refuses root, so as root as the embedded server's user
    (which may reach the server's socket directory)."""
    if os.geteuid() != 0:
        return {}, None
    from pgqueue.server import _ensure_server_user

    uid, gid = _ensure_server_user()
    return {"user": uid, "group": gid, "extra_groups": []}, (uid, gid)


class Bouncer:
    """A PgBouncer process in front of the server of ``admin_dsn``."""

    def __init__(self, admin_dsn: str) -> None:
        server = conninfo_to_dict(admin_dsn)
        target = {
            key: server[key]
            for key in ("host", "port", "user", "password")
            if server.get(key) is not None
        }
        # Short, private: a unix socket path must stay under ~107 bytes, and nobody but
        # PgBouncer's user (and root) may connect.
        self.dir = Path(tempfile.mkdtemp(prefix="pgqueue-bouncer-"))
        ids, owner = _ids()
        if owner:
            os.chown(self.dir, *owner)
        self.log = self.dir / "pgbouncer.log"
        settings = {
            "listen_addr": "",  # no TCP
            "listen_port": str(PORT),
            "unix_socket_dir": str(self.dir),
            "unix_socket_mode": "0600",
            "pool_mode": "transaction",
            "default_pool_size": str(POOL),
            "min_pool_size": "0",
            "reserve_pool_size": "0",
            "max_client_conn": "500",
            # No password check: only this user and root can reach the socket.
            "auth_type": "any",
            "logfile": str(self.log),
            "pidfile": str(self.dir / "pgbouncer.pid"),
            "server_check_delay": "0",
        }
        if _version() >= (1, 21):
            settings["max_prepared_statements"] = "0"  # behave like 1.18: track nothing
        connect = " ".join(f"{key}={value}" for key, value in target.items())
        conf = self.dir / "pgbouncer.ini"
        conf.write_text(
            f"[databases]\n* = {connect}\n\n[pgbouncer]\n"
            + "".join(f"{key} = {value}\n" for key, value in settings.items())
        )
        conf.chmod(0o600)
        if owner:
            os.chown(conf, *owner)
        self.proc = subprocess.Popen(
            [PGBOUNCER, str(conf)],
            **ids,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
        )
        self.user = target.get("user", "postgres")
        self._wait_up()

    def dsn(self, dbname: str) -> str:
        """A DSN for ``dbname`` through PgBouncer."""
        return f"host={self.dir} port={PORT} user={self.user} dbname={dbname}"

    def _wait_up(self) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited: {self.logged()}")
            if (self.dir / f".s.PGSQL.{PORT}").exists():
                return
            time.sleep(0.05)
        raise RuntimeError(f"pgbouncer did not start: {self.logged()}")

    def logged(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # safe shutdown
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def bouncer(admin_dsn: str) -> Iterator[Bouncer]:
    """One PgBouncer for the module; every test uses a database (so a pool) of its own."""
    started = Bouncer(admin_dsn)
    yield started
    started.stop()


@pytest.fixture
def via(bouncer: Bouncer, empty_dsn: str) -> str:
    """This test's empty database, through PgBouncer."""
    return bouncer.dsn(str(conninfo_to_dict(empty_dsn)["dbname"]))


def pgqueue(
    dsn: str, *args: str, pgbouncer: bool, stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run the ``pgqueue`` command on ``dsn``, with PGQUEUE_PGBOUNCER=1 or without it."""
    return subprocess.run(
        [PGQUEUE, "--dsn", dsn, *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(pgbouncer),
        timeout=timeout,
    )


def _env(pgbouncer: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PGQUEUE_DSN", "PGQUEUE_PGBOUNCER")}
    if pgbouncer:
        env["PGQUEUE_PGBOUNCER"] = "1"
    return env


class WorkerProcess:
    """A ``pgqueue worker tests.handlers:noop`` subprocess, its output kept in files."""

    def __init__(self, dsn: str, name: str, logs: Path, *options: str, pgbouncer: bool) -> None:
        self.name = name
        self.out, self.err = logs / f"{name}.out", logs / f"{name}.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [PGQUEUE, "--dsn", dsn, "worker", "tests.handlers:noop", "--name", name,
                 "--queue", "q", *options],
                cwd=ROOT,
                stdout=out,
                stderr=err,
                env=_env(pgbouncer),
            )  # fmt: skip

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(20)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start worker processes; every one is killed afterwards."""
    started: list[WorkerProcess] = []

    def start(dsn: str, name: str, *options: str, pgbouncer: bool) -> WorkerProcess:
        worker = WorkerProcess(dsn, name, tmp_path, *options, pgbouncer=pgbouncer)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()


def _one_line_naming_the_flag(result: subprocess.CompletedProcess, command: str) -> None:
    lines = result.stderr.splitlines()
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"pgqueue {command}: prepared statements failed"), lines[0]
    assert "--pgbouncer" in lines[0] and "PGQUEUE_PGBOUNCER=1" in lines[0], lines[0]
    assert "Traceback" not in result.stderr


def test_without_the_flag_a_command_fails_in_one_line_naming_it(via: str) -> None:
    assert pgqueue(via, "init", pgbouncer=True).returncode == 0
    # The first `stats` runs: it prepares its statements (as _pg3_0, _pg3_1) on the one
    # server connection it used, and PgBouncer keeps that connection for the next client.
    first = pgqueue(via, "stats", pgbouncer=False)
    assert first.returncode == 0, first.stderr
    # The next client names its first statement _pg3_0 too, on the same server connection.
    _one_line_naming_the_flag(pgqueue(via, "stats", pgbouncer=False), "stats")
    # With the flag nothing is prepared: it works on those server connections, every time.
    for _ in range(3):
        again = pgqueue(via, "stats", pgbouncer=True)
        assert again.returncode == 0, again.stderr
        assert "no jobs ready, running or dead" in again.stdout


def test_without_the_flag_a_worker_stops_with_one_line_naming_it(
    via: str, spawn: Callable[..., WorkerProcess]
) -> None:
    assert pgqueue(via, "init", pgbouncer=True).returncode == 0
    stdin = "".join(f'{{"n": {n}}}\n' for n in range(200))
    assert pgqueue(via, "enqueue", "q", pgbouncer=True, stdin=stdin).returncode == 0
    # Four lanes and a keeper: some statement soon meets a server connection where another
    # client's _pg3_0 is prepared. No retry can mend that: the worker stops.
    worker = spawn(via, "plain", "--concurrency", "4", "--batch", "10", "--burst", pgbouncer=False)
    code = worker.wait(30)
    err = worker.stderr()
    assert code == 1, err
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith("pgqueue worker: prepared statements failed"), err
    assert "--pgbouncer" in last and "PGQUEUE_PGBOUNCER=1" in last, last
    logged = [line for line in err.splitlines()[:-1] if "prepared statements failed" in line]
    assert 1 <= len(logged) <= 5, err  # said once, or once by each thread that met it; no loop


def test_init_upgrades_a_first_release_table_through_pgbouncer(via: str, empty_dsn: str) -> None:
    # The index builds run CONCURRENTLY, each a statement of its own outside a transaction
    # block: PgBouncer in transaction mode runs each on a server connection of its own.
    from test_install import FIRST_RELEASE

    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute(FIRST_RELEASE)
    init = pgqueue(via, "init", pgbouncer=True)
    assert init.returncode == 0, init.stderr
    assert "built jobs_ready_idx concurrently" in init.stdout
    assert "validated the status check" in init.stdout
    invalid = rows(empty_dsn, "SELECT count(*) FROM pg_index WHERE NOT indisvalid")
    assert invalid == [(0,)]
    # Nothing of the upgrade's session is left on a server connection another client gets.
    advisory = rows(empty_dsn, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")
    assert advisory == [(0,)]
    again = pgqueue(via, "init", pgbouncer=True)
    assert again.stdout.strip() == "jobs table ready", again.stderr


def test_a_queue_on_your_own_connection_never_prepares_with_the_flag(via: str) -> None:
    with Queue(via, pgbouncer=True) as q:
        q.install()
        job = q.enqueue({"n": 1})
    # Two connections of the caller's own (psycopg prepares a query on its 5th run by
    # default), each behind a Queue told it talks to PgBouncer: nothing may be prepared.
    with psycopg.connect(via, autocommit=True) as a, psycopg.connect(via, autocommit=True) as b:
        queues = [Queue(a, pgbouncer=True), Queue(b, pgbouncer=True)]
        for _ in range(10):
            for q in queues:
                assert q.get(job) is not None
        for conn in (a, b):
            prepared = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
            assert prepared == (0,)


def test_an_async_queue_on_your_own_connection_never_prepares_with_the_flag(via: str) -> None:
    from pgqueue.async_queue import AsyncQueue

    with Queue(via, pgbouncer=True) as q:
        q.install()
        job = q.enqueue({"n": 1})

    async def run() -> None:
        async with (
            await psycopg.AsyncConnection.connect(via, autocommit=True) as a,
            await psycopg.AsyncConnection.connect(via, autocommit=True) as b,
        ):
            queues = [AsyncQueue(a, pgbouncer=True), AsyncQueue(b, pgbouncer=True)]
            for _ in range(10):
                for q in queues:
                    assert await q.get(job) is not None

    asyncio.run(run())


def test_through_a_pool_of_three_every_job_is_done_once(
    via: str, empty_dsn: str, spawn: Callable[..., WorkerProcess]
) -> None:
    jobs = 5_000
    init = pgqueue(via, "init", pgbouncer=True)
    assert init.returncode == 0, init.stderr
    # Over COPY_FROM payloads enqueue_many reserves the ids, then COPYs: two statements,
    # each its own transaction, so each may use another server connection.
    stdin = "".join(f'{{"n": {n}}}\n' for n in range(jobs))
    enqueued = pgqueue(via, "enqueue", "q", pgbouncer=True, stdin=stdin)
    assert enqueued.returncode == 0, enqueued.stderr
    assert f"enqueued {jobs} job(s)" in enqueued.stdout
    # The test's own direct sessions carry a name of their own, so the count below can leave
    # them out: a backend lingers in pg_stat_activity a moment after its client has gone.
    direct = make_conninfo(empty_dsn, application_name="pgqueue test direct")
    assert rows(direct, "SELECT count(*) FROM jobs WHERE status = 'ready'") == [(jobs,)]

    # Watch the server side: PgBouncer must never open more than POOL server connections
    # to this database, however many clients the workers open. Only client backends are
    # connections: an autovacuum worker on the freshly written jobs table is listed with
    # the database too (no application name, state active), and it is no one's connection.
    dbname = conninfo_to_dict(empty_dsn)["dbname"]
    peak: list[Any] = [0, []]
    watching = threading.Event()
    sessions = (
        "SELECT pid, application_name, state FROM pg_stat_activity WHERE datname = %s "
        "AND backend_type = 'client backend' AND application_name <> 'pgqueue test direct'"
    )

    def watch() -> None:
        with psycopg.connect(make_conninfo(empty_dsn, dbname="postgres"), autocommit=True) as c:
            while not watching.is_set():
                seen = c.execute(sessions, (dbname,)).fetchall()
                if len(seen) > peak[0]:
                    peak[:] = [len(seen), seen]
                time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    options = ("--concurrency", "4", "--batch", "10", "--burst")
    workers = [spawn(via, f"w{i}", *options, pgbouncer=True) for i in (1, 2)]
    try:
        codes = [w.wait(120) for w in workers]
    finally:
        watching.set()
        watcher.join(10)
    for worker, code in zip(workers, codes, strict=True):
        assert code == 0, worker.stderr()

    assert 0 < peak[0] <= POOL, peak[1]
    # Every job claimed once (each claim raises attempts and fence) and completed.
    outcome = "SELECT status, attempts, fence, count(*) FROM jobs GROUP BY 1, 2, 3"
    assert rows(empty_dsn, outcome) == [("done", 1, 1, jobs)]
    done = [int(re.search(r": (\d+) done", w.stdout()).group(1)) for w in workers]  # type: ignore[union-attr]
    assert sum(done) == jobs, [w.stdout() for w in workers]
    for worker in workers:
        err = worker.stderr()
        assert "Traceback" not in err and "prepared" not in err, err
        # One warning: no LISTEN through PgBouncer, polling instead.
        assert err.count(WARNING) == 1, err
        assert "polling every 2s instead" in err, err


def test_listen_dsn_wakes_a_worker_behind_pgbouncer(
    via: str, empty_dsn: str, spawn: Callable[..., WorkerProcess]
) -> None:
    assert pgqueue(via, "init", pgbouncer=True).returncode == 0
    poll = 30.0  # so a wake-up within WAKE s is (almost surely) NOTIFY's, not a poll's
    worker = spawn(via, "listener", "--poll", str(poll), "--listen-dsn", empty_dsn, pgbouncer=True)
    # The LISTEN runs on the direct connection: the server shows it as that session's query.
    listening = (
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pgqueue worker "
        "listener' AND query = 'LISTEN pgqueue'"
    )
    wait_for(lambda: rows(empty_dsn, listening) == [(1,)], 30, "the worker's LISTEN")
    time.sleep(1.0)  # the lane's first claim (empty) is over: it now waits for a wake-up
    # Well within the poll: after one poll the next is 30 s away, so three jobs in a row
    # each started within WAKE s were woken by NOTIFY (WAKE leaves room for a loaded CI).
    wake = poll / 3
    with Queue(via, pgbouncer=True) as q:
        for n in range(3):
            job = q.enqueue({"n": n}, queue="q")
            state = wait_for(
                lambda job=job: (s := q.get(job)) is not None and s.status == "done" and s,
                poll / 2,
                f"job {job} to be done",
            )
            waited = (state.started_at - state.run_at).total_seconds()
            assert waited < wake, f"job {job} started {waited:.2f} s after it was enqueued"
            time.sleep(0.3)
    assert worker.stop() == 0
    assert WARNING not in worker.stderr()
    assert "Traceback" not in worker.stderr()
