"""Fenced writes to other tables (DESIGN.md invariant 5), against a real PostgreSQL.

A fence counts the claims of one job. Written with ``job_id=`` (as ``Job.fenced_write``
does), a row remembers its job: the same claim may write it again, an older holder of that
job is refused (``False``, the job is lost), and another job's write raises
``FenceConflict`` instead of being judged by an unrelated fence.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from conftest import rows
from pgqueue import BadInput, FenceConflict, Job, PgQueueError, Queue, Worker, fenced_write

RECEIPTS = """
CREATE TABLE receipts (
  order_id bigint PRIMARY KEY,
  body     text,
  job_id   bigint,
  fence    bigint NOT NULL
)"""


@pytest.fixture
def app(dsn: str) -> Iterator[psycopg.Connection]:
    """The application's connection, with a ``receipts`` table that has a job column."""
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute(RECEIPTS)
    yield conn
    conn.close()


def receipt(conn: psycopg.Connection, order_id: int = 42) -> tuple | None:
    """(body, job_id, fence) of one receipt, or None."""
    return conn.execute(
        "SELECT body, job_id, fence FROM receipts WHERE order_id = %s", [order_id]
    ).fetchone()


def take_over(queue: Queue, dsn: str, job_id: int) -> tuple[Job, Job]:
    """Claim ``job_id`` (holder A), let A's lease run out, reap, claim again (holder B)."""
    [a] = queue.claim("q")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE jobs SET lease_until = now() - interval '1 second' WHERE id = %s", [job_id]
        )
    queue.reap()
    [b] = queue.claim("q")
    assert (a.id, b.id, a.fence, b.fence) == (job_id, job_id, 1, 2)
    return a, b


def recording(job: Job) -> list[str]:
    """Record the kinds of event ``job`` reports; return the list they go to."""
    kinds: list[str] = []
    job.on_event = lambda kind, _job: kinds.append(kind)
    return kinds


# -- the same claim writes its row again ------------------------------------------------
def test_the_same_claim_may_write_a_row_twice(app: psycopg.Connection) -> None:
    assert fenced_write(app, "receipts", {"order_id": 42}, {"body": "draft"}, 1, job_id=7)
    assert fenced_write(app, "receipts", {"order_id": 42}, {"body": "final"}, 1, job_id=7)
    assert receipt(app) == ("final", 7, 1)
    # the update form: an existing row of this job, the same fence again
    for body in ("update 1", "update 2"):
        assert fenced_write(
            app, "receipts", {"order_id": 42}, {"body": body}, 1, job_id=7, upsert=False
        )
    assert receipt(app) == ("update 2", 7, 1)
    # a later claim of the same job (newer fence) takes over the row
    assert fenced_write(
        app, "receipts", {"order_id": 42}, {"body": "retry"}, 2, job_id=7, upsert=False
    )
    assert receipt(app) == ("retry", 7, 2)


@pytest.mark.parametrize("upsert", [True, False])
def test_job_fenced_write_twice_in_one_claim_is_accepted_and_not_lost(
    queue: Queue, app: psycopg.Connection, upsert: bool
) -> None:
    job_id = queue.enqueue({}, queue="q")
    [job] = queue.claim("q")
    kinds = recording(job)
    if not upsert:  # the row exists already, created for this job before it ran
        app.execute("INSERT INTO receipts VALUES (42, 'pending', %s, 0)", [job_id])
    assert job.fenced_write("receipts", {"order_id": 42}, {"body": "first"}, upsert=upsert)
    assert job.fenced_write("receipts", {"order_id": 42}, {"body": "second"}, upsert=upsert)
    assert not job.lost
    assert kinds == ["fenced-write", "fenced-write"]
    assert receipt(app) == ("second", job_id, 1)
    assert queue.complete(job)


# -- a stale holder of the same job ------------------------------------------------------
def test_a_stale_holder_of_the_same_job_is_refused_and_marked_lost(
    queue: Queue, dsn: str, app: psycopg.Connection
) -> None:
    job_id = queue.enqueue({}, queue="q")
    a, b = take_over(queue, dsn, job_id)
    kinds_a, kinds_b = recording(a), recording(b)
    assert b.fenced_write("receipts", {"order_id": 42}, {"body": "by B"})
    for upsert in (True, False):
        assert not a.fenced_write("receipts", {"order_id": 42}, {"body": "late A"}, upsert=upsert)
    assert a.lost and not b.lost
    assert kinds_b == ["fenced-write"]
    assert kinds_a == ["fenced-write-rejected", "fenced-write-rejected"]
    assert receipt(app) == ("by B", job_id, 2)
    # the same refusal without a Job: this job's row, an older fence
    assert not fenced_write(app, "receipts", {"order_id": 42}, {"body": "x"}, 1, job_id=job_id)
    assert receipt(app) == ("by B", job_id, 2)


# -- the job itself is checked: a claim that is over cannot write, even a fresh row ------
def expire_lease(dsn: str, job_id: int) -> None:
    """Make ``job_id``'s lease run out (by the server's clock), as a long freeze would."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE jobs SET lease_until = now() - interval '1 second' WHERE id = %s", [job_id]
        )


@pytest.mark.parametrize("upsert", [True, False])
@pytest.mark.parametrize("ended_by", ["lease ran out", "reaped", "cancelled", "failed elsewhere"])
def test_a_holder_whose_claim_is_over_is_refused_before_anyone_else_writes(
    queue: Queue, dsn: str, app: psycopg.Connection, ended_by: str, upsert: bool
) -> None:
    """No newer holder has written the row (for the insert: the row does not exist yet),
    so the row's fence alone could not refuse. The job in ``jobs`` does: the holder is
    refused and learns that it lost the job, with no heartbeat in between."""
    job_id = queue.enqueue({}, queue="q")
    [a] = queue.claim("q")
    if not upsert:  # the row exists already, created for this job before it ran
        app.execute("INSERT INTO receipts VALUES (42, 'pending', %s, 0)", [job_id])
    assert a.fenced_write("receipts", {"order_id": 42}, {"body": "A, in time"}, upsert=upsert)
    if upsert:  # start again from no row: the row's fence cannot refuse what is not there
        app.execute("DELETE FROM receipts")
    if ended_by in ("lease ran out", "reaped"):
        expire_lease(dsn, job_id)
        if ended_by == "reaped":
            assert [r.id for r in queue.reap()] == [job_id]
    elif ended_by == "cancelled":
        assert queue.cancel(job_id)
    else:  # another process (a worker's timeout, an operator) failed this attempt
        with Queue(dsn) as other:
            held = other.get(job_id)
            assert held is not None
            assert other.fail(replace_fence(a, held.fence), "TimeoutError: took too long")
    kinds = recording(a)
    assert not a.lost  # nothing told A yet: no heartbeat ran
    assert not a.fenced_write("receipts", {"order_id": 42}, {"body": "A, late"}, upsert=upsert)
    assert a.lost and kinds == ["fenced-write-rejected"]
    expected = None if upsert else ("A, in time", job_id, 1)
    assert receipt(app) == expected, "the late write changed nothing"


def replace_fence(job: Job, fence: int) -> Job:
    """A copy of ``job`` held with ``fence`` (as another process holding it would see it)."""
    from dataclasses import replace

    return replace(job, fence=fence)


def test_check_lease_is_the_plain_functions_option_and_needs_a_job_id(
    queue: Queue, dsn: str, app: psycopg.Connection
) -> None:
    job_id = queue.enqueue({}, queue="q")
    [a] = queue.claim("q")
    write = {"key": {"order_id": 42}, "values": {"body": "x"}, "job_id": job_id}
    # Without check_lease (the default of the plain function) only the row's fence counts.
    expire_lease(dsn, job_id)
    assert fenced_write(app, "receipts", fence=a.fence, **write)  # type: ignore[arg-type]
    assert not fenced_write(
        app,
        "receipts",
        fence=a.fence,
        check_lease=True,
        **write,  # type: ignore[arg-type]
    )
    with pytest.raises(BadInput, match="check_lease=True needs job_id="):
        fenced_write(app, "receipts", {"order_id": 1}, {"body": "x"}, 1, check_lease=True)


def test_a_stale_holder_is_refused_as_stale_even_on_another_jobs_row(
    queue: Queue, dsn: str, app: psycopg.Connection
) -> None:
    """A claim that is over is refused (False, lost) before the row's owner is compared:
    whatever the row holds, this holder must stop, and FenceConflict would blame the row."""
    first, second = queue.enqueue({}, queue="q"), queue.enqueue({}, queue="q")
    jobs = {job.id: job for job in queue.claim("q", limit=2)}
    assert jobs[first].fenced_write("receipts", {"order_id": 42}, {"body": "first"})
    assert queue.cancel(second)
    assert not jobs[second].fenced_write("receipts", {"order_id": 42}, {"body": "second"})
    assert jobs[second].lost
    assert receipt(app) == ("first", first, 1)


def test_update_of_a_missing_row_is_false(app: psycopg.Connection) -> None:
    assert not fenced_write(
        app, "receipts", {"order_id": 42}, {"body": "x"}, 1, job_id=7, upsert=False
    )
    assert receipt(app) is None


# -- another job's row -------------------------------------------------------------------
@pytest.mark.parametrize("fence", [1, 2, 5])  # older, equal, newer than the stored one
@pytest.mark.parametrize("upsert", [True, False])
def test_a_row_of_another_job_raises_and_is_left_alone(
    app: psycopg.Connection, fence: int, upsert: bool
) -> None:
    assert fenced_write(app, "receipts", {"order_id": 42}, {"body": "by job 7"}, 2, job_id=7)
    with pytest.raises(FenceConflict) as caught:
        fenced_write(
            app, "receipts", {"order_id": 42}, {"body": "by job 9"}, fence, job_id=9, upsert=upsert
        )
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("row (order_id=42) of receipts was written by job 7;")
    assert "not comparable" in message and "key the row by job" in message
    assert isinstance(caught.value, PgQueueError)
    assert receipt(app) == ("by job 7", 7, 2)


def test_a_row_written_without_a_job_id_is_not_taken_by_a_job(app: psycopg.Connection) -> None:
    assert fenced_write(app, "receipts", {"order_id": 42}, {"body": "no job"}, 1)
    with pytest.raises(FenceConflict, match="written without a job id"):
        fenced_write(app, "receipts", {"order_id": 42}, {"body": "job 9"}, 2, job_id=9)
    assert receipt(app) == ("no job", None, 1)


def test_job_fenced_write_to_another_jobs_row_raises_without_marking_lost(
    queue: Queue, app: psycopg.Connection
) -> None:
    first, second = queue.enqueue({}, queue="q"), queue.enqueue({}, queue="q")
    jobs = {job.id: job for job in queue.claim("q", limit=2)}
    assert jobs[first].fenced_write("receipts", {"order_id": 42}, {"body": "first"})
    kinds = recording(jobs[second])
    with pytest.raises(FenceConflict, match=f"written by job {first};"):
        jobs[second].fenced_write("receipts", {"order_id": 42}, {"body": "second"})
    assert not jobs[second].lost  # its fence is not stale: the write was wrong
    assert kinds == []
    assert receipt(app) == ("first", first, 1)


def test_a_new_job_for_a_different_key_is_accepted(app: psycopg.Connection) -> None:
    assert fenced_write(app, "receipts", {"order_id": 42}, {"body": "42"}, 3, job_id=7)
    assert fenced_write(app, "receipts", {"order_id": 43}, {"body": "43"}, 1, job_id=9)
    assert fenced_write(app, "receipts", {"order_id": 43}, {"body": "43 again"}, 1, job_id=9)
    assert rows_of(app) == [(42, "42", 7, 3), (43, "43 again", 9, 1)]


def rows_of(conn: psycopg.Connection) -> list[tuple]:
    return conn.execute("SELECT order_id, body, job_id, fence FROM receipts ORDER BY 1").fetchall()


def test_a_row_keyed_by_job_needs_no_other_column(app: psycopg.Connection) -> None:
    """The job column may be the key itself (as in the chaos run's result table)."""
    app.execute("CREATE TABLE results (job_id bigint PRIMARY KEY, body text, fence bigint)")
    assert fenced_write(app, "results", {"job_id": 7}, {"body": "a"}, 1, job_id=7)
    assert fenced_write(app, "results", {"job_id": 7}, {"body": "b"}, 1, job_id=7)
    assert not fenced_write(app, "results", {"job_id": 7}, {"body": "stale"}, 0, job_id=7)
    assert fenced_write(app, "results", {"job_id": 9}, {"body": "c"}, 1, job_id=9)
    with pytest.raises(BadInput, match="not the writing job"):
        fenced_write(app, "results", {"job_id": 9}, {"body": "d"}, 5, job_id=7)
    assert app.execute("SELECT * FROM results ORDER BY 1").fetchall() == [(7, "b", 1), (9, "c", 1)]


def test_job_id_is_passed_as_job_id_not_as_a_value(app: psycopg.Connection) -> None:
    with pytest.raises(BadInput, match="job_id="):
        fenced_write(app, "receipts", {"order_id": 42}, {"job_id": 9}, 1, job_id=7)
    assert receipt(app) is None


def test_a_table_without_the_job_column_is_a_one_line_bad_input(app: psycopg.Connection) -> None:
    app.execute("CREATE TABLE reports (id int PRIMARY KEY, body text, fence bigint)")
    with pytest.raises(BadInput) as caught:
        fenced_write(app, "reports", {"id": 1}, {"body": "x"}, 1, job_id=7)
    assert "\n" not in str(caught.value) and "'job_id' bigint column" in str(caught.value)
    assert app.execute("SELECT count(*) FROM reports").fetchone() == (0,)


# -- without job_id: the old rule, for tables with no job column --------------------------
def test_without_job_id_only_a_strictly_newer_fence_is_accepted(app: psycopg.Connection) -> None:
    app.execute("CREATE TABLE reports (id int PRIMARY KEY, body text, fence bigint)")

    def write(body: str, fence: int, upsert: bool = True) -> bool:
        return fenced_write(app, "reports", {"id": 1}, {"body": body}, fence, upsert=upsert)

    assert write("one", 1)
    assert not write("one again", 1)  # an equal fence is refused: no repeated writes
    assert not write("one again", 1, upsert=False)
    assert write("two", 2, upsert=False)
    assert not write("zero", 0)
    # and fences of different jobs are compared as if they were one counter
    assert write("job 9, fence 3", 3)
    assert app.execute("SELECT body, fence FROM reports").fetchall() == [("job 9, fence 3", 3)]


# -- names -------------------------------------------------------------------------------
def test_names_with_percent_signs_work(app: psycopg.Connection) -> None:
    table, key, col = 'my "receipts" 100%', "order %(k0)s", "body %s"
    job_col, fence_col = "job %(job)s", "fence %"
    app.execute(
        sql.SQL("CREATE TABLE {} ({} int PRIMARY KEY, {} text, {} bigint, {} bigint)").format(
            *map(sql.Identifier, (table, key, col, job_col, fence_col))
        )
    )
    names = {"fence_column": fence_col, "job_column": job_col}
    assert fenced_write(app, table, {key: 1}, {col: "v1"}, 1, job_id=7, **names)
    assert fenced_write(app, table, {key: 1}, {col: "v2"}, 1, job_id=7, upsert=False, **names)
    assert not fenced_write(app, table, {key: 1}, {col: "stale"}, 0, job_id=7, **names)
    with pytest.raises(FenceConflict, match="written by job 7"):
        fenced_write(app, table, {key: 1}, {col: "other"}, 2, job_id=9, **names)
    stored = app.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier(table)))
    assert stored.fetchall() == [(1, "v2", 7, 1)]


# -- a conflict is noticed: the handler fails --------------------------------------------
def test_a_handler_whose_write_meets_another_jobs_row_fails(
    queue: Queue, dsn: str, app: psycopg.Connection
) -> None:
    """Two jobs for one order: the second one's receipt write raises FenceConflict, so its
    handler fails and the job ends dead (max_attempts=1) with the reason, not done."""

    def write_receipt(job: Job) -> None:
        job.fenced_write("receipts", {"order_id": job.payload["order"]}, {"body": f"job {job.id}"})

    ids = [queue.enqueue({"order": 42}, queue="receipts", max_attempts=1) for _ in range(2)]
    worker = Worker(write_receipt, queue="receipts", dsn=dsn, burst=True, poll_interval=0.1)
    worker.start()
    worker.join(30)
    worker.stop(5)
    ends = dict(rows(dsn, "SELECT status, id FROM jobs WHERE id = ANY(%s)", [ids]))
    assert sorted(ends) == ["dead", "done"]
    [(error,)] = rows(dsn, "SELECT last_error FROM jobs WHERE id = %s", [ends["dead"]])
    assert error.startswith(
        f"FenceConflict: row (order_id=42) of receipts was written by job {ends['done']};"
    )
    assert receipt(app) == (f"job {ends['done']}", ends["done"], 1)
