"""What the engine's choices cost on the client, measured apart from the engine: the same
claim + ``complete_many`` loop through psycopg's sync driver, through its async one, and
through the sync one on a thread that an event loop hands each statement to; and what one
hop from an event loop to a thread and back costs (the price of running plain handlers
on lane threads beside an asyncio engine).

These are the causes the benchmarks page gives for the CLI worker's gap to a hand-written
loop; here they are numbers in ``data/bench_drivers.csv`` rather than a side run."""

from __future__ import annotations

import asyncio
import concurrent.futures
import statistics
import time
from collections.abc import Callable
from typing import Any

from ...async_queue import AsyncQueue
from ...queue import Queue
from .runner import QUEUE, Bench, _count, _progress, _spread, prefill

DRIVERS_COLUMNS = [
    "system",
    "batch",
    "n",
    "runs",
    "client_cpu_us_median",
    "client_cpu_us_min",
    "client_cpu_us_max",
    "per",
    "jobs_per_s_median",
    "cpu_ratio_to_sync",
    "cpu_ratio_to_sync_min",
    "cpu_ratio_to_sync_max",
]

SYNC = "sync driver (Queue: claim, complete_many)"
ASYNC = "async driver (AsyncQueue: the engine's statements)"
THREAD = "sync driver on a thread, each statement handed over from an event loop"
HOP = "event loop -> thread -> event loop (run_in_executor of a no-op)"


def _timed(drain: Callable[[], None]) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds of ``drain()``."""
    cpu, wall = time.process_time(), time.perf_counter()
    drain()
    return time.perf_counter() - wall, time.process_time() - cpu


def _sync(dsn: str, batch: int) -> None:
    with Queue(dsn) as q:
        while jobs := q.claim(QUEUE, limit=batch):
            q.complete_many(jobs)


def _async(dsn: str, batch: int) -> None:
    async def drain() -> None:
        async with AsyncQueue(dsn) as q:
            while jobs := await q.claim(QUEUE, limit=batch):
                await q.complete_many(jobs)

    asyncio.run(drain())


def _thread(dsn: str, batch: int) -> None:
    async def drain() -> None:
        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(1) as pool, Queue(dsn) as q:
            while jobs := await loop.run_in_executor(pool, lambda: q.claim(QUEUE, limit=batch)):
                await loop.run_in_executor(pool, q.complete_many, jobs)

    asyncio.run(drain())


def hop_cpu_us(n: int) -> tuple[float, float]:
    """CPU µs and wall µs per loop -> thread -> loop round trip, over ``n`` of them."""

    async def hops() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            await loop.run_in_executor(pool, int)  # the thread exists before timing
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(n):
                await loop.run_in_executor(pool, int)
            return (time.process_time() - cpu) / n * 1e6, (time.perf_counter() - wall) / n * 1e6

    return asyncio.run(hops())


def bench_drivers(
    bench: Bench, *, n_jobs: int | None = None, batch: int = 20
) -> list[dict[str, Any]]:
    """Client CPU per job of one claim + complete_many loop through each driver (runs
    interleaved, the order rotated; ratios to the sync driver taken within each run), and
    the CPU of one loop-to-thread round trip."""
    n_jobs = n_jobs or (5_000 if bench.quick else 20_000)
    dsn = bench.database("bench_drivers")
    systems: dict[str, Callable[[str, int], None]] = {SYNC: _sync, ASYNC: _async, THREAD: _thread}
    cpu: dict[str, list[float]] = {s: [] for s in systems}
    rate: dict[str, list[float]] = {s: [] for s in systems}
    hops: list[float] = []
    hop_n = 2_000 if bench.quick else 10_000
    names = list(systems)
    bar = _progress(bench.repeats * (len(names) + 1), "drivers", bench.progress)
    try:
        for r in range(bench.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                bar.set_postfix_str(name.split(" (")[0])
                prefill(dsn, n_jobs)
                wall, used = _timed(lambda name=name: systems[name](dsn, batch))
                if (done := _count(dsn, "done")) != n_jobs:
                    raise RuntimeError(f"{name}: {done} of {n_jobs} jobs done")
                cpu[name].append(used / n_jobs * 1e6)
                rate[name].append(n_jobs / wall)
                bar.update()
            hops.append(hop_cpu_us(hop_n)[0])
            bar.update()
    finally:
        bar.close()
    rows = []
    for name in names:
        med, lo, hi = _spread(cpu[name])
        ratio, ratio_lo, ratio_hi = _spread(
            [c / s for c, s in zip(cpu[name], cpu[SYNC], strict=True)]
        )
        rows.append(
            {
                "system": name,
                "batch": batch,
                "n": n_jobs,
                "runs": len(cpu[name]),
                "client_cpu_us_median": round(med, 1),
                "client_cpu_us_min": round(lo, 1),
                "client_cpu_us_max": round(hi, 1),
                "per": "job",
                "jobs_per_s_median": round(statistics.median(rate[name]), 1),
                "cpu_ratio_to_sync": round(ratio, 3),
                "cpu_ratio_to_sync_min": round(ratio_lo, 3),
                "cpu_ratio_to_sync_max": round(ratio_hi, 3),
            }
        )
    hop, hop_lo, hop_hi = _spread(hops)
    rows.append(
        {
            "system": HOP,
            "batch": "",
            "n": hop_n,
            "runs": len(hops),
            "client_cpu_us_median": round(hop, 1),
            "client_cpu_us_min": round(hop_lo, 1),
            "client_cpu_us_max": round(hop_hi, 1),
            "per": "round trip",
            "jobs_per_s_median": "",
            "cpu_ratio_to_sync": "",
            "cpu_ratio_to_sync_min": "",
            "cpu_ratio_to_sync_max": "",
        }
    )
    return rows
