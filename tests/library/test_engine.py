"""The one engine under Worker and AsyncWorker, against a real PostgreSQL: handlers never
touch the engine's connections (and get theirs reset between jobs), heartbeats never
wait behind a locked row, and a stop gives back unstarted jobs at once and is bounded
when the database cannot be reached. Each test is a defect the two old workers had."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from conftest import rows, wait_for
from pgqueue import AsyncJob, AsyncWorker, Job, NotInstalled, Queue, Worker


def statuses(dsn: str) -> dict[str, int]:
    return dict(rows(dsn, "SELECT status, count(*) FROM jobs GROUP BY status"))


FAST = {"lease": 2.0, "poll_interval": 0.05, "reap_interval": 0.2, "backoff": 0}


def run_async(handler: Any, dsn: str, jobs: int, grace: float = 2) -> AsyncWorker:
    """Run an AsyncWorker with one connection to lend until ``jobs`` jobs ended, then stop."""

    async def main() -> AsyncWorker:
        w = await AsyncWorker(handler, queue="q", dsn=dsn, connections=1, **FAST).start()
        for _ in range(400):
            if w.done + w.failed >= jobs:
                break
            await asyncio.sleep(0.05)
        await w.stop(grace=grace)
        return w

    return asyncio.run(main())


# -- handlers get connections of their own, reset between jobs -----------------------------
def test_a_handler_that_turns_autocommit_off_harms_no_other_job(queue: Queue, dsn: str) -> None:
    """Its lane's connection is replaced; the claims, on the engine's own connection, go
    on. (The old Worker lent its claim connection: the next job ran 1,336 times in 4 s
    with attempts stuck at 0, and a job whose completion was rolled back counted done.)"""
    ids = queue.enqueue_many([{"n": n} for n in range(3)], queue="q")
    runs: list[int] = []

    def handler(job: Job) -> None:
        runs.append(job.id)
        if job.payload["n"] == 0:
            assert job.conn is not None
            job.conn.autocommit = False

    worker = Worker(handler, queue="q", dsn=dsn, **FAST).start()
    try:
        wait_for(lambda: worker.done == 3, what="three jobs done")
    finally:
        worker.stop(grace=2)
    assert sorted(runs) == sorted(ids)  # each ran once
    assert rows(dsn, "SELECT status, attempts FROM jobs ORDER BY id") == [("done", 1)] * 3


def test_a_handler_that_changes_search_path_stops_nothing_and_is_reset(
    queue: Queue, dsn: str
) -> None:
    """The old Worker's next claim met "the jobs table does not exist" and the whole worker
    stopped. Now the handler's session state is reset before the next job gets it."""
    queue.enqueue_many([{"n": n} for n in range(3)], queue="q")
    seen: list[str] = []

    def handler(job: Job) -> None:
        assert job.conn is not None
        seen.append(job.conn.execute("SHOW search_path").fetchone()[0])  # type: ignore[index]
        job.conn.execute("SET search_path TO nowhere")

    worker = Worker(handler, queue="q", dsn=dsn, **FAST).start()
    try:
        wait_for(lambda: worker.done == 3, what="three jobs done")
    finally:
        worker.stop(grace=2)
    assert worker.error is None
    assert "nowhere" not in seen and len(seen) == 3


def test_an_async_handler_that_turns_autocommit_off_harms_no_other_job(
    queue: Queue, dsn: str
) -> None:
    """A pooled connection used to keep what the last handler left: the next, innocent
    job failed and its accepted fenced write was rolled back."""
    queue.conn.execute(
        "CREATE TABLE side (id int PRIMARY KEY, body text, fence bigint, job_id bigint)"
    )
    first, second = queue.enqueue_many([{"n": 0}, {"n": 1}], queue="q")

    async def handler(job: AsyncJob) -> None:
        conn = await job.connection()
        if job.payload["n"] == 0:
            await conn.set_autocommit(False)
            return
        assert await job.fenced_write("side", {"id": 1}, {"body": "kept"})

    w = run_async(handler, dsn, jobs=2)
    assert rows(dsn, "SELECT id, status FROM jobs ORDER BY id") == [
        (first, "done"),
        (second, "done"),
    ]
    assert (w.done, w.failed) == (2, 0)
    assert rows(dsn, "SELECT body, job_id FROM side") == [("kept", second)]


def test_an_async_handler_that_replaces_job_conn_still_gives_its_lent_connection_back(
    queue: Queue, dsn: str
) -> None:
    """The engine gives back the connection it lent, not whatever the handler left in
    ``job.conn``: with one connection to lend, a handler that dropped the lent one from
    ``job.conn`` kept it lent for ever, and every later job waited for a connection."""
    queue.enqueue_many([{"n": n} for n in range(3)], queue="q")

    async def handler(job: AsyncJob) -> None:
        await (await job.connection()).execute("SELECT 1")
        job.conn = None  # the handler forgets it (or puts a connection of its own there)

    w = run_async(handler, dsn, jobs=3, grace=1)
    assert (w.done, w.failed) == (3, 0)
    assert statuses(dsn) == {"done": 3}


# -- heartbeats never wait behind a locked row ---------------------------------------------
def test_a_locked_expired_row_holds_up_no_heartbeat(queue: Queue, dsn: str) -> None:
    """Another session holds an expired job's row with FOR UPDATE. The reaper skips it
    (SKIP LOCKED) and the keeper goes on renewing: a healthy 3 s job under a 1.5 s lease
    runs once. (Before, heartbeats and the reaper shared a loop: no heartbeat went out in
    2.5 s and the job ran twice.)"""
    stuck = queue.enqueue({}, queue="other")
    queue.claim("other", lease=30)
    queue.conn.execute(
        "UPDATE jobs SET lease_until = now() - interval '1 s' WHERE id = %s", [stuck]
    )
    healthy = queue.enqueue({}, queue="q")
    runs: list[int] = []

    def handler(job: Job) -> None:
        runs.append(job.attempts)
        time.sleep(3)

    with psycopg.connect(dsn) as locker:  # a transaction left open, as in psql
        locker.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", [stuck])
        worker = Worker(
            handler, queue="q", dsn=dsn, lease=1.5, poll_interval=0.05, reap_interval=0.1
        )
        worker.start()
        try:
            wait_for(lambda: worker.done == 1, 30, "the healthy job done")
        finally:
            worker.stop(grace=2)
        assert rows(dsn, "SELECT status FROM jobs WHERE id = %s", [stuck]) == [("running",)]
    assert runs == [1]
    assert rows(dsn, "SELECT status, attempts FROM jobs WHERE id = %s", [healthy]) == [("done", 1)]
    assert worker.events.count("heartbeat") >= 4
    assert worker.events.count("lease-lost") == 0


def test_a_heartbeat_skips_a_held_row_locked_by_another_session_without_losing_it(
    queue: Queue, dsn: str
) -> None:
    """A row of our own that someone else has locked is neither renewed nor lost this
    round; the other rows are renewed in the same statement."""
    a, b = queue.enqueue_many([{}, {}], queue="q")
    jobs = {job.id: job for job in queue.claim("q", limit=2, lease=30)}
    with psycopg.connect(dsn) as locker:
        locker.execute("SELECT 1 FROM jobs WHERE id = %s FOR SHARE", [a])
        before = dict(rows(dsn, "SELECT id, lease_until FROM jobs"))
        with Queue(dsn) as other:
            lost = other.heartbeat_many(list(jobs.values()), lease=60)
        after = dict(rows(dsn, "SELECT id, lease_until FROM jobs"))
    assert lost == [] and not jobs[a].lost and not jobs[b].lost
    assert after[a] == before[a] and after[b] > before[b]


# -- a stop gives back unstarted jobs at once, and is bounded ------------------------------
def test_a_graceful_stop_gives_back_unstarted_jobs_while_a_sibling_outlives_the_grace(
    queue: Queue, dsn: str
) -> None:
    """A batch of three, one lane: the first job outlives the grace. The two behind it
    were never started: they go back at once, attempt and all (the old Worker left them
    behind the sibling; with max_attempts=1 all three went dead, and one had run)."""
    queue.enqueue_many([{"n": n} for n in range(3)], queue="q", max_attempts=1)
    started, release = threading.Event(), threading.Event()
    runs: list[int] = []

    def handler(job: Job) -> None:
        runs.append(job.payload["n"])
        started.set()
        release.wait(20)

    worker = Worker(handler, queue="q", dsn=dsn, batch=3, lease=30, poll_interval=0.05).start()
    try:
        assert started.wait(20)
        worker.stop(grace=0.5)
        assert rows(dsn, "SELECT payload->>'n', status, attempts FROM jobs ORDER BY id") == [
            ("0", "running", 1),  # still in its handler: its lease decides
            ("1", "ready", 0),
            ("2", "ready", 0),
        ]
        assert runs == [0]
    finally:
        release.set()


class _Proxy:
    """A TCP relay to the test server's socket that can be cut: bytes stop flowing both
    ways, as when the network to the database goes away (nothing refuses, nothing answers)."""

    def __init__(self, unix_path: str) -> None:
        self.unix_path = unix_path
        self.cut = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.socket(socket.AF_UNIX)
            server.connect(self.unix_path)
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if self.cut.is_set():
                    return  # swallowed: no answer, no error
                dst.sendall(data)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def proxied_dsn(dsn: str) -> Iterator[tuple[str, _Proxy]]:
    params = conninfo_to_dict(dsn)
    host = str(params.get("host", ""))
    if not host.startswith("/"):
        pytest.skip("needs the embedded server's unix socket")
    proxy = _Proxy(f"{host}/.s.PGSQL.{params.get('port', 5432)}")
    yield make_conninfo(dsn, host="127.0.0.1", port=str(proxy.port)), proxy
    proxy.close()


def test_a_stop_with_the_database_unreachable_is_bounded(
    queue: Queue, proxied_dsn: tuple[str, _Proxy]
) -> None:
    """One job finished, its completion buffered behind a slow sibling; then the network
    goes. A stop with a 0.5 s grace returns within the grace plus the engine's few seconds
    for its last writes, and the unfinished jobs are left to their leases (at-least-once).
    (The old AsyncWorker took 13 s: buffered completions were retried one by one.)"""
    dsn, proxy = proxied_dsn
    queue.enqueue_many([{"kind": "fast"}, {"kind": "slow"}], queue="q")
    slow_started = asyncio.Event()

    async def handler(job: AsyncJob) -> None:
        if job.payload["kind"] == "slow":
            slow_started.set()
            await asyncio.sleep(30)

    async def main() -> float:
        w = await AsyncWorker(
            handler,
            queue="q",
            dsn=dsn,
            batch=2,
            concurrency=2,
            lease=30,
            flush_after=60,
            listen=False,
        ).start()
        await asyncio.wait_for(slow_started.wait(), 20)
        for _ in range(200):
            if w.engine.ends.buffer:
                break
            await asyncio.sleep(0.05)
        proxy.cut.set()
        began = time.monotonic()
        await w.stop(grace=0.5)
        return time.monotonic() - began

    took = asyncio.run(main())
    # The bound under test is 0.5 s of grace + 3 s of last writes; 15 s leaves a loaded
    # machine room while still failing an unbounded stop (a cut costs 30 s per try).
    assert took < 15, f"stop took {took:.1f} s"
    assert statuses(queue_dsn(queue)) == {"running": 2}


def queue_dsn(queue: Queue) -> str:
    return queue.conn.info.dsn


# -- setup errors: one rule for both faces --------------------------------------------------
def test_a_dropped_table_stops_the_async_worker_too(queue: Queue, dsn: str) -> None:
    """A setting no retry can mend (the table is gone) is probed again on a fresh
    connection and then stops the worker; ``run()`` raises it (as Worker's does)."""

    async def handler(job: AsyncJob) -> None:
        pass

    async def main() -> None:
        w = AsyncWorker(handler, queue="q", dsn=dsn, poll_interval=0.05)

        async def drop() -> None:
            await asyncio.sleep(0.5)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("DROP TABLE jobs CASCADE")

        dropping = asyncio.create_task(drop())
        with pytest.raises(NotInstalled):
            await asyncio.wait_for(w.run(grace=1), 20)
        await dropping

    asyncio.run(main())


@pytest.mark.slow
@pytest.mark.parametrize("handler", ["tests.handlers:noop", "tests.handlers:async_noop"])
def test_a_sigterm_while_the_worker_starts_up_stops_it(dsn: str, handler: str) -> None:
    """Regression: a stop asked for while the engine was still starting (here: its probe of
    the table waits behind a lock) was dropped, and the worker then ran on for ever (seen
    in .ci/run: children of a killed supervisor that never ended). Threaded and asyncio."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "PGQUEUE_DSN"}
    with psycopg.connect(dsn) as lock:  # the worker's probe reads jobs: it waits here
        lock.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
        proc = subprocess.Popen(
            [sys.executable, "-m", "pgqueue", "--dsn", dsn, "worker", handler, "--queue", "q"],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            waiting = "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            wait_for(lambda: rows(dsn, waiting), what="the worker's probe to wait on the lock")
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)  # the signal is in before the engine has started
        finally:
            lock.rollback()  # the probe goes on; the engine starts, then must stop
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            raise AssertionError(f"the worker ran on after its SIGTERM\n{err}") from None
    assert proc.returncode == 0, err
    assert "stopping after the running handlers" in err


def test_an_async_task_waiting_for_a_slot_starts_when_a_plain_task_frees_it(
    queue: Queue, dsn: str
) -> None:
    """A mixed registry shares its slots: with one lane, an async job claimed beside a
    running plain one waits for the slot, and starts as soon as the plain job ends. (Before,
    nothing woke the async lane when a plain job ended: it slept its whole poll interval.)"""
    from pgqueue import Tasks

    tasks = Tasks(dsn)
    began = threading.Event()

    @tasks.task(queue="q")
    def plain_task(job: Job) -> None:
        began.set()
        time.sleep(0.2)

    @tasks.task(queue="q")
    async def async_task(job: AsyncJob) -> None:
        pass

    plain_task.enqueue()
    async_task.enqueue()
    tasks.close()

    class PlainFirst(Worker):
        def _after_claim(self, jobs: list[Job]) -> None:
            began.wait(10)  # the plain job holds the one slot before the async lane looks

    worker = PlainFirst(
        tasks, dsn=dsn, concurrency=1, batch=2, poll_interval=60, listen=False
    ).start()
    try:
        wait_for(lambda: worker.done == 2, what="both jobs done, long before the 60 s poll")
    finally:
        worker.stop(grace=2)
    assert statuses(dsn) == {"done": 2}


def test_an_idle_worker_keeps_no_pile_of_expired_waits(queue: Queue, dsn: str) -> None:
    """The dispatcher's bell forgets a wait its timer ended. (It kept every one until the
    next ring, and an idle worker hears none: one future a poll, for as long as it ran.)"""

    async def noop(job: AsyncJob) -> None:
        pass

    async def main() -> int:
        w = await AsyncWorker(noop, queue="idle", dsn=dsn, poll_interval=0.01, listen=False).start()
        try:
            await asyncio.sleep(1.0)  # about a hundred polls of an empty queue
            return len(w.engine._bell._waiters)
        finally:
            await w.stop(grace=1)

    assert asyncio.run(main()) <= 2  # the dispatcher's wait and run()'s, at most


@pytest.mark.parametrize("kind", ["plain", "async"])
def test_the_next_claim_overlaps_a_completion_on_its_way_and_the_worker_holds_at_most_twice(
    queue: Queue, dsn: str, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """One lane, batch 1: while job 1's completion is held up, job 2 is claimed and run
    (before, the claim waited for that statement: the engine ran in lock-step, claim, run,
    complete, and a no-op drain went at 0.76x a hand-written loop); but nothing more is
    claimed until the completion has gone out: a worker holds at most twice its cap of
    unfinished jobs (before, an async worker claimed on without a bound)."""
    from pgqueue.async_queue import AsyncQueue

    queue.enqueue_many([{"n": n} for n in range(4)], queue="q")
    gate, runs = threading.Event(), []
    real = AsyncQueue.complete_many

    async def held_up(self: AsyncQueue, jobs: Any, results: Any = None) -> Any:
        await asyncio.to_thread(gate.wait, 20)
        return await real(self, jobs, results)

    monkeypatch.setattr(AsyncQueue, "complete_many", held_up)

    def plain(job: Job) -> None:
        runs.append(job.payload["n"])

    async def coroutine(job: AsyncJob) -> None:
        runs.append(job.payload["n"])

    def running() -> int:
        return statuses(dsn).get("running", 0)

    options = {"queue": "q", "dsn": dsn, "concurrency": 1, "batch": 1, **FAST, "lease": 30.0}
    if kind == "plain":
        worker = Worker(plain, **options).start()
        try:
            wait_for(lambda: len(runs) == 2, what="job 2 run while job 1's completion waits")
            time.sleep(0.5)  # room for a wrong third claim to show
            assert (runs, running()) == ([0, 1], 2)
        finally:
            gate.set()
            wait_for(lambda: worker.done == 4, what="all four done once completions go out")
            worker.stop(grace=2)
    else:

        async def main() -> None:
            w = await AsyncWorker(coroutine, **options).start()
            try:
                for _ in range(400):
                    if len(runs) == 2:
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)
                assert (runs, await asyncio.to_thread(running)) == ([0, 1], 2)
            finally:
                gate.set()
                for _ in range(400):
                    if w.done == 4:
                        break
                    await asyncio.sleep(0.05)
                await w.stop(grace=2)

        asyncio.run(main())
    assert statuses(dsn) == {"done": 4}


def test_a_burst_run_does_not_end_on_a_claim_that_overlapped_a_retry(
    queue: Queue, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim may go out while a fail is on its way; a fail with no backoff that commits
    after the claim's snapshot makes the job runnable again, so that empty claim says
    nothing. (The burst run ended there, leaving the job ready: Django's worker test saw
    its last attempt missing.)"""
    from pgqueue.async_queue import AsyncQueue

    job_id = queue.enqueue({}, queue="q", max_attempts=2)
    real_claim, real_fail = AsyncQueue.claim, AsyncQueue.fail

    async def claim_then_dawdle(self: AsyncQueue, *args: Any, **kwargs: Any) -> Any:
        jobs = await real_claim(self, *args, **kwargs)
        await asyncio.sleep(0.5)  # its reply is read after the fail below committed
        return jobs

    async def slow_fail(self: AsyncQueue, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.2)  # committed after the claim's snapshot
        return await real_fail(self, *args, **kwargs)

    monkeypatch.setattr(AsyncQueue, "claim", claim_then_dawdle)
    monkeypatch.setattr(AsyncQueue, "fail", slow_fail)

    def fails(job: Job) -> None:
        raise ValueError("never works")

    Worker(fails, queue="q", dsn=dsn, burst=True, listen=False, backoff=0).run(grace=2)
    assert rows(dsn, "SELECT status, attempts FROM jobs WHERE id = %s", [job_id]) == [("dead", 2)]


def test_a_worker_that_may_hold_more_than_one_claim_takes_claims_at_most_that_much(
    queue: Queue, dsn: str
) -> None:
    """Four lanes of 5,000 may hold 20,000 jobs, but one claim takes at most 10,000 (its
    own limit): under a backlog the engine asked for 15,000, was refused, and retried for
    ever with the last job never claimed."""
    queue.enqueue_many([{}] * 5_001, queue="q")
    worker = Worker(lambda job: None, queue="q", dsn=dsn, concurrency=4, batch=5_000).start()
    try:
        wait_for(lambda: worker.done == 5_001, timeout=60, what="every job done")
    finally:
        worker.stop(grace=5)
    assert statuses(dsn) == {"done": 5_001}
