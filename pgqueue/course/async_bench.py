"""Notebook 13's measurements of awaited I/O: a live drain by an ``AsyncWorker`` at a given
concurrency (``drain``), and the benchmark figure: ``data/bench_async.csv`` (an
``AsyncWorker`` and a threaded ``Worker`` on the same 10,000 jobs of awaited I/O) compared
like with like: per handler in flight, since the two ran at the concurrency each is built
for (500 coroutines, 50 threads)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from ..async_queue import AsyncQueue
from ..async_worker import AsyncWorker
from ..events import EventLog

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NAMES = {"async": "AsyncWorker", "threads": "Worker (threads)"}


async def drain(
    target: str, concurrency: int, jobs: int = 60, io: float = 0.05
) -> tuple[EventLog, float, int]:
    """Drain ``jobs`` jobs of ``io`` seconds of awaited I/O with ``concurrency`` handlers at
    once on database ``target``; return the events, the seconds it took (from the worker's
    start to its last job) and the most sessions the worker held meanwhile."""
    name = f"io-{concurrency}"

    async def io_bound(job: object) -> None:
        await asyncio.sleep(io)  # the network call: no database work, no connection

    async with AsyncQueue(target) as queue:
        await queue.enqueue_many([{}] * jobs, queue=name)
        events = EventLog()
        worker = AsyncWorker(
            io_bound,
            queue=name,
            dsn=target,
            concurrency=concurrency,
            batch=min(concurrency, 50),
            listen=False,
            burst=True,
            events=events,
            name=name,
        )
        began = time.monotonic()
        await worker.start()
        finished = asyncio.create_task(worker.join())
        sessions = 0
        while not finished.done():
            cur = await queue.conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                [worker.app_name],
            )
            row = await cur.fetchone()
            sessions = max(sessions, row[0] if row else 0)
            await asyncio.sleep(0.01)
        seconds = time.monotonic() - began
        await worker.stop()
        assert worker.done == jobs
    return events, seconds, sessions


def per_handler(path: Path) -> tuple[pd.DataFrame, str]:
    """One row per system: handlers in flight, jobs/s, jobs/s per handler against the
    model's (one job per ``io_ms`` each), memory above the process after its imports per
    handler (KB: an upper bound, as claimed jobs and buffers are in it too) and sessions;
    and the run's stamp."""
    bench = pd.read_csv(path).set_index("system")
    first = bench.iloc[0]
    stamp = (
        f"pgqueue bench --only async, {first.date_utc} UTC, {first.cores}-core "
        f"{first.cpu_model}, PostgreSQL {first.postgres}, Python {first.python}, "
        f"{first.n_jobs:,} jobs of {first.io_ms:g} ms, median of {first.runs} runs"
    )
    table = pd.DataFrame(
        {
            "in flight": bench.concurrency,
            "jobs/s": bench.jobs_per_s_median,
            "jobs/s per handler": bench.jobs_per_s_median / bench.concurrency,
            "model per handler": 1000 / bench.io_ms,
            "KB per handler": (bench.peak_rss_mb_median - bench.baseline_rss_mb)
            * 1024
            / bench.concurrency,
            "sessions": bench.connections_peak,
        }
    )
    table["share of model"] = table["jobs/s per handler"] / table["model per handler"]
    table.index = [NAMES.get(s, s) for s in table.index]
    return table, stamp


def plot_per_handler(table: pd.DataFrame, stamp: str) -> Figure:
    """Two panels: jobs/s per handler in flight against the model's, and memory per handler."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [
        f"{name}\n{int(n)} in flight"
        for name, n in zip(table.index, table["in flight"], strict=True)
    ]
    left.bar(names, table["jobs/s per handler"], 0.5, color=["tab:blue", "tab:orange"])
    model = float(table["model per handler"].iloc[0])
    left.axhline(model, color="0.4", ls="--", lw=1)
    left.annotate(
        f"model: one job per {1000 / model:g} ms", (0.5, model), xytext=(0, 3),
        textcoords="offset points", ha="center", fontsize=8, color="0.3",
        xycoords=("axes fraction", "data"),
    )  # fmt: skip
    for x, share in enumerate(table["share of model"]):
        left.annotate(f"{share:.0%} of it", (x, table["jobs/s per handler"].iloc[x] / 2),
                      ha="center", color="white", fontsize=9)  # fmt: skip
    left.set_ylim(0, model * 1.2)
    left.set_ylabel("jobs/s per handler in flight")
    left.set_title("Throughput, per handler")
    right.bar(names, table["KB per handler"], 0.5, color=["tab:blue", "tab:orange"])
    right.set_ylabel("KB per handler (peak RSS above imports)")
    right.set_title("Memory, per handler")
    fig.suptitle(stamp, fontsize=8)
    fig.tight_layout()
    return fig
