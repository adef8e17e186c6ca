"""Job handlers for notebook 08, run by the command-line worker:

    pgqueue worker example_tasks:handler --queue receipts

A handler is a plain function that takes a claimed ``pgqueue.Job``. It runs outside any
transaction; returning means success, raising means failure (retried with backoff, then
``dead``). ``job.conn`` is the worker's own autocommit connection, for reading your data.
"""

from __future__ import annotations

from pgqueue import Job


def handler(job: Job) -> None:
    """Write the receipt of the order named in the payload, fenced by this job's token."""
    order_id = job.payload["order_id"]
    row = job.conn.execute(
        "SELECT customer, amount_cents FROM orders WHERE id = %s", (order_id,)
    ).fetchone()
    if row is None:
        raise LookupError(f"order {order_id} does not exist")
    customer, amount_cents = row
    body = f"order {order_id}: {customer} paid {amount_cents / 100:.2f} EUR"
    # Accepted unless a holder of this job with a newer fence has written the receipt
    # already (a refused write marks the job lost, and the worker's completion is refused
    # too). ``receipts`` needs a ``job_id`` column beside ``fence``: the row records which
    # job wrote it, and a receipt written by another job raises FenceConflict.
    job.fenced_write("receipts", {"order_id": order_id}, {"body": body})
