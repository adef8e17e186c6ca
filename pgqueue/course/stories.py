"""Instruments and experiments for notebooks 03-06: leases, reapers and fences, as the
database itself recorded them.

- ``watch(conn, *tables)`` installs a trigger that copies every inserted or changed row of
  ``tables`` into ``watch_log`` with the database's ``now()``; ``leases`` and ``fences``
  read it back as the lease deadlines and stored fences the database really held (not
  what a client thinks it asked for), in the client's clock, so they line up with an
  ``EventLog`` on one time axis.
- ``NoHeartbeatWorker``: a Worker whose heartbeats never reach the database (a keeper cut
  off from the server), to show the local lease deadline.
- ``ReaperRace``: the reaps of two reaper loops racing over expiring leases (notebook 03
  runs them in its cell), with the leases they raced over.
- ``sandbox``: a private, throw-away ``jobs`` table for the exercises' checks.

Teaching aids only: production code needs none of this.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from ..db import connect
from ..worker import Worker

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "NoHeartbeatWorker",
    "ReaperRace",
    "clock_offset",
    "fences",
    "leases",
    "sandbox",
    "unwatch",
    "watch",
]

_WATCH = """
CREATE TABLE IF NOT EXISTS watch_log (
  seq bigserial   PRIMARY KEY,
  tbl text        NOT NULL,
  row jsonb       NOT NULL,
  at  timestamptz NOT NULL
);
CREATE OR REPLACE FUNCTION watch_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO watch_log (tbl, row, at) VALUES (TG_TABLE_NAME, to_jsonb(NEW), now());
  RETURN NULL;
END $$;
"""
_TRIGGERS = """
CREATE OR REPLACE TRIGGER watch_insert AFTER INSERT ON {t}
  FOR EACH ROW EXECUTE FUNCTION watch_row();
CREATE OR REPLACE TRIGGER watch_update AFTER UPDATE ON {t}
  FOR EACH ROW WHEN (OLD.* IS DISTINCT FROM NEW.*) EXECUTE FUNCTION watch_row();
"""


def watch(conn: psycopg.Connection, *tables: str) -> None:
    """Record every row inserted into or changed in ``jobs`` (and ``tables``) in
    ``watch_log``, stamped with the database's ``now()`` (idempotent)."""
    conn.execute(_WATCH)
    for table in ("jobs", *tables):
        conn.execute(sql.SQL(_TRIGGERS).format(t=sql.Identifier(table)))


def unwatch(conn: psycopg.Connection, *tables: str) -> None:
    """Stop recording changes of ``jobs`` (and ``tables``); ``watch_log`` keeps what it has.
    A notebook that goes on to time its workers takes the triggers' cost away first."""
    for table in ("jobs", *tables):
        for trigger in ("watch_insert", "watch_update"):
            conn.execute(
                sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(
                    sql.Identifier(trigger), sql.Identifier(table)
                )
            )


def clock_offset(conn: psycopg.Connection) -> float:
    """Seconds the database's clock is ahead of this process's ``time.time()`` (about 0
    when both run on one machine), measured over one round trip."""
    before = time.time()
    row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
    after = time.time()
    assert row is not None
    return float(row[0]) - (before + after) / 2


def leases(conn: psycopg.Connection) -> pd.DataFrame:
    """Every lease deadline the database set (each claim, each heartbeat that took effect):
    columns ``job_id``, ``fence``, ``set_t`` (when, the database's ``now()``) and
    ``until_t`` (``lease_until``), as ``time.time()`` seconds of this process."""
    import pandas as pd

    offset = clock_offset(conn)
    rows = conn.execute(
        """
        SELECT (row->>'id')::bigint, (row->>'fence')::bigint,
               extract(epoch FROM at)::float8,
               extract(epoch FROM (row->>'lease_until')::timestamptz)::float8
        FROM watch_log
        WHERE tbl = 'jobs' AND row->>'status' = 'running' AND row->>'lease_until' IS NOT NULL
        ORDER BY seq
        """
    ).fetchall()
    frame = pd.DataFrame(rows, columns=["job_id", "fence", "set_t", "until_t"])
    frame = frame.drop_duplicates(["job_id", "fence", "until_t"])
    frame[["set_t", "until_t"]] -= offset
    return frame.reset_index(drop=True)


def fences(
    conn: psycopg.Connection, table: str, *, since: float | None = None, **key: object
) -> pd.DataFrame:
    """The fence stored in one row of ``table`` (picked by ``key``, e.g. ``id=1``) each
    time it changed: columns ``t`` (the database's ``now()``, as ``time.time()`` seconds
    of this process), ``fence``, ``status`` and ``job_id`` (None where the table has none).
    With ``since`` (``time.time()`` seconds), only the changes from then on."""
    import pandas as pd

    offset = clock_offset(conn)
    match = Jsonb(dict(key))
    rows = conn.execute(
        """
        SELECT extract(epoch FROM at)::float8, (row->>'fence')::bigint, row->>'status',
               (row->>'job_id')::bigint
        FROM watch_log WHERE tbl = %s AND row @> %s ORDER BY seq
        """,
        [table, match],
    ).fetchall()
    frame = pd.DataFrame(rows, columns=["t", "fence", "status", "job_id"])
    frame["t"] -= offset
    if since is not None:
        frame = frame[frame["t"] >= since]
    frame = frame[frame["fence"].ne(frame["fence"].shift())]  # changes of the fence only
    return frame.reset_index(drop=True)


class NoHeartbeatWorker(Worker):
    """A Worker whose heartbeats never reach the database (its keeper is cut off): the
    lease runs out on the server while the handler runs, and the worker can only learn
    it from its own clock (``job.lost``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

        async def lost_on_the_way(queue: Any) -> None:
            """Send nothing: as if every heartbeat were lost on the way."""

        self.engine.keeper.heartbeat = lost_on_the_way  # type: ignore[method-assign]


class ReaperRace(NamedTuple):
    """Two reapers looping over the same expiring leases."""

    calls: pd.DataFrame  # one row per reap: reaper, start, end (time.time()), returned ids
    leases: pd.DataFrame  # the database's lease deadlines of the jobs (see ``leases``)
    jobs: list[int]

    @classmethod
    def of(
        cls,
        conn: psycopg.Connection,
        calls: list[tuple[str, float, float, list[int]]],
        jobs: list[int],
    ) -> ReaperRace:
        """A race from its reaps (``(reaper, start, end, ids returned)``, ``time.time()``
        seconds) and its jobs, with their lease deadlines read from ``watch_log``."""
        import pandas as pd

        frame = leases(conn)
        table = pd.DataFrame(calls, columns=["reaper", "start", "end", "ids"])
        return cls(table, frame[frame["job_id"].isin(jobs)].reset_index(drop=True), sorted(jobs))

    def returns(self) -> pd.DataFrame:
        """One row per job returned: ``job_id``, ``reaper``, ``t`` (when the reap ended)."""
        frame = self.calls.explode("ids").dropna(subset=["ids"])
        frame = frame.rename(columns={"ids": "job_id", "end": "t"})
        return frame.astype({"job_id": "int64"})[["job_id", "reaper", "t"]]

    def overlaps(self) -> int:
        """How many reaps of one reaper ran while a reap of the other was under way."""
        one, two = (self.calls[self.calls["reaper"] == r] for r in ("reaper 1", "reaper 2"))
        return sum(
            bool(((two["start"] < end) & (two["end"] > start)).any())
            for start, end in zip(one["start"], one["end"], strict=True)
        )


@contextmanager
def sandbox(dsn: str) -> Iterator[psycopg.Connection]:
    """A connection whose ``jobs`` is a private, empty copy of the jobs table (a temporary
    table, which comes first in the search path), inside a transaction rolled back at the
    end: an exercise's SQL runs against rows the check made, and leaves nothing behind."""
    with connect(dsn, autocommit=False) as conn:
        try:
            conn.execute("CREATE TEMP TABLE jobs (LIKE public.jobs INCLUDING ALL)")
            yield conn
        finally:
            conn.rollback()
