"""What retiring old rows leaves behind: a table's size and its dead row versions, for a
plain table or a partitioned one (summed over its partitions), read from the statistics
after flushing this session's counters. Teaching aids, not the queue (``prune`` is the
library's own)."""

from __future__ import annotations

import psycopg

__all__ = ["size_and_dead"]

SIZE_AND_DEAD = """
SELECT coalesce(sum(pg_total_relation_size(relid)), 0), coalesce(sum(n_dead_tup), 0)
FROM pg_stat_user_tables
WHERE relid = %(table)s::regclass
   OR relid IN (SELECT relid FROM pg_partition_tree(%(table)s::regclass))
"""


def size_and_dead(conn: psycopg.Connection, table: str) -> tuple[int, int]:
    """(bytes on disk, dead row versions) of ``table``: itself, or every partition of it."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    row = conn.execute(SIZE_AND_DEAD, {"table": table}).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])
