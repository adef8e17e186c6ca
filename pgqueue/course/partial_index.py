"""What a partial ready index is worth (lesson 01): the plumbing and the figures.

The lesson keeps its SQL (the ``INSERT ... generate_series`` that piles up finished jobs,
the size query, the ``CREATE INDEX`` statements it compares) and passes it in; this module
runs the loops that measure, reads the committed claim-size benchmark, and draws.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib.pyplot as plt
import pandas as pd
import psycopg
from matplotlib.figure import Figure

from .. import statements
from ..queue import Queue

# Why each of pgqueue's indexes exists, and whether the reference text has it.
INDEX_PURPOSE = {
    "jobs_pkey": "one job by id: every write after a claim names its job by id (and fence)",
    "jobs_ready_idx": "the claim: a queue's ready jobs in the claim's order; it sorts nothing",
    "jobs_lease_idx": "the reaper: running jobs, by the time their lease runs out",
    "jobs_key_idx": "unique keys: one live job per (queue, key), enforced by the database",
    "jobs_dead_idx": "dead jobs of a queue by when they died, without reading finished ones",
    "jobs_slot_idx": "per-group limits: no two running jobs of a group hold the same slot",
}
IN_REFERENCE = {
    "jobs_pkey": "yes",
    "jobs_ready_idx": "yes, as (queue, run_at)",
    "jobs_lease_idx": "yes",
}


def index_table(indexes: pd.DataFrame) -> pd.DataFrame:
    """``pg_indexes`` rows (``indexname``, ``indexdef``) as a table: columns, the rows each
    holds (its ``WHERE``, or every row), whether the reference has it, and why it exists."""
    pattern = r"USING btree (?P<columns>\(.*?\))(?: WHERE (?P<rows>.*))?"
    parts = indexes["indexdef"].str.extract(pattern)
    return pd.DataFrame(
        {
            "index": indexes["indexname"],
            "unique": indexes["indexdef"].str.startswith("CREATE UNIQUE"),
            "columns": parts["columns"],
            "rows it holds (WHERE)": parts["rows"].fillna("every row"),
            "in the reference text": indexes["indexname"].map(IN_REFERENCE).fillna("no, added"),
            "why": indexes["indexname"].map(INDEX_PURPOSE).fillna("(not described here)"),
        }
    ).set_index("index")


def grow_and_measure(
    conn: psycopg.Connection, grow: str, sizes: str, done_rows: int, batches: int = 4
) -> pd.DataFrame:
    """Run ``grow`` (with ``%(rows)s``) ``batches`` times, ``done_rows`` rows in all, and
    ``sizes`` (rows of relation, bytes) before and after each batch; then ``VACUUM ANALYZE``.
    One row per measurement: ``done_jobs`` and each relation's bytes."""

    def measure() -> dict[str, Any]:
        found = dict(conn.execute(sizes).fetchall())
        (done,) = conn.execute("SELECT count(*) FROM jobs WHERE status = 'done'").fetchone()
        return {"done_jobs": done, **found}

    rows = [measure()]
    for _ in range(batches):
        conn.execute(grow, {"rows": done_rows // batches})
        rows.append(measure())
    conn.execute("VACUUM ANALYZE jobs")
    return pd.DataFrame(rows)


_SIZE_STYLE = {  # relation: (line style, marker size, label); the partial lines overlap
    "jobs": ("o-", 6, "the jobs table"),
    "jobs_pkey": ("s-", 6, "jobs_pkey (every row)"),
    "jobs_ready_idx": ("^--", 12, "jobs_ready_idx (partial: ready jobs)"),
    "jobs_lease_idx": ("v--", 9, "jobs_lease_idx (partial: running jobs)"),
    "jobs_key_idx": ("D--", 6, "jobs_key_idx (partial: live jobs with a key)"),
    "jobs_dead_idx": ("x--", 8, "jobs_dead_idx (partial: dead jobs)"),
}


def draw_sizes(sizes: pd.DataFrame) -> Figure:
    """Each relation's size against the finished jobs in the table, on linear axes: the
    table and its primary key grow in proportion (left, MB); the partial indexes, drawn on a
    scale of their own (right, kB), stay where they were."""
    fig, (grows, flat) = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    for column in sizes.columns.drop("done_jobs"):
        style, size, label = _SIZE_STYLE.get(column, (".--", 6, column))
        full = column in ("jobs", "jobs_pkey")
        ax = grows if full else flat
        ax.plot(
            sizes["done_jobs"],
            sizes[column] / (1024 * 1024 if full else 1024),
            style,
            ms=size,
            mfc="none" if "--" in style else None,
            label=f"{label}: {sizes[column].iloc[-1] / 1024:,.0f} kB",
        )
    grows.set_title("The table and its primary key grow with every finished job")
    grows.set_ylabel("size on disk (MB)")
    flat.set_title("The partial indexes stay the size they were")
    flat.set_ylabel("size on disk (kB)")
    flat.set_ylim(0, 2 * max(sizes[c].max() for c in flat_columns(sizes)) / 1024)
    for ax in (grows, flat):
        ax.xaxis.set_major_formatter("{x:,.0f}")
        ax.set_xlabel("finished (done) jobs in the table")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8, title="size at the end", title_fontsize=8)
    fig.suptitle("Disk used as a million finished jobs pile up (linear axes)")
    fig.tight_layout()
    return fig


def flat_columns(sizes: pd.DataFrame) -> list[str]:
    """The relations of ``sizes`` drawn on the right: every index but the primary key."""
    return [c for c in sizes.columns if c not in ("done_jobs", "jobs", "jobs_pkey")]


class IndexRun(NamedTuple):
    """The claim under one ready index: its scan of jobs, the rows it read and threw away
    (``Rows Removed by Filter`` under ``EXPLAIN ANALYZE``), and each timed claim in ms."""

    scan: str
    discarded: int
    ms: list[float]


def time_claims(q: Queue, queue: str, rounds: int, limit: int = 10) -> list[float]:
    """Claim ``limit`` jobs and complete them (untimed), ``rounds`` times; each claim's
    latency in ms, as the client waits for it (round trip and commit included)."""
    latencies = []
    for _ in range(rounds + 1):
        started = time.perf_counter()
        jobs = q.claim(queue, limit=limit)
        latencies.append(1000 * (time.perf_counter() - started))
        assert len(jobs) == limit, "ran out of ready jobs"
        q.complete_many(jobs)
    return latencies[1:]  # the first claim also plans and prepares the statement


def _plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(n for child in node.get("Plans", []) for n in _plan_nodes(child))]


def read_and_discarded(q: Queue, params: dict[str, Any]) -> tuple[str, int]:
    """Run the claim under ``EXPLAIN (ANALYZE)`` in a transaction that is rolled back; its
    first scan of ``jobs`` and how many rows its nodes on ``jobs`` read and discarded."""
    with q.conn.transaction(force_rollback=True):
        query = "EXPLAIN (ANALYZE, FORMAT JSON) " + statements.query("claim")
        (plan,) = q.conn.execute(query, params).fetchone()[0]
    nodes = _plan_nodes(plan["Plan"])
    scans = [
        n["Node Type"] + (f" using {n['Index Name']}" if "Index Name" in n else "")
        for n in nodes
        if "Scan" in n["Node Type"] and n.get("Relation Name") == "jobs"
    ]
    on_jobs = [n for n in nodes if n.get("Relation Name") == "jobs"]
    return scans[0], sum(int(n.get("Rows Removed by Filter", 0)) for n in on_jobs)


def compare_indexes(
    q: Queue, ready_indexes: dict[str, str | None], params: dict[str, Any], rounds: int = 12
) -> dict[str, IndexRun]:
    """Time the claim (``params``: queue, limit, lease) under each ready index in turn.

    ``ready_indexes`` maps a label to a ``CREATE INDEX ordinary_idx ...`` statement, or to
    None for pgqueue's own partial index. Enough ready jobs are enqueued first; before each
    ordinary index, ``jobs_ready_idx`` and the previous ``ordinary_idx`` are dropped; at the
    end ``q.install()`` builds ``jobs_ready_idx`` again."""
    queue, limit = params["queue"], params["limit"]
    needed = limit * len(ready_indexes) * (rounds + 2)  # timed claims, warm-up and spare
    q.enqueue_many([{"n": i} for i in range(needed)], queue=queue)
    q.conn.execute("ANALYZE jobs")
    runs = {}
    for label, create in ready_indexes.items():
        if create is not None:
            q.conn.execute("DROP INDEX IF EXISTS jobs_ready_idx")
            q.conn.execute("DROP INDEX IF EXISTS ordinary_idx")
            q.conn.execute(create)
            q.conn.execute("ANALYZE jobs")
        scan, discarded = read_and_discarded(q, params)
        runs[label] = IndexRun(scan, discarded, time_claims(q, queue, rounds, limit))
    q.conn.execute("DROP INDEX IF EXISTS ordinary_idx")
    q.install()  # puts jobs_ready_idx back
    return runs


def summary(runs: dict[str, IndexRun]) -> pd.DataFrame:
    """One row per index: its scan, rows discarded, median, fastest and slowest claim."""
    return pd.DataFrame(
        {
            label: {
                "scan of jobs": run.scan,
                "rows read and discarded": run.discarded,
                "median claim (ms)": pd.Series(run.ms).median(),
                "fastest (ms)": min(run.ms),
                "slowest (ms)": max(run.ms),
            }
            for label, run in runs.items()
        }
    ).T


def read_bench(data: Path = Path("..") / "data") -> tuple[pd.DataFrame | None, str]:
    """The committed claim-size benchmark's vacuumed rows, and a stamp naming the run that
    wrote them (date, mode, machine, PostgreSQL), both read from the files; (None, why)
    when ``data/bench_claim_size.csv`` is missing or lacks the columns."""
    path = data / "bench_claim_size.csv"
    if not path.exists():
        return None, "no data/bench_claim_size.csv (run `pgqueue bench`)"
    bench = pd.read_csv(path)
    needed = {"index", "done_rows", "claim_ms_median"}
    if not needed <= set(bench.columns):
        return None, f"data/bench_claim_size.csv lacks {sorted(needed - set(bench.columns))}"
    if "phase" in bench.columns:
        bench = bench[bench["phase"] == "vacuumed"]
    # Every row carries its run's machine columns; data/machine.json fills in any missing.
    machine = data / "machine.json"
    first = pd.Series(json.loads(machine.read_text()) if machine.exists() else {}, dtype=object)
    if len(bench):
        first = pd.concat([first, bench.iloc[0].dropna()])
        first = first[~first.index.duplicated(keep="last")]
    stamp = f"run of {first.get('date_utc', 'an unknown date')}"
    if "mode" in first:
        stamp += f" ({first['mode']})"
    if {"cpu_model", "cores", "postgres"} <= set(first.index):
        stamp += f", {first['cpu_model']}, {first['cores']} cores, PostgreSQL {first['postgres']}"
    return bench, stamp


def _color(label: str) -> str:
    """Green for the partial index, red for (queue, run_at) as in the benchmark, else orange."""
    if label.startswith("partial"):
        return "tab:green"
    return "tab:red" if "(queue, run_at)" in label else "tab:orange"


def draw_claims(
    runs: dict[str, IndexRun], done_rows: int, bench: pd.DataFrame | None, stamp: str
) -> Figure:
    """Left: every timed claim of each index, with its median. Right: the benchmark's
    medians against the finished jobs, partial against ordinary (queue, run_at), with this
    run's medians as stars (or the stamp's reason when there is no benchmark)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.3), width_ratios=[1, 1.3])
    for i, (label, run) in enumerate(runs.items()):
        ms = pd.Series(run.ms)
        left.plot(
            [i] * len(ms), ms, "o", color=_color(label), alpha=0.5, label=f"{label}: one claim"
        )
        left.plot([i - 0.25, i + 0.25], [ms.median()] * 2, "-", color="black", lw=2)
    left.plot([], [], "-", color="black", lw=2, label="median")
    left.set_xticks(range(len(runs)), [textwrap.fill(label, 18) for label in runs])
    left.set_xlim(-0.6, len(runs) - 0.4)
    left.set_yscale("log")
    left.set_xlabel("ready index")
    left.set_ylabel("claim of 10 jobs (ms, log scale)")
    left.set_title(f"This notebook: {done_rows:,} finished jobs")
    left.legend(fontsize=7, loc="center left")
    if bench is None or bench.empty:
        right.text(0.5, 0.5, stamp, ha="center", va="center", transform=right.transAxes)
        right.set_axis_off()
    else:
        for index, color, name in (
            ("partial", "tab:green", "partial"),
            ("full", "tab:red", "ordinary (queue, run_at)"),
        ):
            part = bench[bench["index"] == index].sort_values("done_rows")
            right.plot(
                part["done_rows"],
                part["claim_ms_median"],
                "o-",
                color=color,
                label=f"benchmark: {name} index, median",
            )
        for label, run in runs.items():
            right.plot(
                done_rows,
                pd.Series(run.ms).median(),
                "*",
                ms=16,
                color=_color(label),
                mec="black",
                label=f"this notebook: {label}, median",
            )
        right.set_yscale("log")
        right.xaxis.set_major_formatter("{x:,.0f}")
        right.set_xlabel("finished (done) jobs in the table")
        right.set_ylabel("claim of 10 jobs (ms, log scale)")
        right.set_title(f"The benchmark, {stamp}", fontsize=9)
        right.legend(fontsize=7, loc="center right")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle("Claim latency with a partial and with ordinary indexes")
    fig.tight_layout()
    return fig
