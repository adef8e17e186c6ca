"""Where the connection comes from: ``--dsn``, ``PGQUEUE_DSN``, ``DATABASE_URL``, libpq's
own environment (``PGHOST``, ``PGSERVICE``, ``PGDATABASE``, ...), else the embedded server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import conninfo
from psycopg.rows import tuple_row

from .errors import ConnectError

# Any of these set means "the usual libpq way": libpq reads them (and PGPORT, PGUSER,
# PGPASSFILE, ...) itself when given an empty DSN.
LIBPQ_SELECTORS = ("PGHOST", "PGHOSTADDR", "PGSERVICE", "PGDATABASE")
# What describe_dsn shows of libpq's environment (passwords as ***).
LIBPQ_SHOWN = (
    "PGHOST",
    "PGHOSTADDR",
    "PGPORT",
    "PGUSER",
    "PGDATABASE",
    "PGSERVICE",
    "PGSERVICEFILE",
    "PGPASSFILE",
    "PGPASSWORD",
)


def _source(dsn: str | None) -> tuple[str, str | None]:
    """Which setting names the server, and its DSN (``None``: the embedded server)."""
    for name, candidate in (
        ("DSN given", dsn),
        ("PGQUEUE_DSN", os.environ.get("PGQUEUE_DSN")),
        ("DATABASE_URL", os.environ.get("DATABASE_URL")),
    ):
        if candidate:
            return name, candidate
    if any(os.environ.get(name) for name in LIBPQ_SELECTORS):
        return "libpq environment", ""
    return "embedded server", None


def resolve_dsn(dsn: str | None = None) -> str:
    """The DSN to use: the argument, then ``PGQUEUE_DSN``, ``DATABASE_URL``, then libpq's
    environment if ``PGHOST``, ``PGHOSTADDR``, ``PGSERVICE`` or ``PGDATABASE`` is set (an
    empty DSN: libpq reads ``PG*`` itself), else the per-user embedded server (started on
    demand)."""
    _, found = _source(dsn)
    if found is not None:
        return found
    from .server import default_server

    return default_server().start()


def describe_dsn(dsn: str | None = None) -> str:
    """One line saying which server ``dsn`` leads to, as given to ``resolve_dsn`` or as it
    returned, with any password masked. Starts nothing and connects nowhere."""
    from .server import default_server

    source, found = _source(dsn)
    embedded = default_server()
    if found is None or (found and _host(found) == str(embedded.socket_dir)):
        return f"embedded server at {embedded.socket_dir} (data in {embedded.data})"
    if source == "libpq environment":
        shown = [
            f"{name}={'***' if name == 'PGPASSWORD' else os.environ[name]}"
            for name in LIBPQ_SHOWN
            if os.environ.get(name)
        ]
        return f"{source}: {' '.join(shown)}"
    return f"{source}: {mask_dsn(found)}"


def _host(dsn: str) -> str | None:
    try:
        return conninfo.conninfo_to_dict(dsn).get("host")  # type: ignore[return-value]
    except psycopg.ProgrammingError:
        return None


# TCP keepalives and a bound on unacknowledged data, so a dead peer or a half-open
# connection is noticed in about half a minute instead of the kernel's two hours (a
# keeper stuck on one sends no heartbeats). A DSN that sets any of them wins.
KEEPALIVES = {
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",  # milliseconds
}


def pgbouncer_mode(flag: bool | None = None) -> bool:
    """Whether to talk to PgBouncer in transaction mode: the flag if given, else the
    ``PGQUEUE_PGBOUNCER`` environment variable (1/true/yes)."""
    if flag is not None:
        return flag
    return os.environ.get("PGQUEUE_PGBOUNCER", "").strip().lower() in {"1", "true", "yes", "on"}


@contextlib.contextmanager
def connecting(target: str, *, autocommit: bool, application_name: str) -> Iterator[dict[str, Any]]:
    """What ``connect`` and ``async_connect`` share: the arguments for psycopg's connect
    (TCP keepalives the DSN does not set), and the one-line ``ConnectError``, password
    masked, that a malformed DSN or an unreachable server raises inside the block."""
    try:
        given = conninfo.conninfo_to_dict(target)
    except psycopg.ProgrammingError:
        given = {}  # malformed: connecting says how
    extra = {k: v for k, v in KEEPALIVES.items() if k not in given}
    try:
        yield {
            "autocommit": autocommit,
            "connect_timeout": 10,
            "application_name": application_name,
            **extra,
        }
    except psycopg.ProgrammingError as exc:  # malformed DSN
        raise ConnectError(
            f"invalid DSN {mask_dsn(target)!r}: {_scrub(first_line(exc), target)}; "
            "fix --dsn / PGQUEUE_DSN, or unset them to use the embedded server"
        ) from None
    except psycopg.OperationalError as exc:
        if not target:  # libpq's environment
            raise ConnectError(
                f"cannot connect to PostgreSQL from the {describe_dsn(target)}: "
                f"{first_line(exc)}; check that the server runs and the PG* variables are "
                "right, or unset PGHOST, PGSERVICE and PGDATABASE to use the embedded server"
            ) from None
        raise ConnectError(
            f"cannot connect to PostgreSQL at {mask_dsn(target)!r}: "
            f"{_scrub(first_line(exc), target)}; "
            "check that the server runs and --dsn / PGQUEUE_DSN is right"
        ) from None


def connect(
    dsn: str | None = None,
    *,
    autocommit: bool = True,
    application_name: str = "pgqueue",
    pgbouncer: bool = False,
) -> psycopg.Connection:
    """Open a connection (autocommit by default: every statement is its own short
    transaction, so no session sits idle in a transaction). ``application_name`` shows
    in ``pg_stat_activity``, so you can tell workers apart there. With ``pgbouncer``, no
    server-side prepared statements: in transaction mode each statement may land on
    another server connection."""
    target = resolve_dsn(dsn)
    with connecting(target, autocommit=autocommit, application_name=application_name) as kw:
        conn = psycopg.Connection.connect(target, **kw)
    if pgbouncer:
        conn.prepare_threshold = None
    return conn


async def async_connect(
    dsn: str | None = None,
    *,
    autocommit: bool = True,
    application_name: str = "pgqueue",
    pgbouncer: bool = False,
) -> psycopg.AsyncConnection:
    """``connect`` for asyncio: the same DSN order, keepalives and one-line errors.
    Finding the DSN may start the embedded server: that runs in a thread, not the loop."""
    target = dsn or await asyncio.to_thread(resolve_dsn, dsn)
    with connecting(target, autocommit=autocommit, application_name=application_name) as kw:
        conn = await psycopg.AsyncConnection.connect(target, **kw)
    if pgbouncer:
        conn.prepare_threshold = None
    return conn


# user:password@ up to the last "@": a raw "@", "/" or "?" in a password happens, and
# masking too much of a DSN shown in a message is harmless.
_URL_PASSWORD = re.compile(r"(://[^:/@]*:).*@")
# password=value in key=value form, where the value may be quoted and contain spaces.
_KV_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'?|\S+)")


def mask_dsn(dsn: str) -> str:
    """The DSN with any password replaced by ``***`` (safe to print or log)."""
    if "://" in dsn:
        masked = _URL_PASSWORD.sub(r"\1***@", dsn)
        return re.sub(r"(password=)[^&]*", r"\1***", masked)
    try:
        parts = conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return _KV_PASSWORD.sub(r"\1***", dsn)
    if "password" in parts:
        parts["password"] = "***"
    return " ".join(f"{key}={value}" for key, value in parts.items())


def _scrub(text: str, dsn: str) -> str:
    """``text`` without any piece of the password written in ``dsn``: libpq may echo a
    piece of a malformed URL back (e.g. as an invalid port)."""
    found = re.search(r"://[^:/@]*:(.*)@", dsn)
    if found:
        pieces = [found.group(1), *re.split(r"[/?#@:]", found.group(1))]
        for piece in sorted(pieces, key=len, reverse=True):
            if len(piece) >= 3:  # shorter bits would garble the message, not protect much
                text = text.replace(piece, "***")
    return text


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message, with passwords masked."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return _KV_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", text))


def own_cursor(conn: psycopg.Connection) -> psycopg.Cursor[tuple[Any, ...]]:
    """A cursor for one of pgqueue's own statements on ``conn``, whoever owns it: rows as
    tuples and the plain client cursor, whatever ``row_factory`` or ``cursor_factory`` the
    connection's owner set (a ``dict_row`` connection unpacked into its keys once read a
    stale step as stored). Costs what ``conn.execute`` costs: that makes a cursor too."""
    return psycopg.Cursor(conn, row_factory=tuple_row)


def async_own_cursor(conn: psycopg.AsyncConnection) -> psycopg.AsyncCursor[tuple[Any, ...]]:
    """``own_cursor`` for an ``AsyncConnection``."""
    return psycopg.AsyncCursor(conn, row_factory=tuple_row)
