"""Checks for notebook 04, fencing tokens: the reader's fenced ``fail``, and a prediction
of what breaks when ``complete`` ignores the fence."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from contextlib import suppress
from typing import Any

import psycopg

from ...db import first_line
from ...job import Job
from ...queue import Queue
from .. import lab
from ..stories import sandbox
from . import compare_prediction, expect, passed, take_out
from .tiers import Hints

BACKOFF = 2.0  # seconds; the check's backoff, so the first retry waits 2 * 2**1 = 4 s
FAIL_HINTS = Hints()


def _claim(q: Queue, payload: dict[str, Any], max_attempts: int = 3) -> Job:
    q.enqueue(payload, queue="check", max_attempts=max_attempts)
    [job] = q.claim("check", lease=30)
    return job


def _row(conn: psycopg.Connection, job_id: int) -> dict[str, Any]:
    cur = conn.execute(
        "SELECT status, attempts, fence, lease_until, last_error,"
        " extract(epoch FROM run_at - now())::float8 AS retry_in,"
        " abs(extract(epoch FROM finished_at - now())) < 1 AS finished_now"
        " FROM jobs WHERE id = %s",
        [job_id],
    )
    names = [c.name for c in cur.description or []]
    row = cur.fetchone()
    assert row is not None
    return dict(zip(names, row, strict=True))


def check_fenced_fail(dsn: str, statement: object) -> None:
    """Run the reader's fail ``statement`` (parameters %(id)s, %(fence)s, %(error)s and
    %(backoff)s) against a private jobs table: the current holder's fail must retry the job
    with backoff and raise the fence; a second fail, a stale holder's fail and a fail of a
    done job must change nothing; a job on its last attempt must go dead."""
    expect(
        isinstance(statement, str) and re.search(r"\bupdate\b", statement, re.I),
        "FAIL should be a text holding one UPDATE jobs ... statement",
    )
    assert isinstance(statement, str)
    with sandbox(dsn) as conn:
        q = Queue(conn)

        def fail(job: Job, error: str = "ConnectionError: service unavailable") -> int:
            params = {"id": job.id, "fence": job.fence, "error": error, "backoff": BACKOFF}
            try:
                return conn.execute(statement, params).rowcount  # type: ignore[arg-type]
            except psycopg.Error as exc:
                expect(False, f"PostgreSQL refused the statement: {first_line(exc)}")
            except (KeyError, TypeError) as exc:
                expect(
                    False,
                    f"your statement asks for a parameter the check does not pass ({exc}): "
                    "use %(id)s, %(fence)s, %(error)s and %(backoff)s",
                )
            raise AssertionError("unreachable")

        hints = FAIL_HINTS
        # 1. The holder fails: retry with backoff, the fence rises, the lease is cleared.
        holder = _claim(q, {"n": 1})
        changed = fail(holder)
        hints.expect(
            changed == 1,
            "holder",
            f"your fail changed {changed} rows for the job's current holder (fence "
            f"{holder.fence}, status running)",
            "it should change exactly that job's row: WHERE id = %(id)s AND fence = %(fence)s",
        )
        row = _row(conn, holder.id)
        hints.expect(
            row["fence"] != holder.fence,
            "raise",
            f"after your fail the job's fence is still {holder.fence}: the failed attempt's "
            "late writes would still be accepted",
            "raise it: fence = fence + 1",
        )
        hints.expect(
            row["fence"] == holder.fence + 1,
            "by-one",
            f"your fail moved the fence from {holder.fence} to {row['fence']}",
            "raise it by exactly one (fence = fence + 1); it must never go down",
        )
        hints.expect(
            row["status"] == "ready",
            "ready",
            f"the job has used 1 of its 3 attempts, but your fail made it {row['status']!r}",
            "it should be 'ready' to be tried again",
        )
        hints.expect(
            row["attempts"] == holder.attempts,
            "attempts",
            f"your fail changed attempts to {row['attempts']}",
            "only the claim counts an attempt, so leave attempts alone",
        )
        hints.expect(
            row["lease_until"] is None,
            "lease",
            "after your fail the job still holds a lease_until",
            "set lease_until = NULL: nobody holds the job now",
        )
        hints.expect(
            row["last_error"] == "ConnectionError: service unavailable",
            "error",
            f"last_error is {row['last_error']!r}, not the error the worker passed",
            "store the error text: last_error = %(error)s",
        )
        hints.expect(
            row["finished_now"] is None,
            "finished-early",
            "the job goes back to ready for another attempt, but your fail gave it a finished_at",
            "only a job that goes dead is finished: CASE WHEN attempts >= max_attempts "
            "THEN now() END",
        )
        wanted = BACKOFF * 2**holder.attempts
        hints.expect(
            abs(row["retry_in"] - wanted) < 1e-3,
            "backoff",
            f"the retry should wait backoff * 2^attempts = {BACKOFF:g} * 2^{holder.attempts} = "
            f"{wanted:g} s from now(), yours waits {row['retry_in']:g} s",
            "run_at = now() + make_interval(secs => %(backoff)s * power(2, attempts))",
        )
        # 2. The same holder fails again: the first fail ended its attempt.
        again = fail(holder, "second fail")
        hints.expect(
            again == 0 and _row(conn, holder.id)["last_error"] != "second fail",
            "twice",
            f"a second fail with the same fence {holder.fence} changed the job again, though "
            "the first fail ended that attempt",
            "check AND fence = %(fence)s AND status = 'running'",
        )
        # 3. A stale holder: the lease ran out, the reaper returned the job, B claimed it.
        stale = _claim(q, {"n": 2})
        _expire_and_reap(conn, q, stale)
        [current] = q.claim("check", lease=30)
        changed = fail(stale)
        row = _row(conn, stale.id)
        hints.expect(
            changed == 0 and row["status"] == "running" and row["fence"] == current.fence,
            "stale",
            f"your fail changed the job although the caller's fence {stale.fence} is stale "
            f"(another worker holds the job with fence {current.fence})",
            "add AND fence = %(fence)s",
        )
        # 4. A job already done: its fence did not change, its status did.
        done = _claim(q, {"n": 3})
        q.complete(done)
        changed = fail(done)
        hints.expect(
            changed == 0 and _row(conn, done.id)["status"] == "done",
            "status",
            f"your fail changed a job that is already done (its fence is still {done.fence})",
            "add AND status = 'running'",
        )
        # 5. The last attempt: dead, not ready.
        last = _claim(q, {"n": 4}, max_attempts=1)
        fail(last)
        row = _row(conn, last.id)
        hints.expect(
            row["status"] == "dead",
            "dead",
            f"the job used its last attempt (1 of 1), but your fail made it {row['status']!r}",
            "CASE WHEN attempts >= max_attempts THEN 'dead' ELSE 'ready' END",
        )
        hints.expect(
            row["fence"] == last.fence + 1,
            "raise",
            "your fail sent the job dead but left its fence: the attempt's late writes would "
            "still be accepted",
            "raise the fence in every fail: fence = fence + 1",
        )
        hints.expect(
            row["finished_now"],
            "finished-at",
            "the job went dead, but its finished_at says "
            + ("nothing" if row["finished_now"] is None else "another time than this fail"),
            "a dead job is finished: finished_at = CASE WHEN attempts >= max_attempts "
            "THEN now() END",
        )
    passed(
        f"your fail retried the job in {wanted:g} s with its fence raised by one, refused a "
        "second fail, a stale holder's fail and a fail of a done job, and sent a job on its "
        "last attempt dead, finished now"
    )


# What the exercise asks to predict, and the story that answers it.
QUESTIONS = {
    "a_complete": "A's late complete, sent without the fence: does it take effect?",
    "b_heartbeat": "B's next heartbeat, still working: does it take effect?",
    "b_complete": "B's complete when it finishes: does it take effect?",
    "status": "the job's status at the end",
}


def _story(dsn: str, fenced: bool) -> dict[str, Any]:
    """A claims and freezes; its lease runs out, the reaper returns the job, B claims it and
    starts working; A wakes and completes (with the fence, or by id alone); then B
    heartbeats and completes. Everything against a private jobs table."""
    with sandbox(dsn) as conn:
        q = Queue(conn)
        q.enqueue({"report": 1}, queue="story")
        [a] = q.claim("story", lease=30)
        conn.execute("UPDATE jobs SET lease_until = now() - interval '1 second'")  # A froze
        q.reap()
        [b] = q.claim("story", lease=30)
        a_done = q.complete(a) if fenced else lab.complete_ignoring_fence(conn, a)
        outcome = {
            "a_complete": a_done,
            "b_heartbeat": q.heartbeat(b, lease=30),
            "b_complete": q.complete(b),
        }
        outcome["status"] = _row(conn, b.id)["status"]
    return outcome


def check_complete_without_fence(dsn: str, prediction: Mapping[str, object]) -> None:
    """Compare the reader's ``prediction`` with the story run live, once with complete
    ignoring the fence (``lab.complete_ignoring_fence``) and once with the real one."""
    expect(
        isinstance(prediction, Mapping) and set(prediction) == set(QUESTIONS),
        f"prediction should be a dict with the keys {', '.join(QUESTIONS)}",
    )
    broken, real = _story(dsn, fenced=False), _story(dsn, fenced=True)
    why = {
        "a_complete": "without the fence the UPDATE finds the row by id alone, so A's late "
        "complete matches it and returns True",
        "b_heartbeat": "A's complete already made the job 'done', and a heartbeat needs "
        "status = 'running': B is told it lost the job although it was the rightful holder",
        "b_complete": "the job is already 'done' by A's stale complete, so B's complete, "
        "which needs status = 'running', changes nothing: B's work is thrown away",
        "status": "A's complete set it, while B was still working",
    }
    for key in QUESTIONS:
        guess = prediction[key]
        if isinstance(broken[key], str) and isinstance(guess, str):
            guess = guess.strip().lower()
        expect(
            guess == broken[key],
            f"{key}: you predicted {prediction[key]!r}, the run says {broken[key]!r}: {why[key]}",
        )
    expect(
        real == {"a_complete": False, "b_heartbeat": True, "b_complete": True, "status": "done"},
        f"with the fence the story should end with A refused and B done, but it gave {real}",
    )
    passed(
        "right: without the fence A's stale complete takes effect and B, the rightful holder, "
        "is refused; with the fence (run too) A is refused and B finishes the job"
    )


def without_status(statement: object) -> str:
    """The reader's COMPLETE without its ``status = 'running'`` condition."""
    return take_out(
        statement,
        r"\s+AND\s+status\s*=\s*'running'|status\s*=\s*'running'\s+AND\s+",
        "status = 'running'",
        "COMPLETE",
    )


def _late_complete(dsn: str, statement: str) -> dict[str, object]:
    """A claims a job on its one attempt and freezes; its lease runs out and the reaper
    sends the job dead (nobody claims it again, so its fence stays A's); A wakes and
    completes with ``statement``."""
    with sandbox(dsn) as conn:
        q = Queue(conn)
        q.enqueue({"report": 1}, queue="story", max_attempts=1)
        [a] = q.claim("story", lease=30)
        _expire_and_reap(conn, q, a)
        took = _run(conn, statement, {"id": a.id, "fence": a.fence}, "%(id)s and %(fence)s")
        return {"a_complete": took == 1, "status": _row(conn, a.id)["status"]}


def check_complete_without_status(dsn: str, statement: object, prediction: object) -> None:
    """The reader's COMPLETE with ``status = 'running'`` taken out, run in the story of a
    job the reaper sent dead before its frozen holder woke; the reader's prediction of
    what the late complete does, and the story with the whole statement beside it."""
    broken = _late_complete(dsn, without_status(statement))
    compare_prediction(
        prediction,
        broken,
        {
            "a_complete": "the reaper does not raise the fence, so A's fence still matches "
            "and, without the status, nothing else stops the UPDATE",
            "status": "A's late complete turned a job the queue had given up on (dead, "
            "with the reaper's note in last_error) into done",
        },
    )
    real = _late_complete(dsn, str(statement))
    expect(
        real == {"a_complete": False, "status": "dead"},
        f"with status = 'running' A's late complete should be refused and the job stay "
        f"dead, but the story gave {real}",
    )
    passed(
        "right: without status = 'running' A's late complete took a dead job (its fence "
        "unchanged by the reaper) and made it done, telling A it had completed; with it "
        "(run too) A is refused and the job stays dead with the reaper's note"
    )


COMPLETE_HINTS = Hints()
WRITE_HINTS = Hints()
STORY_HINTS = Hints()


def _run(conn: psycopg.Connection, statement: str, params: Mapping[str, Any], names: str) -> int:
    """Run the reader's statement; its row count, or a one-line failure."""
    try:
        return conn.execute(statement, params).rowcount  # type: ignore[arg-type]
    except psycopg.Error as exc:
        expect(False, f"PostgreSQL refused the statement: {first_line(exc)}")
    except (KeyError, TypeError) as exc:
        expect(
            False,
            f"your statement asks for a parameter the check does not pass ({exc}): use {names}",
        )
    raise AssertionError("unreachable")


def _expire_and_reap(conn: psycopg.Connection, q: Queue, job: Job) -> None:
    """``job``'s holder froze past its lease, and a reaper returned the job."""
    conn.execute(
        "UPDATE jobs SET lease_until = now() - interval '1 second' WHERE id = %s", [job.id]
    )
    q.reap()


def check_fenced_complete(dsn: str, statement: object) -> None:
    """Run the reader's complete ``statement`` (parameters %(id)s and %(fence)s) against a
    private jobs table: the holder's complete must make the job done, with no lease and a
    finished_at; a second complete, a stale holder's, a reaped job's and a complete of
    another job held with the same fence number must change nothing."""
    hints = COMPLETE_HINTS
    expect(
        isinstance(statement, str) and re.search(r"\bupdate\b", statement, re.I),
        "COMPLETE should be a text holding one UPDATE jobs ... statement",
    )
    assert isinstance(statement, str)
    names = "%(id)s and %(fence)s"
    with sandbox(dsn) as conn:
        q = Queue(conn)

        def complete(job: Job) -> int:
            return _run(conn, statement, {"id": job.id, "fence": job.fence}, names)

        holder, neighbour = _claim(q, {"n": 1}), _claim(q, {"n": 2})  # both hold fence 1
        changed = complete(holder)
        row = _row(conn, holder.id)
        hints.expect(
            changed >= 1 and row["status"] == "done",
            "holder",
            f"the current holder of a running job (fence {holder.fence}) completed it, and "
            f"the row says {row['status']!r} ({changed} rows changed)",
            "SET status = 'done' WHERE id = %(id)s AND fence = %(fence)s",
        )
        hints.expect(
            _row(conn, neighbour.id)["status"] == "running",
            "id",
            "completing one job also completed another job held with the same fence number 1",
            "name the job: WHERE id = %(id)s",
        )
        hints.expect(
            row["lease_until"] is None,
            "lease",
            "the completed job is done but still holds a lease_until",
            "nobody holds a done job: lease_until = NULL",
        )
        (finished,) = conn.execute(
            "SELECT abs(extract(epoch FROM finished_at - now())) < 1 FROM jobs WHERE id = %s",
            [holder.id],
        ).fetchone() or (None,)
        hints.expect(
            finished,
            "finished-at",
            "the completed job is done, but its finished_at says "
            + ("nothing" if finished is None else "another time than this complete"),
            "finished_at = now(): pruning and the monitor read it",
        )
        again = complete(holder)
        hints.expect(
            again == 0,
            "status",
            "a second complete with the same fence changed the job's row again "
            "(the job was already done)",
            "only a running job can be completed: AND status = 'running'",
        )
        reaped = _claim(q, {"n": 3})
        _expire_and_reap(conn, q, reaped)
        changed = complete(reaped)
        hints.expect(
            changed == 0 and _row(conn, reaped.id)["status"] == "ready",
            "status",
            f"A's lease ran out and the reaper put the job back to ready (its fence "
            f"still {reaped.fence}); A's late complete then made it "
            f"{_row(conn, reaped.id)['status']!r}",
            "only a running job can be completed: AND status = 'running'",
        )
        [current] = q.claim("check", lease=30)
        changed = complete(reaped)
        row = _row(conn, reaped.id)
        hints.expect(
            changed == 0 and row["status"] == "running",
            "fence",
            f"A's late complete (fence {reaped.fence}) took effect, though "
            f"B holds the job with fence {current.fence} and is still working on it",
            "only the current holder may complete: AND fence = %(fence)s",
        )
    passed(
        "your complete made the holder's job done, with no lease and a finished_at, and "
        "changed no row for a second complete, a reaped job, a stale holder or another job"
    )


def check_side_write(dsn: str, statement: object) -> None:
    """Run the reader's side-table write ``statement`` (parameters %(id)s, %(body)s,
    %(job_id)s and %(fence)s) against a private ``reports`` table: it must insert a missing
    row with the job id and fence, let the same claim write again and a newer claim of the
    same job overwrite, and refuse an older fence and another job's write."""
    hints = WRITE_HINTS
    expect(
        isinstance(statement, str) and re.search(r"\b(insert|update)\b", statement, re.I),
        "WRITE should be a text holding one INSERT INTO reports ... ON CONFLICT ... statement",
    )
    assert isinstance(statement, str)
    names = "%(id)s, %(body)s, %(job_id)s and %(fence)s"
    with sandbox(dsn) as conn:
        conn.execute(
            "CREATE TEMP TABLE reports (id int PRIMARY KEY, body text NOT NULL, job_id bigint,"
            " fence bigint NOT NULL)"
        )

        def write(body: str, job_id: int, fence: int) -> int:
            params = {"id": 1, "body": body, "job_id": job_id, "fence": fence}
            return _run(conn, statement, params, names)

        def stored() -> tuple[Any, ...] | None:
            return conn.execute("SELECT body, job_id, fence FROM reports WHERE id = 1").fetchone()

        changed = write("by A", 7, 1)
        hints.expect(
            changed == 1 and stored() is not None,
            "insert",
            "report 1 did not exist yet, and your write added nothing",
            "an upsert: INSERT INTO reports (id, body, job_id, fence) VALUES (...) "
            "ON CONFLICT (id) DO UPDATE ...",
        )
        hints.expect(
            stored() == ("by A", 7, 1),
            "store",
            f"after job 7's first write with fence 1 the row holds (body, job_id, fence) = "
            f"{stored()}",
            "store the job id and the fence with the data: VALUES (%(id)s, %(body)s, "
            "%(job_id)s, %(fence)s)",
        )
        changed = write("by A, again", 7, 1)
        hints.expect(
            changed == 1 and stored() == ("by A, again", 7, 1),
            "equal",
            "the same claim (job 7, fence 1) wrote its report a second time and was refused: a "
            "handler that retries its write is told it lost a job it still holds",
            "accept an equal fence of the same job: reports.fence <= EXCLUDED.fence",
        )
        changed = write("by B", 7, 2)
        hints.expect(
            changed == 1 and stored() is not None and stored()[0] == "by B",  # type: ignore[index]
            "newer",
            "B, the new holder of job 7 (fence 2), wrote the report and was refused",
            "ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body, fence = EXCLUDED.fence WHERE ...",
        )
        hints.expect(
            stored() == ("by B", 7, 2),
            "fence-stored",
            f"after B's write with fence 2 the row holds (body, job_id, fence) = {stored()}",
            "the row keeps the newest fence: SET ..., fence = EXCLUDED.fence",
        )
        changed = write("by A, late", 7, 1)
        hints.expect(
            changed == 0 and stored() == ("by B", 7, 2),
            "stale",
            "A woke and wrote with its stale fence 1, and its report replaced B's of fence 2",
            "accept no older fence: ... WHERE reports.fence <= EXCLUDED.fence",
        )
        changed = write("by job 8", 8, 5)
        hints.expect(
            changed == 0 and stored() == ("by B", 7, 2),
            "other-job",
            "job 8, holding its own fence 5, overwrote the report job 7 wrote with fence 2: "
            "two jobs' fences were compared as if they were one counter",
            "the row belongs to the job that wrote it: AND reports.job_id = EXCLUDED.job_id",
        )
    passed(
        "your write inserted the missing report with job 7's id and fence, let the same claim "
        "write again and job 7's newer claim overwrite, and refused the stale fence 1 and "
        "job 8's write"
    )


Work = Callable[[psycopg.Connection, Job, str], tuple[object, object]]


class _Killed(BaseException):
    """The check's stand-in for a worker killed between two statements (a BaseException,
    so that an ``except Exception`` in the reader's code does not catch it)."""


class _KilledAfter:
    """A connection that runs ``statements`` statements and then dies: the next
    ``execute`` raises ``_Killed`` instead of running. Everything else is the connection's."""

    def __init__(self, conn: psycopg.Connection, statements: int) -> None:
        self._conn, self._left = conn, statements

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        if self._left == 0:
            raise _Killed("the worker was killed here")
        self._left -= 1
        return self._conn.execute(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def check_paused_worker(dsn: str, work: Work) -> None:
    """Replay the paused-worker story with the reader's ``work(conn, job, body)`` (one pass
    of a worker's loop: write report 1, complete the job; returns whether each took
    effect): A claims and freezes past its lease, the reaper returns the job, B claims and
    works; A wakes after B, and (second run) before B has written anything. Then a worker
    killed between its two statements must not leave a done job without its report."""
    hints = STORY_HINTS
    expect(callable(work), "work should be a function work(conn, job, body)")
    outcomes = {}
    for order in ("A wakes after B", "A wakes before B writes"):
        with sandbox(dsn) as conn:
            conn.execute(
                "CREATE TEMP TABLE reports (id int PRIMARY KEY, body text NOT NULL,"
                " job_id bigint, fence bigint NOT NULL)"
            )
            q = Queue(conn)
            a = _claim(q, {"report": 1})
            _expire_and_reap(conn, q, a)
            [b] = q.claim("check", lease=30)
            if order == "A wakes after B":
                b_did = work(conn, b, "report by B")
                a_did = work(conn, a, "report by A")
            else:
                a_did = work(conn, a, "report by A")
                b_did = work(conn, b, "report by B")
            report = conn.execute("SELECT body, fence FROM reports WHERE id = 1").fetchone()
            row = _row(conn, b.id)
        hints.expect(
            report == ("report by B", b.fence) and row["status"] == "done",
            f"story-{order}",
            f"{order}: the story ends with report {report} and the job {row['status']!r}, "
            f"not B's report (fence {b.fence}) and a done job",
            "run WRITE, then COMPLETE, with the job's own id and fence (job.id, job.fence)",
        )
        hints.expect(
            isinstance(b_did, tuple) and len(b_did) == 2 and all(b_did),
            "b-told",
            f"{order}: B's write and complete took effect, but your work returned {b_did!r}",
            "return (wrote, completed), each cursor.rowcount == 1",
        )
        told = a_did[1] if isinstance(a_did, tuple) and len(a_did) == 2 else a_did
        hints.expect(
            not told,
            "a-told",
            f"{order}: A's complete was refused, but your work told A {a_did!r}",
            "return (wrote, completed), each cursor.rowcount == 1: a refused statement "
            "changes 0 rows",
        )
        outcomes[order] = a_did
    # A worker killed between its two statements: whatever ran first stays. A report written
    # and a job still running is retried (the reaper returns it); a job done without its
    # report is never run again, and the report is lost.
    with sandbox(dsn) as conn:
        conn.execute(
            "CREATE TEMP TABLE reports (id int PRIMARY KEY, body text NOT NULL,"
            " job_id bigint, fence bigint NOT NULL)"
        )
        c = _claim(Queue(conn), {"report": 1})
        with suppress(_Killed):
            work(_KilledAfter(conn, 1), c, "report by C")  # type: ignore[arg-type]
        reported = conn.execute("SELECT count(*) FROM reports WHERE id = 1").fetchone()
        killed_row = _row(conn, c.id)
    hints.expect(
        not (killed_row["status"] == "done" and reported == (0,)),
        "order",
        "a worker killed between your two statements left the job done and report 1 "
        "missing: nobody runs a done job again, so the report is lost for good",
        "write the report first, then complete: killed in between, the job is still running "
        "and the reaper gives it to another worker, whose fenced write replaces the report",
    )
    late = outcomes["A wakes before B writes"]
    passed(
        "your statements survive the paused worker: whenever A wakes, the report is B's, the "
        "job is done by B and A's complete is refused, and a worker killed between them "
        "leaves no done job without its report"
        + (
            "; A's write into the still missing row went in and B's newer fence replaced it "
            "(pgqueue's job.fenced_write also checks the job row, and refuses it at once)"
            if isinstance(late, tuple) and late and late[0]
            else ""
        )
    )
