"""Benchmark: what pausing costs the claim, the hot path (issue #32).

A paused queue is skipped by the claim statement itself: one more primary-key lookup of
``pgqueue_paused`` in every claim. Measured here as the claim and fenced completion of a
drain, batch 10, one connection, prepared statements (what a ``Queue`` does), with today's
``claim`` statement and with the same statement less its ``paused`` check (the claim as it
was before pausing), in alternating rounds on one table of ready jobs so both see the same
machine. Reported: milliseconds a claim (median of the rounds' medians, and their range),
and the ratio with / without. A third row times the claim of a paused queue (it returns at
once, claiming nothing).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ... import statements
from ...db import connect
from .runner import QUEUE, Bench, _progress, _spread

PAUSE_COLUMNS = ["claim", "claims", "ms_median", "ms_min", "ms_max", "ratio", "note"]

BATCH = 10
CHECK = "AND NOT (SELECT yes FROM paused)"


def without_pause(claim: str) -> str:
    """The claim statement less its pause check: the claim of the release before."""
    if CHECK not in claim:
        raise LookupError("the claim statement has no pause check to take out")
    return claim.replace(CHECK, "")


def bench_pause(
    bench: Bench, *, jobs: int | None = None, rounds: int | None = None
) -> list[dict[str, Any]]:
    """The claim's time with and without the pause check, alternating rounds."""
    jobs = jobs or (20_000 if bench.quick else 100_000)
    rounds = rounds or (6 if bench.quick else 20)
    per_round = jobs // (2 * rounds * BATCH)  # claims a round and variant
    dsn = bench.database("bench_pause")
    with connect(dsn) as conn:
        conn.execute(
            "INSERT INTO jobs (queue, payload) SELECT %s, '{}'::jsonb FROM generate_series(1, %s)",
            [QUEUE, jobs + 1000],  # and the warm-up's
        )
        conn.execute("VACUUM ANALYZE jobs")
    claim = statements.query("claim")
    variants = {"with the pause check": claim, "without (before pausing)": without_pause(claim)}
    medians: dict[str, list[float]] = {name: [] for name in variants}
    complete = statements.query("complete_many")
    params = {"queue": QUEUE, "limit": BATCH, "lease": 30.0}
    bar = _progress(rounds, "pause", bench.progress)
    with connect(dsn) as conn:
        for text in variants.values():  # once first: prepared, plans cached
            for _ in range(6):
                done = conn.execute(text, params, prepare=True).fetchall()
                conn.execute(complete, _held(done), prepare=True)
        for r in range(rounds):
            order = list(variants.items())
            for name, text in order if r % 2 == 0 else order[::-1]:
                took = []
                for _ in range(per_round):
                    t = time.perf_counter()
                    done = conn.execute(text, params, prepare=True).fetchall()
                    took.append((time.perf_counter() - t) * 1000)
                    if len(done) != BATCH:
                        raise RuntimeError("the pause benchmark ran out of ready jobs")
                    conn.execute(complete, _held(done), prepare=True)
                medians[name].append(statistics.median(took))
            bar.update()
        conn.execute("INSERT INTO pgqueue_paused (queue) VALUES (%s)", [QUEUE])
        paused = []
        for _ in range(per_round):
            t = time.perf_counter()
            if conn.execute(claim, params, prepare=True).fetchall():
                raise RuntimeError("a paused queue's claim took a job")
            paused.append((time.perf_counter() - t) * 1000)
    bar.close()
    without = statistics.median(medians["without (before pausing)"])
    rows = []
    for name, values in medians.items():
        mid, low, high = _spread(values)
        rows.append(
            {
                "claim": name,
                "claims": len(values) * per_round,
                "ms_median": round(mid, 4),
                "ms_min": round(low, 4),
                "ms_max": round(high, 4),
                "ratio": round(mid / without, 3),
                "note": f"batch {BATCH}, {len(values)} rounds' medians, alternating",
            }
        )
    mid, low, high = _spread(paused)
    rows.append(
        {
            "claim": "of a paused queue",
            "claims": len(paused),
            "ms_median": round(mid, 4),
            "ms_min": round(low, 4),
            "ms_max": round(high, 4),
            "ratio": round(mid / without, 3),
            "note": "returns at once, claiming nothing",
        }
    )
    return rows


def _held(rows: list[tuple[Any, ...]]) -> dict[str, Any]:
    """complete_many's parameters for the claimed rows (id, queue, payload, fence, ...)."""
    return {"ids": [row[0] for row in rows], "fences": [row[3] for row in rows]}
