"""``conn=``: a job written in your own transaction, on a psycopg 3 connection directly or
through SQLAlchemy (``postgresql+psycopg://``), whose transaction the job joins. SQLAlchemy
is imported only when a SQLAlchemy object is passed."""

from __future__ import annotations

from typing import Any

import psycopg

from .errors import (
    BadInput,
)


def your_conn(conn: object) -> psycopg.Connection | None:
    """``conn=`` of ``Queue``: a psycopg connection as it is, or a SQLAlchemy ``Connection``
    or ``Session`` on psycopg 3 unwrapped to the psycopg connection under it, with its
    SQLAlchemy transaction begun (a Session's ``connection()`` begins it), so that the job
    commits or rolls back with that transaction."""
    if conn is None or isinstance(conn, psycopg.Connection):
        return conn
    if from_sqlalchemy(conn):
        from sqlalchemy.engine import Connection
        from sqlalchemy.orm import Session, scoped_session

        if isinstance(conn, Session | scoped_session):
            conn = conn.connection()
        if isinstance(conn, Connection):
            if not conn.in_transaction():
                conn.begin()  # else its commit() would find nothing begun to commit
            raw = conn.connection.driver_connection
            return _driver(raw, psycopg.Connection, conn.dialect.driver)
    raise _not_a_conn(conn, "Connection or Session")


async def your_async_conn(conn: object) -> psycopg.AsyncConnection | None:
    """``conn=`` of ``AsyncQueue``: a psycopg ``AsyncConnection``, or SQLAlchemy's
    ``AsyncConnection`` or ``AsyncSession`` on psycopg 3 (``postgresql+psycopg://``),
    unwrapped as ``your_conn`` does."""
    if conn is None or isinstance(conn, psycopg.AsyncConnection):
        return conn
    if from_sqlalchemy(conn):
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session

        if isinstance(conn, AsyncSession | async_scoped_session):
            conn = await conn.connection()
        if isinstance(conn, AsyncConnection):
            if not conn.in_transaction():
                await conn.begin()
            raw = (await conn.get_raw_connection()).driver_connection
            return _driver(raw, psycopg.AsyncConnection, conn.dialect.driver)
    raise _not_a_conn(conn, "AsyncConnection or AsyncSession")


def from_sqlalchemy(conn: object) -> bool:
    return type(conn).__module__.split(".")[0] == "sqlalchemy"  # never imports SQLAlchemy


def _driver(raw: object, kind: type[Any], driver: str) -> Any:
    if not isinstance(raw, kind):
        raise BadInput(
            f"conn= is a SQLAlchemy connection on the {driver!r} driver; pgqueue joins only "
            "a transaction on psycopg 3: create the engine from a postgresql+psycopg:// URL"
        )
    return raw


def _not_a_conn(conn: object, sqlalchemy_kinds: str) -> BadInput:
    kind = "AsyncConnection" if "Async" in sqlalchemy_kinds else "Connection"
    return BadInput(
        f"conn= must be a psycopg {kind} or a SQLAlchemy {sqlalchemy_kinds} on psycopg 3, "
        f"got {type(conn).__module__}.{type(conn).__qualname__}"
    )
