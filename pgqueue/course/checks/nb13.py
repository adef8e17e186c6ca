"""Checks for notebook 13, asyncio and the worker engine: an async handler that awaits its
I/O and its write, and the statements a one-lane worker sends for a backlog, with hints in
tiers (what the run shows first, the fix at the second slip of a kind)."""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ...async_job import AsyncJob
from ...async_queue import AsyncQueue
from ...async_worker import AsyncWorker
from .. import engine_lab, lab
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


# -- the worker engine: predict the statements a backlog costs ----------------------------
STATEMENT_HINTS = Hints()
BACKLOGS = ((30, 1), (60, 10), (25, 10))  # (jobs, batch), drained by one lane each


def _slip(
    kind: str, predicted: int, measured: int, jobs: int, batch: int, what: str, fragment: str
) -> None:
    """The hint for one wrong count: what the worker sent, then (second time) the fix."""
    if predicted == jobs and batch > 1:
        kind, fragment = f"{kind}-per-job", PER_JOB[kind]
    elif kind == "claims" and predicted == measured + 1:
        kind = "dry-claim"
        fragment = (
            "count the claims that brought jobs: the last one, which finds the queue dry, "
            "brings none and is not counted"
        )
    elif predicted == jobs // batch:
        kind = "last-batch"
        fragment = (
            "a last batch that is only partly filled still costs a claim and a completion "
            "statement: round up, (jobs + batch - 1) // batch"
        )
    STATEMENT_HINTS.fail(
        kind,
        f"{jobs} jobs with batch={batch}: the worker sent {measured} {what}, you predicted "
        f"{predicted}",
        fragment,
    )


PER_JOB = {
    "claims": "one claim takes up to batch jobs at once: count claims per batch, not per job",
    "completions": "finished jobs wait in a buffer until their batch is over, then go out "
    "together in one fenced complete_many: count completion statements per batch",
}


def check_statements(predict: Callable[[int, int], tuple[int, int]]) -> None:
    """Drain three backlogs of no-op jobs with a one-lane Worker (``flush_after=5``) in a
    scratch database and compare its claims that returned jobs and its completion
    statements (from its event record) with ``predict(jobs, batch)``."""
    expect(callable(predict), "statements should be a function of (jobs, batch)")
    predicted = {}
    for jobs, batch in BACKLOGS:
        got = predict(jobs, batch)
        expect(
            isinstance(got, tuple)
            and len(got) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) for n in got),
            f"statements({jobs}, {batch}) should return two whole numbers, (claims, "
            f"completions); it returned {got!r}",
        )
        predicted[jobs, batch] = got
    measured = {}
    with lab.scratch_database("course_13_exercise") as dsn:
        for jobs, batch in BACKLOGS:
            queue = f"jobs-{jobs}-batch-{batch}"
            engine_lab.enqueue_noops(dsn, jobs, queue)
            drained = engine_lab.drain(dsn, queue, concurrency=1, batch=batch, flush_after=5.0)
            measured[jobs, batch] = (drained["claims"], drained["completions"])
            rule = (jobs + batch - 1) // batch
            expect(
                drained["jobs"] == jobs and measured[jobs, batch] == (rule, rule),
                f"the worker's run over {jobs} jobs was disturbed (a batch's completions left "
                "before it was over on a busy machine): run the check again",
            )
    for (jobs, batch), (claims, completions) in measured.items():
        guess_claims, guess_completions = predicted[jobs, batch]
        if guess_claims != claims:
            fragment = (
                "one lane holds at most batch jobs whose handler has not ended, and claims in "
                "whole batches: it claims again once the last job of its batch has ended"
            )
            _slip("claims", guess_claims, claims, jobs, batch, "claims that brought jobs", fragment)
        if guess_completions != completions:
            fragment = "one completion statement per claimed batch, sent when its last job ends"
            _slip(
                "completions",
                guess_completions,
                completions,
                jobs,
                batch,
                "completion statements",
                fragment,
            )
    shown = ", ".join(f"{j} jobs by {b}: {c[0]} + {c[1]}" for (j, b), c in measured.items())
    passed(
        f"claims + completion statements: {shown}. One lane claims a whole batch once the "
        "last job of the one before has ended, so each batch costs one claim and one completion"
    )
