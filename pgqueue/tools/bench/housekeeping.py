"""Benchmark 10, housekeeping at scale: ``stats``, ``prune`` and day partitions, at five
million rows (``--quick``: 100,000).

The table is made by one ``INSERT ... SELECT generate_series``: 99.7 % done jobs whose
``finished_at`` is spread evenly over ``DAYS`` days (older ids finished earlier, as in a
real queue), 0.1 % dead jobs spread over the same days, and the newest 0.2 % ready and
running (half each); then ``VACUUM ANALYZE``, as autovacuum would have left it. Retention
keeps ``DAYS - 1`` days: every removal below takes the same oldest day of done jobs (about
a tenth of the table).

Destructive operations run on file copies of that database (``CREATE DATABASE ...
TEMPLATE``), one copy per operation and repetition, in interleaved order:

- ``prune``: ``Queue.prune(older_than=...)``, batches of 10,000 jobs, one transaction each;
- ``delete``: the same rows in one unbounded ``DELETE`` (one transaction);
- ``archive-move``: the partition recipe's half that runs every day: the same rows moved
  (``DELETE ... RETURNING`` into ``INSERT``) into ``jobs_done``, an archive partitioned by
  finish day (``ARCHIVE_DDL``), in ranges of 10,000 ids;
- ``archive-drop``: its other half: retention by ``DROP TABLE`` of the archive's day
  partitions older than the cut (whole days only).

The longest single transaction of each is what holds vacuum back (``longest_txn_s``)."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Sequence
from typing import Any

from psycopg import sql
from psycopg.conninfo import make_conninfo

from ...db import connect
from ...queue import Queue
from .runner import Bench, _progress, _spread

DAYS = 10
BATCH = 10_000

GENERATE = """
INSERT INTO jobs (queue, payload, status, run_at, attempts, fence, lease_until,
                  started_at, finished_at, last_error)
SELECT 'bench', '{}'::jsonb, s.status, s.t - interval '1 second', 1, 1,
       CASE WHEN s.status = 'running' THEN now() + interval '30 seconds' END,
       CASE WHEN s.status <> 'ready' THEN s.t - interval '10 milliseconds' END,
       CASE WHEN s.status IN ('done', 'dead') THEN s.t END,
       CASE WHEN s.status = 'dead' THEN 'RuntimeError: boom' END
FROM (SELECT now() - make_interval(secs => %(days)s * 86400.0 * (1 - i::float8 / %(n)s)) AS t,
             CASE WHEN i > %(n)s - %(n)s / 500 THEN
                    CASE WHEN i %% 2 = 0 THEN 'ready' ELSE 'running' END
                  WHEN i %% 1000 = 2 THEN 'dead' ELSE 'done' END AS status
      FROM generate_series(1, %(n)s) AS i) AS s
"""

# The recipe's archive: done jobs by finish day (UTC), one partition a day, plus a default
# partition for rows without finished_at (finished before the column existed).
ARCHIVE_DDL = """
CREATE TABLE jobs_done (LIKE jobs) PARTITION BY RANGE (finished_at);
CREATE TABLE jobs_done_default PARTITION OF jobs_done DEFAULT;
"""
ARCHIVE_DAY = "CREATE TABLE {name} PARTITION OF jobs_done FOR VALUES FROM ({lo}) TO ({hi})"
MOVE = """
WITH moved AS (
  DELETE FROM jobs
  WHERE id >= %(lo)s AND id < %(hi)s AND status IN ('done', 'cancelled')
    AND finished_at < now() - make_interval(secs => %(older_than)s)
  RETURNING *
)
INSERT INTO jobs_done SELECT * FROM moved
"""
DELETE_ALL = """
DELETE FROM jobs
WHERE status IN ('done', 'cancelled')
  AND coalesce(finished_at, run_at) < now() - make_interval(secs => %(older_than)s)
"""
OPERATIONS = ("prune", "delete", "archive-move", "archive-drop")


def generate(dsn: str, n: int, days: int = DAYS) -> None:
    """Fill an empty jobs table with ``n`` jobs as described above, then VACUUM ANALYZE."""
    with connect(dsn) as conn:
        conn.execute(GENERATE, {"n": n, "days": days})
        conn.execute("VACUUM ANALYZE jobs")


def _copy(bench: Bench, source: str, name: str) -> str:
    with connect(bench.admin_dsn) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {} STRATEGY = FILE_COPY").format(
                sql.Identifier(name), sql.Identifier(source)
            )
        )
    return make_conninfo(bench.admin_dsn, dbname=name)


def _drop(bench: Bench, name: str) -> None:
    with connect(bench.admin_dsn) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def _ranges(dsn: str) -> list[tuple[int, int]]:
    with connect(dsn) as conn:
        row = conn.execute("SELECT min(id), max(id) FROM jobs").fetchone()
    assert row is not None and row[0] is not None
    return [(lo, lo + BATCH) for lo in range(int(row[0]), int(row[1]) + 1, BATCH)]


def _timed_prune(dsn: str, older_than: float) -> tuple[float, float, int, int]:
    """``Queue.prune``: total seconds, longest gap between its progress calls (one batch
    statement, its own transaction), transactions and rows removed."""
    gaps: list[float] = []
    last = [time.perf_counter()]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        gaps.append(now - last[0])
        last[0] = now

    with Queue(dsn) as queue:
        started = time.perf_counter()
        last[0] = started
        rows = queue.prune(older_than=older_than, batch=BATCH, progress=progress)
        return time.perf_counter() - started, max(gaps), len(gaps), rows


def _timed_delete(dsn: str, older_than: float) -> tuple[float, float, int, int]:
    with connect(dsn) as conn:
        started = time.perf_counter()
        rows = conn.execute(DELETE_ALL, {"older_than": older_than}).rowcount
        seconds = time.perf_counter() - started
    return seconds, seconds, 1, rows


def archive_partitions(dsn: str, days: int = DAYS) -> None:
    """Create ``jobs_done`` with a partition per UTC day covering the table's finish times."""
    today = dt.datetime.now(dt.timezone.utc).date()
    with connect(dsn) as conn:
        conn.execute(ARCHIVE_DDL)
        for d in range(-days - 1, 2):
            day = today + dt.timedelta(days=d)
            conn.execute(
                ARCHIVE_DAY.format(
                    name=f"jobs_done_{day:%Y%m%d}",
                    lo=f"'{day.isoformat()} 00:00+00'",
                    hi=f"'{(day + dt.timedelta(days=1)).isoformat()} 00:00+00'",
                )
            )


def _timed_move(dsn: str, older_than: float) -> tuple[float, float, int, int]:
    """Move the rows ``prune`` would delete into ``jobs_done``, range by range."""
    ranges = _ranges(dsn)
    longest, rows = 0.0, 0
    with connect(dsn) as conn:
        started = time.perf_counter()
        for lo, hi in ranges:
            t = time.perf_counter()
            params = {"lo": lo, "hi": hi, "older_than": older_than}
            rows += conn.execute(MOVE, params, prepare=True).rowcount
            longest = max(longest, time.perf_counter() - t)
        return time.perf_counter() - started, longest, len(ranges), rows


def _timed_drop(dsn: str, older_than: float) -> tuple[float, float, int, int]:
    """Retention: drop every day partition wholly older than the cut, one transaction each."""
    with connect(dsn) as conn:
        old = conn.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = 'jobs_done'::regclass AND c.relname ~ '^jobs_done_[0-9]{8}$'"
            "   AND to_date(right(c.relname, 8), 'YYYYMMDD') + 1"
            "       <= (now() - make_interval(secs => %s)) AT TIME ZONE 'UTC'",
            [older_than],
        ).fetchall()
        names = [sql.Identifier(r[0]) for r in old]
        counted = sum(
            conn.execute(sql.SQL("SELECT count(*) FROM {}").format(n)).fetchone()[0]  # type: ignore[index]
            for n in names
        )
        longest, started = 0.0, time.perf_counter()
        for name in names:
            t = time.perf_counter()
            conn.execute(sql.SQL("DROP TABLE {}").format(name))
            longest = max(longest, time.perf_counter() - t)
        seconds = time.perf_counter() - started
    return seconds, longest, len(names), counted


def _stats_times(dsn: str, repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"stats": [], "stats-exact": []}
    with Queue(dsn) as queue:
        queue.stats()  # connect and prepare first
        for _ in range(repeats):
            for exact in (False, True):
                t = time.perf_counter()
                queue.stats(exact=exact)
                times["stats-exact" if exact else "stats"].append(time.perf_counter() - t)
    return times


def bench_housekeeping(
    bench: Bench, *, n_rows: int | None = None, repeats: int | None = None
) -> list[dict[str, Any]]:
    """``stats`` against ``stats(exact=True)``, then batched prune, one unbounded DELETE and
    the partition recipe (move, then drop), each on a fresh copy of the same table."""
    n_rows = n_rows or (100_000 if bench.quick else 5_000_000)
    repeats = repeats or bench.repeats
    older_than = (DAYS - 1) * 86400.0
    bar = _progress(2 + repeats * 3, "housekeeping", bench.progress)
    try:
        bar.set_postfix_str(f"generating {n_rows:,} rows")
        base_name = "bench_housekeeping"
        base = bench.database(base_name)
        generate(base, n_rows)
        bar.update()
        bar.set_postfix_str("stats")
        stats = _stats_times(base, max(3, repeats))
        bar.update()
        results: dict[str, list[tuple[float, float, int, int]]] = {op: [] for op in OPERATIONS}
        runs = {"prune": _timed_prune, "delete": _timed_delete, "archive": _timed_move}
        order = list(runs)
        for rep in range(repeats):
            for what in order[rep % 3 :] + order[: rep % 3]:
                bar.set_postfix_str(what)
                name = f"bench_housekeeping_{what}"
                dsn = _copy(bench, base_name, name)
                try:
                    if what == "archive":
                        archive_partitions(dsn)
                        results["archive-move"].append(_timed_move(dsn, older_than))
                        results["archive-drop"].append(_timed_drop(dsn, older_than))
                    else:
                        results[what].append(runs[what](dsn, older_than))
                finally:
                    _drop(bench, name)
                bar.update()
    finally:
        bar.close()
    rows = [_row(op, n_rows, [(t, t, 1, 0) for t in stats[op]]) for op in stats]
    rows += [_row(op, n_rows, results[op]) for op in OPERATIONS]
    return rows


NOTES = {
    "stats": "Queue.stats(): ready/running/dead through partial indexes, finished estimated",
    "stats-exact": "Queue.stats(exact=True): reads the whole table",
    "prune": f"Queue.prune(older_than={DAYS - 1} days, batch={BATCH:,}): a transaction per "
    f"{BATCH:,} jobs",
    "delete": "the same rows in one unbounded DELETE (one transaction)",
    "archive-move": "recipe, daily half: the same rows moved into jobs_done (partitioned "
    f"by finish day), DELETE ... RETURNING into INSERT, ranges of {BATCH:,} ids",
    "archive-drop": "recipe, retention half: DROP TABLE of each day partition older than "
    "the cut (whole days only; the partial day waits for tomorrow)",
}


def _row(op: str, n_rows: int, runs: Sequence[tuple[float, float, int, int]]) -> dict[str, Any]:
    med, lo, hi = _spread([r[0] for r in runs])
    return {
        "operation": op,
        "rows_in_table": n_rows,
        "rows_affected": max(r[3] for r in runs) if op not in ("stats", "stats-exact") else "",
        "runs": len(runs),
        "seconds_median": round(med, 4),
        "seconds_min": round(lo, 4),
        "seconds_max": round(hi, 4),
        "longest_txn_s": round(_spread([r[1] for r in runs])[0], 4),  # median of runs
        "transactions": runs[0][2],
        "note": NOTES[op],
    }
