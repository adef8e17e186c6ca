"""Benchmark 6, bulk enqueue against a raw COPY into the same table."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from psycopg.types.json import Jsonb

from ...db import connect
from ...queue import Queue
from .runner import QUEUE, Bench, _count, _progress, _spread


def _payloads(n: int) -> list[dict[str, Any]]:
    return [{"i": i} for i in range(n)]


def enqueue_once(dsn: str, method: str, payloads: list[dict[str, Any]], chunk: int) -> float:
    """Insert ``payloads`` into an emptied jobs table by ``method``, ``chunk`` per statement
    and transaction; return jobs per second.

    Methods: ``enqueue`` (one ``Queue.enqueue`` each), ``enqueue_many``
    (``Queue.enqueue_many``), ``copy`` (psycopg's COPY jobs (queue, payload) FROM STDIN)."""
    with connect(dsn) as conn:
        conn.execute("TRUNCATE jobs")
    with Queue(dsn) as queue:
        started = time.perf_counter()
        if method == "enqueue":
            for p in payloads:
                queue.enqueue(p, queue=QUEUE)
        elif method == "enqueue_many":
            for i in range(0, len(payloads), chunk):
                queue.enqueue_many(payloads[i : i + chunk], queue=QUEUE)
        elif method == "copy":
            cur = queue.conn.cursor()
            for i in range(0, len(payloads), chunk):
                with (
                    queue.conn.transaction(),
                    cur.copy("COPY jobs (queue, payload) FROM STDIN") as copy,
                ):
                    for p in payloads[i : i + chunk]:
                        copy.write_row((QUEUE, Jsonb(p)))
        else:
            raise ValueError(f"unknown enqueue method {method!r}")
        elapsed = time.perf_counter() - started
    if _count(dsn, "ready") != len(payloads):
        raise RuntimeError(f"{method}: wrong number of jobs enqueued")
    return len(payloads) / elapsed


def bench_enqueue(
    bench: Bench,
    *,
    n_jobs: int | None = None,
    single_jobs: int | None = None,
    chunks: Sequence[int] = (100, 1_000, 10_000),
    repeats: int | None = None,
) -> list[dict[str, Any]]:
    """Jobs/s for ``enqueue_many`` and COPY at each chunk size (and one-by-one ``enqueue``),
    interleaved; ``ratio_to_copy`` is the median of the per-repetition ratios."""
    n_jobs = n_jobs or (10_000 if bench.quick else 50_000)
    single_jobs = single_jobs or (500 if bench.quick else 2_000)
    repeats = repeats or bench.repeats
    chunks = [c for c in chunks if c <= n_jobs] if not bench.quick else [1_000]
    dsn = bench.database("bench_enqueue")
    payloads = _payloads(n_jobs)
    configs = [(m, c) for c in chunks for m in ("enqueue_many", "copy")] + [("enqueue", 1)]
    runs: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    bar = _progress(len(configs) * repeats, "enqueue", bench.progress)
    try:
        for _ in range(repeats):
            for method, chunk in configs:
                bar.set_postfix_str(f"{method} x{chunk}")
                jobs = payloads[:single_jobs] if method == "enqueue" else payloads
                runs[(method, chunk)].append(enqueue_once(dsn, method, jobs, chunk))
                bar.update()
    finally:
        bar.close()
    rows = []
    for (method, chunk), values in runs.items():
        med, lo, hi = _spread(values)
        copy = runs.get(("copy", chunk))
        ratio = (
            statistics.median(v / c for v, c in zip(values, copy, strict=True)) if copy else None
        )
        rows.append(
            {
                "method": method,
                "chunk": chunk,
                "n_jobs": single_jobs if method == "enqueue" else n_jobs,
                "jobs_per_s_median": round(med, 1),
                "jobs_per_s_min": round(lo, 1),
                "jobs_per_s_max": round(hi, 1),
                "runs": len(values),
                "ratio_to_copy": "" if ratio is None else round(ratio, 3),
            }
        )
    return rows
