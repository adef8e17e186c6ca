"""Checks for notebook 12: the partial unique index that lets one live job hold a key, with
hints in tiers (what the inserts did first, the fix at the second slip of a kind)."""

from __future__ import annotations

import threading

import psycopg

from ...db import first_line
from ..lab import run_threads
from . import ExerciseFailed, expect, passed
from .tiers import Hints

HINTS = Hints()

TABLE = "my_jobs"


def _insert(conn: psycopg.Connection, queue: str, key: str | None) -> bool:
    """Insert a ready job; False if a unique index refused it."""
    try:
        conn.execute(
            f"INSERT INTO {TABLE} (queue, payload, key) VALUES (%s, '{{}}', %s)", [queue, key]
        )
        return True
    except psycopg.errors.UniqueViolation:
        return False


def _together(dsn: str, queue: str, key: str, threads: int = 8) -> int:
    """``threads`` connections insert a job with ``key`` at once; how many were added."""
    start = threading.Barrier(threads)
    added: list[bool] = []
    errors: list[BaseException] = []

    def insert() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                start.wait()
                added.append(_insert(conn, queue, key))
        except BaseException as exc:
            errors.append(exc)
            start.abort()

    run_threads([threading.Thread(target=insert) for _ in range(threads)], errors)
    return sum(added)


def check_key_index(ddl: object, dsn: str) -> None:
    """``ddl`` creates an index on ``my_jobs`` (a copy of ``jobs``) such that concurrent
    enqueues of one key add one job, the key is held while the job is ready or running and
    free once it is done, dead or cancelled, per queue, and jobs without a key never clash."""
    expect(isinstance(ddl, str) and ddl.strip(), "KEY_INDEX should be a CREATE INDEX statement")
    assert isinstance(ddl, str)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
        conn.execute(f"CREATE TABLE {TABLE} (LIKE jobs INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
        conn.execute(f"ALTER TABLE {TABLE} ADD PRIMARY KEY (id)")
        try:
            conn.execute(ddl)
        except psycopg.Error as exc:
            raise ExerciseFailed(f"the statement failed: {first_line(exc)}") from None
        (indexes,) = conn.execute(
            "SELECT count(*) FROM pg_indexes WHERE tablename = %s AND indexname NOT LIKE '%%_pkey'",
            [TABLE],
        ).fetchone() or (0,)
        expect(indexes >= 1, f"no index was created on {TABLE}: write CREATE ... ON {TABLE}")

        hints = HINTS
        added = _together(dsn, "reports", "daily")
        hints.expect(
            added == 1,
            "unique",
            f"8 concurrent enqueues of key 'daily' on 'reports' added {added} jobs",
            "only a unique index refuses the second: CREATE UNIQUE INDEX ... ON my_jobs (queue, "
            "key)",
        )
        hints.expect(
            _insert(conn, "emails", "daily"),
            "per-queue",
            "a job of the queue 'emails' was refused the key 'daily', which only a job of "
            "'reports' holds",
            "keys are per queue: the index covers (queue, key)",
        )
        hints.expect(
            _insert(conn, "reports", None) and _insert(conn, "reports", None),
            "null-key",
            "two jobs without a key (key NULL) clashed",
            "index the key itself: a unique index never counts two NULLs as equal (no COALESCE)",
        )

        def set_status(status: str) -> None:
            conn.execute(
                f"UPDATE {TABLE} SET status = %s WHERE queue = 'reports' AND key = 'daily' "
                "AND status IN ('ready', 'running')",
                [status],
            )

        set_status("running")
        hints.expect(
            not _insert(conn, "reports", "daily"),
            "running",
            "the job holding 'daily' started running, and a new job with the key 'daily' went in "
            "beside it",
            "a running job still holds its key: WHERE status IN ('ready', 'running')",
        )
        for ended in ("done", "dead", "cancelled"):
            set_status(ended)
            hints.expect(
                _insert(conn, "reports", "daily"),
                "ended",
                f"the job holding 'daily' is {ended}, and a new job with the key was refused",
                "make the index partial, over the live jobs only: WHERE status IN ('ready', "
                "'running')",
            )
        (partial,) = conn.execute(
            "SELECT count(*) FROM pg_indexes WHERE tablename = %s AND indexdef ILIKE '%%WHERE%%'",
            [TABLE],
        ).fetchone() or (0,)
        conn.execute(f"DROP TABLE {TABLE}")
    HINTS.expect(
        partial >= 1,
        "partial",
        "your index holds every job, finished or not, though only live ones can clash",
        "make it partial: ... WHERE status IN ('ready', 'running')",
    )
    passed(
        "8 concurrent enqueues of one key added one job; the key is held while ready or "
        "running, free once done, dead or cancelled; per queue; no clash without a key"
    )
