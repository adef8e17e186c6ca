"""The server connections a fleet of worker processes holds: counted on the server, and
drawn against the server's limit.

``sessions`` counts a worker's sessions in ``pg_stat_activity`` by the ``application_name``
each worker sets, and ``settle`` waits for such a count to reach what is expected. The model
of a fleet is the notebook's own function (its arithmetic is the lesson), passed in as
``connections(hosts, processes, threads, pool=None)``; ``plot_fleet`` draws it for 1 to 16
processes per host, directly and through a pooler. Teaching aids, not the queue."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import psycopg

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_fleet", "sessions", "settle"]

T = TypeVar("T")


def plot_fleet(
    connections: Callable[..., int], usable: int, *, hosts: int, threads: int, pool: int
) -> Figure:
    """Server connections of ``hosts`` worker hosts against their processes per host, directly
    and through PgBouncer with a pool of ``pool``, under the server's ``usable`` limit."""
    import matplotlib.pyplot as plt

    processes = range(1, 17)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    direct = [connections(hosts, p, threads) for p in processes]
    pooled = [connections(hosts, p, threads, pool=pool) for p in processes]
    ax.plot(processes, direct, marker="o", label=f"direct: {threads} lanes + 4 per process")
    through = f"through PgBouncer: pool of {pool} + one direct listener per process"
    ax.plot(processes, pooled, marker="s", label=through)
    ax.axhline(usable, color="tab:red", linestyle="--", label=f"this server's limit ({usable})")
    ax.set_title(f"Server connections held by {hosts} worker hosts (model)")
    ax.set_xlabel("worker processes per host")
    ax.set_ylabel("server connections")
    ax.set_xlim(0.5, 16.5)
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    return fig


def sessions(conn: psycopg.Connection, app_name: str, query: str | None = None) -> int:
    """How many sessions the server holds for one ``application_name`` (in any database), or
    only those whose last statement was ``query``."""
    sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
    sql += " AND query = %s" if query else ""
    row = conn.execute(sql, (app_name, query) if query else (app_name,)).fetchone()
    return int(row[0]) if row else 0


def settle(read: Callable[[], T], until: T, timeout: float = 20.0) -> T:
    """Call ``read`` every 50 ms until it returns ``until`` or ``timeout`` seconds have
    passed; return what it returned last (the caller asserts on it)."""
    deadline = time.monotonic() + timeout
    value = read()
    while value != until and time.monotonic() < deadline:
        time.sleep(0.05)
        value = read()
    return value
