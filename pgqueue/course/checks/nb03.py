"""Checks for notebook 03, leases and the reaper: the reader's own reaper statement."""

from __future__ import annotations

import re

import psycopg

from ...db import first_line
from ..stories import sandbox
from . import expect, passed

# The jobs the reaper meets (a private copy of the table): id -> (status, lease_until,
# attempts, max_attempts, what a correct reaper leaves). Leases are relative to now().
_ROWS = {
    1: ("running", "-1 second", 1, 3, "ready"),  # ran out; attempts left
    2: ("running", "-5 seconds", 3, 3, "dead"),  # ran out on its last attempt
    3: ("running", "30 seconds", 1, 3, "running"),  # healthy: lease still good
    4: ("running", "30 seconds", 3, 3, "running"),  # healthy, last attempt: not dead yet
    5: ("done", "-10 seconds", 1, 3, "done"),  # finished (a lease_until left behind)
    6: ("ready", None, 2, 3, "ready"),  # waiting for a retry
}


def check_reaper(dsn: str, statement: object) -> None:
    """Run the reader's reaper ``statement`` (an UPDATE ... RETURNING id, status) against a
    private jobs table with expired and live leases, and check which jobs it returned."""
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
                "SELECT id, status, lease_until, attempts, fence, lease_until < now()"
                " FROM jobs ORDER BY id"
            ).fetchall()
        }
        for job_id in (3, 4):
            expect(
                job_id not in returned and rows[job_id][0] == "running",
                f"the reaper returned job {job_id}, whose lease has not run out (lease_until is "
                "30 s from now): compare lease_until with now()",
            )
        for job_id, what in ((5, "done"), (6, "ready, waiting for a retry")):
            expect(
                job_id not in returned and rows[job_id][0] == _ROWS[job_id][4],
                f"the reaper changed job {job_id}, which is {what}: only running jobs hold a "
                "lease, so add status = 'running' to the WHERE clause",
            )
        for job_id in (1, 2):
            expect(
                job_id in returned,
                f"job {job_id}'s lease ran out {_ROWS[job_id][1].lstrip('-')} ago, but your "
                "reaper did not return it: WHERE status = 'running' AND lease_until < now()",
            )
        expect(
            rows[1][0] == "ready",
            f"job 1 has used 1 of its 3 attempts, but your reaper made it {rows[1][0]!r}: it "
            "should be 'ready' for another worker",
        )
        expect(
            rows[2][0] == "dead",
            f"job 2 has used all 3 of its 3 attempts, but your reaper made it {rows[2][0]!r}: "
            "send it 'dead' (CASE WHEN attempts >= max_attempts THEN 'dead' ELSE 'ready' END)",
        )
        expect(
            returned == {1: "ready", 2: "dead"},
            f"your RETURNING says {returned}, but the rows say job 1 is {rows[1][0]} and job 2 "
            f"is {rows[2][0]}: return the new status",
        )
        for job_id in (1, 2):
            expect(
                rows[job_id][1] is None,
                f"job {job_id} came back but still holds a lease_until: set lease_until = NULL, "
                "nobody holds it now",
            )
            expect(
                rows[job_id][2] == _ROWS[job_id][2],
                f"your reaper changed job {job_id}'s attempts to {rows[job_id][2]}: only a "
                "claim counts an attempt, the reaper just hands the job back",
            )
        expect(
            rows[3][1] == before[3] and rows[4][1] == before[4],
            "your reaper changed the lease of a healthy job: leave running jobs with a "
            "lease in the future alone",
        )
        again = conn.execute(statement).fetchall()  # type: ignore[arg-type]
        expect(
            not again,
            f"a second run of your reaper right away returned {sorted(r[0] for r in again)} "
            "again: a returned job must no longer match the WHERE clause",
        )
    passed(
        "your reaper returned job 1 (ready) and job 2 (dead, no attempts left), left the two "
        "live leases and the jobs that were not running alone, and a second run found nothing"
    )
