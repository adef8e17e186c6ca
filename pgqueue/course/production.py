"""Notebooks 09 and 10's experiments: dead row versions and what holds VACUUM back, and the
samples and simulation behind choosing a lease. Teaching aids, not part of the queue."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import psycopg
from psycopg import sql

from ..queue import Queue

# The stall model of the lease exercise: how long a healthy worker goes silent (a GC pause,
# a VM migration, a slow disk), heavy-tailed like real pauses. Seconds.
STALL_MEDIAN = 0.3
STALL_SIGMA = 1.0
# The job durations of the same exercise: they vary far more than the stalls do. Seconds.
JOB_MEDIAN = 4.0
JOB_SIGMA = 1.2


def churn(q: Queue, n: int, queue: str = "churn") -> None:
    """Run ``n`` jobs through the queue's own statements at once (enqueue, one claim, one
    fenced completion): each job leaves two dead row versions in ``jobs``."""
    q.enqueue_many([{"n": i} for i in range(n)], queue=queue)
    jobs = q.claim(queue, limit=n, lease=60)
    rejected = q.complete_many(jobs)
    assert len(jobs) == n and not rejected, "churn: another worker took jobs of its queue"


def vacuum_verbose(conn: psycopg.Connection, table: str = "jobs") -> dict[str, int]:
    """``VACUUM (VERBOSE)`` one table; return the dead versions it removed, those it had to
    keep (``not_removable``: still visible to some open snapshot or transaction), its removal
    cutoff (``cutoff_xid``: the oldest transaction id it had to respect) and how many
    transaction ids old that was when it ended."""
    notes: list[str] = []

    def keep(diag: psycopg.errors.Diagnostic) -> None:  # valid only inside the callback
        notes.append(diag.message_primary or "")

    conn.add_notice_handler(keep)
    try:
        conn.execute(sql.SQL("VACUUM (VERBOSE) {}").format(sql.Identifier(table)))
    finally:
        conn.remove_notice_handler(keep)
    report = next(n for n in notes if "finished vacuuming" in n and f".{table}" in n)
    tuples = re.search(r"tuples: (\d+) removed, (\d+) remain, (\d+) are dead but not yet", report)
    cutoff = re.search(r"removable cutoff: (\d+), which was (\d+) XIDs old", report)
    assert tuples is not None and cutoff is not None, f"unexpected VACUUM report: {report}"
    removed, _remain, kept = map(int, tuples.groups())
    xid, old = map(int, cutoff.groups())
    return {"removed": removed, "not_removable": kept, "cutoff_xid": xid, "cutoff_xids_old": old}


def session_state(conn: psycopg.Connection, application_name: str) -> dict[str, Any]:
    """What ``pg_stat_activity`` says of the session named ``application_name``: its state,
    the transaction id it holds (``backend_xid``) and the snapshot horizon (``backend_xmin``)."""
    row = conn.execute(
        "SELECT state, backend_xid::text, backend_xmin::text FROM pg_stat_activity "
        "WHERE application_name = %s AND datname = current_database()",
        [application_name],
    ).fetchone()
    assert row is not None, f"no session named {application_name!r}"
    return {"state": row[0], "backend_xid": row[1], "backend_xmin": row[2]}


def horizon_case(dsn: str, q: Queue, statements: Sequence[str], *, jobs: int = 1000) -> dict:
    """Open a session, run ``statements`` in it and leave it idle; meanwhile churn ``jobs``
    jobs through the queue and VACUUM. Returns what the session showed in
    ``pg_stat_activity`` and what VACUUM removed or had to keep."""
    name = "case session"
    # autocommit: psycopg sends no BEGIN of its own, so the session runs exactly `statements`
    with psycopg.connect(dsn, autocommit=True, application_name=name) as session:
        for statement in statements:
            session.execute(statement)
        time.sleep(0.05)  # pg_stat_activity is read from shared memory: let it settle
        seen = session_state(q.conn, name)
        churn(q, jobs)
        vacuumed = vacuum_verbose(q.conn)
    return {**seen, **vacuumed}


# -- choosing a lease ----------------------------------------------------------------------
def stall_sample(n: int, seed: int = 7) -> np.ndarray:
    """``n`` stall durations (seconds): how long a healthy worker went silent, from the
    course's heavy-tailed model (lognormal, median ``STALL_MEDIAN``)."""
    rng = np.random.default_rng(seed)
    return STALL_MEDIAN * np.exp(STALL_SIGMA * rng.standard_normal(n))


def job_duration_sample(n: int, seed: int = 8) -> np.ndarray:
    """``n`` job durations (seconds) from the course's model (lognormal, median ``JOB_MEDIAN``)."""
    rng = np.random.default_rng(seed)
    return JOB_MEDIAN * np.exp(JOB_SIGMA * rng.standard_normal(n))


def lost_fraction(lease: float, stalls: np.ndarray, seed: int = 11) -> float:
    """The share of ``stalls`` that cost a healthy worker its job with this ``lease``.

    The worker heartbeats every ``lease / 3``; a stall starts at a random moment, so the
    last renewal was ``U(0, lease/3)`` seconds earlier. The job is lost when that time plus
    the stall reaches the lease (the reaper may be a little later: this errs on the safe side).
    """
    rng = np.random.default_rng(seed)
    since_renewal = rng.uniform(0.0, lease / 3, size=len(stalls))
    return float(np.mean(since_renewal + stalls >= lease))
