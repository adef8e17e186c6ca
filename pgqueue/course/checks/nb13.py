"""Checks for notebook 13, asyncio: an async handler that awaits its I/O and its write,
with hints in tiers (what the run shows first, the fix at the second slip of a kind)."""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ...async_job import AsyncJob
from ...async_queue import AsyncQueue
from ...async_worker import AsyncWorker
from .. import lab
from . import expect, passed
from .tiers import Hints

HINTS = Hints()

RECEIPTS = """
CREATE TABLE receipts (
  order_id bigint PRIMARY KEY,
  body     text   NOT NULL,
  job_id   bigint NOT NULL,
  fence    bigint NOT NULL
)
"""
JOBS = 20  # as many as the worker runs at once: with awaited I/O they all wait together
IO = 0.1  # seconds of I/O in the notebook's send_email
FIRST_ORDER = 1001  # order numbers unlike the jobs' ids, so a row keyed by job.id shows


async def check_async_handler(handler: Callable[[AsyncJob], Awaitable[Any]]) -> None:
    """Run the reader's handler with an AsyncWorker (20 at once) on 20 jobs in a scratch
    database: every job done, a receipt at fence 1 for each order, and the handlers
    really waiting together (none blocking the event loop)."""
    expect(
        inspect.iscoroutinefunction(handler),
        "notify_customer should be an async def function: the AsyncWorker awaits it",
    )
    starts: list[float] = []
    ends: list[float] = []

    async def watched(job: AsyncJob) -> Any:
        starts.append(time.monotonic())
        try:
            return await handler(job)
        finally:
            ends.append(time.monotonic())

    with lab.scratch_database("course_13_exercise") as dsn:
        async with AsyncQueue(dsn) as q:
            await q.conn.execute(RECEIPTS)
            orders = range(FIRST_ORDER, FIRST_ORDER + JOBS)
            ids = await q.enqueue_many(
                [{"order_id": n} for n in orders], queue="emails", max_attempts=1
            )
            worker = AsyncWorker(
                watched,
                queue="emails",
                dsn=dsn,
                concurrency=JOBS,
                batch=JOBS,
                lease=30,
                poll_interval=0.1,
                listen=False,
                burst=True,
                name="exercise",
            )
            await worker.start()
            await worker.join(timeout=30)
            await worker.stop(grace=1)
            cur = await q.conn.execute(
                "SELECT id, status, last_error FROM jobs WHERE status <> 'done' ORDER BY id"
            )
            failed = await cur.fetchall()
            cur = await q.conn.execute("SELECT order_id, job_id, fence, body FROM receipts")
            receipts = await cur.fetchall()
    hints = HINTS
    if failed:
        job_id, status, error = failed[0]
        hints.expect(
            status != "running",
            "stuck",
            f"job {job_id} was still running after 30 s",
            "notify_customer must return: await send_email(...) once, write, and end",
        )
        expect(False, f"job {job_id} failed: {error} (fix notify_customer and run it again)")
    hints.expect(
        receipts,
        "no-await",
        f"all {JOBS} jobs are done, and the receipts table is empty",
        "await job.fenced_write(...): without await the write is a coroutine that never runs",
    )
    hints.expect(
        len(receipts) == JOBS,
        "count",
        f"{len(receipts)} receipts for {JOBS} orders",
        'write one receipt per job, keyed by job.payload["order_id"]',
    )
    hints.expect(
        {(order, job, fence) for order, job, fence, _ in receipts}
        == {(n, job_id, 1) for n, job_id in zip(orders, ids, strict=True)},
        "keyed",
        "the receipts' (order_id, job_id, fence) are not each job's own order, id and fence 1 "
        f"(orders {FIRST_ORDER} to {FIRST_ORDER + JOBS - 1}, job ids {ids[0]} to {ids[-1]})",
        'job.fenced_write("receipts", {"order_id": job.payload["order_id"]}, {"body": ...}) '
        "adds the job's id and fence itself",
    )
    order, body = min((order, body) for order, _, _, body in receipts)
    hints.expect(
        not body.startswith("<coroutine"),
        "body-coroutine",
        f"the receipt of order {order} reads {body.split(' at ')[0]}...>, not the e-mail "
        "service's answer",
        "send_email is a coroutine function: body = await send_email(order_id)",
    )
    hints.expect(
        all(str(order) in body for order, _, _, body in receipts),
        "body",
        f"the receipt of order {order} reads {body!r}, which does not name its order",
        "store what await send_email(order_id) answered as the body",
    )
    span = max(ends) - min(starts)
    hints.expect(
        span < JOBS * IO / 2,
        "blocking",
        f"the {JOBS} handlers took {span:.1f} s from the first start to the last end, one "
        f"after another ({JOBS} x {IO:g} s): something blocks the event loop",
        "await the I/O (await send_email(...)), never time.sleep, so the others run meanwhile",
    )
    passed(
        f"{JOBS} receipts at fence 1, one per order; the {JOBS} handlers awaited their "
        f"{IO:g} s of I/O together, not one after another"
    )
