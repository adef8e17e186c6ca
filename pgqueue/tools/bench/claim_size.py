"""Benchmark 5, claim cost against table size: done rows, dead tuples, partial index or not."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from ...db import connect
from ...queue import Queue
from .runner import QUEUE, Bench, _percentile, _progress, _spread


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


def _churn(conn: psycopg.Connection, n: int) -> None:
    """Take ``n`` new jobs ready -> running -> done as claims and completions would: two
    dead row versions each, and dead entries in the ready index."""
    _add_ready(conn, n)
    conn.execute(
        "UPDATE jobs SET status = 'running', fence = fence + 1, attempts = attempts + 1"
        " WHERE status = 'ready'"
    )
    conn.execute("UPDATE jobs SET status = 'done' WHERE status = 'running'")


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
    dead index entries), before and after a VACUUM, and vacuumed while another session held
    the vacuum horizon (an open transaction with an xid, kept open while the claims run).

    Every case has a database of its own, built first; then the claims are measured in
    interleaved rounds across all of them, so the machine's noise hits every case alike.
    Each case gets ``samples`` claims, or fewer when they take longer than ``budget`` s."""
    sizes = sorted(sizes or claim_sizes(bench.quick))
    churn = churn if churn is not None else (20_000 if bench.quick else 200_000)
    cases: dict[tuple[str, str, int], str] = {}  # (index, phase, done rows) -> dsn
    bar = _progress(len(sizes) + 1 + samples // 20, "claim cost", bench.progress)
    holder: psycopg.Connection | None = None  # the session that holds the horizon
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
            _churn(conn, churn)
        clean = _clone(bench, "bench_claim_churn", "bench_claim_churn_vacuumed")
        with connect(clean) as conn:
            conn.execute("VACUUM jobs")
        cases[("partial", "churned, not vacuumed", churn)] = dirty
        cases[("partial", "churned, vacuumed", churn)] = clean
        # The same churn while another session holds the vacuum horizon (an open transaction
        # with an xid, as an idle-in-transaction session has): VACUUM runs and can remove
        # none of it, and the session stays open while the claims are measured.
        bar.set_postfix_str(f"churn of {churn:,} jobs, horizon held")
        held = bench.database("bench_claim_churn_held")
        holder = psycopg.connect(held)  # not autocommit: its transaction stays open
        holder.execute("SELECT txid_current()")
        with connect(held) as conn:
            _churn(conn, churn)
            conn.execute("VACUUM jobs")  # removes nothing the open transaction may still see
        cases[("partial", "churned, vacuumed, horizon held", churn)] = held
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
        if holder is not None:
            holder.close()
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
