"""Notebook 13's plumbing: the shop of notebook 11 read and written on an async connection,
the web framework's part of a request, waiting for a worker from the notebook's event loop,
the concurrency table and the "Try it" drain. Teaching aids, not the queue."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import psycopg
from psycopg import sql

from ..async_queue import async_connect
from ..events import EventLog
from . import async_bench, plot
from .lab import scratch_database
from .own_code_lab import SHOP

__all__ = [
    "SHOP",
    "add_order",
    "concurrency_table",
    "count",
    "create_shop",
    "job_states",
    "requests",
    "serve",
    "table",
    "try_drain",
    "until",
]

Handler = Callable[[dict[str, Any], psycopg.AsyncConnection], Awaitable[dict[str, Any]]]


async def create_shop(conn: psycopg.AsyncConnection) -> None:
    """Create the shop's tables (``SHOP``: ``orders`` and ``receipts``) on ``conn``."""
    await conn.execute(SHOP)


async def count(conn: psycopg.AsyncConnection, table: str, **equal: Any) -> int:
    """Rows in ``table`` (those whose columns equal the values ``equal`` names, if any),
    read on the async connection ``conn``."""
    query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))
    if equal:
        query += sql.SQL(" WHERE ") + sql.SQL(" AND ").join(
            sql.SQL("{} = %s").format(sql.Identifier(column)) for column in equal
        )
    row = await (await conn.execute(query, list(equal.values()) or None)).fetchone()
    assert row is not None
    return int(row[0])


async def table(conn: psycopg.AsyncConnection, query: str, params: Any = None) -> Any:
    """The rows of ``query`` as a pandas DataFrame, its columns named as the query names them."""
    import pandas as pd

    cur = await conn.execute(query, params)
    assert cur.description is not None
    return pd.DataFrame(await cur.fetchall(), columns=[c.name for c in cur.description])


async def add_order(conn: psycopg.AsyncConnection, customer: str, amount_cents: int) -> int:
    """Insert an order (no job) and return its id."""
    cur = await conn.execute(
        "INSERT INTO orders (customer, amount_cents) VALUES (%s, %s) RETURNING id",
        (customer, amount_cents),
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def job_states(conn: psycopg.AsyncConnection, ids: list[int]) -> Any:
    """The jobs ``ids`` as the table holds them, indexed by id: status, attempts, fence and
    whether they hold no lease (``lease_until IS NULL``)."""
    frame = await table(
        conn,
        "SELECT id, status, attempts, fence, lease_until IS NULL AS no_lease FROM jobs"
        " WHERE id = ANY(%s) ORDER BY id",
        [ids],
    )
    return frame.set_index("id")


def requests(n: int, declined: Iterable[int] = ()) -> list[dict[str, Any]]:
    """``n`` order requests, ``customer 0`` paying 1000 cents, ``customer 1`` 1001 and so on;
    the card of the requests numbered in ``declined`` is declined."""
    refused = set(declined)
    return [
        {
            "customer": f"customer {k}",
            "amount_cents": 1000 + k,
            "card": "declined" if k in refused else "ok",
        }
        for k in range(n)
    ]


async def serve(dsn: str, handler: Handler, request: dict[str, Any]) -> dict[str, Any]:
    """What a web framework does for one request: a connection of its own (an application
    would take one from a pool), the handler's answer, and a ``RuntimeError`` it raises
    turned into status 402."""
    async with await async_connect(dsn, application_name="shop web") as conn:
        try:
            return await handler(request, conn)
        except RuntimeError as exc:
            return {"status": 402, "error": str(exc)}


async def until(
    condition: Callable[[], bool], *, timeout: float = 30.0, every: float = 0.02
) -> float:
    """Await, ``every`` seconds, until ``condition()`` holds (the event loop runs on
    meanwhile, with any worker started on it); return the seconds waited. Raise
    ``TimeoutError`` after ``timeout`` seconds."""
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout:
            raise TimeoutError(f"waited {timeout:g} s for {getattr(condition, '__name__', '?')}")
        await asyncio.sleep(every)
    return time.monotonic() - began


def concurrency_table(
    runs: Mapping[int, tuple[EventLog, float, int]], jobs: int = 60, io: float = 0.05
) -> Any:
    """One row per concurrency of ``async_bench.drain`` results (events, seconds, sessions)
    for ``jobs`` jobs of ``io`` seconds each: seconds, jobs/s, the model's jobs/s (one job
    per ``io`` for each handler at once, at most ``jobs`` at once) and sessions."""
    import pandas as pd

    rows = [
        {
            "at once": c,
            "seconds": seconds,
            "jobs/s": jobs / seconds,
            "model: jobs/s": min(c, jobs) / io,
            "sessions": sessions,
        }
        for c, (_, seconds, sessions) in runs.items()
    ]
    return pd.DataFrame(rows).set_index("at once")


TRY_JOBS = 100  # the jobs each "Try it" run drains


def try_drain(concurrency: int = 20, io_ms: int = 50) -> None:
    """Drain ``TRY_JOBS`` jobs of ``io_ms`` ms with ``concurrency`` handlers at once in the
    scratch database ``course_13_try`` (dropped afterwards), on an event loop of its own in
    a thread (a widget's callback is a plain function, called while the notebook's loop
    runs); print the throughput and the sessions and show the jobs finishing."""
    import matplotlib.pyplot as plt

    jobs = TRY_JOBS

    def experiment() -> tuple[EventLog, float, int]:
        with scratch_database("course_13_try") as scratch:
            return asyncio.run(async_bench.drain(scratch, concurrency, jobs=jobs, io=io_ms / 1000))

    result: dict[str, tuple[EventLog, float, int]] = {}
    thread = threading.Thread(target=lambda: result.update(run=experiment()))
    thread.start()
    thread.join()
    if "run" not in result:  # the thread's error was printed by threading's excepthook
        raise RuntimeError("the experiment failed")
    events, seconds, sessions = result["run"]
    print(f"{jobs / seconds:.0f} jobs/s ({seconds:.2f} s), {sessions} sessions")
    plot.throughput({f"{concurrency} at once, {io_ms} ms": events})
    plt.show()
