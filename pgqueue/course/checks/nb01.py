"""Checks for notebook 01, the jobs table: the partial index that keeps the claim cheap."""

from __future__ import annotations

import re
from typing import Any

import psycopg

from ...db import connect, first_line
from .. import lab
from . import expect, passed
from .tiers import Hints

# The claim's inner SELECT (sql/queries.sql, name "claim"): what the ready index must serve.
CLAIM_SELECT = """
    SELECT id FROM jobs
    WHERE queue = 'emails' AND status = 'ready' AND run_at <= now()
    ORDER BY priority DESC, run_at, id
    LIMIT 10
    FOR UPDATE SKIP LOCKED
"""
DONE_ROWS = 20_000
READY_ROWS = 40
HINTS = Hints()  # the tiers of this exercise's hints, for as long as the kernel lives


def _fill(conn: psycopg.Connection) -> None:
    """Finished jobs older than every ready one (a table never pruned), then ready jobs of
    mixed priority, in a queue of their own and a second queue beside it."""
    conn.execute(
        "INSERT INTO jobs (queue, payload, status, run_at, attempts, fence, finished_at)"
        " SELECT 'emails', '{}', 'done', now() - interval '1 day', 1, 1,"
        "        now() - interval '1 day'"
        " FROM generate_series(1, %s)",
        [DONE_ROWS],
    )
    conn.execute(
        "INSERT INTO jobs (queue, payload, priority)"
        " SELECT q, '{}', g %% 3 FROM generate_series(1, %s) AS g,"
        "      unnest(ARRAY['emails', 'reports']) AS q",
        [READY_ROWS // 2],
    )


def _plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan, depth first."""
    nodes = [plan]
    for child in plan.get("Plans", []):
        nodes += _plan_nodes(child)
    return nodes


def check_ready_index(statement: object) -> None:
    """Run the reader's CREATE INDEX on a table of finished and ready jobs (in a scratch
    database, without pgqueue's own ready index) and check that it holds only the ready
    jobs and that the claim reads them from it in the claim's order, without a sort."""
    expect(
        isinstance(statement, str) and re.search(r"\bcreate\b.*\bindex\b", statement, re.I | re.S),
        "ready_index should be a text holding one CREATE INDEX ... ON jobs (...) statement",
    )
    assert isinstance(statement, str)
    with lab.scratch_database("course_01_exercise") as dsn, connect(dsn) as conn:
        conn.execute("DROP INDEX jobs_ready_idx")
        _fill(conn)
        before = {r[0] for r in conn.execute("SELECT indexname FROM pg_indexes").fetchall()}
        try:
            conn.execute(statement)  # type: ignore[arg-type]  # the reader's own SQL
        except psycopg.Error as exc:
            expect(False, f"PostgreSQL refused the statement: {first_line(exc)}")
        conn.execute("ANALYZE jobs")
        new = conn.execute(
            "SELECT indexname, indexdef, pg_relation_size(format('%%I', indexname)::regclass)"
            " FROM pg_indexes WHERE tablename = 'jobs' AND NOT indexname = ANY(%s)",
            [list(before)],
        ).fetchall()
        expect(new, "the statement made no new index on the jobs table: CREATE INDEX ... ON jobs")
        expect(len(new) == 1, f"make one index, not {len(new)}")
        name, definition, size = new[0]
        table = conn.execute("SELECT pg_relation_size('jobs')").fetchone()[0]
        where = definition.partition(" WHERE ")[2]
        HINTS.expect(
            where,
            "no-where",
            f"your index holds every row, the {DONE_ROWS:,} finished jobs too ({size // 1024} kB "
            f"beside a {table // 1024} kB table), though the claim only ever reads ready ones",
            "make it partial: WHERE status = 'ready'",
        )
        HINTS.expect(
            re.fullmatch(r"\(?status = 'ready'::text\)?", where.strip()),
            "where",
            f"your index keeps the rows WHERE {where}, not the rows the claim looks for",
            "the claim looks for status = 'ready', so the index should hold exactly those rows",
        )
        columns = definition.partition(" USING btree ")[2].partition(" WHERE ")[0]
        HINTS.expect(
            columns.startswith("(queue"),
            "queue-first",
            f"your index is on {columns}: the claim cannot go straight to one queue's jobs in it",
            "the claim picks one queue first (WHERE queue = ...), so queue comes first",
        )
        (plan,) = conn.execute("EXPLAIN (FORMAT JSON) " + CLAIM_SELECT).fetchone()[0]
        nodes = _plan_nodes(plan["Plan"])
        used = {n.get("Index Name") for n in nodes}
        kinds = [n["Node Type"] for n in nodes]
        HINTS.expect(
            name in used,
            "unused",
            f"the claim does not use your index {columns} (the plan: {' > '.join(kinds)})",
            "put queue first, then the claim's ORDER BY columns",
        )
        HINTS.expect(
            not any("Sort" in kind for kind in kinds),
            "sorts",
            f"the claim reads your index {columns} but still sorts the ready jobs (the plan: "
            f"{' > '.join(kinds)})",
            "list priority DESC, run_at, id after queue, in the claim's ORDER BY order",
        )
    expect(size * 20 < table, f"your index takes {size // 1024} kB for {READY_ROWS} ready jobs")
    passed(
        f"{name} holds only the {READY_ROWS} ready jobs, and the claim reads it in order: "
        "no sort, no finished job read"
    )
