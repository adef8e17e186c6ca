"""Databases of their own for the benchmarks and the course's notebooks: each made afresh
with the pgqueue schema, so runs do not disturb one another, and dropped after."""

from __future__ import annotations

from psycopg import sql
from psycopg.conninfo import make_conninfo

from ..db import connect, resolve_dsn
from ..queue import Queue

__all__ = ["drop_database", "fresh_database"]


def fresh_database(name: str, dsn: str | None = None) -> str:
    """Drop and re-create database ``name`` with the pgqueue schema; return its DSN.

    Each notebook works in a database of its own, so notebooks run in any order and
    measurements (dead rows, table sizes) are not disturbed by one another.
    """
    admin = resolve_dsn(dsn)
    with connect(admin) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    target = make_conninfo(admin, dbname=name)
    with Queue(target) as q:
        q.install()
    return target


def drop_database(name: str, dsn: str | None = None) -> None:
    """Remove a database made by ``fresh_database`` (cleaning up after a notebook)."""
    with connect(resolve_dsn(dsn)) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
