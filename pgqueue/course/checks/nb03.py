"""Checks for notebook 03, leases and the reaper: the reader's own heartbeat and reaper
statements, run against a private copy of the jobs table, with hints in tiers (the symptom
first, the fragment at the second slip of a kind)."""

from __future__ import annotations

import re
from typing import Any

import psycopg

from ...db import first_line
from ...queue import Queue
from ..stories import sandbox
from . import compare_prediction, expect, passed, take_out
from .tiers import Hints

HEARTBEAT_HINTS = Hints()
REAPER_HINTS = Hints()

# The jobs the heartbeat meets: id -> (status, fence, lease_until from now, what it is).
_HELD = {
    1: ("running", 2, "2 seconds", "the holder's job: fence 2, lease nearly over"),
    2: ("running", 3, "20 seconds", "taken over: B holds it with fence 3, A still has 2"),
    3: ("ready", 2, None, "reaped: back to ready, fence still 2 until the next claim"),
    4: ("done", 2, None, "done by its holder with fence 2"),
    5: ("running", 2, "2 seconds", "another worker's job, also held with fence 2"),
}
LEASE = 30.0  # the lease the heartbeat asks for, in seconds


def _fill_held(conn: psycopg.Connection) -> None:
    for job_id, (status, fence, lease, _) in _HELD.items():
        conn.execute(
            "INSERT INTO jobs (id, queue, payload, status, attempts, fence, lease_until)"
            " VALUES (%s, 'videos', '{}', %s, 1, %s, now() + %s::interval)",
            [job_id, status, fence, lease],
        )


def _leases(conn: psycopg.Connection) -> dict[int, tuple[Any, ...]]:
    """Each job's status, attempts, fence and lease (seconds from now(), or None)."""
    rows = conn.execute(
        "SELECT id, status, attempts, fence,"
        " extract(epoch FROM lease_until - now())::float8 FROM jobs ORDER BY id"
    ).fetchall()
    return {row[0]: row[1:] for row in rows}


def check_heartbeat(dsn: str, statement: object) -> None:
    """Run the reader's heartbeat ``statement`` (parameters %(id)s, %(fence)s, %(lease)s)
    against a private jobs table: the holder's heartbeat must move its lease to now() +
    lease and change nothing else; a heartbeat with a stale fence, for a job that is no
    longer running, must change nothing."""
    hints = HEARTBEAT_HINTS
    expect(
        isinstance(statement, str) and re.search(r"\bupdate\b", statement, re.I),
        "HEARTBEAT should be a text holding one UPDATE jobs ... statement",
    )
    assert isinstance(statement, str)
    with sandbox(dsn) as conn:
        _fill_held(conn)
        before = _leases(conn)

        def beat(job_id: int, fence: int, lease: float = LEASE) -> int:
            params = {"id": job_id, "fence": fence, "lease": lease}
            try:
                return conn.execute(statement, params).rowcount  # type: ignore[arg-type]
            except psycopg.Error as exc:
                expect(False, f"PostgreSQL refused the statement: {first_line(exc)}")
            raise AssertionError("unreachable")

        changed = beat(1, 2)
        after = _leases(conn)
        hints.expect(
            changed >= 1 and after[1][3] is not None and after[1][3] > 5,
            "renew",
            f"the holder of job 1 (fence 2, running) heartbeat, but its lease still ends in "
            f"{after[1][3] or 0:.0f} s: the heartbeat did not renew it",
            "SET lease_until = now() + make_interval(secs => %(lease)s)",
        )
        hints.expect(
            after[5] == before[5],
            "id",
            "a heartbeat for job 1 also renewed job 5, another job held with the same fence 2",
            "name the job: WHERE id = %(id)s",
        )
        hints.expect(
            abs(after[1][3] - LEASE) < 1,
            "from-now",
            f"after a heartbeat asking for a {LEASE:g} s lease, job 1's lease ends "
            f"{after[1][3]:.0f} s from now",
            "a renewal counts from the database's now(), not from the old lease_until: "
            "lease_until = now() + make_interval(secs => %(lease)s)",
        )
        hints.expect(
            after[1][:3] == before[1][:3],
            "only-lease",
            f"your heartbeat changed job 1's (status, attempts, fence) from {before[1][:3]} to "
            f"{after[1][:3]}: its holder's next write with fence 2 would be judged by those",
            "a heartbeat sets lease_until only; the fence rises at a claim or a fail",
        )
        beat(1, 2, lease=7.0)
        seven = _leases(conn)[1][3]
        hints.expect(
            abs(seven - 7.0) < 1,
            "lease-param",
            f"a heartbeat asking for a 7 s lease left job 1 with {seven:.0f} s",
            "take the length from the parameter: make_interval(secs => %(lease)s)",
        )
        stale = beat(2, 2)
        hints.expect(
            stale == 0 and _leases(conn)[2] == before[2],
            "fence",
            "A, holding the stale fence 2, heartbeat job 2 and its lease moved, though B holds "
            "the job with fence 3: A is not told it lost the job",
            "only the current holder may renew: AND fence = %(fence)s",
        )
        for job_id in (3, 4):
            changed = beat(job_id, 2)
            now = _leases(conn)[job_id]
            hints.expect(
                changed == 0 and now == before[job_id],
                "status",
                f"a heartbeat with fence 2 renewed job {job_id} ({_HELD[job_id][3]}): the "
                f"row now says {now[0]} with a lease, and its old holder thinks it still has it",
                "a job that is not running has no lease to renew: AND status = 'running'",
            )
    passed(
        "your heartbeat moved the holder's lease to now() + lease and nothing else, and "
        "changed no row for a stale fence, a reaped job or a done one"
    )


# The jobs the reaper meets (a private copy of the table): id -> (status, lease_until,
# attempts, max_attempts, what a correct reaper leaves). Leases are relative to now().
_ROWS = {
    1: ("running", "-1 second", 1, 3, "ready"),  # ran out; attempts left
    2: ("running", "-5 seconds", 3, 3, "dead"),  # ran out on its last attempt
    3: ("running", "30 seconds", 1, 3, "running"),  # healthy: lease still good
    4: ("running", "30 seconds", 3, 3, "running"),  # healthy, last attempt: not dead yet
    5: ("done", "-10 seconds", 1, 3, "done"),  # finished (a lease_until left behind)
    6: ("ready", None, 2, 3, "ready"),  # waiting for a retry
    7: ("running", "2 seconds", 1, 3, "running"),  # about to run out, but not yet
}


def check_reaper(dsn: str, statement: object) -> None:
    """Run the reader's reaper ``statement`` (an UPDATE ... RETURNING id, status) against a
    private jobs table with expired and live leases, and check which jobs it returned."""
    hints = REAPER_HINTS
    expect(
        isinstance(statement, str) and re.search(r"\bupdate\b", statement, re.I),
        "REAP should be a text holding one UPDATE jobs ... RETURNING id, status statement",
    )
    assert isinstance(statement, str)
    with sandbox(dsn) as conn:
        for job_id, (status, lease, attempts, most, _) in _ROWS.items():
            conn.execute(
                "INSERT INTO jobs (id, queue, payload, status, lease_until, attempts,"
                " max_attempts, fence, run_at)"
                " VALUES (%s, 'videos', '{}', %s, now() + %s::interval, %s, %s, %s,"
                "         now() - interval '1 minute')",
                [job_id, status, lease, attempts, most, attempts],
            )
        before = dict(conn.execute("SELECT id, lease_until FROM jobs").fetchall())
        try:
            cur = conn.execute(statement)  # type: ignore[arg-type]  # the reader's own SQL
        except psycopg.Error as exc:
            expect(False, f"PostgreSQL refused the statement: {first_line(exc)}")
        expect(
            cur.description is not None,
            "your statement returns no rows: end it with RETURNING id, status",
        )
        names = [c.name for c in cur.description or []]
        expect(
            names[:2] == ["id", "status"],
            f"your statement returns ({', '.join(names)}): make it RETURNING id, status",
        )
        returned = {row[0]: row[1] for row in cur.fetchall()}
        rows = {
            row[0]: row[1:]
            for row in conn.execute(
                "SELECT id, status, lease_until, attempts, fence,"
                " abs(extract(epoch FROM finished_at - now())) < 1,"
                " abs(extract(epoch FROM run_at - now())) < 1 FROM jobs ORDER BY id"
            ).fetchall()
        }
        for job_id in (3, 4):
            hints.expect(
                job_id not in returned and rows[job_id][0] == "running",
                "live-lease",
                f"the reaper returned job {job_id}, whose lease ends 30 s from now",
                "compare lease_until with now(): lease_until < now()",
            )
        hints.expect(
            7 not in returned and rows[7][0] == "running",
            "early",
            "the reaper returned job 7, whose lease still has 2 s to run: its worker may be "
            "about to heartbeat, and now two workers hold the job",
            "a lease ends when lease_until has passed, not shortly before: lease_until < now()",
        )
        for job_id, what in ((5, "done"), (6, "ready, waiting for a retry")):
            hints.expect(
                job_id not in returned and rows[job_id][0] == _ROWS[job_id][4],
                "not-running",
                f"the reaper changed job {job_id}, which is {what} (its lease_until is a leftover)",
                "only running jobs hold a lease: add status = 'running' to the WHERE clause",
            )
        for job_id in (1, 2):
            hints.expect(
                job_id in returned,
                "missed",
                f"job {job_id}'s lease ran out {_ROWS[job_id][1].lstrip('-')} ago, but your "
                "reaper did not return it",
                "WHERE status = 'running' AND lease_until < now()",
            )
        hints.expect(
            rows[1][0] == "ready",
            "ready",
            f"job 1 has used 1 of its 3 attempts, but your reaper made it {rows[1][0]!r}",
            "it should be 'ready' for another worker",
        )
        hints.expect(
            rows[2][0] == "dead",
            "dead",
            f"job 2 has used all 3 of its 3 attempts, but your reaper made it {rows[2][0]!r}",
            "CASE WHEN attempts >= max_attempts THEN 'dead' ELSE 'ready' END",
        )
        expect(
            returned == {1: "ready", 2: "dead"},
            f"your RETURNING says {returned}, but the rows say job 1 is {rows[1][0]} and job 2 "
            f"is {rows[2][0]}: return the new status",
        )
        hints.expect(
            rows[2][4] is True,
            "finished-at",
            "job 2 is dead, but its finished_at says "
            + ("nothing" if rows[2][4] is None else "another time than this reap"),
            "a dead job is finished: finished_at = CASE WHEN attempts >= max_attempts "
            "THEN now() END",
        )
        hints.expect(
            rows[1][4] is None,
            "finished-early",
            "job 1 goes back to ready, but your reaper gave it a finished_at",
            "only the dead job is finished: CASE WHEN attempts >= max_attempts THEN now() END",
        )
        for job_id in (1, 2):
            hints.expect(
                rows[job_id][1] is None,
                "lease-left",
                f"job {job_id} came back but still holds a lease_until",
                "set lease_until = NULL: nobody holds it now",
            )
            hints.expect(
                rows[job_id][2] == _ROWS[job_id][2],
                "attempts",
                f"your reaper changed job {job_id}'s attempts to {rows[job_id][2]}",
                "only a claim counts an attempt; the reaper just hands the job back",
            )
        hints.expect(
            rows[1][5] is True,
            "run-at",
            "job 1 is ready again, but its run_at still says a minute ago: claims take the "
            "oldest run_at first, so it would jump ahead of every job already waiting",
            "set run_at = now(): a returned job goes to the back of the line",
        )
        hints.expect(
            rows[3][1] == before[3] and rows[4][1] == before[4] and rows[7][1] == before[7],
            "live-changed",
            "your reaper changed the lease of a healthy job",
            "leave running jobs with a lease in the future alone",
        )
        again = conn.execute(statement).fetchall()  # type: ignore[arg-type]
        hints.expect(
            not again,
            "again",
            f"a second run of your reaper right away returned {sorted(r[0] for r in again)} again",
            "a returned job must no longer match the WHERE clause",
        )
    passed(
        "your reaper returned job 1 (ready, at the back of the line) and job 2 (dead, "
        "finished now, no attempts left), left the three live leases (one with 2 s to go) and "
        "the jobs that were not running alone, and a second run found nothing"
    )


def without_run_at(statement: object) -> str:
    """The reader's REAP without its ``run_at = now()``."""
    return take_out(
        statement,
        r"run_at\s*=\s*now\(\)\s*,\s*|,\s*run_at\s*=\s*now\(\)",
        "run_at = now()",
        "REAP",
    )


def _next_claim(dsn: str, statement: str) -> dict[str, object]:
    """Job 1 was claimed a minute ago and its worker died; jobs 2 and 3 have waited 10 and
    5 seconds. The reaper (``statement``) runs, then one claim of one job: which it takes,
    and how long ago job 1's run_at says it became due."""
    with sandbox(dsn) as conn:
        conn.execute(
            "INSERT INTO jobs (id, queue, payload, status, lease_until, attempts, fence,"
            " run_at) VALUES"
            " (1, 'videos', '{}', 'running', now() - interval '1 second', 1, 1,"
            "  now() - interval '1 minute'),"
            " (2, 'videos', '{}', 'ready', NULL, 0, 0, now() - interval '10 seconds'),"
            " (3, 'videos', '{}', 'ready', NULL, 0, 0, now() - interval '5 seconds')"
        )
        try:
            conn.execute(statement)  # type: ignore[arg-type]  # the reader's own SQL
        except psycopg.Error as exc:
            expect(False, f"PostgreSQL refused the statement: {first_line(exc)}")
        (due,) = conn.execute(
            "SELECT round(extract(epoch FROM now() - run_at))::int FROM jobs WHERE id = 1"
        ).fetchone() or (None,)
        [job] = Queue(conn).claim("videos", limit=1, lease=30)
        return {"next_claimed": job.id, "job_1_due_s_ago": due}


def check_reaper_without_run_at(dsn: str, statement: object, prediction: object) -> None:
    """The reader's REAP with ``run_at = now()`` taken out, then the next claim; the
    reader's prediction of which job it takes, and the whole reaper run beside it."""
    broken = _next_claim(dsn, without_run_at(statement))
    compare_prediction(
        prediction,
        broken,
        {
            "next_claimed": "claims take the earliest run_at first, and job 1's still says "
            "when it was first due, a minute ago: it jumps ahead of jobs 2 and 3",
            "job_1_due_s_ago": "without run_at = now() the reaper leaves the run_at it had "
            "when it was first claimed",
        },
    )
    real = _next_claim(dsn, str(statement))
    expect(
        real["next_claimed"] == 2,
        f"with run_at = now() the next claim should take job 2, but it took {real}",
    )
    passed(
        "right: without run_at = now() the returned job keeps its old place and jumps ahead of "
        "every job waiting (job 1 first); with it (run too) job 1 goes to the back of the line "
        "and job 2, waiting longest, is next"
    )
