"""Benchmark 9, fewer round trips: the hand loop's "complete batch k, claim batch k+1" three
ways, on the same statements.

- ``two-statements``: ``complete_many``, then ``claim``: two round trips and two commits a
  batch (what the Worker sends today, and ``drain.hand_loop``);
- ``pipeline``: the same two statements in psycopg's pipeline mode (``conn.pipeline()``):
  one round trip; the two run in one implicit transaction (one Sync), so one commit;
- ``one-statement``: ``COMPLETE_AND_CLAIM`` below, a candidate CTE (not in queries.sql):
  one round trip, one commit.

A verdict needs more than a better median: ``ratio_to_two_statements`` is taken within
each repetition, and a variant counts as faster only if its minimum ratio is above 1."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from ... import statements
from .drain import _client_cpu
from .runner import QUEUE, Bench, _count, _progress, _spread, prefill

# Complete the previous batch and claim the next in one statement. The two UPDATEs touch
# different rows (running ones done, ready ones claimed), so they cannot meet; both see the
# statement's snapshot. Completed ids come back as rows with completed = true.
COMPLETE_AND_CLAIM = """\
WITH done AS (
  UPDATE jobs
  SET status = 'done', lease_until = NULL, finished_at = now()
  FROM unnest(%(ids)s::bigint[], %(fences)s::bigint[]) AS held(id, fence)
  WHERE jobs.id = held.id AND jobs.fence = held.fence AND jobs.status = 'running'
  RETURNING jobs.id
), claimed AS (
  UPDATE jobs
  SET status      = 'running',
      attempts    = attempts + 1,
      fence       = fence + 1,
      lease_until = now() + make_interval(secs => %(lease)s),
      started_at  = now()
  WHERE id IN (
    SELECT id FROM jobs
    WHERE queue = %(queue)s AND status = 'ready' AND run_at <= now()
    ORDER BY priority DESC, run_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
  )
  RETURNING id, queue, payload, fence, attempts, max_attempts, lease_until, priority, run_at
)
SELECT id, queue, payload, fence, attempts, max_attempts, lease_until, false AS completed,
       priority, run_at
FROM claimed
UNION ALL
SELECT id, NULL, NULL, NULL, NULL, NULL, NULL, true, NULL, NULL FROM done
ORDER BY completed, priority DESC, run_at, id"""

VARIANTS = ("two-statements", "pipeline", "one-statement")
TRIPS = {"two-statements": (2, 2), "pipeline": (1, 1), "one-statement": (1, 1)}


def _held(rows: Sequence[tuple[Any, ...]]) -> dict[str, list[int]]:
    return {"ids": [r[0] for r in rows], "fences": [r[3] for r in rows]}


def _lane(conn: psycopg.Connection, variant: str, params: dict[str, Any]) -> None:
    """Drain with one connection: claim, then complete k and claim k+1 until none is left."""
    claim, complete_many = statements.query("claim"), statements.query("complete_many")
    rows = conn.execute(claim, params, prepare=True).fetchall()
    while rows:
        if variant == "two-statements":
            done = conn.execute(complete_many, _held(rows), prepare=True).fetchall()
            following = conn.execute(claim, params, prepare=True).fetchall()
        elif variant == "pipeline":
            with conn.pipeline():
                completing = conn.execute(complete_many, _held(rows), prepare=True)
                claiming = conn.execute(claim, params, prepare=True)
            done, following = completing.fetchall(), claiming.fetchall()
        else:
            both = conn.execute(COMPLETE_AND_CLAIM, params | _held(rows), prepare=True).fetchall()
            done = [r for r in both if r[7]]
            following = [r for r in both if not r[7]]
        if len(done) != len(rows):
            raise RuntimeError(f"{variant}: {len(done)} of {len(rows)} completions took effect")
        rows = following


def roundtrip_loop(dsn: str, variant: str, threads: int, batch: int, lease: float = 30.0) -> float:
    """Drain the prefilled queue with ``threads`` lanes of ``variant``; return seconds."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}")
    params = {"queue": QUEUE, "limit": batch, "lease": lease}
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                _lane(conn, variant, params)
        except BaseException as exc:  # reported in the caller's thread
            errors.append(exc)

    lanes = [threading.Thread(target=run) for _ in range(threads)]
    started = time.perf_counter()
    for t in lanes:
        t.start()
    for t in lanes:
        t.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return elapsed


def bench_roundtrips(
    bench: Bench,
    *,
    grid: Sequence[tuple[int, int]] | None = None,
    n_jobs: Callable[[int], int] | None = None,
    repeats: int | None = None,
) -> list[dict[str, Any]]:
    """Jobs/s of each variant at each (threads, batch) of ``grid``, interleaved; ratios to
    ``two-statements`` within each repetition."""
    grid = list(grid or ([(4, 10)] if bench.quick else [(4, 10), (4, 1)]))
    jobs_for = n_jobs or (
        (lambda b: 3_000) if bench.quick else (lambda b: 10_000 if b > 1 else 3_000)
    )
    repeats = repeats or bench.repeats + (0 if bench.quick else 2)
    dsn = bench.database("bench_roundtrips")
    configs = [(v, c, b) for c, b in grid for v in VARIANTS]
    runs: dict[tuple[str, int, int], list[float]] = {k: [] for k in configs}
    cpu: dict[tuple[str, int, int], list[float]] = {k: [] for k in configs}
    bar = _progress(len(configs) * repeats, "round trips", bench.progress)
    try:
        for rep in range(repeats):
            for variant, c, b in configs[rep % len(configs) :] + configs[: rep % len(configs)]:
                bar.set_postfix_str(f"{variant} c={c} b={b}")
                n = jobs_for(b)
                prefill(dsn, n)
                used = _client_cpu()
                seconds = roundtrip_loop(dsn, variant, c, b)
                cpu[(variant, c, b)].append((_client_cpu() - used) / n * 1e6)
                if (done := _count(dsn, "done")) != n:
                    raise RuntimeError(f"{variant}: {done} of {n} jobs done")
                runs[(variant, c, b)].append(n / seconds)
                bar.update()
    finally:
        bar.close()
    rows = []
    for variant, c, b in configs:
        values, base = runs[(variant, c, b)], runs[("two-statements", c, b)]
        med, lo, hi = _spread(values)
        r = _spread([x / y for x, y in zip(values, base, strict=True)])
        trips, commits = TRIPS[variant]
        rows.append(
            {
                "variant": variant,
                "concurrency": c,
                "batch": b,
                "n_jobs": jobs_for(b),
                "runs": len(values),
                "jobs_per_s_median": round(med, 1),
                "jobs_per_s_min": round(lo, 1),
                "jobs_per_s_max": round(hi, 1),
                "ratio_to_two_statements": round(r[0], 3),
                "ratio_min": round(r[1], 3),
                "ratio_max": round(r[2], 3),
                "faster": "yes" if r[1] > 1 and variant != "two-statements" else "no",
                "round_trips_per_batch": trips,
                "commits_per_batch": commits,
                "client_cpu_us_per_job": round(_spread(cpu[(variant, c, b)])[0], 1),
            }
        )
    return rows
