"""Benchmark 8, CPU-bound handlers: threads against processes.

Each job runs a fixed pure-Python loop of about 20 ms (``bench_handlers:spin``, its
iteration count calibrated once in this process and carried in the payload, so every
configuration runs exactly the same work). Threads share one GIL, so a second thread
should add nothing; ``--processes 2`` runs two interpreters. All three configurations run
``pgqueue worker`` as a user would (default flags but these, ``--burst``)."""

from __future__ import annotations

import time
from typing import Any

from ...db import connect
from .cli_worker import db_span, handler_dir, run_cli
from .runner import QUEUE, Bench, _count, _progress, _spread

# name -> the worker's flags (batch stays at its default, 1)
CONFIGS: dict[str, list[str]] = {
    "threads-1": ["--concurrency", "1"],
    "threads-2": ["--concurrency", "2"],
    "processes-2": ["--processes", "2", "--concurrency", "1"],
}


def spin(n: int) -> int:
    """The handler's loop (the same code as ``bench_handlers:spin``)."""
    total = 0
    for i in range(n):
        total += i * i
    return total


def timed(n: int, tries: int = 5) -> float:
    """Seconds ``spin(n)`` takes here: the fastest of ``tries`` (the least disturbed by
    other work on the machine, which only ever adds time)."""
    times = []
    for _ in range(tries):
        t = time.perf_counter()
        spin(n)
        times.append(time.perf_counter() - t)
    return min(times)


def calibrate(ms: float = 20.0) -> int:
    """Iterations of ``spin`` that take about ``ms`` milliseconds of CPU here."""
    n = 100_000
    return max(1_000, round(n * ms / 1000 / timed(n)))


def _prefill_spin(dsn: str, n_jobs: int, iterations: int) -> None:
    with connect(dsn) as conn:
        conn.execute("TRUNCATE jobs RESTART IDENTITY")
        conn.execute(
            "INSERT INTO jobs (queue, payload)"
            " SELECT %s, jsonb_build_object('n', %s::int) FROM generate_series(1, %s)",
            [QUEUE, iterations, n_jobs],
        )
        conn.execute("VACUUM ANALYZE jobs")


def bench_cpu(
    bench: Bench,
    *,
    n_jobs: int | None = None,
    repeats: int | None = None,
    handler_ms: float = 20.0,
) -> list[dict[str, Any]]:
    """Jobs/s for 1 thread, 2 threads and 2 processes on the same CPU-bound jobs,
    interleaved; ratios to 2 threads and to 1 thread within each repetition."""
    n_jobs = n_jobs or (60 if bench.quick else 300)
    repeats = repeats or bench.repeats
    iterations = calibrate(handler_ms)
    measured_ms = timed(iterations) * 1000
    dsn = bench.database("bench_cpu")
    names = list(CONFIGS)
    span: dict[str, list[float]] = {c: [] for c in names}
    wall: dict[str, list[float]] = {c: [] for c in names}
    bar = _progress(len(names) * repeats, "cpu-bound", bench.progress)
    try:
        with handler_dir() as cwd:
            for rep in range(repeats):
                for name in names[rep % 3 :] + names[: rep % 3]:
                    bar.set_postfix_str(name)
                    _prefill_spin(dsn, n_jobs, iterations)
                    seconds, _, out = run_cli(dsn, "spin", CONFIGS[name], cwd)
                    if (done := _count(dsn, "done")) != n_jobs:
                        raise RuntimeError(f"cpu {name}: {done} of {n_jobs} done: {out[-300:]}")
                    span[name].append(n_jobs / db_span(dsn)[0])
                    wall[name].append(n_jobs / seconds)
                    bar.update()
    finally:
        bar.close()
    rows = []
    for name in names:
        med, lo, hi = _spread(span[name])
        wmed, wlo, whi = _spread(wall[name])
        to_two = _spread([a / b for a, b in zip(span[name], span["threads-2"], strict=True)])
        to_one = _spread([a / b for a, b in zip(span[name], span["threads-1"], strict=True)])
        wall_two = _spread([a / b for a, b in zip(wall[name], wall["threads-2"], strict=True)])
        rows.append(
            {
                "config": name,
                "flags": " ".join(CONFIGS[name]),
                "n_jobs": n_jobs,
                "handler_ms": round(measured_ms, 1),
                "iterations": iterations,
                "runs": len(span[name]),
                "jobs_per_s_median": round(med, 2),
                "jobs_per_s_min": round(lo, 2),
                "jobs_per_s_max": round(hi, 2),
                "wall_jobs_per_s_median": round(wmed, 2),
                "wall_jobs_per_s_min": round(wlo, 2),
                "wall_jobs_per_s_max": round(whi, 2),
                "ratio_to_threads_2": round(to_two[0], 3),
                "ratio_to_threads_2_min": round(to_two[1], 3),
                "ratio_to_threads_2_max": round(to_two[2], 3),
                "wall_ratio_to_threads_2": round(wall_two[0], 3),
                "ratio_to_threads_1": round(to_one[0], 3),
            }
        )
    return rows
