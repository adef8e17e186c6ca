"""``pgqueue bench``: throughput, latency and cost, measured in one run on one server.

Each benchmark is a function returning a list of row dicts, usable from a notebook; ``main``
runs them, prints a table for each and writes ``data/bench_<name>.csv`` with the machine's
description as columns (also in ``data/machine.json``).

By default the benchmarks start a throwaway embedded PostgreSQL of their own, with the
server's default durability (fsync and synchronous_commit on, as a production server
would have them), so results do not depend on whatever server the user runs; ``--dsn``
points them at another server (the user must be allowed to create databases).

The machine is assumed shared and noisy: configurations are interleaved, each one is
repeated, and results carry the median with the min-max spread. Ratios between systems
are taken within one repetition, then their median is reported.

From a notebook::

    from pgqueue.tools import bench
    with bench.bench_server() as b:          # or bench.Bench(admin_dsn)
        rows = bench.bench_polling(b, intervals=[0.1, 1.0])
    print(bench.table(rows))
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as dt
import importlib.metadata
import json
import math
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.types.json import Jsonb

from ... import statements
from ...course.lab import drop_database, fresh_database
from ...db import connect
from ...events import EventLog
from ...job import Job
from ...queue import Queue
from ...server import EmbeddedServer, package_bin_dir
from ...worker import Worker

QUEUE = "bench"
BENCHMARKS = ("drain", "limit", "peers", "polling", "claim", "enqueue")

# The CSV columns the notebooks read (machine columns are appended to every file).
DRAIN_COLUMNS = [
    "system",
    "concurrency",
    "batch",
    "completion",
    "jobs_per_s_median",
    "jobs_per_s_min",
    "jobs_per_s_max",
    "runs",
    "n_jobs",
    "ratio_to_limit",
    "client_cpu_us_per_job",
]
POLLING_COLUMNS = [
    "poll_interval_s",
    "listen",
    "jobs_per_s",
    "latency_p50_ms",
    "latency_p95_ms",
    "latency_p99_ms",
    "idle_qps",
    "idle_server_xacts_per_s",
    "arrival_per_s",
    "jobs",
]
CLAIM_COLUMNS = [
    "index",
    "phase",
    "done_rows",
    "dead_tuples",
    "table_mb",
    "claim_ms_median",
    "claim_ms_p95",
    "claim_ms_min",
    "claim_ms_max",
    "samples",
    "batch",
]
PEERS_COLUMNS = [
    "system",
    "version",
    "operation",
    "n_jobs",
    "jobs_per_s_median",
    "jobs_per_s_min",
    "jobs_per_s_max",
    "runs",
    "settings",
    "note",
]
ENQUEUE_COLUMNS = [
    "method",
    "chunk",
    "n_jobs",
    "jobs_per_s_median",
    "jobs_per_s_min",
    "jobs_per_s_max",
    "runs",
    "ratio_to_copy",
]
SUMMARY_COLUMNS = ["target", "goal", "measured", "met", "note"]


# -- where the benchmarks run ---------------------------------------------------------
@dataclass
class Bench:
    """A server to benchmark on: its admin DSN, and (when ours) the embedded server."""

    admin_dsn: str
    server: EmbeddedServer | None = None
    quick: bool = False
    repeats: int = 3
    progress: bool = True
    databases: list[str] = field(default_factory=list)

    def database(self, name: str, *, schema: bool = True) -> str:
        """A fresh database ``name`` (with the pgqueue schema unless told otherwise)."""
        self.databases.append(name)
        if schema:
            return fresh_database(name, self.admin_dsn)
        with connect(self.admin_dsn) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return make_conninfo(self.admin_dsn, dbname=name)

    def cleanup(self) -> None:
        """Drop the databases the benchmarks made (on a server that is not ours)."""
        for name in self.databases:
            with contextlib.suppress(Exception):
                drop_database(name, self.admin_dsn)
        self.databases.clear()

    def pgbench(self) -> Path:
        """The pgbench program shipped with the embedded server's binaries."""
        found = shutil.which("pgbench")
        path = self.server.bin("pgbench") if self.server else package_bin_dir() / "pgbench"
        if path.exists():
            return path
        if found:
            return Path(found)
        raise FileNotFoundError("pgbench not found next to the embedded server's binaries")


@contextlib.contextmanager
def bench_server(dsn: str | None = None, *, durable: bool = True) -> Iterator[Bench]:
    """A ``Bench`` on ``dsn``, else on a throwaway embedded server removed afterwards."""
    if dsn:
        bench = Bench(dsn)
        try:
            yield bench
        finally:
            bench.cleanup()
        return
    home = Path(tempfile.mkdtemp(prefix="pgqueue-bench-"))
    home.chmod(0o755)  # as root the server runs as another user, which must reach it
    server = EmbeddedServer(home, durable=durable)
    try:
        yield Bench(server.start(), server)
    finally:
        with contextlib.suppress(Exception):
            server.stop()
        shutil.rmtree(home, ignore_errors=True)


def machine(dsn: str) -> dict[str, Any]:
    """This machine and server, described without paths or host names."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with connect(dsn) as conn:
        settings = dict(
            conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name = ANY(%s)",
                [["server_version", "fsync", "synchronous_commit", "shared_buffers"]],
            ).fetchall()
        )
    return {
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "postgres": settings.get("server_version", ""),
        "fsync": settings.get("fsync", ""),
        "synchronous_commit": settings.get("synchronous_commit", ""),
        "python": platform.python_version(),
        "psycopg": psycopg.__version__,
        "pgqueue": _version("pgqueue"),
    }


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


# -- small helpers ---------------------------------------------------------------------
def _progress(total: int, desc: str, enabled: bool = True) -> Any:
    """A tqdm bar if tqdm is installed and wanted, else an object that ignores updates."""
    if enabled:
        try:
            from tqdm.auto import tqdm

            return tqdm(total=total, desc=desc, leave=False, file=sys.stderr)
        except ImportError:
            pass
    return _NoBar()


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def close(self) -> None: ...
    def set_postfix_str(self, s: str) -> None: ...


def _spread(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def _percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (nearest rank) of ``values``; nan for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1))
    return ordered[rank]


def _noop(job: Job) -> None:
    """The benchmark handler: does nothing, so the queue's own cost is all that is measured."""


class NullEventLog(EventLog):
    """An event record that records nothing: the counterfactual for its cost."""

    def record(
        self,
        kind: str,
        worker: str,
        job_id: int | None = None,
        fence: int | None = None,
        detail: str = "",
    ) -> None:
        """Drop the event."""

    def record_many(self, rows: Iterable[tuple[str, str, int | None, int | None, str]]) -> None:
        """Drop the events."""


def prefill(dsn: str, n: int, *, queue: str = QUEUE) -> None:
    """Empty the jobs table and fill it with ``n`` ready no-op jobs (server-side, fast)."""
    with connect(dsn) as conn:
        conn.execute("TRUNCATE jobs RESTART IDENTITY")
        conn.execute(
            "INSERT INTO jobs (queue, payload) SELECT %s, '{}'::jsonb FROM generate_series(1, %s)",
            [queue, n],
        )
        conn.execute("VACUUM ANALYZE jobs")


def _count(dsn: str, status: str) -> int:
    with connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM jobs WHERE status = %s", [status]).fetchone()
    return int(row[0]) if row else 0


# -- 1. drain throughput -----------------------------------------------------------------
@dataclass(frozen=True)
class DrainConfig:
    """One way to drain the queue: who, how many threads, jobs per claim, how to complete."""

    # "pgqueue": the Worker; "pgqueue-no-events": the Worker with a null event record;
    # "hand-loop": the same SQL in plain threads; "pgbench": the same SQL run by pgbench.
    system: str
    concurrency: int
    batch: int
    completion: str  # "per-job" or "batched"

    @property
    def label(self) -> str:
        return f"{self.system} c={self.concurrency} b={self.batch} {self.completion}"


def drain_configs(quick: bool = False) -> list[DrainConfig]:
    """The grid: the Worker at 1/4/8 threads x batch 1/10/100 x per-job/batched completion,
    plus the hand-written loop and the Worker without its event record at 4 threads/batch 10."""
    grid = [(4, 10)] if quick else [(c, b) for c in (1, 4, 8) for b in (1, 10, 100)]
    configs = [
        DrainConfig("pgqueue", c, b, comp) for c, b in grid for comp in ("per-job", "batched")
    ]
    for comp in ("per-job", "batched"):
        configs.append(DrainConfig("hand-loop", 4, 10, comp))
        configs.append(DrainConfig("pgqueue-no-events", 4, 10, comp))
    for b in (10,) if quick else (1, 10, 100):
        configs.append(DrainConfig("pgbench", 4, b, "batched"))
    return configs


def drain_once(dsn: str, config: DrainConfig, n_jobs: int, pgbench: Path | None = None) -> float:
    """Prefill ``n_jobs`` and drain them with ``config``; return jobs per second."""
    return drain_measured(dsn, config, n_jobs, pgbench)[0]


def _client_cpu() -> float:
    """CPU seconds used so far by this process (all threads) and its finished children."""
    me, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def drain_measured(
    dsn: str, config: DrainConfig, n_jobs: int, pgbench: Path | None = None
) -> tuple[float, float]:
    """Like ``drain_once``, and also the client's CPU microseconds per job (this process's
    threads, or pgbench): a measure of client overhead that a busy machine disturbs less."""
    prefill(dsn, n_jobs)
    cpu = _client_cpu()
    if config.system in ("pgqueue", "pgqueue-no-events"):
        worker = Worker(
            _noop,
            queue=QUEUE,
            dsn=dsn,
            concurrency=config.concurrency,
            batch=config.batch,
            listen=False,
            burst=True,
            complete_in_batches=config.completion == "batched",
            events=EventLog() if config.system == "pgqueue" else NullEventLog(),
            name="bench",
        )
        started = time.perf_counter()
        worker.start()
        worker.join()
        elapsed = time.perf_counter() - started
        worker.stop(grace=5)
    elif config.system == "hand-loop":
        elapsed = hand_loop(dsn, config.concurrency, config.batch, config.completion == "batched")
    elif config.system == "pgbench":
        elapsed = pgbench_drain(
            pgbench or Path("pgbench"), dsn, config.concurrency, config.batch, n_jobs
        )
    else:
        raise ValueError(f"unknown system {config.system!r}")
    cpu = _client_cpu() - cpu
    done = _count(dsn, "done")
    if done != n_jobs:
        raise RuntimeError(f"{config.label}: {done} of {n_jobs} jobs done")
    return n_jobs / elapsed, cpu / n_jobs * 1e6


def hand_loop(dsn: str, threads: int, batch: int, batched: bool, lease: float = 30.0) -> float:
    """The least code that runs the Worker's SQL: ``threads`` threads, each with its own
    connection, claim ``batch`` jobs, then complete them by fence (one statement per job or
    one for the batch); no Worker, no Job objects, no heartbeats. Return seconds taken."""
    claim = statements.query("claim")
    complete = statements.query("complete")
    complete_many = statements.query("complete_many")
    params = {"queue": QUEUE, "limit": batch, "lease": lease}
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                while rows := conn.execute(claim, params, prepare=True).fetchall():
                    if batched:
                        held = {"ids": [r[0] for r in rows], "fences": [r[3] for r in rows]}
                        done = conn.execute(complete_many, held, prepare=True).fetchall()
                        assert len(done) == len(rows)
                    else:
                        for r in rows:
                            cur = conn.execute(complete, {"id": r[0], "fence": r[3]}, prepare=True)
                            assert cur.rowcount == 1
        except BaseException as exc:  # reported in the caller's thread
            errors.append(exc)

    workers = [threading.Thread(target=loop) for _ in range(threads)]
    started = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return elapsed


# The seed's claim, then its batched fenced completion, as one pgbench script: the
# claim's ids and fences come back as two arrays (\gset) and feed the completion, so
# each script run is the same two autocommit statements the Worker sends per batch.
# The claim returns id and fence only (the Worker's also returns payload etc.).
PGBENCH_SCRIPT = """\
WITH c AS (
  UPDATE jobs
  SET status = 'running', attempts = attempts + 1, fence = fence + 1,
      lease_until = now() + interval '30 seconds'
  WHERE id IN (
    SELECT id FROM jobs
    WHERE queue = '{queue}' AND status = 'ready' AND run_at <= now()
    ORDER BY run_at
    LIMIT {batch}
    FOR UPDATE SKIP LOCKED
  )
  RETURNING id, fence
)
SELECT coalesce(array_agg(id), '{{}}') AS ids, coalesce(array_agg(fence), '{{}}') AS fences
FROM c \\gset
UPDATE jobs
SET status = 'done', lease_until = NULL
FROM unnest(:ids::bigint[], :fences::bigint[]) AS held(id, fence)
WHERE jobs.id = held.id AND jobs.fence = held.fence AND jobs.status = 'running';
"""


def pgbench_drain(pgbench: Path, dsn: str, clients: int, batch: int, n_jobs: int) -> float:
    """Drain the prefilled queue with pgbench running the claim + complete_many SQL from
    ``clients`` connections (2 pgbench threads); return the seconds it took."""
    per_client = -(-n_jobs // (clients * batch))  # enough script runs to empty the queue
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as script:
        script.write(PGBENCH_SCRIPT.format(queue=QUEUE, batch=batch))
    try:
        cmd = [str(pgbench), "-n", "-M", "prepared", "-f", script.name]
        cmd += ["-c", str(clients), "-j", str(min(2, clients)), "-t", str(per_client), dsn]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        started = time.perf_counter()
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        elapsed = time.perf_counter() - started
    finally:
        os.unlink(script.name)
    if result.returncode != 0:
        raise RuntimeError(f"pgbench failed: {(result.stderr or result.stdout).strip()[-500:]}")
    return elapsed


def bench_drain(
    bench: Bench,
    *,
    n_jobs: int | None = None,
    configs: Sequence[DrainConfig] | None = None,
    repeats: int | None = None,
    samples: dict[DrainConfig, list[float]] | None = None,
    cpu_samples: dict[DrainConfig, list[float]] | None = None,
) -> list[dict[str, Any]]:
    """Drain throughput for each config, repeated with configs interleaved; one row each.

    ``samples`` (if given) receives every run's jobs/s, so callers can take ratios
    between configs within one repetition; ``cpu_samples`` the client CPU us per job."""
    n_jobs = n_jobs or (2_000 if bench.quick else 4_000)
    configs = list(configs or drain_configs(bench.quick))
    # Its ratios are the headline numbers: one more repetition in a full run.
    repeats = repeats or bench.repeats + (0 if bench.quick else 1)
    dsn = bench.database("bench_drain")
    pgbench = bench.pgbench() if any(c.system == "pgbench" for c in configs) else None
    runs: dict[DrainConfig, list[float]] = {c: [] for c in configs}
    cpu: dict[DrainConfig, list[float]] = {c: [] for c in configs}
    bar = _progress(len(configs) * repeats, "drain", bench.progress)
    try:
        for rep in range(repeats):
            # Rotate the order, so no config always runs first (or right after another).
            for config in configs[rep % len(configs) :] + configs[: rep % len(configs)]:
                bar.set_postfix_str(config.label)
                jobs_per_s, cpu_us = drain_measured(dsn, config, n_jobs, pgbench)
                runs[config].append(jobs_per_s)
                cpu[config].append(cpu_us)
                bar.update()
    finally:
        bar.close()
    if samples is not None:
        samples.update(runs)
    if cpu_samples is not None:
        cpu_samples.update(cpu)
    rows = []
    for config, values in runs.items():
        med, lo, hi = _spread(values)
        rows.append(
            {
                "system": config.system,
                "concurrency": config.concurrency,
                "batch": config.batch,
                "completion": config.completion,
                "jobs_per_s_median": round(med, 1),
                "jobs_per_s_min": round(lo, 1),
                "jobs_per_s_max": round(hi, 1),
                "runs": len(values),
                "n_jobs": n_jobs,
                "ratio_to_limit": "",
                "client_cpu_us_per_job": round(statistics.median(cpu[config]), 1),
            }
        )
    return rows


# -- 4. polling interval sweep: latency under steady arrivals, and the idle cost ----------
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
    """Count the statements every ``Queue`` in this process sends while the block runs
    (the Worker sends all of its statements through ``Queue``, except its one LISTEN)."""
    counter = [0]
    lock = threading.Lock()
    original = Queue._run

    def counted(self: Queue, *args: Any, **kwargs: Any) -> psycopg.Cursor:
        with lock:
            counter[0] += 1
        return original(self, *args, **kwargs)

    Queue._run = counted  # type: ignore[method-assign]
    try:
        yield counter
    finally:
        Queue._run = original  # type: ignore[method-assign]


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


# -- 5. claim cost against table size ------------------------------------------------------
def claim_sizes(quick: bool = False) -> list[int]:
    """Numbers of done rows to measure the claim at."""
    return [0, 20_000, 200_000] if quick else [0, 100_000, 1_000_000, 5_000_000]


def _claim_once(queue: Queue, batch: int) -> float:
    """Claim ``batch`` jobs and complete them; return the claim's latency in ms."""
    t = time.perf_counter()
    jobs = queue.claim(QUEUE, limit=batch)
    ms = (time.perf_counter() - t) * 1000
    if not jobs:
        raise RuntimeError("claim benchmark ran out of ready jobs")
    queue.complete_many(jobs)
    return ms


def _table_state(dsn: str) -> tuple[int, float]:
    """Dead tuples (as the statistics see them) and the jobs table's size in MB, indexes too."""
    with connect(dsn) as conn:
        row = conn.execute(
            "SELECT n_dead_tup, pg_total_relation_size('jobs') / 1048576.0"
            " FROM pg_stat_user_tables WHERE relname = 'jobs'"
        ).fetchone()
    return (int(row[0]), float(row[1])) if row else (0, 0.0)


def _add_done(conn: psycopg.Connection, n: int) -> None:
    """Add ``n`` finished jobs, older than any ready job (the state of a table never pruned)."""
    conn.execute(
        "INSERT INTO jobs (queue, payload, status, run_at, attempts, fence)"
        " SELECT %s, '{}'::jsonb, 'done', now() - interval '1 day', 1, 1"
        " FROM generate_series(1, %s)",
        [QUEUE, n],
    )


def _add_ready(conn: psycopg.Connection, n: int) -> None:
    conn.execute(
        "INSERT INTO jobs (queue, payload) SELECT %s, '{}'::jsonb FROM generate_series(1, %s)",
        [QUEUE, n],
    )


def _clone(bench: Bench, source: str, name: str) -> str:
    """A copy of database ``source`` named ``name`` (file copy: fast for big tables)."""
    bench.databases.append(name)
    with connect(bench.admin_dsn) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {} STRATEGY = FILE_COPY").format(
                sql.Identifier(name), sql.Identifier(source)
            )
        )
    return make_conninfo(bench.admin_dsn, dbname=name)


def _use_full_index(dsn: str) -> None:
    """The counterfactual: one ordinary (queue, run_at) index instead of the partial one."""
    with connect(dsn) as conn:
        conn.execute("DROP INDEX jobs_ready_idx")
        conn.execute("CREATE INDEX jobs_queue_run_at_idx ON jobs (queue, run_at)")


def bench_claim(
    bench: Bench,
    *,
    sizes: Sequence[int] | None = None,
    batch: int = 10,
    samples: int = 200,
    budget: float = 4.0,
    churn: int | None = None,
) -> list[dict[str, Any]]:
    """Claim latency (claim of ``batch`` jobs) with 0 ... millions of done rows, with the
    seed's partial index and with an ordinary (queue, run_at) index as the counterfactual;
    and after ``churn`` jobs went ready -> running -> done with autovacuum off (dead tuples,
    dead index entries), before and after a VACUUM.

    Every case has a database of its own, built first; then the claims are measured in
    interleaved rounds across all of them, so the machine's noise hits every case alike.
    Each case gets ``samples`` claims, or fewer when they take longer than ``budget`` s."""
    sizes = sorted(sizes or claim_sizes(bench.quick))
    churn = churn if churn is not None else (20_000 if bench.quick else 200_000)
    cases: dict[tuple[str, str, int], str] = {}  # (index, phase, done rows) -> dsn
    bar = _progress(len(sizes) + 1 + samples // 20, "claim cost", bench.progress)
    try:
        have, previous = 0, None
        for size in sizes:
            bar.set_postfix_str(f"building {size:,} done rows")
            # Each size starts from a copy of the one before, so rows are inserted once.
            name = f"bench_claim_{size}"
            dsn = _clone(bench, previous, name) if previous else bench.database(name)
            with connect(dsn) as conn:
                _add_done(conn, size - have)
                conn.execute("VACUUM ANALYZE jobs")  # what autovacuum would have done by now
            previous, have = name, size
            full = _clone(bench, name, f"{name}_full")
            _use_full_index(full)
            cases[("partial", "vacuumed", size)] = dsn
            cases[("full", "vacuumed", size)] = full
            bar.update()
        # Churn with autovacuum off: every job leaves two dead row versions behind, and
        # dead entries in the ready index that claims must step over until cleaned up.
        bar.set_postfix_str(f"churn of {churn:,} jobs")
        dirty = bench.database("bench_claim_churn")
        with connect(dirty) as conn:
            conn.execute("ALTER TABLE jobs SET (autovacuum_enabled = false)")
            _add_ready(conn, churn)
            conn.execute(
                "UPDATE jobs SET status = 'running', fence = fence + 1, attempts = attempts + 1"
                " WHERE status = 'ready'"
            )
            conn.execute("UPDATE jobs SET status = 'done' WHERE status = 'running'")
        clean = _clone(bench, "bench_claim_churn", "bench_claim_churn_vacuumed")
        with connect(clean) as conn:
            conn.execute("VACUUM jobs")
        cases[("partial", "churned, not vacuumed", churn)] = dirty
        cases[("partial", "churned, vacuumed", churn)] = clean
        for dsn in cases.values():
            with connect(dsn) as conn:
                _add_ready(conn, (samples + 10) * batch)  # newer than every done job
                conn.execute("ANALYZE jobs")
        bar.update()
        time.sleep(0.5)  # let the statistics catch up before reading dead tuples
        state = {case: _table_state(dsn) for case, dsn in cases.items()}
        latencies: dict[tuple[str, str, int], list[float]] = {case: [] for case in cases}
        queues = {case: Queue(dsn) for case, dsn in cases.items()}
        try:
            for queue in queues.values():
                _claim_once(queue, batch)  # warm up: connect, prepare, plan
            per_round, spent = 20, dict.fromkeys(cases, 0.0)
            for _ in range(samples // per_round):
                bar.set_postfix_str("claiming")
                for case, queue in queues.items():
                    for _ in range(per_round):
                        if spent[case] > budget and len(latencies[case]) >= 5:
                            break
                        ms = _claim_once(queue, batch)
                        latencies[case].append(ms)
                        spent[case] += ms / 1000
                bar.update()
        finally:
            for queue in queues.values():
                queue.close()
    finally:
        bar.close()
    rows = []
    for (index, phase, done_rows), lat in latencies.items():
        med, lo, hi = _spread(lat)
        dead, mb = state[(index, phase, done_rows)]
        rows.append(
            {
                "index": index,
                "phase": phase,
                "done_rows": done_rows,
                "dead_tuples": dead,
                "table_mb": round(mb, 1),
                "claim_ms_median": round(med, 3),
                "claim_ms_p95": round(_percentile(lat, 95), 3),
                "claim_ms_min": round(lo, 3),
                "claim_ms_max": round(hi, 3),
                "samples": len(lat),
                "batch": batch,
            }
        )
    rows.sort(key=lambda r: (r["phase"] != "vacuumed", r["index"], r["done_rows"]))
    return rows


# -- 6. bulk enqueue against a raw COPY into the same table --------------------------------
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


# -- 3. peers: procrastinate and pgqueuer, same server, same N -----------------------------
PEER_SETTINGS = {
    "pgqueue": "Worker(concurrency=4, batch=10, complete_in_batches=True, listen=False, "
    "burst=True); enqueue: Queue.enqueue per job, Queue.enqueue_many(chunk)",
    "procrastinate": "PsycopgConnector (async pool), async no-op task, "
    "run_worker_async(concurrency=4, wait=False, listen_notify=False, delete_jobs=never); "
    "enqueue: defer_async per job, batch_defer_async(chunk)",
    "pgqueuer": "AsyncpgDriver (its recommended driver; PsycopgDriver if asyncpg is missing), "
    "one connection, async no-op entrypoint, "
    "QueueManager.run(batch_size=10, mode=drain), other settings default; "
    "enqueue: Queries.enqueue per job, Queries.enqueue(lists of chunk)",
}


def _peer_pgqueue(dsn: str, operation: str, n: int, chunk: int) -> float:
    if operation == "drain":
        return drain_once(dsn, DrainConfig("pgqueue", 4, 10, "batched"), n)
    method = "enqueue" if operation == "enqueue_single" else "enqueue_many"
    return enqueue_once(dsn, method, _payloads(n), chunk)


def _peer_procrastinate(dsn: str, operation: str, n: int, chunk: int) -> float:
    import asyncio
    import logging

    import procrastinate

    logging.getLogger("procrastinate").setLevel(logging.WARNING)
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name="noop", queue=QUEUE)
    async def noop(i: int = 0) -> None:
        """Does nothing."""

    async def run() -> float:
        async with app.open_async():
            async with app.connector.pool.connection() as conn:  # type: ignore[attr-defined]
                await conn.execute("TRUNCATE procrastinate_jobs CASCADE")
            if operation == "drain":
                for i in range(0, n, 1000):
                    await noop.batch_defer_async(*({"i": k} for k in range(i, min(n, i + 1000))))
            started = time.perf_counter()
            if operation == "enqueue_single":
                for k in range(n):
                    await noop.defer_async(i=k)
            elif operation == "enqueue_bulk":
                for i in range(0, n, chunk):
                    await noop.batch_defer_async(*({"i": k} for k in range(i, min(n, i + chunk))))
            else:
                await app.run_worker_async(
                    queues=[QUEUE],
                    concurrency=4,
                    wait=False,
                    listen_notify=False,
                    install_signal_handlers=False,
                )
            elapsed = time.perf_counter() - started
            async with app.connector.pool.connection() as conn:  # type: ignore[attr-defined]
                want = "succeeded" if operation == "drain" else "todo"
                cur = await conn.execute(
                    "SELECT count(*) FROM procrastinate_jobs WHERE status = %s", [want]
                )
                row = await cur.fetchone()
                if not row or row[0] != n:
                    raise RuntimeError(f"procrastinate {operation}: {row} of {n} jobs {want}")
        return n / elapsed

    return asyncio.run(run())


def _peer_pgqueuer(dsn: str, operation: str, n: int, chunk: int) -> float:
    import asyncio
    import logging

    from pgqueuer.core.qm import QueueManager
    from pgqueuer.domain.types import QueueExecutionMode
    from pgqueuer.queries import Queries

    logging.getLogger("pgqueuer").setLevel(logging.WARNING)

    async def enqueue(queries: Queries, count: int, size: int) -> None:
        for i in range(0, count, size):
            m = min(count, i + size) - i
            await queries.enqueue(["noop"] * m, [None] * m, [0] * m)

    async def run() -> float:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        async with conn, _pgqueuer_driver(dsn) as driver:
            await conn.execute("TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics")
            queries = Queries(driver)
            if operation == "drain":
                await enqueue(queries, n, 1000)
            started = time.perf_counter()
            if operation == "enqueue_single":
                for _ in range(n):
                    await queries.enqueue("noop", None)
            elif operation == "enqueue_bulk":
                await enqueue(queries, n, chunk)
            else:
                qm = QueueManager(queries)

                @qm.entrypoint("noop")
                async def noop(job: Any) -> None:
                    """Does nothing."""

                await qm.run(batch_size=10, mode=QueueExecutionMode.drain)
            elapsed = time.perf_counter() - started
            cur = await conn.execute("SELECT count(*) FROM pgqueuer")
            row = await cur.fetchone()
            left = row[0] if row else -1
            if left != (0 if operation == "drain" else n):
                raise RuntimeError(f"pgqueuer {operation}: {left} jobs left in the queue of {n}")
        return n / elapsed

    return asyncio.run(run())


@contextlib.asynccontextmanager
async def _pgqueuer_driver(dsn: str) -> Any:
    """pgqueuer's asyncpg driver on its own connection (psycopg's if asyncpg is missing)."""
    try:
        import asyncpg
        from pgqueuer.adapters.drivers.asyncpg import AsyncpgDriver
    except ImportError:
        from pgqueuer.adapters.drivers.psycopg import PsycopgDriver

        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        async with conn:
            yield PsycopgDriver(conn)
        return
    params = conninfo_to_dict(dsn)
    conn = await asyncpg.connect(
        host=params.get("host"),
        port=int(params.get("port", 5432)),
        user=params.get("user"),
        password=params.get("password"),
        database=params.get("dbname"),
    )
    try:
        yield AsyncpgDriver(conn)
    finally:
        await conn.close()


def _install_peer(system: str, dsn: str) -> None:
    import asyncio

    if system == "procrastinate":
        import procrastinate

        app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))
        with app.open():
            app.schema_manager.apply_schema()
    elif system == "pgqueuer":
        from pgqueuer.adapters.drivers.psycopg import PsycopgDriver
        from pgqueuer.queries import Queries

        async def install() -> None:
            conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
            async with conn:
                await Queries(PsycopgDriver(conn)).install()

        asyncio.run(install())


PEERS: dict[str, Callable[[str, str, int, int], float]] = {
    "pgqueue": _peer_pgqueue,
    "procrastinate": _peer_procrastinate,
    "pgqueuer": _peer_pgqueuer,
}


def bench_peers(
    bench: Bench,
    *,
    n_jobs: int | None = None,
    single_jobs: int | None = None,
    chunk: int = 1_000,
    repeats: int | None = None,
    systems: Sequence[str] = ("pgqueue", "procrastinate", "pgqueuer"),
    samples: dict[tuple[str, str], list[float]] | None = None,
) -> list[dict[str, Any]]:
    """Enqueue one by one, enqueue in bulk, and drain ``n_jobs`` no-op jobs with each system
    in a database of its own on the same server, interleaved; a system that cannot run
    gets one row saying why."""
    n_jobs = n_jobs or (500 if bench.quick else 2_000)
    single_jobs = single_jobs or (200 if bench.quick else 1_000)
    repeats = repeats or bench.repeats
    operations = ("enqueue_single", "enqueue_bulk", "drain")
    rows: list[dict[str, Any]] = []
    ready: dict[str, str] = {}
    for system in systems:
        try:
            dsn = bench.database(f"bench_peer_{system}", schema=system == "pgqueue")
            _install_peer(system, dsn)
            ready[system] = dsn
        except Exception as exc:  # e.g. not installed: say so in the results
            rows.append(_peer_row(system, "all", 0, [], f"cannot run: {exc}"))
    runs: dict[tuple[str, str], list[float]] = {(s, op): [] for s in ready for op in operations}
    errors: dict[tuple[str, str], str] = {}
    bar = _progress(len(runs) * repeats, "peers", bench.progress)
    try:
        for _ in range(repeats):
            for system, op in runs:
                if (system, op) in errors:
                    continue
                bar.set_postfix_str(f"{system} {op}")
                n = single_jobs if op == "enqueue_single" else n_jobs
                try:
                    runs[(system, op)].append(PEERS[system](ready[system], op, n, chunk))
                except Exception as exc:
                    errors[(system, op)] = f"failed: {type(exc).__name__}: {exc}"
                bar.update()
    finally:
        bar.close()
    if samples is not None:
        samples.update(runs)
    for (system, op), values in runs.items():
        n = single_jobs if op == "enqueue_single" else n_jobs
        note = errors.get((system, op), "")
        if op == "enqueue_bulk":
            note = note or f"chunks of {chunk}"
        rows.append(_peer_row(system, op, n, values, note))
    return rows


def _peer_row(
    system: str, operation: str, n: int, values: Sequence[float], note: str
) -> dict[str, Any]:
    med, lo, hi = _spread(values) if values else (float("nan"),) * 3
    return {
        "system": system,
        "version": _version(system),
        "operation": operation,
        "n_jobs": n,
        "jobs_per_s_median": round(med, 1),
        "jobs_per_s_min": round(lo, 1),
        "jobs_per_s_max": round(hi, 1),
        "runs": len(values),
        "settings": PEER_SETTINGS.get(system, ""),
        "note": note,
    }


# -- targets, tables, CSV -------------------------------------------------------------------
def _ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of the per-repetition ratios a[i] / b[i] (runs paired within one repetition)."""
    pairs = [x / y for x, y in zip(a, b, strict=False) if y]
    return statistics.median(pairs) if pairs else float("nan")


def _target(target: str, goal: str, measured: float, ok: bool, note: str = "") -> dict[str, Any]:
    return {
        "target": target,
        "goal": goal,
        "measured": round(measured, 3),
        "met": "yes" if ok else "no",
        "note": note,
    }


def summarize(
    drain: dict[DrainConfig, list[float]] | None,
    peers: dict[tuple[str, str], list[float]] | None,
    polling: list[dict[str, Any]] | None,
    claim: list[dict[str, Any]] | None,
    enqueue: list[dict[str, Any]] | None,
    drain_cpu: dict[DrainConfig, list[float]] | None = None,
) -> list[dict[str, Any]]:
    """The issue's targets, each met or missed, from one run's results."""
    out: list[dict[str, Any]] = []
    if drain:
        by = {(c.system, c.concurrency, c.batch, c.completion): v for c, v in drain.items()}
        worker = by.get(("pgqueue", 4, 10, "batched"))
        limit = by.get(("pgbench", 4, 10, "batched"))
        hand = by.get(("hand-loop", 4, 10, "batched"))
        if worker and limit:
            r = _ratio(worker, limit)
            out.append(
                _target("drain c=4 b=10 batched vs pgbench, same SQL", ">= 0.7x", r, r >= 0.7)
            )
        if worker and hand:
            r = _ratio(worker, hand)
            out.append(
                _target("Worker vs hand-written loop, c=4 b=10 batched", ">= 0.9x", r, r >= 0.9)
            )
        for comp in ("per-job", "batched"):
            w = by.get(("pgqueue", 4, 10, comp))
            h = by.get(("hand-loop", 4, 10, comp))
            q = by.get(("pgqueue-no-events", 4, 10, comp))
            if w and q:
                r = _ratio(w, q)
                note = f"throughput with the record is {r:.2f}x without"
                on = (drain_cpu or {}).get(DrainConfig("pgqueue", 4, 10, comp))
                off = (drain_cpu or {}).get(DrainConfig("pgqueue-no-events", 4, 10, comp))
                if on and off:
                    extra = statistics.median(on) - statistics.median(off)
                    note += f"; client CPU {extra:+.1f} us per job"
                out.append(
                    _target(
                        f"event record on vs off, c=4 b=10 {comp}", "cost reported", r, True, note
                    )
                )
            if comp == "per-job" and w and h:
                r = _ratio(w, h)
                out.append(
                    _target("Worker vs hand-written loop, c=4 b=10 per-job", ">= 0.9x", r, r >= 0.9)
                )
    if peers:
        ours = peers.get(("pgqueue", "drain"))
        for peer, goal in (("pgqueuer", 3.0), ("procrastinate", 10.0)):
            theirs = peers.get((peer, "drain"))
            if ours and theirs:
                r = _ratio(ours, theirs)
                out.append(_target(f"drain vs {peer}", f">= {goal:g}x", r, r >= goal))
    if polling:
        for row in polling:
            if row["listen"]:
                ok = row["latency_p50_ms"] <= 3 and row["latency_p99_ms"] <= 10
                out.append(
                    _target(
                        f"LISTEN wake-up p50/p99 at poll {row['poll_interval_s']:g}s",
                        "p50 <= 3 ms, p99 <= 10 ms",
                        row["latency_p50_ms"],
                        ok,
                        f"p99 {row['latency_p99_ms']} ms",
                    )
                )
        default = [r for r in polling if r["listen"] and r["poll_interval_s"] == 2.0]
        if default:
            q = default[0]["idle_qps"]
            out.append(_target("idle statements/s per worker, defaults", "<= 1", q, q <= 1))
    if claim:
        vac = [r for r in claim if r["index"] == "partial" and r["phase"] == "vacuumed"]
        if len(vac) >= 2:
            empty, biggest = vac[0], vac[-1]
            r = biggest["claim_ms_median"] / empty["claim_ms_median"]
            out.append(
                _target(
                    f"claim with {biggest['done_rows']:,} done rows vs empty (partial index)",
                    "<= 1.2x (at 5,000,000)",
                    r,
                    r <= 1.2,
                    "" if biggest["done_rows"] >= 5_000_000 else "fewer rows than the target's",
                )
            )
    if enqueue:
        for row in enqueue:
            if row["method"] == "enqueue_many" and row["ratio_to_copy"] != "":
                r = float(row["ratio_to_copy"])
                what = f"enqueue_many vs COPY, chunks of {row['chunk']:,}"
                out.append(_target(what, ">= 0.8x", r, r >= 0.8))
    return out


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A plain-text table of ``rows`` (for the terminal)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0])
    cells = [[_cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def write_csv(
    path: Path | str,
    rows: Iterable[dict[str, Any]],
    columns: Sequence[str],
    machine_info: dict[str, Any] | None = None,
) -> Path:
    """Write ``rows`` with ``columns`` first, then the machine description on every row."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = list(machine_info or {})
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=[*columns, *extra], extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **(machine_info or {})})
    return path


# -- figures for the README ------------------------------------------------------------------
def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def figures(out: Path | str = "data") -> list[Path]:
    """Draw ``bench_drain.png`` and ``bench_polling.png`` from the CSVs in ``out`` (needs
    matplotlib; uses no pyplot state, so it is safe inside a notebook)."""
    from matplotlib.figure import Figure

    out = Path(out)
    written = []
    drain_csv, polling_csv = out / "bench_drain.csv", out / "bench_polling.csv"
    if drain_csv.exists():
        rows = _read_csv(drain_csv)
        fig = Figure(figsize=(8, 4.5), layout="constrained")
        ax = fig.add_subplot()
        for comp, style in (("per-job", "--"), ("batched", "-")):
            for c in sorted({int(r["concurrency"]) for r in rows if r["system"] == "pgqueue"}):
                pts = sorted(
                    (
                        int(r["batch"]),
                        float(r["jobs_per_s_median"]),
                        float(r["jobs_per_s_min"]),
                        float(r["jobs_per_s_max"]),
                    )
                    for r in rows
                    if r["system"] == "pgqueue"
                    and r["completion"] == comp
                    and int(r["concurrency"]) == c
                )
                if len(pts) < 2:
                    continue
                xs, med, lo, hi = zip(*pts, strict=True)
                ax.errorbar(
                    xs,
                    med,
                    yerr=[
                        [m - v for m, v in zip(med, lo, strict=True)],
                        [v - m for m, v in zip(med, hi, strict=True)],
                    ],
                    linestyle=style,
                    marker="o",
                    capsize=3,
                    label=f"pgqueue Worker, {c} thread(s), {comp} completion",
                )
        limit = sorted(
            (int(r["batch"]), float(r["jobs_per_s_median"]))
            for r in rows
            if r["system"] == "pgbench"
        )
        if limit:
            ax.plot(
                *zip(*limit, strict=True), "k:", marker="s", label="pgbench, same SQL, 4 clients"
            )
        ax.set_xscale("log")
        batches = sorted({int(r["batch"]) for r in rows})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("jobs per claim (batch)")
        ax.set_ylabel("jobs drained per second (median, min-max)")
        ax.set_title("Draining no-op jobs: pgqueue's Worker against the pgbench limit")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.savefig(out / "bench_drain.png", dpi=110)
        written.append(out / "bench_drain.png")
    if polling_csv.exists():
        rows = _read_csv(polling_csv)
        fig = Figure(figsize=(9, 4), layout="constrained")
        lat, idle = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        for listen, label in (("True", "LISTEN/NOTIFY + polling"), ("False", "polling only")):
            pts = sorted(
                (
                    float(r["poll_interval_s"]),
                    float(r["latency_p50_ms"]),
                    float(r["latency_p99_ms"]),
                    float(r["idle_qps"]),
                )
                for r in rows
                if r["listen"] == listen
            )
            if not pts:
                continue
            xs, p50, p99, qps = zip(*pts, strict=True)
            (line,) = lat.plot(xs, p50, marker="o", label=f"{label}, p50")
            lat.plot(
                xs, p99, marker="^", linestyle="--", color=line.get_color(), label=f"{label}, p99"
            )
            # The two idle curves coincide (notifications cost no statements): mark both.
            idle.plot(
                xs,
                qps,
                marker="o" if listen == "True" else "x",
                linestyle="-" if listen == "True" else "--",
                label=label,
            )
        for ax in (lat, idle):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("poll interval (s)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        lat.set_ylabel("enqueue-to-start latency (ms)")
        lat.set_title("Wake-up latency at 20 jobs/s")
        idle.set_ylabel("statements per second, empty queue")
        idle.set_title("Idle cost of one worker")
        fig.savefig(out / "bench_polling.png", dpi=110)
        written.append(out / "bench_polling.png")
    return written


# -- the command ----------------------------------------------------------------------------
def run(
    bench: Bench,
    only: Sequence[str] = BENCHMARKS,
    out: Path | str = "data",
    *,
    log: Callable[[str], None] = print,
) -> dict[str, list[dict[str, Any]]]:
    """Run the chosen benchmarks on ``bench``, print a table for each, write their CSVs
    under ``out`` and the targets to ``bench_summary.csv``; return every table's rows."""
    out = Path(out)
    info = machine(bench.admin_dsn)
    info["durable"] = "yes" if info["fsync"] == "on" else "no"
    info["mode"] = "quick" if bench.quick else "full"
    out.mkdir(parents=True, exist_ok=True)
    versions = {name: _version(name) for name in ("procrastinate", "pgqueuer")}
    (out / "machine.json").write_text(json.dumps(info | versions, indent=2) + "\n")
    log(f"machine: {info}")
    results: dict[str, list[dict[str, Any]]] = {}
    drain_samples: dict[DrainConfig, list[float]] = {}
    drain_cpu: dict[DrainConfig, list[float]] = {}
    peer_samples: dict[tuple[str, str], list[float]] = {}
    plan: list[tuple[str, str, Sequence[str], Callable[[], list[dict[str, Any]]]]] = [
        (
            "drain",
            "bench_drain.csv",
            DRAIN_COLUMNS,
            lambda: bench_drain(bench, samples=drain_samples, cpu_samples=drain_cpu),
        ),
        (
            "peers",
            "bench_peers.csv",
            PEERS_COLUMNS,
            lambda: bench_peers(bench, samples=peer_samples),
        ),
        ("polling", "bench_polling.csv", POLLING_COLUMNS, lambda: bench_polling(bench)),
        ("claim", "bench_claim_size.csv", CLAIM_COLUMNS, lambda: bench_claim(bench)),
        ("enqueue", "bench_enqueue.csv", ENQUEUE_COLUMNS, lambda: bench_enqueue(bench)),
    ]
    for name, filename, columns, func in plan:
        if name not in only:
            continue
        started = time.perf_counter()
        rows = func()
        if name == "drain":
            _add_ratio_to_limit(rows)
        results[name] = rows
        write_csv(out / filename, rows, columns, info)
        log(f"\n== {name} ({time.perf_counter() - started:.0f} s) -> {out / filename}")
        log(table(rows, columns))
    summary = summarize(
        drain_samples,
        peer_samples,
        results.get("polling"),
        results.get("claim"),
        results.get("enqueue"),
        drain_cpu,
    )
    if summary:
        results["summary"] = summary
        write_csv(out / "bench_summary.csv", summary, SUMMARY_COLUMNS, info)
        log("\n== targets")
        log(table(summary, SUMMARY_COLUMNS))
    try:
        for path in figures(out):
            log(f"figure: {path}")
    except ImportError:
        log("(matplotlib is not installed: no figures)")
    return results


def _add_ratio_to_limit(rows: list[dict[str, Any]]) -> None:
    """Fill ``ratio_to_limit``: each row's median over pgbench's at the same batch size."""
    limit = {r["batch"]: r["jobs_per_s_median"] for r in rows if r["system"] == "pgbench"}
    for row in rows:
        if row["batch"] in limit and row["system"] != "pgbench":
            row["ratio_to_limit"] = round(row["jobs_per_s_median"] / limit[row["batch"]], 3)


def main(argv: Sequence[str] | None = None) -> int:
    """``pgqueue bench [--quick] [--only NAME,...] [--out DIR] [--dsn DSN]``."""
    parser = argparse.ArgumentParser(
        prog="pgqueue bench",
        description="Run the benchmarks on a throwaway embedded server (or --dsn) and write "
        "CSV files with the machine's description under --out.",
    )
    parser.add_argument("--quick", action="store_true", help="fewer configs and jobs (< 2 min)")
    parser.add_argument(
        "--only",
        default=",".join(BENCHMARKS),
        help=f"comma-separated subset of: {', '.join(BENCHMARKS)} ('limit' runs with drain)",
    )
    parser.add_argument("--out", default="data", help="directory for the CSV files (data/)")
    parser.add_argument("--dsn", help="benchmark this server instead (needs CREATEDB)")
    parser.add_argument("--repeats", type=int, help="repetitions per config (3; quick: 2)")
    parser.add_argument(
        "--no-fsync",
        action="store_true",
        help="embedded server without fsync/synchronous_commit (default: durable)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    only = {"drain" if n.strip() == "limit" else n.strip() for n in args.only.split(",")}
    unknown = only - set(BENCHMARKS)
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    started = time.perf_counter()
    with bench_server(args.dsn, durable=not args.no_fsync) as bench:
        bench.quick = args.quick
        bench.repeats = args.repeats or (2 if args.quick else 3)
        bench.progress = not args.no_progress
        run(bench, [b for b in BENCHMARKS if b in only], args.out)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


__all__ = [
    "Bench",
    "DrainConfig",
    "bench_claim",
    "bench_drain",
    "bench_enqueue",
    "bench_peers",
    "bench_polling",
    "bench_server",
    "drain_configs",
    "figures",
    "hand_loop",
    "machine",
    "main",
    "run",
    "summarize",
    "table",
    "write_csv",
]

if __name__ == "__main__":
    raise SystemExit(main())
