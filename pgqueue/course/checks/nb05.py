"""Checks for notebook 05: the idempotency table that guards an e-mail send, and the partial
unique index that lets one live job hold an enqueue key, with hints in tiers (what the runs
did first, the fix at the second slip of a kind)."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg

from ...db import first_line
from ...job import Job
from ..idempotency import FakeMailer, paused_worker_story
from ..lab import run_threads
from . import ExerciseFailed, expect, passed
from .tiers import Hints

HINTS = Hints()  # the guard's
KEY_HINTS = Hints()  # the key index's


def check_guard(guard: object, dsn: str) -> None:
    """Replay the paused worker with a handler that sends only when ``guard`` (an INSERT into
    ``sent_emails`` with ``%(job_id)s``, ``%(to)s``) added a row: one e-mail, not two, no
    error; and a different job still gets its own e-mail."""
    expect(
        isinstance(guard, str) and guard.strip(),
        "GUARD should be the text of an INSERT statement",
    )
    assert isinstance(guard, str)
    hints = HINTS
    hints.expect(
        "%(job_id)s" in guard,
        "job-id",
        "your guard never uses %(job_id)s, the one parameter that is the same for every run "
        "of the job",
        "key the row on the job (the fence changes from run to run): INSERT INTO sent_emails "
        "(job_id, to_addr) VALUES (%(job_id)s, %(to)s)",
    )
    mailer = FakeMailer()
    errors: list[str] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE sent_emails")

    def send_welcome(job: Job) -> None:
        assert job.conn is not None
        time.sleep(0.2)  # render the e-mail
        params: dict[str, Any] = {"job_id": job.id, "to": job.payload["to"], "fence": job.fence}
        try:
            won = job.conn.execute(guard, params).rowcount == 1
        except psycopg.Error as exc:
            errors.append(f"{type(exc).__name__}: {first_line(exc)}")
            raise
        if won:
            mailer.send(job.payload["to"], "Welcome!", job=job)

    job_id, _ = paused_worker_story(dsn, send_welcome, payload={"to": "check@example.com"})
    duplicate = [e for e in errors if e.startswith("UniqueViolation")]
    hints.expect(
        not duplicate,
        "conflict",
        f"the late run's guard raised {duplicate[0] if duplicate else ''}: one e-mail, but "
        "a duplicate run now ends in an error that looks like a bug (and after a crash "
        "between the row and the completion, every later attempt fails the same way)",
        "a run that finds the job's row should add nothing, quietly: ON CONFLICT (job_id) DO "
        "NOTHING",
    )
    expect(not errors, f"the guard failed: {errors[0] if errors else ''}")
    hints.expect(
        len(mailer.delivered) <= 1,
        "twice",
        f"{len(mailer.delivered)} e-mails went out for job {job_id}: the guard's rowcount was "
        "1 for both runs",
        "DO UPDATE counts as a row too: a run that finds the row must change nothing, ON "
        "CONFLICT (job_id) DO NOTHING",
    )
    hints.expect(
        len(mailer.delivered) == 1,
        "none",
        f"no e-mail went out for job {job_id}: the guard's rowcount was 0 even for the first run",
        "the first run must add the row: INSERT INTO sent_emails (job_id, to_addr) VALUES "
        "(%(job_id)s, %(to)s)",
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        other = {"job_id": job_id + 1_000_000, "to": "other@example.com", "fence": 1}
        try:
            first = conn.execute(guard, other).rowcount
        except psycopg.Error as exc:
            raise ExerciseFailed(
                f"the guard raised {type(exc).__name__} for another job's e-mail"
            ) from None
        hints.expect(
            first == 1,
            "other-job",
            "another job's first e-mail was refused: the guard's rowcount was 0",
            "the guard must key on the job (job_id), not on something two jobs share",
        )
    passed(
        f"job {job_id} ran twice (paused worker A, then B) and sent one e-mail; "
        "another job still sends its own"
    )


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

        hints = KEY_HINTS
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
    KEY_HINTS.expect(
        partial >= 1,
        "partial",
        "your index holds every job, finished or not, though only live ones can clash",
        "make it partial: ... WHERE status IN ('ready', 'running')",
    )
    passed(
        "8 concurrent enqueues of one key added one job; the key is held while ready or "
        "running, free once done, dead or cancelled; per queue; no clash without a key"
    )
