"""Checks for notebook 09, dead rows and the vacuum horizon: the reader's query on
``pg_stat_activity`` that finds the sessions holding vacuum back, oldest first, and their
diagnosis of a slow queue (``slow_queue.SlowQueue``): which session makes it slow."""

from __future__ import annotations

import re
from contextlib import ExitStack
from typing import TYPE_CHECKING

import psycopg

from . import ExerciseFailed, expect, passed
from .tiers import Hints

if TYPE_CHECKING:
    from ..slow_queue import SlowQueue

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


DIAGNOSIS_HINTS = Hints()


def check_diagnosis(slow: SlowQueue, culprit: object) -> dict[str, int]:
    """The reader's ``culprit`` (the application_name of the session that makes the slow
    queue's claims slow) is the one holding the horizon: the check ends that session, waits
    for autovacuum to come by again, and measures the claim before and after. Returns the
    buffers the claim touched and the dead versions of ``jobs``, before and after."""
    open_names = sorted(name for name in slow.sessions if slow.pid(name) is not None)
    expect(
        isinstance(culprit, str) and culprit in slow.sessions,
        f"CULPRIT should be the application_name of one of the shop's sessions "
        f"({', '.join(open_names)}), not {culprit!r}",
    )
    assert isinstance(culprit, str)
    pid = slow.pid(culprit)
    expect(pid is not None, f"the session {culprit!r} is closed already: run the setup again")
    with psycopg.connect(slow.dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT state, backend_xid, backend_xmin FROM pg_stat_activity WHERE pid = %s",
            [pid],
        ).fetchone()
    state, xid, xmin = row if row else (None, None, None)
    DIAGNOSIS_HINTS.expect(
        xid is not None or xmin is not None,
        "state",
        f"{culprit!r} is {state}, but it holds neither a transaction id nor a snapshot "
        "(backend_xid and backend_xmin are empty): ending it would let vacuum remove nothing",
        "look for the session with backend_xid or backend_xmin set, oldest first: "
        "pg_stat_activity, as in your HORIZON_QUERY",
    )
    before = {"buffers": slow.claim_buffers(), "dead": slow.table()["n_dead_tup"]}
    with psycopg.connect(slow.dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", [pid])
    after_vacuum = slow.wait_for_autovacuum()  # autovacuum comes by on its own
    after = {"buffers": slow.claim_buffers(), "dead": after_vacuum["n_dead_tup"]}
    expect(
        after["dead"] < before["dead"] / 10 and after["buffers"] < before["buffers"] / 2,
        f"ended {culprit!r}, and autovacuum left {after['dead']} of {before['dead']} dead "
        f"versions: the claim still touches {after['buffers']} buffers",
    )
    passed(
        f"{culprit!r} held the horizon: the check ended it, autovacuum's next visit removed "
        "the dead versions it had been keeping, and the claim touches less than half the "
        "buffers it did (the counts are returned)"
    )
    return {
        "buffers before": before["buffers"],
        "buffers after": after["buffers"],
        "dead before": before["dead"],
        "dead after": after["dead"],
    }
