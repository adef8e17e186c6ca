"""Checks for notebook 09: the idempotency table that guards an e-mail send."""

from __future__ import annotations

import time
from typing import Any

import psycopg

from ...db import first_line
from ...job import Job
from ..idempotency import FakeMailer, paused_worker_story
from . import ExerciseFailed, expect, passed


def check_guard(guard: object, dsn: str) -> None:
    """Replay the paused worker with a handler that sends only when ``guard`` (an INSERT into
    ``sent_emails`` with ``%(job_id)s``, ``%(to)s``) added a row: one e-mail, not two, no
    error; and a different job still gets its own e-mail."""
    expect(
        isinstance(guard, str) and guard.strip(),
        "GUARD should be the text of an INSERT statement",
    )
    assert isinstance(guard, str)
    expect(
        "%(job_id)s" in guard,
        "the guard should use the job's id, %(job_id)s: it is the same for every run of the "
        "job (the fence is not)",
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
    expect(
        not duplicate,
        f"the late run's guard raised {duplicate[0] if duplicate else ''}: a run that finds "
        "the job's row should add nothing, quietly (ON CONFLICT (job_id) DO NOTHING)",
    )
    expect(not errors, f"the guard failed: {errors[0] if errors else ''}")
    expect(
        len(mailer.delivered) <= 1,
        f"{len(mailer.delivered)} e-mails went out for job {job_id}: the guard added a row "
        "(rowcount 1) for both runs; it must add one for the first run only",
    )
    expect(
        len(mailer.delivered) == 1,
        f"no e-mail went out for job {job_id}: the guard added no row even for the first run",
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        other = {"job_id": job_id + 1_000_000, "to": "other@example.com", "fence": 1}
        try:
            first = conn.execute(guard, other).rowcount
        except psycopg.Error as exc:
            raise ExerciseFailed(
                f"the guard raised {type(exc).__name__} for another job's e-mail"
            ) from None
        expect(
            first == 1,
            "another job's e-mail was refused: the guard must key on the job, not on "
            "something two jobs share",
        )
    passed(
        f"job {job_id} ran twice (paused worker A, then B) and sent one e-mail; "
        "another job still sends its own"
    )
