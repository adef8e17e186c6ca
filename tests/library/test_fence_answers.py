"""Every answer a fence gives is true (issue #29): the edges where a write used to be told
wrongly (a missing row taken for a lost claim, a ``dict_row`` connection read as a stored
step, a handler's client settings leaking into the next job, a step that starved its own
heartbeats, a burst run that left a crashed worker's job running, a backslash-u0000 taken
for a NUL, metrics on every interface) and the suspicions settled beside them. Each test
fails on the code before its fix; all run against the real server."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from conftest import rows, wait_for
from pgqueue import AsyncJob, AsyncQueue, AsyncWorker, BadInput, Job, LeaseLost, Queue, Worker
from tests.library.test_queue import execute, expire

FAST = {"poll_interval": 0.05, "reap_interval": 0.2, "backoff": 0}
REPORTS = "CREATE TABLE reports (id int PRIMARY KEY, job_id bigint, fence bigint, body text)"


def statuses(dsn: str) -> list[tuple[str, int]]:
    return rows(dsn, "SELECT status, attempts FROM jobs ORDER BY id")


# -- 1. a missing row under a held claim is not a lost claim -------------------------------
def test_an_update_of_a_row_not_there_yet_is_refused_without_losing_the_claim(
    queue: Queue, dsn: str
) -> None:
    execute(dsn, REPORTS)
    queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    assert job.fenced_write("reports", {"id": 1}, {"body": "x"}, upsert=False) is False
    assert not job.lost  # the claim holds: nothing was there to update
    assert queue.heartbeat(job) and queue.complete(job)
    assert rows(dsn, "SELECT count(*) FROM reports") == [(0,)]


def test_an_async_update_of_a_row_not_there_yet_is_refused_without_losing_the_claim(
    queue: Queue, dsn: str
) -> None:
    execute(dsn, REPORTS)
    queue.enqueue({}, queue="q")

    async def main() -> tuple[bool, bool, bool]:
        async with AsyncQueue(dsn) as q:
            [job] = await q.claim("q")
            wrote = await job.fenced_write("reports", {"id": 1}, {"body": "x"}, upsert=False)
            return wrote, job.lost, await q.complete(job)

    assert asyncio.run(main()) == (False, False, True)


def test_a_worker_whose_handler_updates_a_missing_row_runs_its_job_once(
    queue: Queue, dsn: str
) -> None:
    """Before: the job was marked lost, its heartbeats stopped, the reaper handed it to the
    other lane while the handler still ran, and every completion was refused."""
    execute(dsn, REPORTS)
    queue.enqueue({}, queue="q")
    answers: list[bool] = []

    def handler(job: Job) -> None:
        answers.append(job.fenced_write("reports", {"id": 1}, {"body": "x"}, upsert=False))
        time.sleep(2.5)  # past the lease: only heartbeats keep the job
        job.raise_if_lost()

    worker = Worker(handler, queue="q", dsn=dsn, concurrency=2, lease=1, **FAST).start()
    try:
        wait_for(lambda: worker.done + worker.failed >= 1, what="the job ended")
    finally:
        worker.stop(grace=5)
    assert answers == [False]
    assert statuses(dsn) == [("done", 1)]


# -- 2. pgqueue's own statements read their replies whatever the row factory ---------------
def test_a_stale_holders_step_on_a_dict_row_connection_is_refused(queue: Queue, dsn: str) -> None:
    """Before: ``held, stored = row`` unpacked the dict's keys, both truthy: the stale holder
    was told its step was stored, and nothing was."""
    [job_id] = [queue.enqueue({}, queue="q")]
    [job] = queue.claim("q")
    assert Queue(dsn).cancel(job_id)
    job.conn = psycopg.connect(dsn, autocommit=True, row_factory=dict_row)
    with pytest.raises(LeaseLost):
        job.step("charge", lambda: 1)
    assert job.lost
    assert rows(dsn, "SELECT count(*) FROM pgqueue_steps") == [(0,)]


def test_steps_writes_and_transactions_answer_the_same_on_a_dict_row_connection(
    queue: Queue, dsn: str
) -> None:
    execute(dsn, REPORTS)
    other = queue.enqueue({}, queue="q")
    queue.enqueue({}, queue="q")
    [first, job] = queue.claim("q", limit=2)
    assert first.id == other
    assert first.fenced_write("reports", {"id": 2}, {"body": "theirs"})
    job.conn = psycopg.connect(dsn, autocommit=True, row_factory=dict_row)
    assert job.step("charge", lambda: [1, 2]) == [1, 2]
    assert job.step("charge", lambda: 0) == [1, 2]  # stored earlier: read back, not KeyError
    assert job.fenced_write("reports", {"id": 1}, {"body": "mine"})
    from pgqueue import FenceConflict

    with pytest.raises(FenceConflict):  # another job's row: not read as a stale fence
        job.fenced_write("reports", {"id": 2}, {"body": "mine"})
    with job.transaction() as conn:
        conn.execute("UPDATE reports SET body = 'in tx' WHERE id = 1")
    assert not job.lost
    mine = Queue(psycopg.connect(dsn, autocommit=True, row_factory=dict_row))
    state = mine.get(job.id)
    assert state is not None and state.status == "running" and state.fence == job.fence
    assert mine.complete(job)


def test_an_async_stale_step_on_a_dict_row_connection_is_refused(queue: Queue, dsn: str) -> None:
    job_id = queue.enqueue({}, queue="q")

    async def main() -> tuple[bool, int]:
        async with AsyncQueue(dsn) as q:
            [job] = await q.claim("q")
            assert queue.cancel(job_id)
            job.conn = await psycopg.AsyncConnection.connect(
                dsn, autocommit=True, row_factory=dict_row
            )
            try:
                with pytest.raises(LeaseLost):
                    await job.step("charge", lambda: 1)
            finally:
                await job.conn.close()
            return job.lost, rows(dsn, "SELECT count(*) FROM pgqueue_steps")[0][0]

    assert asyncio.run(main()) == (True, 0)


# -- 3. a handler's client settings do not leak into the next job -------------------------
def test_a_handlers_client_settings_do_not_reach_the_next_job_on_its_lane(
    queue: Queue, dsn: str
) -> None:
    """Before: job a left ``read_only`` on; job b's transaction failed with
    ReadOnlySqlTransaction and went dead."""
    execute(dsn, "CREATE TABLE notes (job_id bigint PRIMARY KEY)")
    queue.enqueue({"n": "a"}, queue="q")
    queue.enqueue({"n": "b"}, queue="q")
    seen: list[tuple[Any, ...]] = []

    def handler(job: Job) -> None:
        conn = job.conn
        assert conn is not None
        if job.payload["n"] == "a":
            conn.read_only = True
            conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
            conn.deferrable = True
            conn.row_factory = dict_row  # type: ignore[assignment]
            return
        seen.append((conn.read_only, conn.isolation_level, conn.deferrable))
        with job.transaction() as tx:
            tx.execute("INSERT INTO notes VALUES (%s)", [job.id])
            seen.append(tx.execute("SELECT 1 AS one").fetchone())

    worker = Worker(handler, queue="q", dsn=dsn, concurrency=1, batch=1, **FAST).start()
    try:
        wait_for(lambda: worker.done + worker.failed >= 2, what="both jobs ended")
    finally:
        worker.stop(grace=2)
    assert statuses(dsn) == [("done", 1), ("done", 1)]
    assert seen[0] == (None, None, None)
    assert seen[1] == (1,)  # a tuple again, not a dict


def test_an_async_handlers_client_settings_do_not_reach_the_next_job(
    queue: Queue, dsn: str
) -> None:
    execute(dsn, "CREATE TABLE notes (job_id bigint PRIMARY KEY)")
    queue.enqueue({"n": "a"}, queue="q")
    queue.enqueue({"n": "b"}, queue="q")

    async def handler(job: AsyncJob) -> None:
        conn = await job.connection()
        if job.payload["n"] == "a":
            await conn.set_read_only(True)
            conn.row_factory = dict_row  # type: ignore[assignment]
            return
        async with job.transaction() as tx:
            await tx.execute("INSERT INTO notes VALUES (%s)", [job.id])
            row = await (await tx.execute("SELECT 1")).fetchone()
            assert row == (1,), row

    async def main() -> None:
        w = await AsyncWorker(handler, queue="q", dsn=dsn, connections=1, **FAST).start()
        for _ in range(400):
            if w.done + w.failed >= 2:
                break
            await asyncio.sleep(0.05)
        await w.stop(grace=2)

    asyncio.run(main())
    assert statuses(dsn) == [("done", 1), ("done", 1)]


def test_session_authorization_and_a_handlers_prepare_do_not_survive_its_job(
    queue: Queue, dsn: str
) -> None:
    """RESET ALL undoes neither SET SESSION AUTHORIZATION nor a PREPARE of the handler's."""
    role = f"pgq_other_{uuid.uuid4().hex[:8]}"
    execute(dsn, f'CREATE ROLE "{role}"')
    try:
        queue.enqueue({"n": "a"}, queue="q")
        queue.enqueue({"n": "b"}, queue="q")
        seen: list[tuple[Any, ...]] = []

        def handler(job: Job) -> None:
            conn = job.conn
            assert conn is not None
            if job.payload["n"] == "a":
                conn.execute(f'SET SESSION AUTHORIZATION "{role}"')
                conn.execute("PREPARE mine AS SELECT 1")
                return
            seen.append(conn.execute("SELECT session_user = current_user").fetchone())
            seen.append(conn.execute("SELECT session_user::text").fetchone())
            seen.append(
                conn.execute(
                    "SELECT count(*) FROM pg_prepared_statements WHERE from_sql"
                ).fetchone()
            )

        worker = Worker(handler, queue="q", dsn=dsn, concurrency=1, **FAST).start()
        try:
            wait_for(lambda: worker.done + worker.failed >= 2, what="both jobs ended")
        finally:
            worker.stop(grace=2)
        assert statuses(dsn) == [("done", 1), ("done", 1)]
        assert seen[1] != (role,)
        assert seen[2] == (0,)
    finally:
        execute(dsn, f'DROP ROLE IF EXISTS "{role}"')


# -- 4. a step inside job.transaction() does not starve the job's heartbeats --------------
def test_a_step_inside_job_transaction_longer_than_the_lease_keeps_its_claim(
    queue: Queue, dsn: str
) -> None:
    """Before: the step's FOR SHARE lock lasted to COMMIT, every heartbeat skipped the row,
    and the claim was over at commit: every attempt, until dead."""
    execute(dsn, "CREATE TABLE notes (job_id bigint PRIMARY KEY)")
    queue.enqueue({}, queue="q", max_attempts=2)

    def handler(job: Job) -> None:
        with job.transaction() as conn:
            job.step("charge", lambda: "ok")
            conn.execute("INSERT INTO notes VALUES (%s)", [job.id])
            time.sleep(2.5)  # past the lease: only heartbeats keep the job

    worker = Worker(handler, queue="q", dsn=dsn, lease=1, **FAST).start()
    try:
        wait_for(lambda: worker.done + worker.dead >= 1, what="the job ended")
    finally:
        worker.stop(grace=5)
    assert statuses(dsn) == [("done", 1)]
    assert rows(dsn, "SELECT count(*) FROM notes") == [(1,)]
    assert rows(dsn, "SELECT name FROM pgqueue_steps") == [("charge",)]


def test_a_step_in_a_transaction_that_commits_after_the_claim_ended_stores_nothing(
    queue: Queue, dsn: str
) -> None:
    """The step inside job.transaction() takes no lock of its own now: the commit's check
    holds the claim. A cancel between the step and the commit refuses the whole block."""
    job_id = queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    job.conn = psycopg.connect(dsn, autocommit=True)
    with pytest.raises(LeaseLost), job.transaction():
        job.step("charge", lambda: 1)
        assert Queue(dsn).cancel(job_id)  # does not wait for the step: no lock held
    assert rows(dsn, "SELECT count(*) FROM pgqueue_steps") == [(0,)]


def test_a_handler_hung_in_job_transaction_after_a_step_is_failed_at_its_timeout(
    queue: Queue, dsn: str
) -> None:
    """Invariant 7 for the suspicion of #29: the timed-out job leaves 'running' while the
    handler's thread still hangs inside its transaction."""
    queue.enqueue({}, queue="q", max_attempts=1)
    release = threading.Event()

    def handler(job: Job) -> None:
        with job.transaction():
            job.step("charge", lambda: 1)
            release.wait(30)

    worker = Worker(handler, queue="q", dsn=dsn, lease=5, timeout=1, **FAST).start()
    try:
        wait_for(lambda: statuses(dsn)[0][1] == 1, what="the job claimed")
        wait_for(lambda: statuses(dsn)[0][0] != "running", what="the job left running")
        assert statuses(dsn) == [("dead", 1)]
        assert not release.is_set()  # the handler was still inside its transaction
    finally:
        release.set()
        worker.stop(grace=5)
    assert rows(dsn, "SELECT count(*) FROM pgqueue_steps") == [(0,)]


# -- 5. a burst run reaps before it calls the queue dry -----------------------------------
def test_a_burst_run_returns_a_crashed_workers_expired_job_and_runs_it(
    queue: Queue, dsn: str
) -> None:
    job_id = queue.enqueue({}, queue="q")
    [crashed] = Queue(dsn).claim("q", lease=1)  # a worker that died holding it
    expire(dsn, job_id)
    ran: list[int] = []
    worker = Worker(lambda job: ran.append(job.fence), queue="q", dsn=dsn, burst=True,
                    reap_interval=600, poll_interval=0.05)  # fmt: skip
    worker.run()
    assert ran == [crashed.fence + 1]
    assert statuses(dsn) == [("done", 2)]


# -- 8. only a real NUL is refused --------------------------------------------------------
def test_text_with_a_backslash_before_u0000_is_stored_and_a_real_nul_refused(
    queue: Queue, dsn: str
) -> None:
    path = "C:\\u0000dir"  # a backslash, then the six characters u0000: valid text
    job_id = queue.enqueue({"path": path}, queue="q")
    [job] = queue.claim("q")
    assert job.payload == {"path": path}
    job.conn = psycopg.connect(dsn, autocommit=True)
    assert job.step("copy", lambda: path) == path
    assert queue.complete(job, {"path": path})
    assert Queue(dsn).result(job_id, timeout=5) == {"path": path}
    assert json.loads(json.dumps(path)) == path
    for bad in ("a\x00b", "\\\x00", "C:\\\\\x00"):
        with pytest.raises(BadInput, match="NUL"):
            queue.enqueue({"path": bad}, queue="q")


# -- 7. the metrics endpoint listens on loopback unless told ------------------------------
def test_metrics_listen_on_loopback_by_default_and_where_told(dsn: str) -> None:
    pytest.importorskip("prometheus_client")
    for given, bound in ((None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")):
        kw: dict[str, Any] = {} if given is None else {"metrics_addr": given}
        worker = Worker(lambda job: None, queue="q", dsn=dsn, metrics_port=0, **kw).start()
        try:
            metrics = worker.engine.metrics
            assert metrics is not None
            wait_for(lambda m=metrics: m.port != 0, what="metrics served")
            assert metrics.address == bound
            assert metrics.url.startswith(f"http://{bound}:")
            assert metrics._server is not None
            assert metrics._server.server_address[0] == bound
        finally:
            worker.stop(grace=1)


# -- suspicions --------------------------------------------------------------------------
def test_a_notification_that_arrives_during_a_statement_is_kept_for_notifies(dsn: str) -> None:
    """Queue.result reads the row, then waits on notifies(): a job's end notified while
    that SELECT ran must not be lost (psycopg >= 3.2.4 keeps such notifications)."""
    with (
        psycopg.connect(dsn, autocommit=True) as listener,
        psycopg.connect(dsn, autocommit=True) as sender,
    ):
        listener.execute("LISTEN pgqueue_done")
        timer = threading.Timer(0.2, lambda: sender.execute("NOTIFY pgqueue_done, '42'"))
        timer.start()
        listener.execute("SELECT pg_sleep(0.6)")  # the notification arrives meanwhile
        timer.join()
        heard = [n.payload for n in listener.notifies(timeout=0.5, stop_after=1)]
    assert heard == ["42"]


def test_a_fail_whose_reply_was_lost_is_never_counted_for_another_holders_identical_fail(
    queue: Queue, dsn: str
) -> None:
    """The engine reads the row back after a retried fail. Before, any higher fence with
    the same error text counted as this holder's fail taking effect, though here a reaper
    and another holder's identical fail made it; now that cannot be told (None), and only
    a state no other writer makes counts as taken."""
    from pgqueue.endings import _took_effect

    queue.enqueue({}, queue="q")
    [mine] = queue.claim("q")

    async def took() -> bool | None:
        async with AsyncQueue(dsn) as q:
            return await _took_effect(q, "fail", mine, "ValueError: boom")

    assert asyncio.run(took()) is False  # nothing happened yet
    expire(dsn, mine.id)
    assert [r.id for r in queue.reap()] == [mine.id]
    [theirs] = queue.claim("q")
    assert queue.fail(theirs, "ValueError: boom", backoff=0)
    assert asyncio.run(took()) is None  # the row moved on: not this holder's fail

    queue.enqueue({}, queue="r")
    [mine] = queue.claim("r")
    assert queue.fail(mine, "ValueError: boom", backoff=0)  # this one's own, reply "lost"
    assert asyncio.run(took()) is True
