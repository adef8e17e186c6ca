"""Fenced writes to tables other than ``jobs``: accept a write only from a newer fence.

The seed's pattern, ``UPDATE reports SET body = $2, fence = $3 WHERE id = $1 AND fence < $3``,
generalised to any table with a unique key and a ``fence bigint`` column. A write from a
worker whose fence is older than the one already stored changes nothing, and the caller is
told so. A fence only protects systems that check it: e-mails or payment calls need
idempotency keys instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg import sql

from .errors import BadInput, LeaseLost

__all__ = ["LeaseLost", "fenced_write"]


def fenced_write(
    conn: psycopg.Connection,
    table: str,
    key: Mapping[str, Any],
    values: Mapping[str, Any],
    fence: int,
    *,
    fence_column: str = "fence",
    upsert: bool = True,
) -> bool:
    """Write ``values`` to the row of ``table`` identified by ``key`` if ``fence`` is newer
    than the stored one; return whether the write took effect.

    With ``upsert`` (the default) a missing row is inserted (``key`` must be a unique key);
    without it, only an existing row with an older fence is updated, as in the seed.
    """
    if not key or not values:
        raise BadInput("fenced_write needs a non-empty key and values")
    if fence_column in key or fence_column in values:
        raise BadInput(f"pass the fence as fence=, not as the column {fence_column!r}")
    target = _name(*table.split("."))
    fence_id = _name(fence_column)
    params: dict[str, Any] = {f"k{i}": v for i, v in enumerate(key.values())}
    params |= {f"v{i}": v for i, v in enumerate(values.values())}
    params["fence"] = fence
    keys = [_name(k) for k in key]
    cols = [_name(c) for c in values]
    if upsert:
        query = sql.SQL(
            "INSERT INTO {t} ({all_cols}) VALUES ({all_vals}) "
            "ON CONFLICT ({keys}) DO UPDATE SET {sets} WHERE {t}.{f} < EXCLUDED.{f}"
        ).format(
            t=target,
            f=fence_id,
            all_cols=sql.SQL(", ").join([*keys, *cols, fence_id]),
            all_vals=sql.SQL(", ").join(
                [sql.Placeholder(f"k{i}") for i in range(len(keys))]
                + [sql.Placeholder(f"v{i}") for i in range(len(cols))]
                + [sql.Placeholder("fence")]
            ),
            keys=sql.SQL(", ").join(keys),
            sets=sql.SQL(", ").join(
                [sql.SQL("{c} = EXCLUDED.{c}").format(c=c) for c in [*cols, fence_id]]
            ),
        )
    else:
        query = sql.SQL(
            "UPDATE {t} SET {sets}, {f} = %(fence)s WHERE {match} AND {f} < %(fence)s"
        ).format(
            t=target,
            f=fence_id,
            sets=sql.SQL(", ").join(
                sql.SQL("{} = {}").format(c, sql.Placeholder(f"v{i}")) for i, c in enumerate(cols)
            ),
            match=sql.SQL(" AND ").join(
                sql.SQL("{} = {}").format(k, sql.Placeholder(f"k{i}")) for i, k in enumerate(keys)
            ),
        )
    return conn.execute(query, params).rowcount == 1


def _name(*parts: str) -> sql.Identifier:
    """A quoted identifier. ``%`` is doubled because psycopg reads the composed query
    for %(name)s placeholders and would take a ``%`` inside a name for one."""
    return sql.Identifier(*(part.replace("%", "%%") for part in parts))
