"""Checks for notebook 12: the aging statement that raises ready jobs waiting past a bound to
the top priority, with hints in tiers (what the statement did first, the fix at the second
slip of a kind)."""

from __future__ import annotations

import psycopg

from ...db import first_line
from . import ExerciseFailed, expect, passed
from .tiers import Hints

HINTS = Hints()

QUEUE, TOP, AFTER = "aging-check", 10, 1.0

# The jobs the statement is run against, in one transaction rolled back afterwards: name,
# queue, status, priority, and how many seconds ago run_at was (negative: in the future).
JOBS = [
    ("waited", QUEUE, "ready", 0, 5.0),  # past the bound: raised to the top
    ("fresh", QUEUE, "ready", 0, 0.2),  # not yet
    ("delayed", QUEUE, "ready", 0, -60.0),  # not due for a minute
    ("running", QUEUE, "running", 0, 5.0),  # claimed already: nothing to raise
    ("other queue", "elsewhere", "ready", 0, 5.0),  # another queue's business
    ("above the top", QUEUE, "ready", 20, 5.0),  # must not be lowered
    ("at the top", QUEUE, "ready", TOP, 5.0),  # nothing to change: not rewritten
    ("urgent, new", QUEUE, "ready", TOP, 0.1),  # the urgent job that came just now
]


def check_aging(statement: object, dsn: str) -> None:
    """``statement`` (an ``UPDATE jobs`` with ``%(queue)s``, ``%(top)s``, ``%(after)s``)
    raises to ``top`` exactly the ready jobs of ``queue`` whose ``run_at`` is more than
    ``after`` seconds past, rewrites no other row, and keeps their ``run_at``, so that the
    claim's order puts an aged job before an urgent job that came later."""
    expect(
        isinstance(statement, str) and statement.strip(),
        "AGING should be the text of an UPDATE statement",
    )
    assert isinstance(statement, str)
    hints = HINTS
    params = {"queue": QUEUE, "top": TOP, "after": AFTER}
    with psycopg.connect(dsn) as conn:  # one transaction, rolled back: the table is unchanged
        ids = {}
        for name, queue, status, priority, ago in JOBS:
            (ids[name],) = conn.execute(
                "INSERT INTO jobs (queue, payload, status, priority, run_at)"
                " VALUES (%s, '{}', %s, %s, now() - make_interval(secs => %s)) RETURNING id",
                [queue, status, priority, ago],
            ).fetchone() or (0,)
        before = _rows(conn, ids)
        try:
            touched = conn.execute(statement, params).rowcount  # type: ignore[arg-type]
        except psycopg.Error as exc:
            raise ExerciseFailed(f"the statement failed: {first_line(exc)}") from None
        after = _rows(conn, ids)
        order = [
            name
            for (job_id,) in conn.execute(
                "SELECT id FROM jobs WHERE status = 'ready' AND run_at <= now()"
                " ORDER BY priority DESC, run_at, id"
            ).fetchall()
            for name, i in ids.items()
            if i == job_id
        ]
        conn.rollback()

    def priority(name: str) -> int:
        return int(after[name][0])

    hints.expect(
        priority("waited") == TOP,
        "raise",
        f"the ready job that waited 5 s has priority {priority('waited')}, not {TOP}",
        "SET priority = %(top)s for ready jobs of the queue whose run_at is older than "
        "now() - make_interval(secs => %(after)s)",
    )
    hints.expect(
        priority("fresh") == 0,
        "age",
        "a job that waited 0.2 s was raised, with a bound of 1 s",
        "raise only jobs past the bound: AND run_at < now() - make_interval(secs => %(after)s)",
    )
    hints.expect(
        priority("running") == 0,
        "status",
        "a running job's priority was changed: it has been claimed already",
        "age ready jobs only: AND status = 'ready'",
    )
    hints.expect(
        priority("other queue") == 0,
        "queue",
        "a job of another queue was raised",
        "age the queue you were given: WHERE queue = %(queue)s",
    )
    hints.expect(
        priority("above the top") == 20,
        "lowered",
        f"a job of priority 20 now has {priority('above the top')}: aging lowered it",
        "raise only jobs below the top: AND priority < %(top)s",
    )
    hints.expect(
        all(after[name][1] == before[name][1] for name in ids),
        "run-at",
        "the statement changed run_at: an aged job then queues behind the urgent jobs "
        "already waiting, and waits again",
        "set the priority alone; the kept run_at puts the aged job first among the top",
    )
    hints.expect(
        touched == 1,
        "rewrite",
        f"the statement rewrote {touched} rows to raise one: each row an UPDATE touches "
        "leaves a dead row version behind (notebook 09), every tick",
        "leave the jobs already at the top out: AND priority < %(top)s",
    )
    expect(
        order.index("waited") < order.index("urgent, new"),
        f"the claim would take the jobs in this order: {', '.join(order)}",
    )
    passed(
        "one job raised to the top, its run_at kept: the claim now takes it before the urgent "
        "job that came after it; fresh, delayed, running, other-queue and higher jobs untouched"
    )


def _rows(conn: psycopg.Connection, ids: dict[str, int]) -> dict[str, tuple[int, object]]:
    """Each job's priority and run_at, by name."""
    rows = dict(
        (job_id, (priority, run_at))
        for job_id, priority, run_at in conn.execute(
            "SELECT id, priority, run_at FROM jobs WHERE id = ANY(%s)", [list(ids.values())]
        ).fetchall()
    )
    return {name: rows[job_id] for name, job_id in ids.items()}
