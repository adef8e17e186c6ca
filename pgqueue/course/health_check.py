"""A queue's health check as a monitoring system would run it: one query, its values
against alert thresholds, and what the query reads of the ``jobs`` table to answer.

``health`` runs the query and flags each value over its threshold. ``jobs_scans`` lists
how the plan reaches ``jobs`` (a sequential scan, or which index); ``pages_read`` runs the
query under ``EXPLAIN (ANALYZE, BUFFERS)`` and counts the pages of ``jobs`` it touched,
so a notebook can show that a check meant for every minute costs what the live work costs,
not what the whole table does. Teaching aids, not the queue (``pgqueue stats`` and
``pgqueue monitor`` are the library's own)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import psycopg

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["health", "jobs_scans", "pages_read"]


def health(
    conn: psycopg.Connection, query: str, alerts: Mapping[str, tuple[float, str]]
) -> pd.DataFrame:
    """Run ``query`` (one row) and return one row per column: its value, whether it is over
    the threshold that ``alerts`` gives it (metric -> (threshold, meaning)), and the meaning
    of an alert that fires."""
    import pandas as pd

    cur = conn.execute(query)
    row = cur.fetchone()
    assert cur.description is not None and row is not None
    rows = []
    for column, value in zip(cur.description, row, strict=True):
        threshold, meaning = alerts.get(column.name, (None, ""))
        fires = threshold is not None and value > threshold
        rows.append(
            {
                "metric": column.name,
                "value": round(float(value), 1),
                "alert": fires,
                "meaning": meaning if fires else "",
            }
        )
    return pd.DataFrame(rows).set_index("metric")


def _nodes(plan: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _plan(conn: psycopg.Connection, query: str, options: str) -> Mapping[str, Any]:
    row = conn.execute(f"EXPLAIN ({options}, FORMAT JSON) {query}").fetchone()
    assert row is not None
    return row[0][0]


def jobs_scans(conn: psycopg.Connection, query: str) -> list[str]:
    """How the plan of ``query`` reaches the jobs table, one entry per scan: ``"Seq Scan"``,
    or the node and the index it reads (``"Index Only Scan using jobs_ready_idx"``)."""
    scans = []
    for node in _nodes(_plan(conn, query, "COSTS OFF")["Plan"]):
        kind = node["Node Type"]
        if node.get("Index Name", "").startswith("jobs_"):
            scans.append(f"{kind} using {node['Index Name']}")
        elif kind == "Seq Scan" and node.get("Relation Name") == "jobs":
            scans.append(kind)
    return scans


def pages_read(conn: psycopg.Connection, query: str) -> int:
    """Pages of the jobs table and its indexes (8 kB buffers, from cache or disk) that
    running ``query`` touched, from ``EXPLAIN (ANALYZE, BUFFERS)``: the scans of ``jobs``
    in its whole plan, subqueries included (a bitmap heap scan counts its index's pages)."""
    plan = _plan(conn, query, "ANALYZE, BUFFERS")["Plan"]
    return sum(
        int(node["Shared Hit Blocks"] + node["Shared Read Blocks"])
        for node in _nodes(plan)
        if node.get("Relation Name") == "jobs"
    )
