"""``pgqueue bench``: run the chosen benchmarks, print their tables, write CSVs and figures.

Each benchmark is a function returning a list of row dicts, usable from a notebook; ``main``
runs them, prints a table for each and writes ``bench_<name>.csv`` with the machine's
description as columns (also in ``machine.json``) under ``--out``. The default is a fresh
per-user directory outside any checkout (``default_out()``): the committed ``data/`` is
refreshed only when asked for, with ``--out data`` (``make data``)."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .async_io import ASYNC_COLUMNS, bench_async
from .claim_size import bench_claim
from .cli_worker import bench_cli_worker
from .cpu import bench_cpu
from .dashboard import DASHBOARD_COLUMNS, bench_dashboard
from .drain import DrainConfig, _add_ratio_to_limit, bench_drain
from .drivers import DRIVERS_COLUMNS, bench_drivers
from .enqueue import bench_enqueue
from .housekeeping import bench_housekeeping
from .limits import bench_limits
from .notify import bench_notify
from .pause import PAUSE_COLUMNS, bench_pause
from .peers import bench_peers
from .plots import figures
from .polling import bench_polling
from .report import (
    CLAIM_COLUMNS,
    CLI_WORKER_COLUMNS,
    CPU_COLUMNS,
    DRAIN_COLUMNS,
    ENQUEUE_COLUMNS,
    HOUSEKEEPING_COLUMNS,
    LIMIT_COLUMNS,
    NOTIFY_COLUMNS,
    PEERS_COLUMNS,
    POLLING_COLUMNS,
    ROUNDTRIPS_COLUMNS,
    SUMMARY_COLUMNS,
    _version,
    machine,
    row_targets,
    summarize,
    table,
    write_csv,
)
from .results import DONE_NOTIFY_COLUMNS, RESULTS_COLUMNS, bench_done_notify, bench_results
from .roundtrips import bench_roundtrips
from .runner import Bench, bench_server

BENCHMARKS = (
    "drain",
    "limit",
    "peers",
    "polling",
    "claim",
    "enqueue",
    "async",
    "cli_worker",
    "cpu",
    "roundtrips",
    "housekeeping",
    "notify",
    "results",
    "done_notify",
    "drivers",
    "dashboard",
    "pause",
)


# How long a run takes on the 2-core machine of data/ (a shared VM): said when a run
# begins and ends, so a quick look tells what the full run would cost.
QUICK_TAKES = "under 2 minutes"
FULL_TAKES = "about 16 minutes"


def how_long(quick: bool, took: float | None = None) -> str:
    """One line saying how long this run took (or takes) and what the full run takes."""
    took_text = f"took {took:.0f} s" if took is not None else f"takes {QUICK_TAKES}"
    if quick:
        return (
            f"quick look {took_text} on 2 cores; the full run (without --quick: more "
            f"configurations, jobs and repeats) takes {FULL_TAKES}"
        )
    took_text = f"took {took:.0f} s" if took is not None else f"takes {FULL_TAKES}"
    return f"full run {took_text} on 2 cores; --quick takes {QUICK_TAKES}"


def default_out(now: datetime | None = None) -> Path:
    """A new directory for one run's files, outside the working tree: under
    ``$PGQUEUE_BENCH_DIR`` if set, else ``$XDG_CACHE_HOME/pgqueue/bench`` (default
    ``~/.cache/pgqueue/bench``), named by the UTC time the run began."""
    base = os.environ.get("PGQUEUE_BENCH_DIR")
    if not base:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = str(Path(cache) / "pgqueue" / "bench")
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    return Path(base).expanduser() / stamp


def _load() -> list[float]:
    """The machine's load average over 1, 5 and 15 minutes (others share this machine)."""
    return [round(x, 2) for x in os.getloadavg()]


def run(
    bench: Bench,
    only: Sequence[str] = BENCHMARKS,
    out: Path | str | None = None,
    *,
    log: Callable[[str], None] = print,
) -> dict[str, list[dict[str, Any]]]:
    """Run the chosen benchmarks on ``bench``, print a table for each, write their CSVs
    under ``out`` (default: ``default_out()``) and the targets to ``bench_summary.csv``;
    return every table's rows."""
    out = Path(out) if out is not None else default_out()
    info = machine(bench.admin_dsn)
    info["durable"] = "yes" if info["fsync"] == "on" else "no"
    info["mode"] = "quick" if bench.quick else "full"
    out.mkdir(parents=True, exist_ok=True)
    versions = {name: _version(name) for name in ("procrastinate", "pgqueuer")}
    # The load average (1, 5, 15 min) when the run and each benchmark began, and at the
    # end: a number taken while others loaded the machine can be told apart.
    load: dict[str, Any] = {"load_average_start": _load(), "load_average_by_benchmark": {}}

    def write_machine() -> None:
        (out / "machine.json").write_text(json.dumps(info | versions | load, indent=2) + "\n")

    write_machine()
    log(f"writing to {out.resolve()}")
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
        ("limit", "bench_limit.csv", LIMIT_COLUMNS, lambda: bench_limits(bench)),
        (
            "peers",
            "bench_peers.csv",
            PEERS_COLUMNS,
            lambda: bench_peers(bench, samples=peer_samples),
        ),
        ("polling", "bench_polling.csv", POLLING_COLUMNS, lambda: bench_polling(bench)),
        ("claim", "bench_claim_size.csv", CLAIM_COLUMNS, lambda: bench_claim(bench)),
        ("enqueue", "bench_enqueue.csv", ENQUEUE_COLUMNS, lambda: bench_enqueue(bench)),
        ("async", "bench_async.csv", ASYNC_COLUMNS, lambda: bench_async(bench)),
        (
            "cli_worker",
            "bench_cli_worker.csv",
            CLI_WORKER_COLUMNS,
            lambda: bench_cli_worker(bench),
        ),
        ("cpu", "bench_cpu.csv", CPU_COLUMNS, lambda: bench_cpu(bench)),
        (
            "roundtrips",
            "bench_roundtrips.csv",
            ROUNDTRIPS_COLUMNS,
            lambda: bench_roundtrips(bench),
        ),
        (
            "housekeeping",
            "bench_housekeeping.csv",
            HOUSEKEEPING_COLUMNS,
            lambda: bench_housekeeping(bench),
        ),
        ("notify", "bench_notify.csv", NOTIFY_COLUMNS, lambda: bench_notify(bench)),
        ("results", "bench_results.csv", RESULTS_COLUMNS, lambda: bench_results(bench)),
        (
            "done_notify",
            "bench_done_notify.csv",
            DONE_NOTIFY_COLUMNS,
            lambda: bench_done_notify(bench),
        ),
        ("drivers", "bench_drivers.csv", DRIVERS_COLUMNS, lambda: bench_drivers(bench)),
        (
            "dashboard",
            "bench_dashboard.csv",
            DASHBOARD_COLUMNS,
            lambda: bench_dashboard(bench),
        ),
        ("pause", "bench_pause.csv", PAUSE_COLUMNS, lambda: bench_pause(bench)),
    ]
    for name, filename, columns, func in plan:
        if name not in only:
            continue
        load["load_average_by_benchmark"][name] = _load()
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
    ) + row_targets(results)
    load["load_average_end"] = _load()
    write_machine()
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
    log(f"\nwrote {out.resolve()}")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """``pgqueue bench [--quick] [--only NAME,...] [--out DIR] [--dsn DSN]``."""
    parser = argparse.ArgumentParser(
        prog="pgqueue bench",
        description="Run the benchmarks on a throwaway embedded server (or --dsn) and write "
        "CSV files with the machine's description under --out.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"fewer configs and jobs ({QUICK_TAKES} on 2 cores; the full run {FULL_TAKES})",
    )
    parser.add_argument(
        "--only",
        default=",".join(BENCHMARKS),
        help=f"comma-separated subset of: {', '.join(BENCHMARKS)} ('limit': what a "
        "per-group concurrency limit costs; drain's ratio_to_limit is to pgbench, its ceiling)",
    )
    parser.add_argument(
        "--out",
        help="directory for the CSV files and figures (default: a new one under "
        "$PGQUEUE_BENCH_DIR or ~/.cache/pgqueue/bench; `--out data` refreshes the committed "
        "data/, as `make data` does)",
    )
    parser.add_argument("--dsn", help="benchmark this server instead (needs CREATEDB)")
    parser.add_argument("--repeats", type=int, help="repetitions per config (3; quick: 2)")
    parser.add_argument(
        "--no-fsync",
        action="store_true",
        help="embedded server without fsync/synchronous_commit (default: durable)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    only = {n.strip() for n in args.only.split(",")}
    unknown = only - set(BENCHMARKS)
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    started = time.perf_counter()
    print(how_long(args.quick))
    with bench_server(args.dsn, durable=not args.no_fsync) as bench:
        bench.quick = args.quick
        bench.repeats = args.repeats or (2 if args.quick else 3)
        bench.progress = not args.no_progress
        run(bench, [b for b in BENCHMARKS if b in only], args.out)
    print(f"\n{how_long(args.quick, time.perf_counter() - started)}")
    return 0
