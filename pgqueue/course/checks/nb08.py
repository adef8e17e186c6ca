"""Checks for notebook 08, NOTIFY: the reader's prediction of what a listening worker
hears from one transaction that enqueues in four statements."""

from __future__ import annotations

import psycopg

from . import expect, passed
from .tiers import Hints

# One producer transaction, four INSERT statements (queue, number of jobs), as
# `enqueue_many` and `enqueue` would send them inside one transaction of the application.
STATEMENTS = [("emails", 20), ("emails", 1), ("reports", 1), ("emails", 5)]
HINTS = Hints()


def heard(dsn: str) -> list[str]:
    """Run the transaction above on ``dsn`` (a database with pgqueue's schema) while a
    session listens; the payloads it heard, in order."""
    with (
        psycopg.connect(dsn, autocommit=True) as listener,
        psycopg.connect(dsn, autocommit=True) as producer,
    ):
        listener.execute("LISTEN pgqueue")
        with producer.transaction():
            for queue, n in STATEMENTS:
                producer.execute(
                    "INSERT INTO jobs (queue, payload) "
                    "SELECT %s, jsonb_build_object('n', i) FROM generate_series(1, %s) AS i",
                    (queue, n),
                )
        payloads = [n.payload for n in listener.notifies(timeout=0.5)]
        producer.execute("DELETE FROM jobs WHERE queue = ANY(%s)", ([q for q, _ in STATEMENTS],))
    return payloads


def check_heard(dsn: str, predicted: object) -> None:
    """``predicted`` is the list of payloads the listener hears, in order."""
    expect(
        isinstance(predicted, list) and all(isinstance(p, str) for p in predicted),
        f"HEARD should be a list of payloads (queue names), such as ['x', 'y']; got {predicted!r}",
    )
    assert isinstance(predicted, list)
    actual = heard(dsn)
    HINTS.expect(
        bool(predicted) or not actual,
        "commit",
        f"you predicted silence; the listener heard {len(actual)} notification(s) once the "
        "transaction committed",
        "a notification is delivered when its transaction commits, and this listener sits in "
        "no transaction of its own",
    )
    HINTS.expect(
        len(predicted) <= len(actual) or set(predicted) != set(actual),
        "fold",
        f"you predicted {len(predicted)} notifications; the listener heard {len(actual)}",
        "the trigger notifies once per statement and queue, and within one transaction the "
        "same channel and payload are sent once",
    )
    HINTS.expect(
        set(actual) <= set(predicted),
        "distinct",
        f"the listener also heard {sorted(set(actual) - set(predicted))}",
        "only identical notifications fold: another payload (another queue) is sent too",
    )
    HINTS.expect(
        predicted == actual,
        "order",
        f"you predicted {predicted}; the listener heard {actual}",
        "notifications arrive in the order the transaction first sent them",
    )
    passed(f"the listener heard {actual}: 27 jobs, 4 statements, {len(actual)} notifications")
