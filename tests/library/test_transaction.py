"""``job.transaction()``: a handler's own transaction held to its commit (DESIGN.md
invariant 9), against a real PostgreSQL, with the handler and the other session on real
threads.

The claim is checked as the transaction's last statement and the job row locked FOR SHARE
until COMMIT. So of a handler's write and a cancel (fail, reap) from another session, never
both "the claim ended first" and "the write committed": a claim that ended before the
commit rolls the write back (``LeaseLost``), and an end that comes after the check waits
for the commit. To hold a transaction between its check and its COMMIT, the ``receipts``
table has a deferred constraint trigger: it runs at COMMIT, after every statement of the
transaction, and waits there for an advisory lock that the test holds.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from pgqueue import AsyncJob, AsyncQueue, BadInput, Job, LeaseLost, PgQueueError, Queue

RECEIPTS = """
CREATE TABLE receipts (
  order_id bigint PRIMARY KEY,
  body     text,
  job_id   bigint,
  fence    bigint NOT NULL
);
CREATE FUNCTION wait_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_advisory_xact_lock(4242);  -- held by the test while it acts mid-commit
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER wait_at_commit AFTER INSERT ON receipts
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION wait_at_commit();
"""
GATE = 4242
# A session of the test's that waits on a lock fails with this instead of hanging the test.
NO_HANG = "-c lock_timeout=20s"


@pytest.fixture
def app(dsn: str) -> Iterator[psycopg.Connection]:
    """The application's connection, with a ``receipts`` table that waits at commit."""
    conn = psycopg.connect(dsn, autocommit=True, options=NO_HANG)
    conn.execute(RECEIPTS)
    yield conn
    conn.close()


@pytest.fixture
def running(queue: Queue) -> Iterator[list[threading.Thread]]:
    """The test's threads, joined before the queue (whose connection a handler uses)
    closes, even if the test failed: closing it under a thread's COMMIT would crash."""
    threads: list[threading.Thread] = []
    yield threads
    for thread in threads:
        thread.join(30)


@pytest.fixture
def gate(dsn: str, running: list[threading.Thread]) -> Iterator[psycopg.Connection]:
    """Holds the advisory lock that a commit waits for; closed (the lock let go) at the
    end of the test even if it failed, before its threads are joined."""
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("SELECT pg_advisory_lock(%s)", [GATE])
    yield conn
    conn.close()


def receipt(app: psycopg.Connection, order_id: int = 42) -> tuple | None:
    """(body, job_id, fence) of one committed receipt, or None."""
    return app.execute(
        "SELECT body, job_id, fence FROM receipts WHERE order_id = %s", [order_id]
    ).fetchone()


def job_row(app: psycopg.Connection, job_id: int) -> tuple:
    """(status, fence) of a job as committed now (reads never wait for row locks)."""
    row = app.execute("SELECT status, fence FROM jobs WHERE id = %s", [job_id]).fetchone()
    assert row is not None
    return row


def insert(conn: psycopg.Connection, job: Job, body: str) -> None:
    """The handler's own plain write, in its transaction."""
    conn.execute("INSERT INTO receipts VALUES (42, %s, %s, %s)", [body, job.id, job.fence])


def write(how: str, conn: psycopg.Connection, job: Job) -> None:
    """The handler's write: plain SQL, or a fenced write (which passes: the claim holds)."""
    if how == "plain":
        insert(conn, job, "by the holder")
    else:
        assert job.fenced_write("receipts", {"order_id": 42}, {"body": "by the holder"})


class Handler(threading.Thread):
    """A handler on its own thread: ``with job.transaction()``, write, set ``wrote``, then
    leave the block (commit) once ``leave`` is set. ``error`` is what it raised."""

    def __init__(self, job: Job, running: list[threading.Thread], how: str = "plain") -> None:
        super().__init__(daemon=True)
        running.append(self)
        self.job, self.how = job, how
        self.wrote, self.leave = threading.Event(), threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.job.transaction() as conn:
                write(self.how, conn, self.job)
                self.wrote.set()
                assert self.leave.wait(30), "the test never let the handler commit"
        except BaseException as exc:  # the test reads it
            self.error = exc
        finally:
            self.wrote.set()

    def done(self) -> BaseException | None:
        """Wait for the handler to leave its block; what it raised, if anything."""
        self.join(30)
        assert not self.is_alive(), "the handler's commit never returned"
        return self.error


class Act(threading.Thread):
    """Another session's statement (cancel, fail, reap, heartbeat) on a thread of its own,
    so the test can watch it wait. ``pid`` is its backend; ``result`` what it returned."""

    def __init__(
        self, dsn: str, action: Callable[[Queue], Any], running: list[threading.Thread]
    ) -> None:
        super().__init__(daemon=True)
        running.append(self)
        self.queue = Queue(psycopg.connect(dsn, autocommit=True, options=NO_HANG))
        self.pid = self.queue.conn.info.backend_pid
        self.action = action
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.action(self.queue)
        except BaseException as exc:  # the test reads it
            self.error = exc
        finally:
            self.queue.conn.close()

    def done(self) -> Any:
        """Wait for the statement to return; what it returned."""
        self.join(30)
        assert not self.is_alive() and self.error is None, self.error
        return self.result


def until(check: Callable[[], Any], what: str, *, unless: threading.Thread | None = None) -> Any:
    """Poll ``check()`` until it is truthy; fail if ``unless`` ends first (it was meant to
    be waiting) or after 20 s (a bound for a stuck test, not a timing assertion)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        if unless is not None and not unless.is_alive():
            raise AssertionError(f"it finished without waiting, so never: {what}")
        time.sleep(0.02)
    raise AssertionError(f"gave up after 20 s waiting for: {what}")


def waits_on(app: psycopg.Connection, pid: int, event: str | None = None) -> bool:
    """Whether backend ``pid`` is waiting on a heavyweight lock (of ``event``, if given)."""
    row = app.execute(
        "SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %s", [pid]
    ).fetchone()
    return row is not None and row[0] == "Lock" and event in (None, row[1])


def fail_elsewhere(job: Job) -> Callable[[Queue], Any]:
    """Fail ``job``'s attempt from another process (a copy: the holder is not told)."""
    return lambda q: q.fail(replace(job), "TimeoutError: failed by another process")


def set_lease(app: psycopg.Connection, job_id: int, until_sql: str) -> None:
    app.execute(f"UPDATE jobs SET lease_until = {until_sql} WHERE id = %s", [job_id])


# -- the claim ends before the commit: the write is rolled back ------------------------
ENDINGS = [
    "cancelled",
    "failed elsewhere",
    "reaped",
    "lease ran out a second ago",
    "lease ran out after the transaction began",
]


@pytest.mark.parametrize("how", ["plain", "fenced"])
@pytest.mark.parametrize("ended_by", ENDINGS)
def test_a_claim_that_ends_before_the_commit_rolls_the_write_back(
    queue: Queue, app: psycopg.Connection, running: list[threading.Thread], ended_by: str, how: str
) -> None:
    """The handler wrote (a fenced write was accepted: the claim held then); the claim ends
    from another session before the block exits, without waiting (the handler holds no
    lock on the job row yet). At the exit the check finds the claim over: the write is
    rolled back, the job is lost, ``LeaseLost`` is raised."""
    job_id = queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    handler = Handler(job, running, how)
    handler.start()
    assert handler.wrote.wait(30) and handler.error is None
    assert receipt(app) is None, "the write is in the handler's transaction, not committed"
    if ended_by == "cancelled":
        assert queue.cancel(job_id)
    elif ended_by == "failed elsewhere":
        assert fail_elsewhere(job)(queue)
    elif ended_by == "reaped":
        set_lease(app, job_id, "now() - interval '1 second'")
        assert [r.id for r in queue.reap()] == [job_id]
    elif ended_by == "lease ran out a second ago":
        set_lease(app, job_id, "now() - interval '1 second'")
    else:  # after the handler's BEGIN, so its now() is earlier: only the clock can tell
        set_lease(app, job_id, "clock_timestamp()")
    assert not job.lost, "nothing told the holder yet"
    handler.leave.set()
    error = handler.done()
    assert isinstance(error, LeaseLost) and "rolled back" in str(error)
    assert job.lost
    assert receipt(app) is None, "a write under a claim that was over must not commit"


# -- the claim ends after the check: the end waits for the commit -----------------------
@pytest.mark.parametrize("ended_by", ["cancelled", "failed elsewhere", "reaped", "heartbeat"])
def test_an_end_of_the_claim_after_the_check_waits_for_the_commit(
    queue: Queue,
    dsn: str,
    app: psycopg.Connection,
    running: list[threading.Thread],
    gate: psycopg.Connection,
    ended_by: str,
) -> None:
    """The check has passed and the transaction is committing (held at COMMIT by the
    deferred trigger). A cancel, fail or reap from another session now waits on the job
    row's lock until the commit, then applies: the write was made while the claim was held.
    A heartbeat of the job waits too (only this long: the lock is the last statement)."""
    job_id = queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    handler = Handler(job, running)
    handler.start()
    assert handler.wrote.wait(30) and handler.error is None
    if ended_by == "reaped":  # the lease must pass while the commit waits, not before
        set_lease(app, job_id, "clock_timestamp() + interval '2 seconds'")
    handler.leave.set()
    pid = job.conn.info.backend_pid  # type: ignore[union-attr]
    until(lambda: waits_on(app, pid, "advisory"), "the handler at COMMIT", unless=handler)
    if ended_by == "reaped":
        until(
            lambda: app.execute(
                "SELECT lease_until < now() FROM jobs WHERE id = %s", [job_id]
            ).fetchone()[0],  # type: ignore[index]
            "the lease to run out",
        )
    action: Callable[[Queue], Any] = {
        "cancelled": lambda q: q.cancel(job_id),
        "failed elsewhere": fail_elsewhere(job),
        "reaped": lambda q: [r.id for r in q.reap()],
        "heartbeat": lambda q: q.heartbeat(replace(job)),
    }[ended_by]
    act = Act(dsn, action, running)
    act.start()
    skipped = False
    if ended_by == "reaped":  # a reaper that skips locked rows may pass this one by
        until(lambda: waits_on(app, act.pid) or not act.is_alive(), "the reap to wait or skip")
        skipped = not act.is_alive()
        if skipped:
            assert act.done() == [], "reaped while the claim was held to a commit"
    else:
        until(lambda: waits_on(app, act.pid), f"the {ended_by} to wait on the job row", unless=act)
    assert receipt(app) is None and job_row(app, job_id) == ("running", job.fence)
    gate.execute("SELECT pg_advisory_unlock(%s)", [GATE])
    assert handler.done() is None
    assert receipt(app) == ("by the holder", job_id, job.fence), "committed under the claim"
    if skipped:  # the next round, after the commit, reaps it
        act = Act(dsn, action, running)
        act.start()
    result = act.done()
    assert result == ([job_id] if ended_by == "reaped" else True), "applied after the commit"
    expected = {"cancelled": "cancelled", "heartbeat": "running"}.get(ended_by, "ready")
    assert job_row(app, job_id)[0] == expected


def test_a_heartbeat_before_the_check_does_not_wait(
    queue: Queue, dsn: str, app: psycopg.Connection, running: list[threading.Thread]
) -> None:
    """While the handler's block runs, its transaction holds no lock on the job row: the
    keeper's heartbeats go through (only the last statement before COMMIT takes one)."""
    job_id = queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    handler = Handler(job, running)
    handler.start()
    assert handler.wrote.wait(30) and handler.error is None
    with Queue(psycopg.connect(dsn, autocommit=True, options="-c lock_timeout=1s")) as other:
        assert other.heartbeat(replace(job))
        other.conn.close()
    handler.leave.set()
    assert handler.done() is None
    assert receipt(app) == ("by the holder", job_id, job.fence)


# -- what the block itself does ------------------------------------------------------
def test_an_exception_in_the_block_rolls_back_and_propagates(
    queue: Queue, app: psycopg.Connection
) -> None:
    job_id = queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    with pytest.raises(ZeroDivisionError), job.transaction() as conn:
        insert(conn, job, "half done")
        assert job.fenced_write("receipts", {"order_id": 7}, {"body": "half done"})
        1 / 0  # noqa: B018 - the handler's own bug
    assert receipt(app) is None and receipt(app, 7) is None
    assert not job.lost, "the claim still holds: the handler's own error lost nothing"
    with job.transaction() as conn:  # the connection is usable again, and so is the claim
        insert(conn, job, "second try")
    assert receipt(app) == ("second try", job_id, job.fence)
    assert queue.complete(job)


def test_a_fenced_write_in_the_block_is_part_of_the_transaction(
    queue: Queue, app: psycopg.Connection
) -> None:
    job_id = queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    with job.transaction() as conn:
        assert job.fenced_write("receipts", {"order_id": 42}, {"body": "fenced"})
        assert receipt(app) is None, "not committed on its own"
        assert conn.execute("SELECT body FROM receipts").fetchall() == [("fenced",)]
    assert receipt(app) == ("fenced", job_id, job.fence)


def test_a_job_known_lost_opens_no_transaction_and_commits_none(
    queue: Queue, app: psycopg.Connection
) -> None:
    queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    with pytest.raises(LeaseLost, match="rolled back"), job.transaction() as conn:
        insert(conn, job, "told mid-block")
        job.mark_lost()  # a heartbeat on the keeper's thread learnt the job was taken over
    assert receipt(app) is None
    with pytest.raises(LeaseLost, match="no transaction opened"), job.transaction():
        pass


def test_the_block_needs_a_connection_with_no_transaction_open(
    queue: Queue, app: psycopg.Connection
) -> None:
    queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    assert job.conn is not None
    no_nesting = pytest.raises(BadInput, match="no transaction open")
    with job.conn.transaction(), no_nesting, job.transaction():
        pass
    for bad in (0, -1, 86401, float("nan"), float("inf"), True, "5"):
        with pytest.raises(BadInput, match="lock_timeout"), job.transaction(lock_timeout=bad):
            pass
    with pytest.raises(LeaseLost, match="no connection"), replace(job, conn=None).transaction():
        pass


def test_a_job_row_locked_elsewhere_fails_the_check_within_lock_timeout(
    queue: Queue, dsn: str, app: psycopg.Connection
) -> None:
    """A session that holds the job row (an operator's ``SELECT ... FOR UPDATE``) cannot
    hang the handler at commit: past ``lock_timeout`` the write rolls back with a one-line
    error. The claim may still hold, so the job is not marked lost."""
    job_id = queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    with psycopg.connect(dsn) as operator:
        operator.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", [job_id])
        refused = pytest.raises(PgQueueError, match="stayed locked")
        with refused as raised, job.transaction(lock_timeout=0.2) as conn:
            insert(conn, job, "behind a lock")
        assert not isinstance(raised.value, LeaseLost) and not job.lost
        operator.rollback()
    assert receipt(app) is None
    assert job.conn is not None and job.conn.info.transaction_status.name == "IDLE"


def test_under_repeatable_read_a_row_changed_since_the_snapshot_fails_the_commit(
    queue: Queue, dsn: str, app: psycopg.Connection
) -> None:
    """A REPEATABLE READ transaction cannot lock a row version newer than its snapshot: a
    heartbeat committed meanwhile makes the check raise (rolled back; run it again)."""
    job_id = queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    assert job.conn is not None
    job.conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    with pytest.raises(psycopg.errors.SerializationFailure), job.transaction() as conn:
        insert(conn, job, "on an old snapshot")
        with Queue(dsn) as other:
            assert other.heartbeat(replace(job))
    assert receipt(app) is None and not job.lost
    with job.transaction() as conn:  # again, on a new snapshot
        insert(conn, job, "again")
    assert receipt(app) == ("again", job_id, job.fence)


# -- AsyncJob ----------------------------------------------------------------------------
def test_async_a_cancel_before_the_commit_rolls_the_write_back(
    dsn: str, app: psycopg.Connection, running: list[threading.Thread]
) -> None:
    async def main() -> None:
        async with AsyncQueue(dsn) as q:
            job_id = await q.enqueue({}, queue="q")
            [job] = await q.claim("q")
            with pytest.raises(LeaseLost, match="rolled back"):
                async with job.transaction() as conn:
                    await conn.execute(
                        "INSERT INTO receipts VALUES (42, 'async', %s, %s)", [job_id, job.fence]
                    )
                    assert await job.fenced_write("receipts", {"order_id": 7}, {"body": "f"})
                    # another session, on another thread, cancels before the commit
                    act = Act(dsn, lambda other: other.cancel(job_id), running)
                    act.start()
                    assert await asyncio.to_thread(act.done) is True
            assert job.lost
            assert receipt(app) is None and receipt(app, 7) is None

    asyncio.run(main())


def test_async_a_cancel_after_the_check_waits_for_the_commit(
    dsn: str, app: psycopg.Connection, running: list[threading.Thread], gate: psycopg.Connection
) -> None:
    async def main() -> None:
        async with AsyncQueue(dsn) as q:
            job_id = await q.enqueue({}, queue="q")
            [job] = await q.claim("q")
            conn = await job.connection()
            pid = conn.info.backend_pid

            async def handler() -> None:
                async with job.transaction() as tx:
                    await tx.execute(
                        "INSERT INTO receipts VALUES (42, 'async', %s, %s)", [job_id, job.fence]
                    )

            committing = asyncio.create_task(handler())
            await asyncio.to_thread(until, lambda: waits_on(app, pid, "advisory"), "COMMIT")
            act = Act(dsn, lambda other: other.cancel(job_id), running)
            act.start()
            await asyncio.to_thread(until, lambda: waits_on(app, act.pid), "the cancel", unless=act)
            assert receipt(app) is None
            gate.execute("SELECT pg_advisory_unlock(%s)", [GATE])
            await committing
            assert receipt(app) == ("async", job_id, job.fence)
            assert await asyncio.to_thread(act.done) is True
            assert job_row(app, job_id)[0] == "cancelled"

    asyncio.run(main())


def test_async_an_exception_in_the_block_rolls_back_and_propagates(
    dsn: str, app: psycopg.Connection
) -> None:
    async def main() -> None:
        async with AsyncQueue(dsn) as q:
            job_id = await q.enqueue({}, queue="q")
            [job] = await q.claim("q")
            with pytest.raises(ZeroDivisionError):
                async with job.transaction() as conn:
                    await conn.execute(
                        "INSERT INTO receipts VALUES (42, 'async', %s, %s)", [job_id, job.fence]
                    )
                    1 / 0  # noqa: B018 - the handler's own bug
            assert receipt(app) is None and not job.lost
            async with job.transaction() as conn:
                assert await job.fenced_write("receipts", {"order_id": 42}, {"body": "again"})
            assert receipt(app) == ("again", job_id, job.fence)
            assert isinstance(job, AsyncJob) and await q.complete(job)

    asyncio.run(main())
