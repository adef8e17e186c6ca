"""The shop's background jobs for notebook 11: a task registry run by the command-line worker,

    pgqueue worker example_tasks:tasks --burst

which runs every task's queue (``receipts`` and ``reports``). A task is a plain function of
the claimed ``pgqueue.Job`` and the keyword arguments it was enqueued with. It runs outside
any transaction; returning means success, raising means failure (retried with backoff, then
``dead``); ``pgqueue.GiveUp`` sends the job dead at once. ``job.conn`` is the worker's own
autocommit connection, for reading your data.
"""

from __future__ import annotations

import time

import pgqueue
from pgqueue import Job

# Enqueues made through the tasks (receipt.enqueue(...)) go to PGQUEUE_DSN, or run inside
# your own transaction with receipt.configure(conn=...); the worker has its own --dsn.
tasks = pgqueue.Tasks()


@tasks.task(queue="receipts", max_attempts=3)
def receipt(job: Job, order_id: int) -> None:
    """Write the receipt of one order, fenced by this job's token."""
    row = job.conn.execute(
        "SELECT customer, amount_cents FROM orders WHERE id = %s", (order_id,)
    ).fetchone()
    if row is None:  # retrying will not make the order appear: send the job dead now
        raise pgqueue.GiveUp(f"order {order_id} does not exist")
    customer, amount_cents = row
    body = f"order {order_id}: {customer} paid {amount_cents / 100:.2f} EUR"
    # Refused (False, job marked lost) if a newer claim of this job wrote the receipt already.
    # ``receipts`` has a ``job_id`` column beside ``fence``: the row records which job wrote
    # it, and a receipt written by another job raises pgqueue.FenceConflict.
    job.fenced_write("receipts", {"order_id": order_id}, {"body": body})


@tasks.task(queue="reports", max_attempts=1, timeout=0.5)
def sales_report(job: Job, seconds: float) -> None:
    """A report that takes ``seconds``; past its 0.5 s timeout the worker fails it."""
    time.sleep(seconds)
