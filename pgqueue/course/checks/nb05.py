"""Checks for notebook 05: the idempotency table that guards an e-mail send, with hints in
tiers (what the runs did first, the fix at the second slip of a kind)."""

from __future__ import annotations

import time
from typing import Any

import psycopg

from ...db import first_line
from ...job import Job
from ..idempotency import FakeMailer, paused_worker_story
from . import ExerciseFailed, expect, passed
from .tiers import Hints

HINTS = Hints()


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
