"""Benchmark: I/O-bound jobs on the AsyncWorker against the threaded Worker.

Every job waits ``io_ms`` of simulated I/O (``await asyncio.sleep`` in the AsyncWorker's
handler, ``time.sleep`` in the Worker's: a network call that needs no database) and
touches nothing else, so what is measured is how many waits a worker keeps in the air at
once, and what that costs in memory. The handlers ask for no connection, so 500 of them
at once need none: the AsyncWorker's own four (claims, writes, keeper, LISTEN when on)
are all it opens, where the Worker opens one per thread.

Each run drains ``n_jobs`` prefilled jobs with a fresh worker process (``main`` of this
module, ``--child ...``: burst mode, no LISTEN, no event record), which
reports the time from building the worker to the last completion and its peak resident
memory (``VmHWM`` of ``/proc/self/status``; ``baseline_rss_mb`` is its memory after
imports, before the worker starts). Meanwhile the benchmark counts the worker's sessions
in ``pg_stat_activity``, and the 1-minute load average before each run (the machine is
shared: the AsyncWorker's throughput is CPU-bound, and falls when others load the cores).
Runs of the two systems are interleaved; medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...db import connect
from .runner import QUEUE, Bench, _count, _progress, _spread, prefill

ASYNC_COLUMNS = [
    "system",
    "concurrency",
    "batch",
    "io_ms",
    "n_jobs",
    "jobs_per_s_median",
    "jobs_per_s_min",
    "jobs_per_s_max",
    "ideal_jobs_per_s",
    "peak_rss_mb_median",
    "peak_rss_mb_min",
    "peak_rss_mb_max",
    "baseline_rss_mb",
    "connections_peak",
    "load_1m_median",
    "runs",
    "settings",
]
APP_NAME = "pgqueue worker bench-io"  # the worker's sessions, as pg_stat_activity shows them
# The worker process (not ``python -m``: the package imports this module before runpy would).
CHILD = "import sys; from pgqueue.tools.bench.async_io import main; sys.exit(main(sys.argv[1:]))"


@dataclass(frozen=True)
class IoConfig:
    """One system to measure: which worker, how many handlers at once, jobs per claim."""

    system: str  # "async" (AsyncWorker) or "threads" (Worker)
    concurrency: int
    batch: int

    @property
    def settings(self) -> str:
        name = "AsyncWorker" if self.system == "async" else "Worker"
        return (
            f"{name}(concurrency={self.concurrency}, batch={self.batch}, burst=True, "
            "listen=False, record_events=False, complete_in_batches=True)"
        )


CONFIGS = (IoConfig("async", 500, 50), IoConfig("threads", 50, 10))


def bench_async(
    bench: Bench,
    *,
    n_jobs: int | None = None,
    io_ms: float = 50.0,
    configs: Sequence[IoConfig] = CONFIGS,
    repeats: int | None = None,
) -> list[dict[str, Any]]:
    """Drain ``n_jobs`` jobs of ``io_ms`` simulated I/O with each config, interleaved
    ``repeats`` times; one row per config (medians, min-max, peak memory, sessions)."""
    n = n_jobs or (2_000 if bench.quick else 10_000)
    repeats = repeats or bench.repeats
    dsn = bench.database("bench_async_io")
    samples: dict[IoConfig, list[dict[str, float]]] = {c: [] for c in configs}
    bar = _progress(repeats * len(configs), "async vs threads", bench.progress)
    for rep in range(repeats):
        order = list(configs[rep % len(configs) :]) + list(configs[: rep % len(configs)])
        for config in order:
            samples[config].append(drain_io_once(dsn, config, n, io_ms))
            bar.update()
    bar.close()
    rows = []
    for config in configs:
        runs = samples[config]
        rate = _spread([r["jobs_per_s"] for r in runs])
        peak = _spread([r["peak_rss_mb"] for r in runs])
        rows.append(
            {
                "system": config.system,
                "concurrency": config.concurrency,
                "batch": config.batch,
                "io_ms": io_ms,
                "n_jobs": n,
                "jobs_per_s_median": round(rate[0], 1),
                "jobs_per_s_min": round(rate[1], 1),
                "jobs_per_s_max": round(rate[2], 1),
                "ideal_jobs_per_s": round(config.concurrency * 1000 / io_ms, 1),
                "peak_rss_mb_median": round(peak[0], 1),
                "peak_rss_mb_min": round(peak[1], 1),
                "peak_rss_mb_max": round(peak[2], 1),
                "baseline_rss_mb": round(statistics.median(r["baseline_rss_mb"] for r in runs), 1),
                "connections_peak": int(max(r["connections"] for r in runs)),
                "load_1m_median": round(statistics.median(r["load_1m"] for r in runs), 2),
                "runs": len(runs),
                "settings": config.settings,
            }
        )
    return rows


def drain_io_once(dsn: str, config: IoConfig, n_jobs: int, io_ms: float) -> dict[str, float]:
    """Prefill ``n_jobs`` jobs, drain them with a worker process; what it measured."""
    prefill(dsn, n_jobs)
    load = os.getloadavg()[0]  # others share this machine: a loaded run can be told apart
    command = [
        sys.executable,
        "-c",
        CHILD,
        "--child",
        config.system,
        "--dsn",
        dsn,
        "--concurrency",
        str(config.concurrency),
        "--batch",
        str(config.batch),
        "--io-ms",
        str(io_ms),
    ]
    sessions = 0
    with (
        connect(dsn) as watch,
        subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as child,
    ):
        while child.poll() is None:  # count the worker's sessions while it drains
            row = watch.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                [APP_NAME],
            ).fetchone()
            sessions = max(sessions, int(row[0]) if row else 0)
            time.sleep(0.05)
        out = child.stdout.read() if child.stdout else ""
    if child.returncode != 0:
        raise RuntimeError(f"{config.system} worker exited with {child.returncode}")
    if _count(dsn, "done") != n_jobs:
        raise RuntimeError(f"{config.system}: not every job ended done")
    result = json.loads(out.strip().splitlines()[-1])
    return {
        "jobs_per_s": n_jobs / result["seconds"],
        "peak_rss_mb": result["peak_rss_kb"] / 1024,
        "baseline_rss_mb": result["baseline_rss_kb"] / 1024,
        "connections": sessions,
        "load_1m": load,
    }


# -- the worker process ---------------------------------------------------------------
def _status_kb(field: str) -> int:
    """A ``/proc/self/status`` memory field (VmRSS, VmHWM) in kB."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _child(system: str, dsn: str, concurrency: int, batch: int, io_ms: float) -> dict[str, Any]:
    """Drain the queue with one worker in this process; its time and memory."""
    from ...async_job import AsyncJob
    from ...async_worker import AsyncWorker
    from ...job import Job
    from ...worker import Worker

    io = io_ms / 1000
    options: dict[str, Any] = {
        "queue": QUEUE,
        "dsn": dsn,
        "concurrency": concurrency,
        "batch": batch,
        "burst": True,
        "listen": False,
        "record_events": False,
        "complete_in_batches": True,
        "name": "bench-io",
    }
    baseline = _status_kb("VmRSS")
    started = time.perf_counter()
    if system == "async":

        async def wait_for_io(job: AsyncJob) -> None:
            await asyncio.sleep(io)

        worker: Any = AsyncWorker(wait_for_io, **options)
        asyncio.run(worker.run())
    else:

        def block_on_io(job: Job) -> None:
            time.sleep(io)

        worker = Worker(block_on_io, **options)
        worker.run()
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "done": worker.done,
        "peak_rss_kb": _status_kb("VmHWM"),
        "baseline_rss_kb": baseline,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """The worker process of one run (``--child``): prints one JSON line."""
    parser = argparse.ArgumentParser(prog="pgqueue.tools.bench.async_io worker process")
    parser.add_argument("--child", choices=["async", "threads"], required=True)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--io-ms", type=float, required=True)
    args = parser.parse_args(argv)
    result = _child(args.child, args.dsn, args.concurrency, args.batch, args.io_ms)
    print(json.dumps(result), flush=True)
    return 0
