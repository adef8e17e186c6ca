"""Benchmark: what a per-group concurrency limit costs. The same drain (a prefilled queue of
no-op jobs, the Worker, burst mode) without groups, with groups but no limit, and with a
limit per group, which sends every claim through ``claim_limited`` (slots under a unique
index, a try-lock per group). The limit is set so it never binds on the Worker's threads
(groups x per_group >= threads): what is measured is the cost of enforcing it, not the
throttling itself; the "tight" case has exactly one slot per thread, so slots turn over
at every job. Reports jobs/s and the client's CPU per job, and each case's ratio to the
same workload without groups, taken within one repetition.

Two things of the engine's, not of the limit, would swamp the measure, so every case runs
the same way around them: the Worker is not in burst mode (a burst run ends at its first
empty claim, and under a limit a claim is empty while every group's slots are held), and
polls every ``POLL`` s (a slot is freed when a finished job's completion is flushed, which
does not wake the dispatcher: with the default 2 s poll, 200 jobs of the tight case took
58 s instead of 1.6 s). The drain ends when a watcher sees every job done."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from ...db import connect
from ...worker import Worker
from .drain import _client_cpu
from .runner import QUEUE, Bench, _count, _noop, _progress, _spread

POLL = 0.05  # seconds between the Worker's claims when one comes back empty
WATCH = 0.02  # seconds between the watcher's counts of done jobs


@dataclass(frozen=True)
class LimitCase:
    """One workload: jobs spread over ``groups`` groups (0: none), limit ``per_group``
    (None: no limit), drained by a Worker of ``concurrency`` threads claiming ``batch``."""

    case: str
    groups: int
    per_group: int | None
    concurrency: int = 4
    batch: int = 10

    @property
    def label(self) -> str:
        return f"{self.case} b={self.batch}"


def limit_cases(quick: bool = False) -> list[LimitCase]:
    """No groups; 8 groups without a limit; 8 groups of at most 2 (16 slots for 4
    threads); 4 groups of at most 1 (one slot per thread): at batch 1 and 10 (``quick``:
    at batch 10 only; the eight cases were a fifth of the quick run)."""
    cases = []
    for batch in (10,) if quick else (1, 10):
        cases += [
            LimitCase("no groups", 0, None, batch=batch),
            LimitCase("groups, no limit", 8, None, batch=batch),
            LimitCase("limit 2 x 8 groups", 8, 2, batch=batch),
            LimitCase("tight: limit 1 x 4 groups", 4, 1, batch=batch),
        ]
    return cases


def prefill_groups(dsn: str, n: int, case: LimitCase) -> None:
    """Empty jobs and limits, then ``n`` ready no-op jobs dealt round-robin to the case's
    groups, and its limit."""
    with connect(dsn) as conn:
        conn.execute("TRUNCATE jobs RESTART IDENTITY")
        conn.execute("DELETE FROM pgqueue_limits")
        conn.execute(
            "INSERT INTO jobs (queue, payload, group_key) "
            "SELECT %s, '{}'::jsonb, CASE WHEN %s > 0 THEN 'g' || (n %% %s) END "
            "FROM generate_series(1, %s) AS n",
            [QUEUE, case.groups, max(case.groups, 1), n],
        )
        if case.per_group is not None:
            conn.execute(
                "INSERT INTO pgqueue_limits (queue, per_group) VALUES (%s, %s)",
                [QUEUE, case.per_group],
            )
        conn.execute("VACUUM ANALYZE jobs")


def limit_drain(
    dsn: str, case: LimitCase, n_jobs: int, timeout: float = 600.0
) -> tuple[float, float]:
    """Prefill and drain one case; return jobs/s and the client's CPU microseconds per job."""
    prefill_groups(dsn, n_jobs, case)
    worker = Worker(
        _noop,
        queue=QUEUE,
        dsn=dsn,
        concurrency=case.concurrency,
        batch=case.batch,
        listen=False,
        poll_interval=POLL,
        complete_in_batches=True,
        name="bench",
    )
    cpu = _client_cpu()
    started = time.perf_counter()
    worker.start()
    try:
        with connect(dsn) as watcher:
            while _done(watcher) < n_jobs:
                if time.perf_counter() - started > timeout:
                    raise RuntimeError(
                        f"{case.label}: {_done(watcher)} of {n_jobs} jobs done in {timeout:g} s"
                    )
                time.sleep(WATCH)
        elapsed = time.perf_counter() - started
        cpu = _client_cpu() - cpu
    finally:
        worker.stop(grace=5)
    done = _count(dsn, "done")
    if done != n_jobs:
        raise RuntimeError(f"{case.label}: {done} of {n_jobs} jobs done")
    return n_jobs / elapsed, cpu / n_jobs * 1e6


def _done(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM jobs WHERE status = 'done'").fetchone()
    return int(row[0]) if row else 0


def bench_limits(
    bench: Bench,
    *,
    n_jobs: int | None = None,
    cases: Sequence[LimitCase] | None = None,
    repeats: int | None = None,
) -> list[dict[str, Any]]:
    """Drain throughput and client CPU per job of each case, repeated with the cases
    interleaved; one row each, with its median ratio to "no groups" at the same batch."""
    n_jobs = n_jobs or (2_000 if bench.quick else 5_000)
    cases = list(cases or limit_cases(bench.quick))
    repeats = repeats or bench.repeats
    dsn = bench.database("bench_limits")
    runs: dict[LimitCase, list[float]] = {c: [] for c in cases}
    cpu: dict[LimitCase, list[float]] = {c: [] for c in cases}
    bar = _progress(len(cases) * repeats, "limits", bench.progress)
    try:
        for rep in range(repeats):
            for case in cases[rep % len(cases) :] + cases[: rep % len(cases)]:
                bar.set_postfix_str(case.label)
                jobs_per_s, cpu_us = limit_drain(dsn, case, n_jobs)
                runs[case].append(jobs_per_s)
                cpu[case].append(cpu_us)
                bar.update()
    finally:
        bar.close()
    base = {c.batch: c for c in cases if c.groups == 0}
    rows = []
    for case, values in runs.items():
        med, lo, hi = _spread(values)
        plain = base.get(case.batch)
        ratio = (
            round(statistics.median(v / b for v, b in zip(values, runs[plain], strict=True)), 3)
            if plain is not None
            else ""
        )
        rows.append(
            {
                "case": case.case,
                "groups": case.groups,
                "per_group": "" if case.per_group is None else case.per_group,
                "concurrency": case.concurrency,
                "batch": case.batch,
                "jobs_per_s_median": round(med, 1),
                "jobs_per_s_min": round(lo, 1),
                "jobs_per_s_max": round(hi, 1),
                "ratio_to_no_groups": ratio,
                "client_cpu_us_per_job": round(statistics.median(cpu[case]), 1),
                "runs": len(values),
                "n_jobs": n_jobs,
            }
        )
    return rows
