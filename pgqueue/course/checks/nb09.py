"""Checks for notebook 09, dead rows and the vacuum horizon: the reader's query on
``pg_stat_activity`` that finds the sessions holding vacuum back, oldest first."""

from __future__ import annotations

import re
from contextlib import ExitStack

import psycopg

from . import ExerciseFailed, expect, passed
from .tiers import Hints

PREFIX = "horizon check: "
# Opened in this order, each left idle in its transaction: the two that hold the horizon
# are "repeatable read" (a snapshot) and, a few transactions later, "write" (an xid).
SESSIONS = {
    "begin only": ["BEGIN"],
    "read committed": ["BEGIN", "SELECT 1"],
    "repeatable read": ["BEGIN ISOLATION LEVEL REPEATABLE READ", "SELECT 1"],
    "write": ["BEGIN", "SELECT txid_current()"],
}
HOLDERS = ["repeatable read", "write"]  # oldest first
YOU = "your query"
HINTS = Hints()


def _names(dsn: str, query: str) -> list[str]:
    """Run ``query`` while the sessions above sit idle; the check's session names it returned."""
    with ExitStack() as stack:
        # Connected newest first, so that pg_stat_activity's own order (roughly by backend
        # slot, which follows connecting) is not the age order: a query without ORDER BY
        # lists the younger holder first.
        conns = {
            name: stack.enter_context(
                psycopg.connect(dsn, autocommit=True, application_name=PREFIX + name)
            )
            for name in reversed(SESSIONS)
        }
        for name, statements in SESSIONS.items():
            conn = conns[name]
            for statement in statements:
                conn.execute(statement)
            if name == "repeatable read":  # a few transactions, so the two holders differ in age
                with psycopg.connect(dsn, autocommit=True) as other:
                    for _ in range(3):
                        other.execute("SELECT txid_current()")
        reader = stack.enter_context(
            psycopg.connect(dsn, autocommit=True, application_name=PREFIX + YOU)
        )
        try:
            cur = reader.execute(query)
        except psycopg.Error as e:
            raise ExerciseFailed(
                f"the query failed: {type(e).__name__}: {str(e).strip().splitlines()[0]}"
            ) from None
        columns = [c.name for c in cur.description or []]
        expect(
            "application_name" in columns,
            f"the query returned the columns {columns}: return application_name (and pid) "
            "of each session, so the check can tell which it found",
        )
        at = columns.index("application_name")
        names = [row[at] for row in cur.fetchall()]
    return [n[len(PREFIX) :] for n in names if isinstance(n, str) and n.startswith(PREFIX)]


def check_horizon_query(dsn: str, query: str) -> None:
    """``query`` lists the sessions that hold the vacuum horizon back (an xid or a snapshot),
    oldest first, and neither the idle sessions that hold nothing nor its own."""
    expect(
        isinstance(query, str) and query.strip(),
        "HORIZON_QUERY should be one SELECT on pg_stat_activity, as a string",
    )
    found = _names(dsn, query)
    HINTS.expect(
        YOU not in found,
        "own",
        "your own session is in the answer, though it sat in no transaction before the query",
        "while a query runs it holds a snapshot of its own (backend_xmin); leave out "
        "pid = pg_backend_pid()",
    )
    for harmless in ("begin only", "read committed"):
        HINTS.expect(
            harmless not in found,
            "state",
            f"the session {harmless!r} is in the answer: it is idle in transaction, but in the "
            "notebook VACUUM removed every dead version while a session like it sat there",
            "test backend_xid and backend_xmin, not state: it holds neither",
        )
    HINTS.expect(
        "write" in found,
        "xid",
        "the session that wrote ('write', it ran txid_current()) is missing, and it holds "
        "vacuum back",
        "it holds a transaction id (backend_xid IS NOT NULL) though no snapshot",
    )
    HINTS.expect(
        "repeatable read" in found,
        "xmin",
        "the 'repeatable read' session is missing, and it holds vacuum back",
        "it has no xid, but one snapshot for its whole transaction (backend_xmin IS NOT NULL)",
    )
    HINTS.expect(
        found == HOLDERS,
        "order",
        f"found both, in the order {found}: the one that holds the horizon furthest back "
        "should come first",
        "ORDER BY greatest(age(backend_xid), age(backend_xmin)) DESC",
    )
    HINTS.expect(
        re.search(r"\border\s+by\b", query, re.IGNORECASE) is not None,
        "order",
        "found both in the right order, but your query has no ORDER BY: pg_stat_activity "
        "lists sessions in no promised order, and here it happened to match",
        "ORDER BY greatest(age(backend_xid), age(backend_xmin)) DESC",
    )
    passed(
        "found the two sessions holding the horizon, the oldest first, and neither the idle "
        "ones that hold nothing nor your own"
    )
