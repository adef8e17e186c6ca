"""What a driver error of one of pgqueue's statements stands for: the one-line pgqueue error
(``errors.py``) that says what to do, or None to let the driver's error through."""

from __future__ import annotations

import psycopg

from . import steps
from .db import first_line
from .errors import (
    BadInput,
    KeyRace,
    NotInstalled,
    PgQueueError,
    SlotRace,
)

RETRY_DEAD = ("retry_dead", "retry_dead_ids")


PERIODIC = ("schedule_clock", "schedule_add", "schedule_tick", "schedules")


def pgqueue_error(exc: psycopg.Error, name: str | None = None) -> PgQueueError | None:
    """The one-line pgqueue error a driver error of statement ``name`` stands for, or None
    to let it through."""
    if isinstance(exc, psycopg.errors.UniqueViolation):
        if exc.diag.constraint_name == "jobs_slot_idx":
            # claim_limited: a slot taken by a claim that committed after this one began.
            return SlotRace(
                "a claim under a per-group limit met a slot another claim took meanwhile; "
                "nothing was claimed: claim again"
            )
        if exc.diag.constraint_name != "jobs_key_idx":
            return None
        if name in RETRY_DEAD:
            # The statement skips taken keys; one taken after its snapshot still stops it.
            return KeyRace(
                f"retry_dead: a job enqueued meanwhile took a dead job's key "
                f"({(exc.diag.message_detail or '').rstrip('.')}); nothing was retried: "
                "run it again"
            )
        return BadInput(
            "a job with the same key is ready or running in that queue: "
            "let it finish or cancel it first"
        )
    if isinstance(
        exc, psycopg.errors.DuplicatePreparedStatement | psycopg.errors.InvalidSqlStatementName
    ):
        return PgQueueError(
            f"prepared statements failed ({first_line(exc)}): behind PgBouncer in "
            "transaction mode? Use --pgbouncer (PGQUEUE_PGBOUNCER=1, Queue(pgbouncer=True))"
        )
    if isinstance(exc, psycopg.errors.UndefinedTable) and name in PERIODIC:
        return NotInstalled(
            "the periodic tables (pgqueue_schedules, pgqueue_slots) do not exist in this "
            "database: run `pgqueue init` (or Queue.install()) to add them"
        )
    if isinstance(exc, psycopg.errors.UndefinedTable) and (found := steps.missing(exc)):
        return found
    if isinstance(exc, psycopg.errors.UndefinedTable):
        newer = next((t for t in ("pgqueue_limits", "pgqueue_paused") if t in str(exc)), None)
        return NotInstalled(
            "the jobs table does not exist in this database: "
            "run `pgqueue init` (or Queue.install()) first"
            if newer is None
            else f"{newer} does not exist: this table is of an older pgqueue; "
            "run `pgqueue init` (or Queue.install()) to upgrade it"
        )
    if isinstance(exc, psycopg.errors.UndefinedColumn) and any(
        f'column "{name}"' in str(exc) for name in ("group_key", "slot", "traceback")
    ):
        return NotInstalled(
            "the jobs table is of an older pgqueue (no group_key): "
            "run `pgqueue init` (or Queue.install()) to upgrade it"
        )
    return None


def key_race(key: object) -> PgQueueError:
    return PgQueueError(f"enqueue of key {key!r} kept racing with other enqueues; try again")
