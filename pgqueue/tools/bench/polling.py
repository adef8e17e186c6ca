"""Benchmark 4, the polling interval sweep: latency under steady arrivals, and the idle cost."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg

from ...async_queue import AsyncQueue
from ...db import connect
from ...events import NullEventLog
from ...job import Job
from ...queue import Queue
from ...worker import Worker
from .runner import QUEUE, Bench, _noop, _percentile, _progress


def _xacts(dsn: str) -> int:
    """Transactions (committed + rolled back) this database has seen so far."""
    with connect(dsn) as conn:
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database"
            " WHERE datname = current_database()"
        ).fetchone()
    # This connection exits now, which flushes its own count; the caller subtracts it.
    return int(row[0]) if row else 0


@contextlib.contextmanager
def _statement_counter() -> Iterator[list[int]]:
    """Count the statements every ``AsyncQueue`` in this process sends while the block runs
    (the Worker's engine sends all of its statements through one, except its LISTEN)."""
    counter = [0]
    lock = threading.Lock()
    original = AsyncQueue._run

    async def counted(self: AsyncQueue, *args: Any, **kwargs: Any) -> psycopg.AsyncCursor[Any]:
        with lock:
            counter[0] += 1
        return await original(self, *args, **kwargs)

    AsyncQueue._run = counted  # type: ignore[method-assign]
    try:
        yield counter
    finally:
        AsyncQueue._run = original  # type: ignore[method-assign]


def idle_qps(
    dsn: str, *, poll_interval: float, listen: bool, seconds: float
) -> tuple[float, float]:
    """Statements per second one default Worker (1 thread) sends to an empty queue, counted
    at the client, and transactions per second the server saw in that database meanwhile
    (pg_stat_database, which also counts our two readings' connections; backends report
    when they go idle, at most once a second, so both readings lag alike).

    Measured over ``seconds`` of steady state, after a warm-up that skips start-up."""
    worker = Worker(
        _noop, queue=QUEUE, dsn=dsn, poll_interval=poll_interval, listen=listen, name="idle"
    )
    with _statement_counter() as sent:
        worker.start()
        try:
            time.sleep(1.5)
            before, sent_before = _xacts(dsn), sent[0]
            time.sleep(seconds)
            after, sent_after = _xacts(dsn), sent[0]
        finally:
            worker.stop(grace=5)
    return (sent_after - sent_before) / seconds, max(0, after - before) / seconds


def latency_run(
    dsn: str,
    *,
    poll_interval: float,
    listen: bool,
    rate: float,
    seconds: float,
) -> tuple[list[float], float]:
    """Enqueue one job every 1/``rate`` s for ``seconds`` while a Worker (1 thread, batch 1)
    runs them; return the enqueue-to-start latencies in ms and the jobs run per second of
    the arrival window (all jobs are waited for).

    Latency runs from the moment the enqueue's commit returned to the producer (a job
    cannot be seen before) to the moment the handler starts."""
    committed: dict[int, float] = {}
    started: dict[int, float] = {}

    def handler(job: Job) -> None:
        started[job.id] = time.perf_counter()

    worker = Worker(
        handler,
        queue=QUEUE,
        dsn=dsn,
        poll_interval=poll_interval,
        listen=listen,
        name="poll",
        events=NullEventLog(),
    )
    worker.start()
    time.sleep(0.3)  # the listener is connected and LISTENing before the first job
    t0 = time.perf_counter()
    with Queue(dsn) as queue:
        k = 0
        while (now := time.perf_counter()) - t0 < seconds:
            job_id = queue.enqueue({"k": k}, queue=QUEUE)
            committed[job_id] = time.perf_counter()
            k += 1
            # Jitter the gaps (+-50 %) so arrivals do not lock step with the poll.
            time.sleep(max(0.0, t0 + k / rate - now) * random.uniform(0.5, 1.5))
    deadline = time.perf_counter() + poll_interval + 5
    while len(started) < len(committed) and time.perf_counter() < deadline:
        time.sleep(0.01)
    worker.stop(grace=5)
    lat = [(started[i] - committed[i]) * 1000 for i in committed if i in started]
    # Jobs run per second of arrivals: the arrival rate whenever the worker keeps up.
    return lat, len(started) / seconds


def polling_intervals(quick: bool = False) -> list[float]:
    """Poll intervals to sweep, in seconds (10 ms ... 5 s)."""
    return [0.1, 2.0] if quick else [0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0]


def bench_polling(
    bench: Bench,
    *,
    intervals: Sequence[float] | None = None,
    rate: float = 20.0,
    seconds: float | None = None,
    idle_seconds: float | None = None,
) -> list[dict[str, Any]]:
    """Per poll interval, with and without LISTEN/NOTIFY: jobs/s, enqueue-to-start latency
    p50/p95/p99 at a steady ``rate`` jobs/s, and statements/s against an empty queue."""
    intervals = list(intervals or polling_intervals(bench.quick))
    seconds = seconds or (2.5 if bench.quick else 5.0)
    idle_seconds = idle_seconds or (2.5 if bench.quick else 5.0)
    dsn = bench.database("bench_polling")
    configs = [(p, listen) for p in intervals for listen in (True, False)]
    random.Random(5).shuffle(configs)  # interleaved, reproducibly
    rows = []
    bar = _progress(len(configs), "polling", bench.progress)
    try:
        for poll, listen in configs:
            bar.set_postfix_str(f"poll={poll:g}s listen={listen}")
            with connect(dsn) as conn:
                conn.execute("TRUNCATE jobs")
            # Long poll intervals need a longer run to see more than a poll or two.
            run_for = max(seconds, 2 * poll) if not listen else seconds
            lat, jobs_per_s = latency_run(
                dsn, poll_interval=poll, listen=listen, rate=rate, seconds=run_for
            )
            with connect(dsn) as conn:
                conn.execute("TRUNCATE jobs")
            idle, idle_xacts = idle_qps(
                dsn, poll_interval=poll, listen=listen, seconds=max(idle_seconds, 2 * poll)
            )
            rows.append(
                {
                    "poll_interval_s": poll,
                    "listen": listen,
                    "jobs_per_s": round(jobs_per_s, 2),
                    "latency_p50_ms": round(_percentile(lat, 50), 2),
                    "latency_p95_ms": round(_percentile(lat, 95), 2),
                    "latency_p99_ms": round(_percentile(lat, 99), 2),
                    "idle_qps": round(idle, 2),
                    "idle_server_xacts_per_s": round(idle_xacts, 2),
                    "arrival_per_s": rate,
                    "jobs": len(lat),
                }
            )
            bar.update()
    finally:
        bar.close()
    rows.sort(key=lambda r: (not r["listen"], r["poll_interval_s"]))
    return rows
