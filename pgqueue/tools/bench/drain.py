"""Benchmark 1, drain throughput: the Worker, a hand-written loop, and pgbench (the limit).

All of them drain a prefilled queue of no-op jobs with the Worker's own SQL (its claim,
then fenced completion). "The limit" here is pgbench running that SQL, the ceiling the
others are compared with (``ratio_to_limit``); ``--only limit`` is another benchmark, the
cost of a per-group concurrency limit (limits.py)."""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from ... import statements
from ...events import EventLog, NullEventLog
from ...worker import Worker
from .runner import QUEUE, Bench, _count, _noop, _progress, _spread, prefill


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


def _add_ratio_to_limit(rows: list[dict[str, Any]]) -> None:
    """Fill ``ratio_to_limit``: each row's median over pgbench's at the same batch size."""
    limit = {r["batch"]: r["jobs_per_s_median"] for r in rows if r["system"] == "pgbench"}
    for row in rows:
        if row["batch"] in limit and row["system"] != "pgbench":
            row["ratio_to_limit"] = round(row["jobs_per_s_median"] / limit[row["batch"]], 3)
