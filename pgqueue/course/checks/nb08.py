"""Checks for notebook 08: a refund enqueued inside the application's own transaction."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from ...queue import Queue
from . import expect, passed


def check_refund(refund_order: Callable[..., Any], dsn: str) -> None:
    """``refund_order(app, q, order_id, provider_fails=...)`` marks the order refunded and
    enqueues its job in one transaction: both or neither, and a wake-up only on commit."""
    with (
        psycopg.connect(dsn, autocommit=True) as app,
        psycopg.connect(dsn, autocommit=True) as listener,
        Queue(dsn) as q,  # its own connection, like the notebook's: conn=app is what joins them
    ):
        listener.execute("LISTEN pgqueue")

        def new_order(customer: str) -> int:
            row = app.execute(
                "INSERT INTO orders (customer, amount_cents) VALUES (%s, 100) RETURNING id",
                [customer],
            ).fetchone()
            assert row is not None
            return int(row[0])

        def state(order_id: int) -> tuple[bool, list[tuple[int, str]]]:
            (refunded,) = app.execute(
                "SELECT refunded FROM orders WHERE id = %s", [order_id]
            ).fetchone() or (None,)
            jobs = app.execute(
                "SELECT id, queue FROM jobs WHERE payload ->> 'order_id' = %s ORDER BY id",
                [str(order_id)],
            ).fetchall()
            return bool(refunded), jobs

        def heard() -> list[str]:
            return [n.payload for n in listener.notifies(timeout=0.3, stop_after=None)]

        heard()  # anything sent before the check began
        ok = new_order("refund check: ok")
        refund_order(app, q, ok)
        expect(
            app.info.transaction_status == TransactionStatus.IDLE,
            "refund_order left a transaction open on app: use `with app.transaction():`",
        )
        refunded, jobs = state(ok)
        expect(refunded, f"refund_order(app, q, {ok}) did not mark order {ok} refunded")
        expect(
            [queue for _, queue in jobs] == ["refunds"],
            f"refund_order(app, q, {ok}) should add one job {{'order_id': {ok}}} on the queue "
            f"'refunds'; found {len(jobs)} job(s) on {sorted({q for _, q in jobs}) or 'none'}",
        )
        expect("refunds" in heard(), "the committed refund woke no worker (no NOTIFY heard)")

        bad = new_order("refund check: provider fails")
        raised = False
        try:
            refund_order(app, q, bad, provider_fails=True)
        except Exception:
            raised = True
        if app.info.transaction_status != TransactionStatus.IDLE:
            app.rollback()
            expect(False, "the failed refund left a transaction open: use app.transaction()")
        expect(
            raised,
            "refund_order(..., provider_fails=True) returned normally: raise an exception "
            "after the enqueue, so the transaction rolls back",
        )
        refunded, jobs = state(bad)
        expect(
            not jobs,
            f"the rolled-back refund left job {jobs[0][0] if jobs else ''} behind: enqueue with "
            "conn=app inside the same transaction as the UPDATE",
        )
        expect(
            not refunded,
            f"the failed refund still marked order {bad} refunded: do the UPDATE inside the "
            "same `with app.transaction():` as the enqueue",
        )
        expect(not heard(), "a worker heard of the rolled-back refund (a NOTIFY got out)")
    passed(
        f"order {ok}: refunded, one job on 'refunds', one wake-up; order {bad}: rolled back, "
        "no job, no wake-up"
    )
