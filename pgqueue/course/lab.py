"""Teaching aids for the course: isolated databases and the counterfactuals the notebooks
run live (claims without locks, fences ignored). Never use these in production code."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from importlib import resources

import psycopg

from .. import statements
from ..errors import BadInput
from ..events import Event, EventLog
from ..job import Job
from ..tools.databases import drop_database, fresh_database


@cache
def counterfactuals() -> dict[str, str]:
    """The deliberately wrong statements of ``counterfactuals.sql``, by name: never use them."""
    text = resources.files(__package__).joinpath("counterfactuals.sql").read_text(encoding="utf-8")
    return statements.parse(text)


@contextmanager
def scratch_database(name: str, dsn: str | None = None) -> Iterator[str]:
    """A fresh database ``name`` with the schema for one ``with`` block; dropped afterwards.

    For experiments re-run from a widget after the notebook's own database is gone.
    """
    target = fresh_database(name, dsn)
    try:
        yield target
    finally:
        drop_database(name, dsn)


# -- counterfactuals: what goes wrong without the seed's safeguards ---------------------
# Every function below is WRONG ON PURPOSE. The notebooks run them so you can watch the
# failure happen; never call them from real code (use Queue.claim / Queue.complete /
# Job.fenced_write). Their SQL is in sql/counterfactuals.sql.

_SELECTS = {
    "no-lock": "select_ready_unlocked",
    "no-skip-locked": "select_ready_wait",
}


def _claim_in_two_steps(
    conn: psycopg.Connection,
    style: str,
    queue: str,
    *,
    limit: int,
    hold: float,
    lease: float,
) -> list[Job]:
    """Select ready ids (locking as ``style`` says), keep the transaction open ``hold``
    seconds, then mark them running."""
    if style not in _SELECTS:
        raise BadInput(f"style must be one of {sorted(_SELECTS)}, got {style!r}")
    cf = counterfactuals()
    with conn.transaction():
        rows = conn.execute(cf[_SELECTS[style]], {"queue": queue, "limit": limit}).fetchall()
        if not rows:
            return []
        if hold > 0:
            conn.execute(cf["hold"], {"seconds": hold})
        params = {"ids": [r[0] for r in rows], "lease": lease}
        claimed = conn.execute(cf["mark_running"], params).fetchall()
    return [Job(*row, conn=conn) for row in claimed]


def claim_without_lock(
    conn: psycopg.Connection,
    queue: str = "default",
    *,
    limit: int = 1,
    window: float = 0.05,
    lease: float = 30.0,
) -> list[Job]:
    """NEVER USE: claim by reading ready ids, then (``window`` seconds later) marking them
    running, with no row lock. Two workers that read in the same window get the same job."""
    return _claim_in_two_steps(conn, "no-lock", queue, limit=limit, hold=window, lease=lease)


def claim_without_skip_locked(
    conn: psycopg.Connection,
    queue: str = "default",
    *,
    limit: int = 1,
    hold: float = 0.05,
    lease: float = 30.0,
) -> list[Job]:
    """NEVER USE: claim with ``FOR UPDATE`` but no ``SKIP LOCKED``, keeping the transaction
    open ``hold`` seconds. Correct, but every other claimer queues behind the locked rows."""
    return _claim_in_two_steps(conn, "no-skip-locked", queue, limit=limit, hold=hold, lease=lease)


def complete_ignoring_fence(conn: psycopg.Connection, job: Job) -> bool:
    """NEVER USE: mark ``job`` done by id alone. A stale holder's late complete succeeds
    (returns True) and nobody learns that two workers ran the job."""
    cur = conn.execute(counterfactuals()["complete_ignoring_fence"], {"id": job.id})
    return cur.rowcount == 1


def write_report_ignoring_fence(job: Job, report_id: int, body: str) -> bool:
    """NEVER USE: write ``body`` to ``reports(id, body, fence)`` whatever fence is stored,
    so a late writer overwrites a newer result. Recorded as an ``unfenced-write`` event."""
    if job.conn is None:
        raise BadInput(f"job {job.id} has no connection to write with; claim it first")
    params = {"id": report_id, "body": body, "fence": job.fence}
    cur = job.conn.execute(counterfactuals()["write_report_ignoring_fence"], params)
    if job.on_event:
        job.on_event("unfenced-write", job)
    return cur.rowcount == 1


def run_threads(threads: list[threading.Thread], errors: list[BaseException]) -> None:
    """Start ``threads``, wait for them all, then raise the first error one of them put in
    ``errors`` (threads cannot raise into their caller: each records what it caught)."""
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def wait_for(
    events: EventLog,
    what: str | Callable[[Event], bool],
    count: int = 1,
    *,
    timeout: float = 10.0,
) -> None:
    """Block until ``events`` holds ``count`` events of kind ``what`` (or matching the
    predicate ``what``); raise ``TimeoutError`` after ``timeout`` seconds."""
    match = (lambda e: e.kind == what) if isinstance(what, str) else what
    deadline = time.monotonic() + timeout
    while sum(1 for e in events.events() if match(e)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g} s for {count} event(s) of {what!r}")
        time.sleep(0.01)


__all__ = [
    "claim_without_lock",
    "claim_without_skip_locked",
    "complete_ignoring_fence",
    "drop_database",
    "fresh_database",
    "run_threads",
    "scratch_database",
    "wait_for",
    "write_report_ignoring_fence",
]
