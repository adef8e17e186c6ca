"""Benchmarks of results: how soon ``Queue.result`` returns after the handler returned,
woken by the completion's notification (pgqueue_done) against the polling fallback
(listen=False); and what that notification costs the completions."""

from __future__ import annotations

import random
import re
import statistics
import threading
import time
from typing import Any

from ...db import connect
from ...events import NullEventLog
from ...job import Job
from ...params import RESULT_POLL
from ...queue import Queue
from ...statements import query
from ...worker import Worker
from .runner import QUEUE, Bench, _count, _percentile, _progress

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
    jobs = jobs or (10 if bench.quick else 100)  # each polled one waits about RESULT_POLL
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


DONE_NOTIFY_COLUMNS = [
    "threads",
    "batch",
    "jobs",
    "runs",
    "every_job_jobs_s",
    "waited_only_jobs_s",
    "none_jobs_s",
    "ratio_waited_only_over_every_job",
    "ratio_min",
    "ratio_max",
    "ratio_none_over_waited_only",
]

# The notification as shipped: only for a job some Queue.result waits for (pgqueue_waiters).
_WAITED = re.compile(
    r"CASE WHEN EXISTS \(SELECT FROM pgqueue_waiters w WHERE w\.job_id = jobs\.id\)\s+"
    r"THEN (pg_notify\('pgqueue_done', (?:jobs\.)?id::text\)) END"
)
NOTIFY_VARIANTS = ("every job", "waited-for only", "none")


def variant(statement: str, notify: str) -> str:
    """A completion statement as shipped ("waited-for only"), notifying every job it ends
    (as pgqueue did before 2026-12-01: "every job"), or not at all ("none")."""
    if not _WAITED.search(statement):
        raise LookupError("the statement has no waited-for notification to vary")
    if notify == "every job":
        return _WAITED.sub(r"\1", statement)
    if notify == "none":
        return _WAITED.sub("NULL", statement)
    return statement


def _running(dsn: str, n: int) -> None:
    """An empty table holding ``n`` running jobs of fence 1, as claims would leave them."""
    with connect(dsn) as conn:
        conn.execute("TRUNCATE jobs RESTART IDENTITY")
        conn.execute(
            "INSERT INTO jobs (queue, payload, status, attempts, fence, lease_until, started_at)"
            " SELECT %s, '{}'::jsonb, 'running', 1, 1, now() + interval '1 hour', now()"
            " FROM generate_series(1, %s)",
            [QUEUE, n],
        )
        conn.execute("VACUUM ANALYZE jobs")


def completion_rate(dsn: str, *, notify: str, threads: int, batch: int, jobs: int) -> float:
    """Jobs completed a second by ``threads`` sessions, each completing its share of ``jobs``
    running jobs ``batch`` at a time (one autocommit statement, so one commit, each), with
    the notification ``notify`` (one of NOTIFY_VARIANTS); nobody waits for these jobs."""
    _running(dsn, jobs)
    single = variant(query("complete"), notify)
    many = variant(query("complete_many"), notify)
    ids = list(range(1, jobs + 1))
    shares = [ids[i::threads] for i in range(threads)]
    start = threading.Barrier(threads + 1)

    def complete(share: list[int]) -> None:
        with connect(dsn) as conn:
            start.wait()
            for i in range(0, len(share), batch):
                chunk = share[i : i + batch]
                if batch == 1:
                    conn.execute(single, {"id": chunk[0], "fence": 1})
                else:
                    conn.execute(many, {"ids": chunk, "fences": [1] * len(chunk)})

    pool = [threading.Thread(target=complete, args=(s,)) for s in shares]
    for t in pool:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - began
    assert _count(dsn, "done") == jobs, "every job completed once"
    return jobs / elapsed


def bench_done_notify(bench: Bench) -> list[dict[str, Any]]:
    """What notifying finished jobs costs: completion throughput when every ending job sends
    pgqueue_done (pgqueue before 2026-12-01), when only jobs someone waits for do (as
    shipped; nobody waits here) and with no notification at all; one job or a batch of 50
    per statement, 1 and 4 sessions; the variants interleaved, ratios per repetition."""
    runs = 2 if bench.quick else 5
    dsn = bench.database("bench_done_notify")
    # quick: one session and four (where notifying commits serialise), not both at batch 1
    configs = [(1, 1), (4, 50)] if bench.quick else [(1, 1), (4, 1), (4, 50)]
    bar = _progress(len(configs) * runs * len(NOTIFY_VARIANTS), "done-notify", bench.progress)
    rows = []
    try:
        for threads, batch in configs:
            jobs = (2_000 if batch == 1 else 20_000) // (2 if bench.quick else 1)
            rates: dict[str, list[float]] = {v: [] for v in NOTIFY_VARIANTS}
            for _ in range(runs):
                for notify in NOTIFY_VARIANTS:
                    rates[notify].append(
                        completion_rate(dsn, notify=notify, threads=threads, batch=batch, jobs=jobs)
                    )
                    bar.update()
            every, waited, none = (rates[v] for v in NOTIFY_VARIANTS)
            gain = [w / e for e, w in zip(every, waited, strict=True)]
            rest = [n / w for w, n in zip(waited, none, strict=True)]
            rows.append(
                {
                    "threads": threads,
                    "batch": batch,
                    "jobs": jobs,
                    "runs": runs,
                    "every_job_jobs_s": round(statistics.median(every)),
                    "waited_only_jobs_s": round(statistics.median(waited)),
                    "none_jobs_s": round(statistics.median(none)),
                    "ratio_waited_only_over_every_job": round(statistics.median(gain), 2),
                    "ratio_min": round(min(gain), 2),
                    "ratio_max": round(max(gain), 2),
                    "ratio_none_over_waited_only": round(statistics.median(rest), 2),
                }
            )
    finally:
        bar.close()
    return rows
