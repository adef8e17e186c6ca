"""Real ``pgqueue worker`` processes running an ``async def`` handler (so the AsyncWorker)
under real faults: SIGKILL mid-job, SIGSTOP past the lease, ``pg_terminate_backend`` of
the worker's sessions, a restart of the PostgreSQL server, and a short chaos run with
threaded and async workers side by side. The handlers module is written to tmp_path."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from conftest import rows
from pgqueue import EmbeddedServer, Queue
from pgqueue.tools import chaos
from tests.handlers import SIDE_TABLES

PGQUEUE = str(Path(sys.executable).parent / "pgqueue")

pytestmark = pytest.mark.slow

# The async twins of tests/handlers.py's ``sleep`` and ``report``.
HANDLERS = '''
import asyncio
import os


def _seconds(job):
    first = float(job.payload.get("first_sleep", 0.0)) if job.attempts == 1 else 0.0
    return float(job.payload.get("sleep", 0.0)) + first


async def sleep(job):
    """Await payload["sleep"] (+ first_sleep on attempt 1) seconds, then complete."""
    await asyncio.sleep(_seconds(job))


_running = 0
_most = 0


async def overlap(job):
    """Like sleep; then write to the file ``most`` how many ran at once at the most."""
    global _running, _most
    _running += 1
    _most = max(_most, _running)
    try:
        await asyncio.sleep(_seconds(job))
    finally:
        _running -= 1
    with open("most", "w") as out:
        out.write(str(_most))


async def report(job):
    """Await, then write reports with the job's fence and log whether it was accepted."""
    if "started" in job.payload:
        open(job.payload["started"], "a").close()
    await asyncio.sleep(_seconds(job))
    report_id = int(job.payload.get("report", job.id))
    body = f"pid {os.getpid()} fence {job.fence}"
    accepted = await job.fenced_write("reports", {"id": report_id}, {"body": body})
    conn = await job.connection()
    await conn.execute(
        "INSERT INTO report_log (job_id, fence, pid, accepted) VALUES (%s, %s, %s, %s)",
        (job.id, job.fence, os.getpid(), accepted),
    )
'''


class WorkerProcess:
    """One ``pgqueue worker ahandlers:NAME`` subprocess, output kept in files."""

    def __init__(self, dsn: str, handler: str, name: str, where: Path, *options: str) -> None:
        self.name = name
        self.out = where / f"{name}.out"
        self.err = where / f"{name}.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [PGQUEUE, "--dsn", dsn, "worker", f"ahandlers:{handler}", "--name", name,
                 "--queue", "q", *options],
                cwd=where,
                stdout=out,
                stderr=err,
                env={k: v for k, v in os.environ.items() if k != "PGQUEUE_DSN"},
            )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM (a graceful stop) and wait for the exit code."""
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
        self.proc.wait(10)

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()


Spawn = Callable[..., WorkerProcess]


@pytest.fixture
def spawn_on(tmp_path: Path) -> Iterator[Callable[[str], Spawn]]:
    """Start async worker processes on a database; every one is killed afterwards."""
    (tmp_path / "ahandlers.py").write_text(HANDLERS)
    started: list[WorkerProcess] = []

    def on(dsn: str) -> Spawn:
        def start(handler: str, name: str, *options: str) -> WorkerProcess:
            worker = WorkerProcess(dsn, handler, name, tmp_path, *options)
            started.append(worker)
            return worker

        return start

    yield on
    for worker in started:
        worker.kill()


def wait_for(
    check: Callable[[], Any], timeout: float = 30.0, what: str = "", *workers: WorkerProcess
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.05)
    logs = "\n".join(f"--- {w.name}:\n{w.stderr()[-2000:]}" for w in workers)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{logs}")


def job_state(dsn: str) -> list[tuple]:
    return rows(dsn, "SELECT status, fence FROM jobs")


FAST = ("--lease", "1", "--poll", "0.2", "--reap-interval", "0.3")


def test_the_cli_runs_an_async_def_handler_with_the_async_worker(
    dsn: str, spawn_on: Callable[[str], Spawn], tmp_path: Path
) -> None:
    with Queue(dsn) as q:
        q.enqueue_many([{"sleep": 0.2} for _ in range(40)], queue="q")
    a = spawn_on(dsn)("overlap", "A", "--burst", "-c", "40", "--batch", "10")
    assert a.proc.wait(60) == 0, a.stderr()
    # awaited at once, not one by one: at least a whole claimed batch ran together
    assert int((tmp_path / "most").read_text()) >= 10
    assert "40 handlers at once (asyncio)" in a.stderr()
    assert "A: 40 done, 0 failed attempts" in a.stdout()
    assert rows(dsn, "SELECT status, count(*) FROM jobs GROUP BY 1") == [("done", 40)]


def test_sigstopped_async_worker_late_writes_are_rejected(
    dsn: str, spawn_on: Callable[[str], Spawn], tmp_path: Path
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SIDE_TABLES)
    started = tmp_path / "handler-started"
    with Queue(dsn) as q:
        job_id = q.enqueue({"report": 1, "first_sleep": 2.5, "started": str(started)}, queue="q")
    spawn = spawn_on(dsn)

    a = spawn("report", "A", *FAST)
    wait_for(lambda: job_state(dsn) == [("running", 1)], 30, "A's claim", a)
    # Frozen between its claim and its handler, A would skip the job on waking (its lease
    # ran out) and write nothing late: wait until the handler has begun.
    wait_for(started.exists, 30, "A's handler to begin", a)
    a.signal(signal.SIGSTOP)  # frozen mid-handler: the whole loop, heartbeats included
    b = spawn("report", "B", *FAST)
    wait_for(lambda: job_state(dsn) == [("done", 2)], 30, "B finishing the job", a, b)
    a.signal(signal.SIGCONT)  # A's loop carries on as if no time had passed
    late = "SELECT fence, accepted, pid FROM report_log WHERE fence = 1"
    wait_for(lambda: rows(dsn, late), 30, "A's late fenced write", a)
    wait_for(lambda: "refused" in a.stderr(), 30, "A's late completion", a)
    assert a.terminate() == 0 and b.terminate() == 0

    assert rows(dsn, "SELECT status, fence, attempts FROM jobs") == [("done", 2, 2)]
    assert rows(dsn, "SELECT fence, accepted, pid FROM report_log ORDER BY fence") == [
        (1, False, a.pid),
        (2, True, b.pid),
    ]
    assert rows(dsn, "SELECT body, fence FROM reports") == [(f"pid {b.pid} fence 2", 2)]
    assert f"late complete of job {job_id} refused" in a.stderr()
    assert "A: 0 done, 0 failed attempts" in a.stdout()
    assert "1 late writes refused" in a.stdout()
    assert "B: 1 done, 0 failed attempts" in b.stdout()
    assert "Traceback" not in a.stderr() + b.stderr()


def test_sigkilled_async_worker_job_is_finished_by_another(
    dsn: str, spawn_on: Callable[[str], Spawn]
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SIDE_TABLES)
    with Queue(dsn) as q:
        q.enqueue({"report": 1, "first_sleep": 60}, queue="q")
    spawn = spawn_on(dsn)

    a = spawn("report", "A", *FAST)
    wait_for(lambda: job_state(dsn) == [("running", 1)], 30, "A's claim", a)
    a.signal(signal.SIGKILL)
    assert a.proc.wait(10) == -signal.SIGKILL
    b = spawn("report", "B", *FAST)
    wait_for(lambda: job_state(dsn) == [("done", 2)], 30, "B finishing the job", b)
    assert b.terminate() == 0

    assert rows(dsn, "SELECT fence, accepted, pid FROM report_log") == [(2, True, b.pid)]
    assert rows(dsn, "SELECT body, fence FROM reports") == [(f"pid {b.pid} fence 2", 2)]
    assert "B: 1 done" in b.stdout()


def _done(dsn: str) -> int:
    """How many jobs are done (-1 while the server is down)."""
    try:
        return rows(dsn, "SELECT count(*) FROM jobs WHERE status = 'done'")[0][0]
    except psycopg.OperationalError:
        return -1


def _terminate_sessions(dsn: str, name: str) -> int:
    return rows(
        dsn,
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE application_name = %s",
        [f"pgqueue worker {name}"],
    )[0][0]


def test_async_worker_whose_sessions_are_terminated_reconnects_and_finishes(
    dsn: str, spawn_on: Callable[[str], Spawn]
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SIDE_TABLES)
    total = 40
    with Queue(dsn) as q:
        q.enqueue_many([{"sleep": 0.15} for _ in range(total)], queue="q")  # report = job id
    a = spawn_on(dsn)("report", "A", "--lease", "3", "--poll", "0.2", "-c", "4", "--backoff", "0")
    ended = 0
    for step in (4, 12, 20):  # three times, mid-run: claims, writes, handlers' connections
        wait_for(lambda step=step: _done(dsn) >= step, 60, f"{step} jobs done", a)
        ended += _terminate_sessions(dsn, "A")
    assert ended >= 3
    wait_for(lambda: _done(dsn) == total, 90, "every job done after the cuts", a)
    assert a.terminate() == 0
    assert rows(dsn, "SELECT count(*) FROM jobs WHERE fence < attempts") == [(0,)]
    # every done job's report carries its final fence
    assert rows(
        dsn, "SELECT count(*) FROM jobs j JOIN reports r ON r.id = j.id WHERE r.fence = j.fence"
    ) == [(total,)]
    assert "Traceback" not in a.stderr()
    assert "reconnecting" in a.stderr() or "failed (" in a.stderr()


@pytest.fixture
def own_server() -> Iterator[EmbeddedServer]:
    """A server of this test's own, so its restart disturbs no other test."""
    home = Path(tempfile.mkdtemp(prefix="pgqueue-restart-"))
    home.chmod(0o755)  # as root, the server runs as another user that must reach it
    server = EmbeddedServer(home, durable=False)
    server.start()
    yield server
    server.stop()
    shutil.rmtree(home, ignore_errors=True)


def _listeners(dsn: str) -> int:
    return rows(
        dsn,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'pgqueue worker%' "
        "AND query = 'LISTEN pgqueue' AND datname = current_database()",
    )[0][0]


def test_server_restart_mid_run_loses_no_async_job_and_listen_resumes(
    own_server: EmbeddedServer, spawn_on: Callable[[str], Spawn]
) -> None:
    if os.environ.get("PGQUEUE_DSN"):
        pytest.skip("restarts only an embedded server of its own")
    with psycopg.connect(own_server.dsn(), autocommit=True) as conn:
        conn.execute("CREATE DATABASE restart")
    dsn = make_conninfo(own_server.dsn(), dbname="restart")
    total = 40
    with Queue(dsn) as q:
        q.install()
    poll = 60.0  # after the restart, only LISTEN (or a reconnect) can wake an idle worker
    options = ("--lease", "3", "--poll", str(poll), "--reap-interval", "0.5", "-c", "2")
    spawn = spawn_on(dsn)
    workers = [spawn("sleep", name, *options) for name in ("A", "B")]
    # Both at work before the jobs come and the restart: a worker still starting when the
    # server goes down fails fast and exits, and a late one could find the jobs all done.
    wait_for(lambda: _listeners(dsn) == 2, 60, "both workers LISTENing", *workers)
    with Queue(dsn) as q:
        q.enqueue_many([{"n": i, "sleep": 0.25} for i in range(total)], queue="q")
    wait_for(lambda: _done(dsn) >= 4, 60, "a few jobs done", *workers)
    own_server.restart()
    assert 0 <= _done(dsn) < total, "the restart came too late to be mid-run"

    wait_for(lambda: _done(dsn) == total, 60, "every job done after the restart", *workers)
    wait_for(lambda: _listeners(dsn) == 2, 30, "both workers LISTENing again", *workers)
    time.sleep(0.5)  # the workers are idle now, each waiting out a long poll
    with Queue(dsn) as q:
        late = q.enqueue({"after": "restart"}, queue="q")
    enqueued = time.monotonic()
    wait_for(
        lambda: rows(dsn, "SELECT status FROM jobs WHERE id = %s", [late]) == [("done",)],
        poll / 2,
        "the job enqueued after the restart",
        *workers,
    )
    assert time.monotonic() - enqueued < poll / 4  # woken by NOTIFY, not by the poll
    assert [w.terminate() for w in workers] == [0, 0]
    assert rows(dsn, "SELECT status, count(*) FROM jobs GROUP BY 1") == [("done", total + 1)]
    assert rows(dsn, "SELECT count(*) FROM jobs WHERE fence <> attempts") == [(0,)]
    assert all("Traceback" not in w.stderr() for w in workers)


@pytest.mark.timeout(240)
def test_chaos_run_with_threaded_and_async_workers_keeps_every_promise(tmp_path: Path) -> None:
    """The chaos run's checks, with every other worker an AsyncWorker: every job done or
    dead, fence >= attempts, results at their final fence, re-runs explained by faults."""
    lines: list[str] = []
    report = chaos.run(
        chaos.Config(seed=5, duration=30, workers=4, lease=2.0, log_dir=tmp_path, kind="mixed"),
        say=lines.append,
    )
    text = "\n".join([*lines, chaos.summary(report)])
    print(text)
    assert report.ok, text
    assert "2 threaded, 2 async" in lines[0]
    assert all(report.faults[kind] >= 1 for kind in chaos.KINDS), text
    assert report.extra_attempts <= report.bound
    logs = [p.read_text() for p in tmp_path.glob("*.log")]
    assert sum("at once (asyncio)" in log for log in logs) >= 2  # "1 handler at once"


def test_the_async_benchmark_runs_both_workers_and_finishes_every_job(admin_dsn: str) -> None:
    """A tiny ``pgqueue bench --only async``: sane rows, never timings."""
    from pgqueue.tools.bench import Bench
    from pgqueue.tools.bench.async_io import ASYNC_COLUMNS, IoConfig, bench_async

    small = Bench(admin_dsn, quick=True, repeats=1, progress=False)
    try:
        configs = (IoConfig("async", 20, 5), IoConfig("threads", 4, 2))
        rows = bench_async(small, n_jobs=60, io_ms=5, configs=configs)
    finally:
        small.cleanup()
    assert [r["system"] for r in rows] == ["async", "threads"]
    for row in rows:  # drain_io_once itself checks that every job ended done
        assert set(ASYNC_COLUMNS) <= set(row) and row["runs"] == 1 and row["n_jobs"] == 60
        assert row["jobs_per_s_median"] > 0 and row["peak_rss_mb_median"] >= row["baseline_rss_mb"]
    assert rows[0]["connections_peak"] <= 4  # claims, writes, keeper: no handler holds one
