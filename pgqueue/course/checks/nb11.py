"""Checks for notebook 11: the partial unique index that lets one live job hold a key."""

from __future__ import annotations

import threading

import psycopg

from ...db import first_line
from . import ExerciseFailed, expect, passed

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

    pool = [threading.Thread(target=insert) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]
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

        added = _together(dsn, "reports", "daily")
        expect(
            added == 1,
            f"8 concurrent enqueues of key 'daily' added {added} jobs: the index must be UNIQUE "
            "over the key",
        )
        expect(
            _insert(conn, "emails", "daily"),
            "a job of another queue could not use the key 'daily': keys are per queue, so the "
            "index must cover (queue, key)",
        )
        expect(
            _insert(conn, "reports", None) and _insert(conn, "reports", None),
            "two jobs without a key clashed: jobs with key NULL must never conflict",
        )

        def set_status(status: str) -> None:
            conn.execute(
                f"UPDATE {TABLE} SET status = %s WHERE queue = 'reports' AND key = 'daily' "
                "AND status IN ('ready', 'running')",
                [status],
            )

        set_status("running")
        expect(
            not _insert(conn, "reports", "daily"),
            "a new job took the key of a running job: a running job still holds its key",
        )
        for ended in ("done", "dead", "cancelled"):
            set_status(ended)
            expect(
                _insert(conn, "reports", "daily"),
                f"once its job is {ended} the key must be free again: make the index partial, "
                "WHERE status IN ('ready', 'running')",
            )
        (partial,) = conn.execute(
            "SELECT count(*) FROM pg_indexes WHERE tablename = %s AND indexdef ILIKE '%%WHERE%%'",
            [TABLE],
        ).fetchone() or (0,)
        conn.execute(f"DROP TABLE {TABLE}")
    expect(partial >= 1, "the index should be partial (a WHERE clause)")
    passed(
        "8 concurrent enqueues of one key added one job; the key is held while ready or "
        "running, free once done, dead or cancelled; per queue; no clash without a key"
    )
