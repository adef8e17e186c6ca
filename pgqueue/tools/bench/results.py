"""Benchmark: how soon ``Queue.result`` returns after the handler returned, woken by the
completion's notification (pgqueue_done) against the polling fallback (listen=False)."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from ...events import NullEventLog
from ...job import Job
from ...params import RESULT_POLL
from ...queue import Queue
from ...worker import Worker
from .runner import QUEUE, Bench, _percentile, _progress

RESULTS_COLUMNS = [
    "wake",
    "poll_interval_s",
    "jobs",
    "lag_p50_ms",
    "lag_p95_ms",
    "lag_max_ms",
]


def result_lags(dsn: str, *, listen: bool, jobs: int, poll_interval: float) -> list[float]:
    """Enqueue one job at a time, wait for it with ``Queue.result`` and return, per job, the
    ms from its handler's return to ``result()`` returning (one process, one clock). The
    worker completes each job at once (batch 1), as a job someone waits for would be."""
    returned: dict[int, float] = {}
    go = threading.Event()

    def handler(job: Job) -> dict[str, int]:
        go.wait(5)  # the caller is waiting in result() before the handler returns
        returned[job.id] = time.perf_counter()
        return {"n": job.id}

    worker = Worker(
        handler,
        queue=QUEUE,
        dsn=dsn,
        poll_interval=0.05,
        batch=1,
        name="results",
        events=NullEventLog(),
    )
    worker.start()
    lags = []
    rng = random.Random(21)
    try:
        with Queue(dsn) as queue:
            for _ in range(jobs):
                go.clear()
                job_id = queue.enqueue({}, queue=QUEUE)
                # Release the handler a random moment after result() began waiting, so the
                # polling fallback's lag is not in lock step with its interval.
                timer = threading.Timer(rng.uniform(0.02, 0.02 + poll_interval), go.set)
                timer.start()
                value = queue.result(job_id, timeout=30, poll_interval=poll_interval, listen=listen)
                lags.append((time.perf_counter() - returned[job_id]) * 1000)
                timer.cancel()
                assert value == {"n": job_id}
    finally:
        worker.stop(grace=5)
    return lags


def bench_results(bench: Bench, *, jobs: int | None = None) -> list[dict[str, Any]]:
    """The median and p95 lag from a handler's return to ``result()`` returning: woken by
    the notification, and by polling every ``RESULT_POLL`` s with LISTEN off."""
    jobs = jobs or (20 if bench.quick else 100)
    dsn = bench.database("bench_results")
    rows = []
    bar = _progress(2, "results", bench.progress)
    try:
        for listen in (True, False):
            bar.set_postfix_str("notify" if listen else "poll")
            lags = result_lags(dsn, listen=listen, jobs=jobs, poll_interval=RESULT_POLL)
            rows.append(
                {
                    "wake": "notification (LISTEN pgqueue_done)" if listen else "polling only",
                    "poll_interval_s": RESULT_POLL,
                    "jobs": len(lags),
                    "lag_p50_ms": round(_percentile(lags, 50), 2),
                    "lag_p95_ms": round(_percentile(lags, 95), 2),
                    "lag_max_ms": round(max(lags), 2),
                }
            )
            bar.update()
    finally:
        bar.close()
    return rows
