"""Checks for notebook 04, fencing tokens: the reader's fenced ``fail``, and a prediction
of what breaks when ``complete`` ignores the fence."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import psycopg

from ...db import first_line
from ...job import Job
from ...queue import Queue
from .. import lab
from ..stories import sandbox
from . import expect, passed

BACKOFF = 2.0  # seconds; the check's backoff, so the first retry waits 2 * 2**1 = 4 s


def _claim(q: Queue, payload: dict[str, Any], max_attempts: int = 3) -> Job:
    q.enqueue(payload, queue="check", max_attempts=max_attempts)
    [job] = q.claim("check", lease=30)
    return job


def _row(conn: psycopg.Connection, job_id: int) -> dict[str, Any]:
    cur = conn.execute(
        "SELECT status, attempts, fence, lease_until, last_error,"
        " extract(epoch FROM run_at - now())::float8 AS retry_in FROM jobs WHERE id = %s",
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

        # 1. The holder fails: retry with backoff, the fence rises, the lease is cleared.
        holder = _claim(q, {"n": 1})
        changed = fail(holder)
        expect(
            changed == 1,
            f"your fail changed {changed} rows for the job's current holder (fence "
            f"{holder.fence}, status running): it should change exactly that job's row",
        )
        row = _row(conn, holder.id)
        expect(
            row["fence"] != holder.fence,
            f"after your fail the job's fence is still {holder.fence}: raise it "
            "(fence = fence + 1), so nothing more from this attempt is accepted",
        )
        expect(
            row["fence"] == holder.fence + 1,
            f"your fail moved the fence from {holder.fence} to {row['fence']}: raise it by "
            "exactly one (fence = fence + 1); it must never go down",
        )
        expect(
            row["status"] == "ready",
            f"job {holder.id} has used 1 of its 3 attempts, but your fail made it "
            f"{row['status']!r}: it should be 'ready' to be tried again",
        )
        expect(
            row["attempts"] == holder.attempts,
            f"your fail changed attempts to {row['attempts']}: only the claim counts an "
            "attempt, so leave attempts alone",
        )
        expect(
            row["lease_until"] is None,
            "after your fail the job still holds a lease_until: set lease_until = NULL, "
            "nobody holds the job now",
        )
        expect(
            row["last_error"] == "ConnectionError: service unavailable",
            f"last_error is {row['last_error']!r}: store the error text, last_error = %(error)s",
        )
        wanted = BACKOFF * 2**holder.attempts
        expect(
            abs(row["retry_in"] - wanted) < 1e-3,
            f"the retry should wait backoff * 2^attempts = {BACKOFF:g} * 2^{holder.attempts} = "
            f"{wanted:g} s from now(), yours waits {row['retry_in']:g} s: run_at = now() + "
            "make_interval(secs => %(backoff)s * power(2, attempts))",
        )
        # 2. The same holder fails again: the first fail ended its attempt.
        again = fail(holder, "second fail")
        expect(
            again == 0 and _row(conn, holder.id)["last_error"] != "second fail",
            f"a second fail with the same fence {holder.fence} changed job {holder.id} again: "
            "the first fail ended that attempt, so check AND fence = %(fence)s AND "
            "status = 'running'",
        )
        # 3. A stale holder: the lease ran out, the reaper returned the job, B claimed it.
        stale = _claim(q, {"n": 2})
        conn.execute(
            "UPDATE jobs SET lease_until = now() - interval '1 second' WHERE id = %s", [stale.id]
        )
        q.reap()
        [current] = q.claim("check", lease=30)
        changed = fail(stale)
        row = _row(conn, stale.id)
        expect(
            changed == 0 and row["status"] == "running" and row["fence"] == current.fence,
            f"your fail changed job {stale.id} although the caller's fence {stale.fence} is "
            f"stale (another worker holds the job with fence {current.fence}): add "
            "AND fence = %(fence)s",
        )
        # 4. A job already done: its fence did not change, its status did.
        done = _claim(q, {"n": 3})
        q.complete(done)
        changed = fail(done)
        expect(
            changed == 0 and _row(conn, done.id)["status"] == "done",
            f"your fail changed job {done.id}, which is already done (its fence is still "
            f"{done.fence}): add AND status = 'running'",
        )
        # 5. The last attempt: dead, not ready.
        last = _claim(q, {"n": 4}, max_attempts=1)
        fail(last)
        row = _row(conn, last.id)
        expect(
            row["status"] == "dead",
            f"job {last.id} used its last attempt (1 of 1), but your fail made it "
            f"{row['status']!r}: CASE WHEN attempts >= max_attempts THEN 'dead' ELSE 'ready' END",
        )
        expect(
            row["fence"] == last.fence + 1,
            "a fail that sends a job dead must raise the fence too: nothing more from that "
            "attempt should be accepted",
        )
    passed(
        f"your fail retried the job in {wanted:g} s with its fence raised by one, refused a "
        "second fail, a stale holder's fail and a fail of a done job, and sent a job on its "
        "last attempt dead"
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
