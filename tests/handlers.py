"""Handlers for worker subprocesses in the tests: ``pgqueue worker tests.handlers:NAME``.

They take their instructions from the payload, so one handler serves many tests:
- ``sleep``: how long the handler works (seconds) before it writes anything;
- ``first_sleep``: extra seconds on the first attempt only (a job that hangs once);
- ``report``: the id of the row of ``reports`` to write with the job's fence;
- ``started``: a file ``sleep`` and ``report`` create as their handler begins (a test that
  freezes or stops the worker waits for it: a job claimed but not started yet is skipped
  by a frozen worker, its lease gone, and handed back unrun by a graceful stop).

``report`` writes to two side tables the test creates first:
``reports (id int PRIMARY KEY, body text, job_id bigint, fence bigint)`` through a
fenced write (``Job.fenced_write`` stores the job id beside the fence), and
``report_log (job_id bigint, fence bigint, pid int, accepted bool)`` with what happened,
so a test can see a rejected late write that left no other trace.

``tracked`` (tests/library/test_limits.py) logs each run of a job to ``runs`` (``RUNS_TABLE``):
which job, its ``group`` (from the payload), the worker's pid, and when it began and
ended by the database's clock, so overlapping runs of one group can be counted exactly.
"""

from __future__ import annotations

import os
import time

from pgqueue import AsyncJob, Job

# The side tables ``report`` writes to; a test runs this before starting workers.
SIDE_TABLES = """
CREATE TABLE reports (id int PRIMARY KEY, body text, job_id bigint, fence bigint NOT NULL);
CREATE TABLE report_log (job_id bigint, fence bigint, pid int, accepted bool);
"""


# The table ``tracked`` writes to; tests/library/test_limits.py creates it before starting workers.
RUNS_TABLE = """
CREATE TABLE runs (job_id bigint, grp text, pid int, began timestamptz, ended timestamptz);
"""


def noop(job: Job) -> None:
    """Do nothing: the job completes at once."""


async def async_noop(job: AsyncJob) -> None:
    """Do nothing, awaited (the CLI runs it under AsyncWorker)."""


def sleep(job: Job) -> None:
    """Work for ``payload["sleep"]`` (+ ``first_sleep`` on attempt 1) seconds, then complete
    (creating the ``started`` file first, if the payload names one)."""
    if "started" in job.payload:
        open(job.payload["started"], "a").close()
    time.sleep(_seconds(job))


def fail(job: Job) -> None:
    """Always raise, so the worker records a failure with this error text."""
    raise RuntimeError(f"boom on attempt {job.attempts}")


def report(job: Job) -> None:
    """Sleep as the payload says, then write ``reports`` with the job's fence and log
    whether that write was accepted (a stale fence is refused by the database)."""
    if "started" in job.payload:
        open(job.payload["started"], "a").close()
    time.sleep(_seconds(job))
    report_id = int(job.payload.get("report", job.id))
    body = f"pid {os.getpid()} fence {job.fence}"
    accepted = job.fenced_write("reports", {"id": report_id}, {"body": body})
    assert job.conn is not None
    job.conn.execute(
        "INSERT INTO report_log (job_id, fence, pid, accepted) VALUES (%s, %s, %s, %s)",
        (job.id, job.fence, os.getpid(), accepted),
    )


def tracked(job: Job) -> None:
    """Log the run's start to ``runs``, work as the payload says, then log its end."""
    assert job.conn is not None
    run = (job.id, job.payload.get("group"), os.getpid())
    job.conn.execute(
        "INSERT INTO runs (job_id, grp, pid, began) VALUES (%s, %s, %s, clock_timestamp())", run
    )
    time.sleep(_seconds(job))
    job.conn.execute(
        "UPDATE runs SET ended = clock_timestamp() "
        "WHERE job_id = %s AND grp IS NOT DISTINCT FROM %s AND pid = %s AND ended IS NULL",
        run,
    )


def _seconds(job: Job) -> float:
    first = float(job.payload.get("first_sleep", 0.0)) if job.attempts == 1 else 0.0
    return float(job.payload.get("sleep", 0.0)) + first
