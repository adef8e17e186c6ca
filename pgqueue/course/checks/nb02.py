"""Checks for notebook 02, SKIP LOCKED: a worker loop built from ``Queue`` methods."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from psycopg.pq import TransactionStatus

from ...db import connect, first_line
from ...job import Job
from ...queue import Queue
from .. import lab
from . import expect, passed

QUEUE = "exercise-02"
JOBS = 30
LOOPS = 3  # the reader's loop runs in this many threads at once, each with its own Queue
TIMEOUT = 20.0  # seconds for all of them to drain the queue


class BadJob(ValueError):
    """What the check's handler raises for the jobs meant to fail."""


def _is_bad(n: int) -> bool:
    return n % 7 == 3


def check_worker_loop(drain: Callable[[Queue, Callable[[Job], Any], str], Any]) -> None:
    """Run ``drain(q, handler, queue)`` in several threads at once over a queue of jobs,
    some of whose handlers raise, and check that every job ran once, outside any
    transaction, and ended done (or dead with its error, for the failing ones)."""
    expect(callable(drain), "drain should be a function: def drain(q, handler, queue): ...")
    with lab.scratch_database("course_02_exercise") as dsn:
        with Queue(dsn) as producer:
            # One attempt each, so a failed job ends dead at once instead of retrying later.
            ids = producer.enqueue_many(
                [{"n": n} for n in range(JOBS)], queue=QUEUE, max_attempts=1
            )
        number = dict(zip(ids, range(JOBS), strict=True))
        runs: Counter[int] = Counter()
        in_transaction: list[int] = []
        lock = threading.Lock()

        def handler(job: Job) -> None:
            with lock:
                runs[job.id] += 1
                if job.conn is not None and job.conn.info.transaction_status not in (
                    TransactionStatus.IDLE,
                    TransactionStatus.UNKNOWN,
                ):
                    in_transaction.append(job.id)
            if _is_bad(job.payload["n"]):
                raise BadJob(f"bad job {job.payload['n']}")

        returned: list[Any] = []
        errors: list[BaseException] = []

        def loop() -> None:
            try:
                with Queue(dsn, application_name="exercise 02") as q:
                    returned.append(drain(q, handler, QUEUE))
            except BaseException as exc:  # shown to the reader below, as one line
                errors.append(exc)

        threads = [threading.Thread(target=loop, daemon=True) for _ in range(LOOPS)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + TIMEOUT
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = any(thread.is_alive() for thread in threads)
        with connect(dsn) as conn:
            if stuck:  # stop the reader's loops: their connections go, their claims fail
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = 'exercise 02'"
                )
            rows = conn.execute(
                "SELECT id, status, last_error FROM jobs WHERE queue = %s ORDER BY id", [QUEUE]
            ).fetchall()
    expect(
        not stuck,
        f"your loop was still running after {TIMEOUT:g} s: return when q.claim gives no job",
    )
    if errors:
        exc = errors[0]
        expect(
            not isinstance(exc, BadJob),
            f"your loop stopped on the handler's error ({first_line(exc)}): catch it and "
            "record it with q.fail(job, error text), then go on",
        )
        expect(False, f"your loop raised {type(exc).__name__}: {first_line(exc)}")
    status = {job_id: (state, error) for job_id, state, error in rows}
    ready = [i for i, (s, _) in status.items() if s == "ready"]
    expect(
        not ready,
        f"{len(ready)} jobs are still ready (job {ready[0] if ready else ''} for one): "
        "keep claiming until q.claim returns an empty list",
    )
    in_flight = [i for i, (s, _) in status.items() if s == "running"]
    expect(
        not in_flight,
        f"job {in_flight[0] if in_flight else ''} is still running: after its handler, "
        "call q.complete(job), or q.fail(job, error) if the handler raised",
    )
    twice = [i for i, n in runs.items() if n > 1]
    expect(not twice, f"job {twice[0] if twice else ''} ran {runs[twice[0]] if twice else 0} times")
    never = [i for i in ids if runs[i] == 0]
    expect(not never, f"job {never[0] if never else ''} never ran: call handler(job) for each job")
    expect(
        not in_transaction,
        f"job {in_transaction[0] if in_transaction else ''} ran inside an open transaction: "
        "claim (the claim commits by itself), then run the handler outside any transaction",
    )
    for job_id, (state, error) in status.items():
        n = number[job_id]
        if _is_bad(n):
            expect(
                state == "dead" and error and f"bad job {n}" in error,
                f"job {job_id} raised 'bad job {n}' but ended {state} with last_error {error!r}:"
                " pass the handler's error text to q.fail(job, ...)",
            )
        else:
            expect(state == "done", f"job {job_id} ended {state}, not done: q.complete(job)")
    good = sum(not _is_bad(n) for n in range(JOBS))
    expect(
        all(isinstance(r, int) for r in returned),
        f"drain returned {returned[0]!r}: return how many jobs your loop completed",
    )
    expect(
        sum(returned) == good,
        f"your {LOOPS} loops say they completed {sum(returned)} jobs, the table says {good}: "
        "count the jobs whose q.complete(job) returned True",
    )
    passed(
        f"{LOOPS} loops at once ran each of the {JOBS} jobs once: {good} done, "
        f"{JOBS - good} dead with their error"
    )
