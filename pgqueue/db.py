"""Where the connection comes from: ``--dsn``, ``PGQUEUE_DSN``, ``DATABASE_URL``, else embedded."""

from __future__ import annotations

import os
import re

import psycopg
from psycopg import conninfo

from .errors import ConnectError


def resolve_dsn(dsn: str | None = None) -> str:
    """The DSN to use: the argument, then ``PGQUEUE_DSN``, ``DATABASE_URL``, else the
    per-user embedded server (started on demand)."""
    for candidate in (dsn, os.environ.get("PGQUEUE_DSN"), os.environ.get("DATABASE_URL")):
        if candidate:
            return candidate
    from .server import default_server

    return default_server().start()


def connect(
    dsn: str | None = None, *, autocommit: bool = True, application_name: str = "pgqueue"
) -> psycopg.Connection:
    """Open a connection (autocommit by default: every statement is its own short
    transaction, so no session sits idle in a transaction). ``application_name`` shows
    in ``pg_stat_activity``, so you can tell workers apart there."""
    target = resolve_dsn(dsn)
    try:
        return psycopg.connect(
            target, autocommit=autocommit, connect_timeout=10, application_name=application_name
        )
    except psycopg.ProgrammingError as exc:  # malformed DSN
        raise ConnectError(
            f"invalid DSN {mask_dsn(target)!r}: {_scrub(first_line(exc), target)}; "
            "fix --dsn / PGQUEUE_DSN, or unset them to use the embedded server"
        ) from None
    except psycopg.OperationalError as exc:
        raise ConnectError(
            f"cannot connect to PostgreSQL at {mask_dsn(target)!r}: "
            f"{_scrub(first_line(exc), target)}; "
            "check that the server runs and --dsn / PGQUEUE_DSN is right"
        ) from None


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
