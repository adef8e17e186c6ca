"""Notebook 11's plumbing: the shop's tables, a query read into a table, the finished jobs a
cost measurement needs, the alert thresholds of the health check and the "Try it" shop.
Notebook 13 opens the same shop. Teaching aids, not the queue."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from . import health_check, worker_runs
from .lab import scratch_database

__all__ = ["ALERTS", "SHOP", "add_finished_jobs", "count", "table", "try_shop"]

# The shop: orders, and their receipts written by jobs with a fenced write (the row keeps
# the fence of the claim that wrote it, and the job).
SHOP = """
CREATE TABLE orders (
  id           bigserial PRIMARY KEY,
  customer     text    NOT NULL,
  amount_cents bigint  NOT NULL,
  refunded     boolean NOT NULL DEFAULT false
);
CREATE TABLE receipts (
  order_id bigint PRIMARY KEY REFERENCES orders (id),
  body     text   NOT NULL,
  fence    bigint NOT NULL,
  job_id   bigint NOT NULL
);
"""

ALERTS = {  # metric -> (threshold, what it means when exceeded)
    "oldest_ready_s": (60, "jobs wait: too few workers, or they are stuck"),
    "expired_leases": (0, "workers died or stalled; the reaper will return their jobs"),
    "dead": (0, "jobs failed for good: read last_error, fix, retry_dead"),
    "longest_holding_s": (60, "a long transaction or snapshot holds vacuum back"),
    "jobs_dead_rows": (100_000, "vacuum is not keeping up with the queue"),
}


def count(conn: psycopg.Connection, table: str) -> int:
    """Rows in ``table``, read on the connection ``conn``."""
    query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))
    row = conn.execute(query).fetchone()
    assert row is not None
    return int(row[0])


def table(conn: psycopg.Connection, query: str, params: Any = None) -> Any:
    """The rows of ``query`` as a pandas DataFrame, its columns named as the query names them."""
    import pandas as pd

    cur = conn.execute(query, params)
    assert cur.description is not None
    return pd.DataFrame(cur.fetchall(), columns=[column.name for column in cur.description])


def add_finished_jobs(conn: psycopg.Connection, n: int, queue: str = "receipts") -> None:
    """Insert ``n`` finished (done) jobs on ``queue``, then ``ANALYZE jobs``, so the planner
    knows the table holds them."""
    conn.execute(
        "INSERT INTO jobs (queue, payload, status, attempts, fence, started_at, finished_at) "
        "SELECT %s, '{}', 'done', 1, 1, now(), now() FROM generate_series(1, %s)",
        [queue, n],
    )
    conn.execute("ANALYZE jobs")


def try_shop(
    place_order: Callable[..., int],
    tasks: Any,
    monitor: str,
    *,
    orders: int = 5,
    concurrency: int = 2,
    alerts: dict[str, tuple[float, str]] = ALERTS,
) -> None:
    """A fresh shop in the scratch database ``course_11_try`` (dropped afterwards):
    ``orders`` orders placed with ``place_order(conn, customer, amount_cents)``, the
    command-line worker run over them with ``concurrency`` threads, its summary and the
    receipts written printed, then the health check (``monitor`` against ``alerts``) shown.
    ``tasks`` (the shop's registry) is pointed at the scratch database while orders are
    placed, and closed again."""
    from IPython.display import display

    with (
        scratch_database("course_11_try") as scratch,
        psycopg.connect(scratch, autocommit=True) as shop_app,
    ):
        shop_app.execute(SHOP)
        tasks.close()
        tasks.dsn = scratch  # the registry's own connection must reach a live database
        try:
            for n in range(orders):
                place_order(shop_app, f"shopper {n}", 500 + n)
        finally:
            tasks.close()
        run = worker_runs.run_worker(shop_app, scratch, "--concurrency", str(concurrency))
        print(f"{run.summary}; receipts written: {count(shop_app, 'receipts')}")
        display(health_check.health(shop_app, monitor, alerts))
