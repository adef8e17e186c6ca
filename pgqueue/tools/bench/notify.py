"""Benchmark 11, the cost of NOTIFY on enqueue: the same producers with the trigger (the
default schema) and without it (``Queue.install(notify=False)``, ``pgqueue init
--no-notify``), at 1, 4 and 16 concurrent producers.

A notifying transaction takes one cluster-wide lock at commit and holds it until the
commit is durable, so notifying commits are serialised (no group commit); the statement
trigger also copies every inserted row into its transition table. ``enqueue`` (one job per
transaction) is where the lock should show; ``enqueue_many`` of 100 amortises it.

Each producer is a thread with its own connection, enqueueing for a fixed time; one
listener (a separate process, ``LISTEN pgqueue``, as a waiting worker would) reads the
notifications in both cases. Runs are interleaved, the table emptied before each, and
``ratio_off_to_on`` is the median of per-repetition ratios."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ...db import connect
from ...queue import Queue
from .runner import QUEUE, Bench, _progress, _spread

METHODS = {"enqueue": 1, "enqueue_many": 100}  # method -> jobs per transaction
LISTENER = """\
import sys, psycopg
with psycopg.connect(sys.argv[1], autocommit=True) as conn:
    conn.execute("LISTEN pgqueue")
    for _ in conn.notifies():
        pass
"""


@contextlib.contextmanager
def listener(dsn: str) -> Iterator[None]:
    """A process that LISTENs on pgqueue's channel and reads every notification."""
    proc = subprocess.Popen([sys.executable, "-c", LISTENER, dsn])
    try:
        deadline = time.monotonic() + 10
        with connect(dsn) as conn:  # wait until it listens, so every run sees it
            while not conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND query = 'LISTEN pgqueue'"
            ).fetchone()[0]:  # type: ignore[index]
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the LISTEN process did not start")
                time.sleep(0.05)
        yield
    finally:
        proc.terminate()
        proc.wait(10)


def produce(dsn: str, producers: int, method: str, seconds: float) -> tuple[float, float]:
    """Enqueue from ``producers`` threads for ``seconds``; return jobs/s and commits/s."""
    size = METHODS[method]
    payloads = [{"i": i} for i in range(size)]
    with connect(dsn) as conn:
        conn.execute("TRUNCATE jobs")
    queues = [Queue(dsn) for _ in range(producers)]
    counts = [0] * producers
    ends = [0.0] * producers
    errors: list[BaseException] = []
    gate = threading.Barrier(producers + 1)

    def run(k: int) -> None:
        q = queues[k]
        try:
            gate.wait()
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                if size == 1:
                    q.enqueue(payloads[0], queue=QUEUE)
                else:
                    q.enqueue_many(payloads, queue=QUEUE)
                counts[k] += 1
        except BaseException as exc:  # reported in the caller's thread
            errors.append(exc)
        finally:
            ends[k] = time.perf_counter()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(producers)]
    try:
        for t in threads:
            t.start()
        gate.wait()
        started = time.perf_counter()
        for t in threads:
            t.join()
    finally:
        for q in queues:
            q.close()
    if errors:
        raise errors[0]
    elapsed = max(ends) - started
    commits = sum(counts)
    with connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM jobs").fetchone()
    if not row or row[0] != commits * size:
        raise RuntimeError(f"notify {method}: {row} jobs in the table, {commits * size} enqueued")
    return commits * size / elapsed, commits / elapsed


def bench_notify(
    bench: Bench,
    *,
    producers: Sequence[int] = (1, 4, 16),
    seconds: float | None = None,
    repeats: int | None = None,
) -> list[dict[str, Any]]:
    """Enqueue throughput with and without the NOTIFY trigger, per method and producers."""
    seconds = seconds or (0.5 if bench.quick else 2.0)
    repeats = repeats or bench.repeats
    dsns = {"on": bench.database("bench_notify_on"), "off": bench.database("bench_notify_off")}
    with Queue(dsns["off"]) as q:
        q.install(notify=False)
    configs = [(m, p, t) for m in METHODS for p in producers for t in ("on", "off")]
    jobs: dict[tuple[str, int, str], list[float]] = {c: [] for c in configs}
    commits: dict[tuple[str, int, str], list[float]] = {c: [] for c in configs}
    bar = _progress(len(configs) * repeats, "notify", bench.progress)
    try:
        with listener(dsns["on"]), listener(dsns["off"]):
            for rep in range(repeats):
                shift = rep % len(configs)
                for method, p, trigger in configs[shift:] + configs[:shift]:
                    bar.set_postfix_str(f"{method} x{p} trigger {trigger}")
                    j, c = produce(dsns[trigger], p, method, seconds)
                    jobs[(method, p, trigger)].append(j)
                    commits[(method, p, trigger)].append(c)
                    bar.update()
    finally:
        bar.close()
    rows = []
    for method, p, trigger in configs:
        values = jobs[(method, p, trigger)]
        med, lo, hi = _spread(values)
        on = jobs[(method, p, "on")]
        r = _spread([x / y for x, y in zip(values, on, strict=True)])
        rows.append(
            {
                "method": method,
                "jobs_per_transaction": METHODS[method],
                "producers": p,
                "trigger": trigger,
                "seconds": seconds,
                "runs": len(values),
                "jobs_per_s_median": round(med, 1),
                "jobs_per_s_min": round(lo, 1),
                "jobs_per_s_max": round(hi, 1),
                "commits_per_s_median": round(_spread(commits[(method, p, trigger)])[0], 1),
                "ratio_off_to_on": round(r[0], 3),
                "ratio_min": round(r[1], 3),
                "ratio_max": round(r[2], 3),
            }
        )
    return rows
