"""Notebook 07's experiments: what a worker sends while it waits for work, statement by
statement, and throughput against the poll interval, under a backlog and under bursts.

Teaching aids only: the statement log adds a trigger to the jobs table of the database it
is given (a notebook's own), which a real queue would not want.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import TYPE_CHECKING, Any

from .. import statements
from ..db import connect
from ..events import EventLog
from ..job import Job
from ..queue import Queue
from ..worker import Worker
from .lab import run_threads, wait_for

if TYPE_CHECKING:
    import pandas as pd

# A statement-level trigger fires once per UPDATE statement, even one that changes no row
# (an empty claim, a reap with nothing to reap): exactly the statements to count. It logs
# the session's application_name (pgqueue names a worker's sessions "pgqueue worker
# <name>") and the statement's text, from which ``kind_of`` tells which statement it was.
_INSTALL = """
CREATE TABLE IF NOT EXISTS course_statement_log (
  app   text,
  query text,
  at    float8 DEFAULT extract(epoch FROM clock_timestamp())
);
CREATE OR REPLACE FUNCTION course_log_statement() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO course_statement_log (app, query)
  VALUES (current_setting('application_name'), left(current_query(), 300));
  RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER course_log_updates AFTER UPDATE ON jobs
  FOR EACH STATEMENT EXECUTE FUNCTION course_log_statement();
"""
_REMOVE = """
DROP TRIGGER IF EXISTS course_log_updates ON jobs;
DROP FUNCTION IF EXISTS course_log_statement();
DROP TABLE IF EXISTS course_statement_log;
"""
WORKER_APP = "pgqueue worker "


def _normal(line: str) -> str:
    """A statement's first line with its placeholders blanked (``%(x)s`` as written in
    queries.sql, ``$1`` as psycopg sends it)."""
    return re.sub(r"%\(\w+\)s|\$\d+", "$", line).strip()


@cache
def _by_first_line() -> dict[str, str]:
    # Every named statement starts with its own one-line description comment.
    return {_normal(text.splitlines()[0]): name for name, text in statements.queries().items()}


def kind_of(query: str) -> str:
    """Which statement of ``sql/queries.sql`` a logged query text is ("claim", "reap",
    "heartbeat_many", ...), or "other"."""
    first = query.splitlines()[0] if query else ""
    return _by_first_line().get(_normal(first), "other")


class StatementLog:
    """The UPDATE statements run on ``jobs`` since the log was installed, by session."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def now(self) -> float:
        """The server's clock (seconds since the epoch): the log's own time base."""
        with connect(self.dsn) as conn:
            row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        assert row is not None
        return float(row[0])

    def frame(self, since: float | None = None, until: float | None = None) -> pd.DataFrame:
        """One row per statement: ``worker`` (the worker's name, or the application name of
        any other session), ``kind`` and ``at`` (server time, seconds since the epoch)."""
        import pandas as pd

        with connect(self.dsn) as conn:
            rows = conn.execute(
                "SELECT app, query, at FROM course_statement_log"
                " WHERE at >= coalesce(%s::float8, '-infinity')"
                " AND at < coalesce(%s::float8, 'infinity')"
                " ORDER BY at",
                [since, until],
            ).fetchall()
        return pd.DataFrame(
            [
                {"worker": app.removeprefix(WORKER_APP), "kind": kind_of(query), "at": at}
                for app, query, at in rows
            ],
            columns=["worker", "kind", "at"],
        )

    def rates(self, since: float, until: float) -> pd.DataFrame:
        """Statements per second of each kind, per worker, between ``since`` and ``until``."""
        frame = self.frame(since, until)
        counts = frame.groupby(["worker", "kind"]).size().unstack("kind", fill_value=0)
        return counts / (until - since)


@contextmanager
def statement_log(dsn: str) -> Iterator[StatementLog]:
    """Log every UPDATE statement on ``jobs`` of database ``dsn`` while the block runs (a
    teaching aid: the trigger, its function and its table are removed afterwards)."""
    with connect(dsn) as conn:
        conn.execute(_INSTALL)
    try:
        yield StatementLog(dsn)
    finally:
        with connect(dsn) as conn:
            conn.execute(_REMOVE)


def idle_statements(
    dsn: str,
    *,
    concurrency: int = 1,
    queues: Sequence[str] = ("idle",),
    poll_interval: float = 2.0,
    reap_interval: float = 5.0,
    seconds: float = 2.0,
    warmup: float = 0.3,
    name: str = "idle",
) -> dict[str, float]:
    """Statements per second, by kind, that one Worker (listening, as by default) sends to
    empty ``queues`` over ``seconds``, from ``warmup`` seconds after its first statement."""
    with statement_log(dsn) as log:
        worker = Worker(
            lambda job: None,
            queue=list(queues),
            dsn=dsn,
            concurrency=concurrency,
            poll_interval=poll_interval,
            reap_interval=reap_interval,
            name=name,
        ).start()
        try:
            # The window opens once the worker polls (start-up takes longer on a busy machine).
            deadline = time.monotonic() + 10
            while name not in log.frame().worker.values and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(warmup)
            since = log.now()
            time.sleep(seconds)
            until = log.now()
        finally:
            worker.stop(grace=1)
        rates = log.rates(since, until)
    return rates.loc[name].to_dict() if name in rates.index else {}


# -- throughput against the poll interval -----------------------------------------------
def _sleeper(work: float) -> Any:
    def handler(job: Job) -> None:
        time.sleep(work)

    return handler


def drain_backlog(
    dsn: str, *, poll_interval: float, jobs: int = 60, work: float = 0.005, listen: bool = False
) -> float:
    """Jobs per second one Worker (1 lane, batch 1) drains a backlog of ``jobs`` at, each
    taking ``work`` seconds: from its first claim to its last completion."""
    queue = f"backlog-{poll_interval:g}-{time.monotonic_ns()}"
    with Queue(dsn) as producer:
        producer.enqueue_many([{"n": n} for n in range(jobs)], queue=queue)
    events = EventLog()
    worker = Worker(
        _sleeper(work),
        queue=queue,
        dsn=dsn,
        poll_interval=poll_interval,
        listen=listen,
        reap_interval=60,
        name=queue,
        events=events,
    ).start()
    try:
        wait_for(events, "complete", jobs, timeout=30 + jobs * work * 5)
    finally:
        worker.stop(grace=1)
    first = min(e.t for e in events.events("claim"))
    last = max(e.t for e in events.events("complete"))
    return jobs / (last - first)


def _burst_rounds(
    dsn: str,
    poll_interval: float,
    listen: bool,
    *,
    burst: int,
    rounds: int,
    work: float,
    rng: random.Random,
) -> list[dict[str, Any]]:
    queue = f"bursts-{'listen' if listen else 'poll'}-{poll_interval:g}"
    events = EventLog()
    worker = Worker(
        _sleeper(work),
        queue=queue,
        dsn=dsn,
        poll_interval=poll_interval,
        listen=listen,
        reap_interval=60,
        name=queue,
        events=events,
    ).start()
    rows = []
    try:
        with Queue(dsn) as producer:
            time.sleep(0.3)  # listening, and past its first (empty) claim
            for k in range(rounds):
                # The worker's poll cycle restarted when it found the queue empty after the
                # last burst: land the next one at a random point of that cycle.
                time.sleep(rng.uniform(0, poll_interval))
                sent = time.time()
                ids = set(producer.enqueue_many([{"k": k}] * burst, queue=queue))

                def ours(event: Any, ids: set[int] = ids) -> bool:
                    return event.kind == "complete" and event.job_id in ids

                wait_for(events, ours, burst, timeout=poll_interval + 10 + burst * work * 5)
                done = [e.t for e in events.events() if ours(e)]
                started = [e.t for e in events.events("claim") if e.job_id in ids]
                rows.append(
                    {
                        "poll_interval_s": poll_interval,
                        "listen": listen,
                        "round": k,
                        "first_start_s": min(started) - sent,
                        "all_done_s": max(done) - sent,
                    }
                )
    finally:
        worker.stop(grace=1)
    return rows


def burst_trials(
    dsn: str,
    settings: Iterable[tuple[float, bool]],
    *,
    burst: int = 20,
    rounds: int = 4,
    work: float = 0.005,
    seed: int = 6,
) -> pd.DataFrame:
    """For each (poll_interval, listen), one Worker (1 lane, batch 1) of its own gets
    ``rounds`` bursts of ``burst`` jobs, each burst once the last is done, at a random point
    of the worker's poll cycle. All settings run at once, each on its own queue. One row
    per burst: seconds from the enqueue to the first job's start and to the last job done."""
    import pandas as pd

    rows: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(i: int, poll: float, listen: bool) -> None:
        try:
            mine = _burst_rounds(
                dsn,
                poll,
                listen,
                burst=burst,
                rounds=rounds,
                work=work,
                rng=random.Random(seed + i),
            )
            with lock:
                rows.extend(mine)
        except BaseException as exc:  # re-raised in the caller's thread below
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(i, poll, listen))
        for i, (poll, listen) in enumerate(settings)
    ]
    run_threads(threads, errors)
    return pd.DataFrame(rows).sort_values(["listen", "poll_interval_s", "round"], ignore_index=True)


__all__ = [
    "StatementLog",
    "burst_trials",
    "drain_backlog",
    "idle_statements",
    "kind_of",
    "statement_log",
]
