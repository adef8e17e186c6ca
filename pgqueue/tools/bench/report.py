"""What a run reports: the CSV columns, the machine, the targets, text tables and CSV files."""

from __future__ import annotations

import contextlib
import csv
import datetime as dt
import importlib.metadata
import os
import platform
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import psycopg

from ...db import connect
from .drain import DrainConfig

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
LIMIT_COLUMNS = [
    "case",
    "groups",
    "per_group",
    "concurrency",
    "batch",
    "jobs_per_s_median",
    "jobs_per_s_min",
    "jobs_per_s_max",
    "ratio_to_no_groups",
    "client_cpu_us_per_job",
    "runs",
    "n_jobs",
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
_SPREAD = ["jobs_per_s_median", "jobs_per_s_min", "jobs_per_s_max"]
_WALL = ["wall_jobs_per_s_median", "wall_jobs_per_s_min", "wall_jobs_per_s_max"]
CLI_WORKER_COLUMNS = [
    "system",
    "command",
    "concurrency",
    "batch",
    "n_jobs",
    "runs",
    *_SPREAD,
    *_WALL,
    *(
        f"{prefix}ratio_to_{other}{stat}"
        for other in ("worker_library", "hand_loop", "pgbench")
        for prefix, stats in (("", ("", "_min", "_max")), ("wall_", ("",)))
        for stat in stats
    ),
    "startup_s_median",
    "exit_s_median",
    "client_cpu_us_per_job",
    "empty_queue_s_median",
    "empty_queue_cpu_s_median",
]
CPU_COLUMNS = [
    "config",
    "flags",
    "n_jobs",
    "handler_ms",
    "iterations",
    "runs",
    *_SPREAD,
    *_WALL,
    "ratio_to_threads_2",
    "ratio_to_threads_2_min",
    "ratio_to_threads_2_max",
    "wall_ratio_to_threads_2",
    "ratio_to_threads_1",
]
ROUNDTRIPS_COLUMNS = [
    "variant",
    "concurrency",
    "batch",
    "n_jobs",
    "runs",
    *_SPREAD,
    "ratio_to_two_statements",
    "ratio_min",
    "ratio_max",
    "faster",
    "round_trips_per_batch",
    "commits_per_batch",
    "client_cpu_us_per_job",
]
HOUSEKEEPING_COLUMNS = [
    "operation",
    "rows_in_table",
    "rows_affected",
    "runs",
    "seconds_median",
    "seconds_min",
    "seconds_max",
    "longest_txn_s",
    "transactions",
    "note",
]
NOTIFY_COLUMNS = [
    "method",
    "jobs_per_transaction",
    "producers",
    "trigger",
    "seconds",
    "runs",
    *_SPREAD,
    "commits_per_s_median",
    "ratio_off_to_on",
    "ratio_min",
    "ratio_max",
]
SUMMARY_COLUMNS = ["target", "goal", "measured", "met", "note"]


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
                note = "library Worker (events recorded), 2,000 jobs; see cli_worker for the CLI"
                out.append(_target(f"drain vs {peer}", f">= {goal:g}x", r, r >= goal, note))
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


def row_targets(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The targets of the benchmarks that compute their own per-repetition ratios
    (cli_worker, cpu, roundtrips, housekeeping, notify), read from their rows."""
    out: list[dict[str, Any]] = []
    for row in results.get("cli_worker", []):
        if row["system"] != "cli-worker":
            continue
        for other, goal in (("hand_loop", 0.9), ("pgbench", 0.7)):
            r, lo, hi = (row[f"ratio_to_{other}{s}"] for s in ("", "_min", "_max"))
            note = (
                f"first claim to last completion (database clock), per-run {lo}-{hi}; "
                f"whole process {row[f'wall_ratio_to_{other}']}x (start-up "
                f"{row['startup_s_median']} s and exit {row['exit_s_median']} s counted); "
                f"CLI / the same Worker in-process {row['ratio_to_worker_library']}x"
            )
            what = "hand-written loop" if other == "hand_loop" else "pgbench, same SQL"
            goal_text = f">= {goal:g}x" + (" (moonshot 1.0x)" if other == "pgbench" else "")
            out.append(_target(f"CLI worker c=4 b=10 vs {what}", goal_text, r, r >= goal, note))
    for row in results.get("cpu", []):
        if row["config"] == "processes-2":
            r = row["ratio_to_threads_2"]
            note = (
                f"{row['handler_ms']} ms pure-Python jobs; per-run "
                f"{row['ratio_to_threads_2_min']}-{row['ratio_to_threads_2_max']}; whole "
                f"process {row['wall_ratio_to_threads_2']}x; "
                f"vs 1 thread {row['ratio_to_threads_1']}x"
            )
            out.append(
                _target("CPU-bound: --processes 2 vs 2 threads", ">= 1.5x", r, r >= 1.5, note)
            )
    for row in results.get("roundtrips", []):
        if row["variant"] != "two-statements":
            out.append(
                _target(
                    f"round trips: {row['variant']} vs two statements, c={row['concurrency']} "
                    f"b={row['batch']}",
                    "faster in every repetition",
                    row["ratio_to_two_statements"],
                    row["faster"] == "yes",
                    f"per-run {row['ratio_min']}-{row['ratio_max']}",
                )
            )
    hk = {r["operation"]: r for r in results.get("housekeeping", [])}
    if "stats" in hk and "stats-exact" in hk:
        fast, exact = hk["stats"], hk["stats-exact"]
        out.append(
            _target(
                f"stats at {fast['rows_in_table']:,} rows (ms)",
                "reported",
                fast["seconds_median"] * 1000,
                True,
                f"exact=True {exact['seconds_median'] * 1000:,.0f} ms",
            )
        )
    if "prune" in hk and "delete" in hk:
        p, d = hk["prune"], hk["delete"]
        out.append(
            _target(
                f"prune of {p['rows_affected']:,} rows: longest transaction (s)",
                "reported",
                p["longest_txn_s"],
                True,
                f"{p['seconds_median']} s in all, {p['transactions']} transactions; one "
                f"unbounded DELETE {d['seconds_median']} s in one transaction",
            )
        )
    for row in results.get("notify", []):
        if row["trigger"] == "off":
            out.append(
                _target(
                    f"{row['method']} without/with NOTIFY trigger, {row['producers']} producer(s)",
                    "reported",
                    row["ratio_off_to_on"],
                    True,
                    f"per-run {row['ratio_min']}-{row['ratio_max']}; "
                    f"{row['jobs_per_s_median']:,.0f} jobs/s without",
                )
            )
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
