"""Fenced writes to tables other than ``jobs``: refuse a write from an older claim.

The seed's pattern, ``UPDATE reports SET body = $2, fence = $3 WHERE id = $1 AND fence < $3``,
generalised to any table with a unique key and a ``fence bigint`` column. A write from a
worker whose fence is older than the one already stored changes nothing, and the caller is
told so. A fence only protects systems that check it: e-mails or payment calls need
idempotency keys instead.

A fence counts the claims of one job, so it orders the writes of that job's holders and
nothing else: fence 2 of job 9 is not newer than fence 1 of job 7. Given ``job_id``, the
row also stores the job that wrote it; a later write from the same job is accepted when
its fence is no older (the same claim may write twice), and a write from another job is
refused loudly (``FenceConflict``) rather than judged by an unrelated number.

A stored fence only refuses a holder once a newer one has written. Where the table lives
in the queue's own database, ``check_lease=True`` (what ``Job.fenced_write`` passes) adds
the job itself to the write's statement: the write takes effect only while ``jobs`` says
the job is running with this fence and an unexpired lease, so a holder that was reaped,
timed out, failed or cancelled is refused at once, before anyone else has written. That is
checked as of the statement: in a longer transaction the claim may end before the commit,
and nothing waits for it; ``Job.transaction()`` holds the claim to the commit.

Table and column names come from the caller and are composed with
``psycopg.sql.Identifier`` (quoted, never pasted in); every value is a parameter.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any, Literal, NamedTuple

import psycopg
from psycopg import sql

from . import statements
from .db import first_line
from .errors import BadInput, FenceConflict, LeaseLost

__all__ = ["Answer", "FenceConflict", "FencedWrite", "LeaseLost", "compose"]

# What a fenced write's statements answered: it took effect, the writer's fence is stale,
# or (an update, no upsert) the row is not there, which says nothing about the claim.
Answer = Literal["written", "stale", "missing"]
WRITTEN: Answer = "written"
STALE: Answer = "stale"
MISSING: Answer = "missing"


class FencedWrite(NamedTuple):
    """A fenced write composed for one call: the write, and how to read a refusal."""

    query: sql.Composed
    params: dict[str, Any]
    lookup: sql.Composed  # the job id stored in the row (to tell stale from conflict)
    key_params: dict[str, Any]
    table: str
    key: Mapping[str, Any]
    job_id: int | None
    fence_column: str
    job_column: str
    holds: sql.Composed | None  # with check_lease: does the job still hold this claim?

    def missing_column(self, exc: psycopg.errors.UndefinedColumn) -> BadInput:
        """What an undefined column means to a write with a job id: no job column."""
        return BadInput(
            f"{self.table}: {first_line(exc)} (a write with job_id= needs a "
            f"{self.job_column!r} bigint column beside {self.fence_column!r})"
        )

    def refused(self, stored: tuple[Any, ...] | None) -> Answer:
        """Why a write with a job id took no effect: no such row (``missing``, only
        without upsert), a newer fence of this job (``stale``), or another job's row
        (``FenceConflict``)."""
        if stored is None:
            return MISSING
        if stored[0] == self.job_id:
            return STALE
        where = ", ".join(f"{k}={v!r}" for k, v in self.key.items())
        by = "without a job id" if stored[0] is None else f"by job {stored[0]}"
        raise FenceConflict(
            f"row ({where}) of {self.table} was written {by}; fences of different jobs are "
            "not comparable: key the row by job (or use one job per row)"
        )


def compose(
    table: str,
    key: Mapping[str, Any],
    values: Mapping[str, Any],
    fence: int,
    job_id: int | None = None,
    fence_column: str = "fence",
    job_column: str = "job_id",
    upsert: bool = True,
    check_lease: bool = False,
) -> FencedWrite:
    """Check the arguments of a fenced write and compose its statements (names quoted
    with ``psycopg.sql.Identifier``, every value a parameter)."""
    if not key or not values:
        raise BadInput("fenced_write needs a non-empty key and values")
    if check_lease and job_id is None:
        raise BadInput("check_lease=True needs job_id=: the lease checked is that job's")
    if fence_column in key or fence_column in values:
        raise BadInput(f"pass the fence as fence=, not as the column {fence_column!r}")
    if job_id is not None and job_column in values:
        raise BadInput(f"pass the job as job_id=, not as the column {job_column!r}")
    if job_id is not None and job_column in key and key[job_column] != job_id:
        raise BadInput(f"key {job_column}={key[job_column]!r} is not the writing job {job_id}")
    target = _name(*table.split("."))
    f, j = _name(fence_column), _name(job_column)
    key_params = {f"k{i}": v for i, v in enumerate(key.values())}
    params: dict[str, Any] = key_params | {f"v{i}": v for i, v in enumerate(values.values())}
    params |= {"fence": fence, "job": job_id}
    keys = [_name(k) for k in key]
    cols = [_name(c) for c in values]
    match = sql.SQL(" AND ").join(
        sql.SQL("{} = {}").format(k, sql.Placeholder(f"k{i}")) for i, k in enumerate(keys)
    )
    holds = _holds() if check_lease else None
    live = sql.SQL("") if holds is None else sql.SQL(" WHERE EXISTS ({})").format(holds)
    if upsert:
        # The job column is written on insert only (unless it is the key): it never changes.
        owner = [] if job_id is None or job_column in key else [(j, sql.Placeholder("job"))]
        accept = sql.SQL("{t}.{f} < EXCLUDED.{f}")
        if job_id is not None:
            accept = sql.SQL("{t}.{j} = EXCLUDED.{j} AND {t}.{f} <= EXCLUDED.{f}")
        # INSERT ... SELECT, not VALUES, so that the claim check can stop the insert too.
        query = sql.SQL(
            "INSERT INTO {t} ({all_cols}) SELECT {all_vals}{live} "
            "ON CONFLICT ({keys}) DO UPDATE SET {sets} WHERE {accept}"
        ).format(
            t=target,
            live=live,
            accept=accept.format(t=target, f=f, j=j),
            all_cols=sql.SQL(", ").join([*keys, *cols, *(c for c, _ in owner), f]),
            all_vals=sql.SQL(", ").join(
                [sql.Placeholder(f"k{i}") for i in range(len(keys))]
                + [sql.Placeholder(f"v{i}") for i in range(len(cols))]
                + [p for _, p in owner]
                + [sql.Placeholder("fence")]
            ),
            keys=sql.SQL(", ").join(keys),
            sets=sql.SQL(", ").join(
                [sql.SQL("{c} = EXCLUDED.{c}").format(c=c) for c in [*cols, f]]
            ),
        )
    else:
        accept = sql.SQL("{f} < %(fence)s")
        if job_id is not None:
            accept = sql.SQL("{j} = %(job)s AND {f} <= %(fence)s")
        checks = accept.format(f=f, j=j)
        if holds is not None:
            checks = sql.SQL("{} AND EXISTS ({})").format(checks, holds)
        query = sql.SQL("UPDATE {t} SET {sets}, {f} = %(fence)s WHERE {match} AND {accept}").format(
            t=target,
            f=f,
            accept=checks,
            sets=sql.SQL(", ").join(
                sql.SQL("{} = {}").format(c, sql.Placeholder(f"v{i}")) for i, c in enumerate(cols)
            ),
            match=match,
        )
    lookup = sql.SQL("SELECT {j} FROM {t} WHERE {match}").format(j=j, t=target, match=match)
    return FencedWrite(
        query, params, lookup, key_params, table, key, job_id, fence_column, job_column, holds
    )


@cache
def _holds() -> sql.Composed:
    """The ``holds`` statement of ``sql/queries.sql`` (its comments left out), to nest in
    a write's ``EXISTS (...)``."""
    lines = statements.query("holds").splitlines()
    return sql.SQL(" ").join(sql.SQL(x.strip()) for x in lines if not x.lstrip().startswith("--"))


def _name(*parts: str) -> sql.Identifier:
    """A quoted identifier. ``%`` is doubled because psycopg reads the composed query
    for %(name)s placeholders and would take a ``%`` inside a name for one."""
    return sql.Identifier(*(part.replace("%", "%%") for part in parts))
