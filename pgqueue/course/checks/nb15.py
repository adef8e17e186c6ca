"""Checks for notebook 15: the reader's tick, one statement that makes a slot's job only if
no other tick made it, raced live by two connections."""

from __future__ import annotations

import threading
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg

from ...db import first_line
from . import expect, passed
from .tiers import Hints

TABLE = "my_slots"
SLOTS_DDL = f"""
DROP TABLE IF EXISTS {TABLE};
CREATE TABLE {TABLE} (
  schedule text        NOT NULL,
  slot     timestamptz NOT NULL,
  job_id   bigint      NOT NULL,
  PRIMARY KEY (schedule, slot)
)
"""
TICK_HINTS = Hints()


def _counts(conn: psycopg.Connection, schedule: str, slot: datetime) -> tuple[int, int, int]:
    """(jobs for the slot, slot rows, slot rows naming one of those jobs)."""
    row = conn.execute(
        f"""
        SELECT (SELECT count(*) FROM jobs WHERE payload->>'schedule' = %(s)s
                  AND (payload->>'slot')::timestamptz = %(t)s),
               (SELECT count(*) FROM {TABLE} WHERE schedule = %(s)s AND slot = %(t)s),
               (SELECT count(*) FROM {TABLE} AS m JOIN jobs AS j ON j.id = m.job_id
                WHERE m.schedule = %(s)s AND m.slot = %(t)s
                  AND j.payload->>'schedule' = %(s)s)
        """,
        {"s": schedule, "t": slot},
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def _race(dsn: str, statement: str, params: dict[str, Any]) -> tuple[bool, BaseException | None]:
    """Ticker A sends the statement in a transaction and waits; ticker B sends it too. A
    commits after 0.5 s. Whether B had to wait for A, and B's error (None: it ran)."""
    done = threading.Event()
    outcome: list[BaseException | None] = []

    def second() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as b:
                b.execute("SET lock_timeout = '5s'")
                b.execute(statement, params)  # type: ignore[arg-type]
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)
        done.set()

    with psycopg.connect(dsn) as a:
        try:
            a.execute(statement, params)  # type: ignore[arg-type]
        except psycopg.Error as exc:
            TICK_HINTS.fail(
                "sql",
                f"PostgreSQL refused your statement: {first_line(exc)}",
                "one statement with %(schedule)s and %(slot)s; a WITH ... INSERT ... RETURNING "
                "can feed a second INSERT in the same statement",
            )
        except (KeyError, TypeError) as exc:
            expect(False, f"your statement asks for a parameter the check does not pass ({exc}): "
                   "use %(schedule)s and %(slot)s")  # fmt: skip
        thread = threading.Thread(target=second, daemon=True)
        thread.start()
        waited = not done.wait(0.5)
        a.commit()
    thread.join(10)
    expect(
        outcome, "the second ticker's statement did not finish within 10 s of the first's commit"
    )
    return waited, outcome[0]


def check_tick(statement: object, dsn: str) -> None:
    """Run the reader's ``TICK`` (parameters %(schedule)s and %(slot)s) as two workers
    ticking the same slot at the same moment, then as a stale worker ticking it later, then
    for the next slot: one job per slot, named by its row in ``my_slots``, and the loser
    of the race makes nothing, quietly."""
    expect(
        isinstance(statement, str) and "insert" in statement.lower(),
        "TICK should be a text holding one statement that INSERTs the slot row and the job",
    )
    assert isinstance(statement, str)
    schedule = f"check-{uuid.uuid4().hex[:8]}"
    slot = datetime.now(timezone.utc).replace(microsecond=0)
    params = {"schedule": schedule, "slot": slot}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SLOTS_DDL)
        (newest,) = conn.execute("SELECT coalesce(max(id), 0) FROM jobs").fetchone() or (0,)
        try:
            waited, error = _race(dsn, statement, params)
            if isinstance(error, psycopg.errors.UniqueViolation):
                TICK_HINTS.fail(
                    "unique-error",
                    "the second ticker's statement failed with a unique_violation on my_slots: "
                    "the worker that loses the race must make nothing, quietly (a real worker "
                    "would log an error on every tick)",
                    "INSERT INTO my_slots ... ON CONFLICT (schedule, slot) DO NOTHING",
                )
            if error is not None:
                expect(False, f"the second ticker's statement failed: {error}")
            jobs, slot_rows, named = _counts(conn, schedule, slot)
            # A job made without the two keys is not "no job": say what its payload lacks.
            unnamed = conn.execute(
                "SELECT id, payload FROM jobs WHERE id > %s ORDER BY id LIMIT 1", [newest]
            ).fetchone()
            TICK_HINTS.expect(
                jobs > 0 or unnamed is None,
                "payload",
                f"two ticks of slot {slot:%H:%M:%S} made job {unnamed[0] if unnamed else ''} "
                f"with the payload {unnamed[1] if unnamed else ''!r}: the check finds a slot's "
                "jobs by their payload's 'schedule' and 'slot', and this one names neither",
                "payload jsonb_build_object('schedule', %(schedule)s::text, 'slot', %(slot)s)",
            )
            TICK_HINTS.expect(
                jobs > 0,
                "no-job",
                f"two ticks of slot {slot:%H:%M:%S} made no job in jobs",
                "INSERT INTO jobs (id, queue, payload) with payload "
                "jsonb_build_object('schedule', %(schedule)s::text, 'slot', %(slot)s) "
                "(the check finds the jobs by those two keys)",
            )
            TICK_HINTS.expect(
                slot_rows == 1,
                "no-slot-row",
                f"two ticks of one slot left {slot_rows} rows in my_slots and {jobs} job(s): "
                "each slot's job needs its row in my_slots, whose primary key is the decision",
                "INSERT INTO my_slots (schedule, slot, job_id) VALUES (%(schedule)s, "
                "%(slot)s, nextval('jobs_id_seq'))",
            )
            TICK_HINTS.expect(
                jobs == 1,
                "job-despite-conflict",
                f"two workers ticking slot {slot:%H:%M:%S} at the same moment made {jobs} jobs "
                "and my_slots kept one row: the loser's job was made although its slot row "
                "was refused",
                "make the job FROM the slot insert's RETURNING: WITH taken AS (INSERT INTO "
                "my_slots ... ON CONFLICT DO NOTHING RETURNING job_id, slot) INSERT INTO jobs "
                "... SELECT ... FROM taken",
            )
            TICK_HINTS.expect(
                named == 1,
                "job-id",
                "the slot's row in my_slots does not name the job that was made (job_id should "
                "be that job's id)",
                "take the id once, nextval('jobs_id_seq') in the slot row, and insert the job "
                "with id = the job_id that RETURNING gives back",
            )
            # A stale worker, its plan made before the others wrote, ticks the slot later.
            conn.execute(statement, params)  # type: ignore[arg-type]
            again = _counts(conn, schedule, slot)[0]
            TICK_HINTS.expect(
                again == 1,
                "job-despite-conflict",
                f"a stale worker ticking slot {slot:%H:%M:%S} once more made a second job",
                "make the job only from the slot rows the insert returned (ON CONFLICT DO "
                "NOTHING returns none)",
            )
            following = {"schedule": schedule, "slot": slot + timedelta(seconds=1)}
            conn.execute(statement, following)  # type: ignore[arg-type]
            made_next = _counts(conn, schedule, following["slot"])[0]
            expect(
                made_next == 1,
                f"the next slot ({following['slot']:%H:%M:%S}) made {made_next} jobs, not one: "
                "each slot gets its own job",
            )
        finally:
            conn.execute("DELETE FROM jobs WHERE payload->>'schedule' = %s", [schedule])
            # and the jobs a tick made without the keys (left ready, a later worker runs them)
            conn.execute("DELETE FROM jobs WHERE id > %s AND NOT payload ? 'schedule'", [newest])
            conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
    passed(
        "two ticks of one slot at the same moment made one job (the second "
        f"{'waited for the first, then ' if waited else ''}made nothing, quietly); a stale "
        "tick later made none; the next slot made its own"
    )
