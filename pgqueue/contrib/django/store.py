"""Where a backend reads and writes its jobs: Django's own connection, or one of its own.

When the task database is Django's own (no ``DSN`` option, Django's default database on
PostgreSQL with psycopg 3), every statement goes through Django's connection of the calling
thread, so an enqueue inside ``transaction.atomic()`` is part of that transaction (rolled
back with it) and a read sees the block's own uncommitted tasks. Two things of Django's are
set aside meanwhile: its jsonb loader (Django reads jsonb as text; pgqueue reads JSON) is
swapped for psycopg's for pgqueue's statements only, and nothing is prepared (Django turns
preparing off, for poolers). Otherwise the backend opens a pgqueue connection of its own,
one per thread, in autocommit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from psycopg.conninfo import make_conninfo
from psycopg.postgres import types
from psycopg.pq import Conninfo, Format
from psycopg.types.json import JsonbBinaryLoader, JsonbLoader

from pgqueue.db import connect, own_cursor, resolve_dsn
from pgqueue.queue import Queue

_JSONB = types["jsonb"].oid
_KEYWORDS = {option.keyword.decode() for option in Conninfo.get_defaults()}


class Store:
    """A connection to run pgqueue's statements on (``use()``) and the server's clock."""

    @contextmanager
    def use(self) -> Iterator[Queue]:
        raise NotImplementedError
        yield

    def now(self, queue: Queue) -> datetime:
        """The server's ``now()``: the time of this transaction (of the statement, outside one)."""
        row = own_cursor(queue.conn).execute("SELECT now()").fetchone()
        assert row is not None
        return row[0]  # type: ignore[no-any-return]


class DjangoStore(Store):
    """Django's connection ``alias`` of the calling thread (see the module's docstring)."""

    def __init__(self, alias: str = DEFAULT_DB_ALIAS) -> None:
        self.alias = alias

    @contextmanager
    def use(self) -> Iterator[Queue]:
        wrapper = connections[self.alias]
        # An error inside atomic() marks the block for rollback, as Django's own queries do.
        with transaction.mark_for_rollback_on_error(self.alias):
            wrapper.ensure_connection()
            conn = wrapper.connection
            assert isinstance(conn, psycopg.Connection)
            with _json_loaded(conn):
                # No statement prepared on Django's connection unless Django prepares too.
                yield Queue(conn, pgbouncer=conn.prepare_threshold is None)


class OwnStore(Store):
    """A pgqueue connection of the backend's own to ``dsn``, one per thread (``keep``), or
    one per use, closed after it."""

    def __init__(self, dsn: str, *, keep: bool = True) -> None:
        self.dsn = dsn
        self.keep = keep
        self._local = threading.local()

    @contextmanager
    def use(self) -> Iterator[Queue]:
        if not self.keep:
            with connect(self.dsn, application_name="pgqueue django") as conn:
                yield Queue(conn)
            return
        queue: Queue | None = getattr(self._local, "queue", None)
        if queue is None or queue.closed or queue.conn.broken:
            queue = self._local.queue = Queue(connect(self.dsn, application_name="pgqueue django"))
        yield queue

    def close(self) -> None:
        queue = getattr(self._local, "queue", None)
        if queue is not None:
            queue.conn.close()
            self._local.queue = None


def django_is_postgresql(alias: str = DEFAULT_DB_ALIAS) -> bool:
    """Whether Django's database ``alias`` is PostgreSQL through psycopg 3."""
    wrapper = connections[alias]
    if wrapper.vendor != "postgresql":
        return False
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    return bool(is_psycopg3)


def django_dsn(wrapper: BaseDatabaseWrapper) -> str:
    """A libpq connection string for Django's database ``wrapper`` (its NAME, USER,
    PASSWORD, HOST, PORT and the libpq keywords among its OPTIONS)."""
    params = wrapper.get_connection_params()
    kept = {
        k: v
        for k, v in params.items()
        if k in _KEYWORDS and isinstance(v, str | int) and not isinstance(v, bool)
    }
    return make_conninfo("", **kept)


def task_dsn(dsn: str | None) -> str:
    """The DSN of the task database: ``dsn`` if given, else Django's default database when
    it is PostgreSQL, else pgqueue's usual order (``PGQUEUE_DSN``, ``DATABASE_URL``, ...)."""
    if dsn is not None:
        return dsn
    if django_is_postgresql():
        return django_dsn(connections[DEFAULT_DB_ALIAS])
    return resolve_dsn(None)


@contextmanager
def _json_loaded(conn: psycopg.Connection[Any]) -> Iterator[None]:
    adapters = conn.adapters
    text = adapters.get_loader(_JSONB, Format.TEXT)
    binary = adapters.get_loader(_JSONB, Format.BINARY)
    adapters.register_loader(_JSONB, JsonbLoader)
    adapters.register_loader(_JSONB, JsonbBinaryLoader)
    try:
        yield
    finally:  # Django's own again, for the ORM's next query
        if text is not None:
            adapters.register_loader(_JSONB, text)
        if binary is not None:
            adapters.register_loader(_JSONB, binary)
