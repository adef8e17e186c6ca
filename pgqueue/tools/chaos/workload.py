"""The chaos run's workload: the jobs, the handler the workers run, and the result tables.

M ``pgqueue worker pgqueue.tools.chaos:handler`` processes (or ``:async_handler``, the same
work as a coroutine, run by the AsyncWorker) work through N jobs. Each job records that
its handler started (``chaos_runs``), sleeps a little, then writes its result to
``chaos_results`` with a fenced write. The controller watches it all through
a session of its own (``Session``), which survives restarts and cut sessions.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Sequence
from typing import Any

import psycopg

from ...async_job import AsyncJob
from ...db import connect
from ...errors import LeaseLost, PgQueueError
from ...job import Job
from ...queue import Queue

WORKER_ENV = "PGQUEUE_CHAOS_WORKER"  # tells the handler which worker process it runs in

# The side tables the handler writes. Kept here, not in sql/, because they belong to
# this experiment, not to the queue. The trigger appends every accepted fence to
# ``history`` in commit order (the row lock orders the writers), so a stale write that
# got through after a newer one would show as a fence going down.
SIDE_TABLES = """
CREATE TABLE IF NOT EXISTS chaos_results (
  job_id  bigint   PRIMARY KEY,
  worker  text     NOT NULL,
  fence   bigint   NOT NULL,
  history bigint[] NOT NULL DEFAULT '{}'
);
CREATE OR REPLACE FUNCTION chaos_results_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'UPDATE' THEN
    NEW.history := OLD.history || NEW.fence;
  ELSE
    NEW.history := ARRAY[NEW.fence];
  END IF;
  RETURN NEW;
END $$;
CREATE OR REPLACE TRIGGER chaos_results_history
  BEFORE INSERT OR UPDATE ON chaos_results
  FOR EACH ROW EXECUTE FUNCTION chaos_results_history();
CREATE TABLE IF NOT EXISTS chaos_runs (
  job_id     bigint      NOT NULL,
  fence      bigint      NOT NULL,
  worker     text        NOT NULL,
  started_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS chaos_faults (
  run    text        NOT NULL,
  kind   text        NOT NULL,
  worker text,
  at     timestamptz NOT NULL,
  detail text        NOT NULL DEFAULT ''
);
"""


# -- the handler the worker processes run ----------------------------------------------
def handler(job: Job) -> None:
    """Record the start, sleep ``payload["sleep"]`` seconds, then write the result with
    the job's fence; raise ``LeaseLost`` if the database refused the write as stale."""
    assert job.conn is not None
    worker = os.environ.get(WORKER_ENV, f"pid {os.getpid()}")
    job.conn.execute(
        "INSERT INTO chaos_runs (job_id, fence, worker) VALUES (%s, %s, %s)",
        (job.id, job.fence, worker),
    )
    time.sleep(float(job.payload.get("sleep", 0.1)))
    if not job.fenced_write("chaos_results", {"job_id": job.id}, {"worker": worker}):
        raise LeaseLost(f"job {job.id}: result with fence {job.fence} refused as stale")


async def async_handler(job: AsyncJob) -> None:
    """``handler`` as a coroutine, for the AsyncWorker: the same records and fenced write."""
    worker = os.environ.get(WORKER_ENV, f"pid {os.getpid()}")
    conn = await job.connection()
    await conn.execute(
        "INSERT INTO chaos_runs (job_id, fence, worker) VALUES (%s, %s, %s)",
        (job.id, job.fence, worker),
    )
    await asyncio.sleep(float(job.payload.get("sleep", 0.1)))
    if not await job.fenced_write("chaos_results", {"job_id": job.id}, {"worker": worker}):
        raise LeaseLost(f"job {job.id}: result with fence {job.fence} refused as stale")


# -- the jobs ----------------------------------------------------------------------------
def enqueue_jobs(dsn: str, queue: str, count: int, mean_sleep: float, seed: int) -> None:
    """Install the queue and the side tables, then enqueue ``count`` jobs on ``queue``
    whose sleeps (a function of ``seed``) average ``mean_sleep`` seconds."""
    rng = random.Random(seed)
    with Queue(dsn) as q:
        q.install()
        q.conn.execute(SIDE_TABLES)
        sleeps = [round(mean_sleep * (0.5 + rng.random()), 3) for _ in range(count)]
        q.enqueue_many(
            [{"n": n, "sleep": s} for n, s in enumerate(sleeps)],
            queue=queue,
            max_attempts=25,
        )


# -- the controller's session --------------------------------------------------------------
class Session:
    """The controller's own session, reopened after a restart or a cut."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn  # set once the server is known; the workers connect here too
        self.conn: psycopg.Connection | None = None

    def db(self) -> psycopg.Connection:
        """The open session, or a new one (retried for a while: the server may restart)."""
        if self.conn is not None and not self.conn.closed and not self.conn.broken:
            return self.conn
        deadline = time.monotonic() + 10  # a restart takes a second or two
        while True:
            try:
                self.conn = connect(self.dsn, application_name="pgqueue chaos")
                return self.conn
            except PgQueueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def sql(self, query: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        """Run one statement, retrying once on a fresh session if the old one was cut."""
        for attempt in (1, 2):
            try:
                cur = self.db().execute(query, params)
                return cur.fetchall() if cur.description else []
            except psycopg.OperationalError:
                if attempt == 2:
                    raise
                if self.conn is not None:
                    self.conn.close()
                self.conn = None
        return []

    def close(self) -> None:
        """Close the session if one is open (the next statement opens another)."""
        if self.conn is not None:
            self.conn.close()
