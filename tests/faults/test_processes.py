"""Real ``pgqueue worker`` processes under real faults: SIGSTOP past the lease (the seed's
paused worker), SIGKILL mid-job, and a restart of the PostgreSQL server mid-run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conftest import rows
from pgqueue import EmbeddedServer, Queue
from tests.handlers import SIDE_TABLES

PGQUEUE = str(Path(sys.executable).parent / "pgqueue")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


class WorkerProcess:
    """One ``pgqueue worker`` subprocess, its output kept in files (no pipe to fill)."""

    def __init__(self, dsn: str, handler: str, name: str, logs: Path, *options: str) -> None:
        self.name = name
        self.out = logs / f"{name}.out"
        self.err = logs / f"{name}.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [PGQUEUE, "--dsn", dsn, "worker", f"tests.handlers:{handler}", "--name", name,
                 *options],
                cwd=ROOT,
                stdout=out,
                stderr=err,
                env={k: v for k, v in os.environ.items() if k != "PGQUEUE_DSN"},
            )  # fmt: skip

    @property
    def pid(self) -> int:
        """The worker process's id."""
        return self.proc.pid

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the worker process."""
        os.kill(self.pid, sig)

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM (a graceful stop) and wait for the exit code."""
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the worker if it still runs (cleanup), and reap it."""
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
        self.proc.wait(10)

    def stdout(self) -> str:
        """Everything the worker printed so far."""
        return self.out.read_text()

    def stderr(self) -> str:
        """Everything the worker logged so far."""
        return self.err.read_text()


Spawn = Callable[..., WorkerProcess]


@pytest.fixture
def spawn(dsn: str, tmp_path: Path) -> Iterator[Spawn]:
    """Start worker processes on this test's database; every one is killed afterwards."""
    started: list[WorkerProcess] = []

    def start(handler: str, name: str, *options: str) -> WorkerProcess:
        worker = WorkerProcess(dsn, handler, name, tmp_path, "--queue", "q", *options)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()


def wait_for(
    check: Callable[[], Any], timeout: float = 30.0, what: str = "", *workers: WorkerProcess
) -> Any:
    """Poll ``check`` until truthy; on timeout fail with the workers' stderr."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.05)
    logs = "\n".join(f"--- {w.name}:\n{w.stderr()[-2000:]}" for w in workers)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{logs}")


def job_state(dsn: str) -> list[tuple]:
    """(status, fence) of every job."""
    return rows(dsn, "SELECT status, fence FROM jobs")


def test_sigstopped_worker_late_writes_are_rejected(dsn: str, spawn: Spawn, tmp_path: Path) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SIDE_TABLES)
    started = tmp_path / "handler-started"
    with Queue(dsn) as q:
        job_id = q.enqueue({"report": 1, "first_sleep": 2.5, "started": str(started)}, queue="q")
    fast = ("--lease", "1", "--poll", "0.2", "--reap-interval", "0.3")

    a = spawn("report", "A", *fast)
    wait_for(lambda: job_state(dsn) == [("running", 1)], 30, "A's claim", a)
    # Frozen between its claim and its handler, A would skip the job on waking (its lease
    # ran out) and write nothing late: wait until the handler has begun.
    wait_for(started.exists, 30, "A's handler to begin", a)
    a.signal(signal.SIGSTOP)  # frozen mid-handler: no heartbeats, no writes
    b = spawn("report", "B", *fast)
    wait_for(lambda: job_state(dsn) == [("done", 2)], 30, "B finishing the job", a, b)
    a.signal(signal.SIGCONT)  # A carries on as if no time had passed
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
    assert "0 late writes refused" in b.stdout()
    assert "Traceback" not in a.stderr() + b.stderr()


def test_sigkilled_worker_job_is_finished_by_another(dsn: str, spawn: Spawn) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SIDE_TABLES)
    with Queue(dsn) as q:
        q.enqueue({"report": 1, "first_sleep": 60}, queue="q")
    fast = ("--lease", "1", "--poll", "0.2", "--reap-interval", "0.3")

    a = spawn("report", "A", *fast)
    wait_for(lambda: job_state(dsn) == [("running", 1)], 30, "A's claim", a)
    a.signal(signal.SIGKILL)
    assert a.proc.wait(10) == -signal.SIGKILL
    b = spawn("report", "B", *fast)
    wait_for(lambda: job_state(dsn) == [("done", 2)], 30, "B finishing the job", b)
    assert b.terminate() == 0

    assert rows(dsn, "SELECT fence, accepted, pid FROM report_log") == [(2, True, b.pid)]
    assert rows(dsn, "SELECT body, fence FROM reports") == [(f"pid {b.pid} fence 2", 2)]
    assert "B: 1 done" in b.stdout()


def _listeners(dsn: str) -> int:
    """How many worker sessions issued LISTEN on this database."""
    return rows(
        dsn,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'pgqueue worker%' "
        "AND query = 'LISTEN pgqueue' AND datname = current_database()",
    )[0][0]


def _done(dsn: str) -> int:
    """How many jobs are done (-1 while the server is down)."""
    try:
        return rows(dsn, "SELECT count(*) FROM jobs WHERE status = 'done'")[0][0]
    except psycopg.OperationalError:  # the server is restarting
        return -1


def test_server_restart_mid_run_loses_no_job_and_listen_resumes(
    dsn: str, spawn: Spawn, server: EmbeddedServer | None
) -> None:
    if server is None:
        pytest.skip("restarts only the embedded test server, not the one PGQUEUE_DSN names")
    total = 40
    poll = 60.0  # after the restart, only LISTEN (or a reconnect) can wake an idle worker
    options = ("--lease", "3", "--poll", str(poll), "--reap-interval", "0.5", "-c", "2")
    workers = [spawn("sleep", name, *options) for name in ("A", "B")]
    # Both at work before the jobs come and the restart: a worker still starting when the
    # server goes down fails fast and exits, and a late one could find the jobs all done.
    wait_for(lambda: _listeners(dsn) == 2, 60, "both workers LISTENing", *workers)
    with Queue(dsn) as q:
        q.enqueue_many([{"n": i, "sleep": 0.25} for i in range(total)], queue="q")
    wait_for(lambda: _done(dsn) >= 4, 60, "a few jobs done", *workers)
    server.restart()
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
