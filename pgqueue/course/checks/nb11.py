"""Checks for notebook 11: a refund enqueued inside the application's own transaction, with
hints in tiers (what the tables show first, the fix at the second slip of a kind)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from ...queue import Queue
from . import passed
from .tiers import Hints

HINTS = Hints()


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

        hints = HINTS
        heard()  # anything sent before the check began
        ok = new_order("refund check: ok")
        refund_order(app, q, ok)
        hints.expect(
            app.info.transaction_status == TransactionStatus.IDLE,
            "left-open",
            f"after refund_order(app, q, {ok}) returned, app is still inside a transaction: "
            "nothing it did is committed, and its row locks are held",
            "let a block end the transaction: `with app.transaction():` commits when the block "
            "ends, and rolls back when it raises",
        )
        refunded, jobs = state(ok)
        hints.expect(
            refunded,
            "update",
            f"refund_order(app, q, {ok}) returned, and order {ok} is not refunded",
            'app.execute("UPDATE orders SET refunded = true WHERE id = %s", [order_id])',
        )
        hints.expect(
            [queue for _, queue in jobs] == ["refunds"],
            "enqueue",
            f"refund_order(app, q, {ok}) added {len(jobs)} job(s) for order {ok}, on "
            f"{sorted({q for _, q in jobs}) or 'no queue'}, not one on 'refunds'",
            'q.enqueue({"order_id": order_id}, queue="refunds", conn=app)',
        )
        hints.expect(
            "refunds" in heard(),
            "notify",
            f"order {ok}'s refund committed with its job, and no worker heard of it (no NOTIFY)",
            "enqueue with pgqueue's Queue.enqueue: its NOTIFY goes out when the transaction "
            "commits",
        )

        bad = new_order("refund check: provider fails")
        raised = False
        try:
            refund_order(app, q, bad, provider_fails=True)
        except Exception:
            raised = True
        if app.info.transaction_status != TransactionStatus.IDLE:
            app.rollback()
            hints.fail(
                "failed-open",
                f"refund_order(app, q, {bad}, provider_fails=True) raised and left app inside "
                "its transaction: the next statement on app would fail until a rollback",
                "`with app.transaction():` rolls back by itself when its block raises",
            )
        hints.expect(
            raised,
            "no-raise",
            f"refund_order(app, q, {bad}, provider_fails=True) returned normally",
            "after the enqueue, `if provider_fails: raise RuntimeError(...)`, inside the "
            "transaction block, so it rolls back",
        )
        refunded, jobs = state(bad)
        hints.expect(
            not (jobs and refunded),
            "no-transaction",
            f"the provider failed, and order {bad} is refunded all the same, with job "
            f"{jobs[0][0] if jobs else ''} queued: each statement committed on its own",
            "put the UPDATE and the enqueue in one `with app.transaction():` block",
        )
        hints.expect(
            not jobs,
            "conn",
            f"the failed refund rolled back (order {bad} is not refunded), but its job "
            f"{jobs[0][0] if jobs else ''} is queued: the enqueue went through another "
            "connection, q's own, and committed there",
            "enqueue on the application's connection, inside its transaction: conn=app",
        )
        hints.expect(
            not refunded,
            "update-outside",
            f"the failed refund left no job, but order {bad} is refunded: the UPDATE committed "
            "outside the transaction that rolled back",
            "do the UPDATE inside the same `with app.transaction():` as the enqueue",
        )
        hints.expect(
            not heard(),
            "notify-rollback",
            "a worker heard of the rolled-back refund (a NOTIFY got out)",
            "send nothing by hand: the enqueue's own NOTIFY is dropped with the rollback",
        )
    passed(
        f"order {ok}: refunded, one job on 'refunds', one wake-up; order {bad}: rolled back, "
        "no job, no wake-up"
    )
