"""The README's figures, drawn from the benchmark CSVs (matplotlib, imported only to draw).

Every figure has a title, labelled axes with units, a legend, and a footer naming the
machine, the server and the date of the run that wrote its CSV (with the machine's load
average when that benchmark began, from ``machine.json``)."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

FOOTER_IN = 0.42  # inches kept free at the bottom of every figure for the footer


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def stamp(rows: list[dict[str, str]], machine: dict[str, Any], name: str) -> str:
    """The footer (two lines): when, and on what, the run that wrote ``rows`` measured."""
    first = rows[0] if rows else {}
    info = {**machine, **{k: v for k, v in first.items() if v}}
    when = f"Measured {info.get('date_utc', '?')} UTC ({info.get('mode', '?')} run)"
    load = machine.get("load_average_by_benchmark", {}).get(name)
    if load and machine.get("date_utc") == first.get("date_utc"):
        when += f"; load average {load[0]:.1f} (1 min) when this benchmark began"
    where = (
        f"{info.get('cpu_model', '?')}, {info.get('cores', '?')} cores; PostgreSQL "
        f"{info.get('postgres', '?')} (fsync {info.get('fsync', '?')}, synchronous_commit "
        f"{info.get('synchronous_commit', '?')}); Python {info.get('python', '?')}, "
        f"psycopg {info.get('psycopg', '?')}"
    )
    return f"{when}\n{where}"


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    bottom = FOOTER_IN / height
    fig = Figure(figsize=(width, height))
    fig.set_layout_engine(ConstrainedLayoutEngine(rect=(0, bottom, 1, 1 - bottom)))
    return fig


def _spread(rows: list[dict[str, str]], prefix: str = "") -> tuple[list[float], list[list[float]]]:
    """Medians and their (down, up) error bars from the ``*_median/_min/_max`` columns."""
    med = [float(r[f"{prefix}jobs_per_s_median"]) for r in rows]
    lo = [float(r[f"{prefix}jobs_per_s_min"]) for r in rows]
    hi = [float(r[f"{prefix}jobs_per_s_max"]) for r in rows]
    return med, [
        [m - v for m, v in zip(med, lo, strict=True)],
        [v - m for m, v in zip(med, hi, strict=True)],
    ]


def _bars(ax: Any, labels: list[str], series: list[tuple[str, list[dict[str, str]], str]]) -> None:
    """Grouped bars of jobs/s (median, min-max) for each (legend, rows, column prefix)."""
    width = 0.8 / len(series)
    for k, (legend, rows, prefix) in enumerate(series):
        med, err = _spread(rows, prefix)
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        bars = ax.bar(xs, med, width, yerr=err, capsize=3, label=legend)
        _base_labels(ax, bars, [f"{m:,.0f}" for m in med])
    ax.set_xticks(range(len(labels)), labels)
    ax.grid(alpha=0.3, axis="y")


def _base_labels(ax: Any, bars: Any, labels: list[str]) -> None:
    """Write ``labels`` inside the bars, at their foot: at the top they would collide with
    the error bars, which start at the lowest run, well above the foot."""
    for bar, label in zip(bars, labels, strict=True):
        ax.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, 0),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
            color="w",
        )


def draw_drain(rows: list[dict[str, str]]) -> Any:
    fig = _figure(8, 4.8)
    ax = fig.add_subplot()
    for comp, style in (("per-job", "--"), ("batched", "-")):
        for c in sorted({int(r["concurrency"]) for r in rows if r["system"] == "pgqueue"}):
            pts = sorted(
                (int(r["batch"]), r)
                for r in rows
                if r["system"] == "pgqueue"
                and r["completion"] == comp
                and int(r["concurrency"]) == c
            )
            if len(pts) < 2:
                continue
            med, err = _spread([r for _, r in pts])
            ax.errorbar(
                [b for b, _ in pts],
                med,
                yerr=err,
                linestyle=style,
                marker="o",
                capsize=3,
                label=f"pgqueue Worker, {c} thread(s), {comp} completion",
            )
    limit = sorted(
        (int(r["batch"]), float(r["jobs_per_s_median"])) for r in rows if r["system"] == "pgbench"
    )
    if limit:
        ax.plot(*zip(*limit, strict=True), "k:", marker="s", label="pgbench, same SQL, 4 clients")
    ax.set_xscale("log")
    batches = sorted({int(r["batch"]) for r in rows})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("jobs per claim (batch)")
    ax.set_ylabel("jobs drained per second (median, min-max)")
    ax.set_title("Draining no-op jobs: pgqueue's Worker against the pgbench limit")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig


def draw_polling(rows: list[dict[str, str]]) -> Any:
    fig = _figure(9, 4.3)
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
        lat.plot(xs, p99, marker="^", linestyle="--", color=line.get_color(), label=f"{label}, p99")
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
    return fig


def draw_cli_worker(rows: list[dict[str, str]]) -> Any:
    fig = _figure(9, 4.8)
    ax = fig.add_subplot()
    names = {
        "cli-worker": "pgqueue worker (CLI)",
        "worker-library": "the same Worker,\nin-process",
        "hand-loop": "hand-written loop",
        "pgbench": "pgbench",
    }
    _bars(
        ax,
        [names.get(r["system"], r["system"]) for r in rows],
        [
            ("first claim to last completion (database clock)", rows, ""),
            ("whole process, launch to exit", rows, "wall_"),
        ],
    )
    cli = next((r for r in rows if r["system"] == "cli-worker"), None)
    title = "Draining no-op jobs, 4 threads, batch 10: the CLI worker as a user runs it"
    if cli:
        title += (
            f"\nCLI / hand loop {cli['ratio_to_hand_loop']}x, CLI / pgbench "
            f"{cli['ratio_to_pgbench']}x (whole process: {cli['wall_ratio_to_hand_loop']}x, "
            f"{cli['wall_ratio_to_pgbench']}x); {int(cli['n_jobs']):,} jobs a run"
        )
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("system (same claim and complete_many SQL)")
    ax.set_ylabel("jobs per second (median, min-max)")
    ax.legend(fontsize=8, loc="upper left")
    return fig


def draw_cpu(rows: list[dict[str, str]]) -> Any:
    fig = _figure(8, 4.8)
    ax = fig.add_subplot()
    labels = [f"{r['config']}\n({r['flags']})" for r in rows]
    _bars(
        ax,
        labels,
        [
            ("first claim to last completion (database clock)", rows, ""),
            ("whole process, launch to exit", rows, "wall_"),
        ],
    )
    procs = next((r for r in rows if r["config"] == "processes-2"), None)
    title = "CPU-bound jobs (pure Python) in pgqueue worker: threads against processes"
    if procs:
        title += (
            f"\n{procs['handler_ms']} ms a job; --processes 2 / 2 threads "
            f"{procs['ratio_to_threads_2']}x; {int(procs['n_jobs']):,} jobs a run"
        )
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("worker configuration")
    ax.set_ylabel("jobs per second (median, min-max)")
    ax.legend(fontsize=8, loc="upper left")
    return fig


def draw_roundtrips(rows: list[dict[str, str]]) -> Any:
    batches = sorted({int(r["batch"]) for r in rows}, reverse=True)
    fig = _figure(max(7.5, 4.5 * len(batches) + 1), 4.6)
    for i, b in enumerate(batches, start=1):
        ax = fig.add_subplot(1, len(batches), i)
        sub = [r for r in rows if int(r["batch"]) == b]
        med, err = _spread(sub)
        bars = ax.bar(
            range(len(sub)),
            med,
            yerr=err,
            capsize=3,
            color=["tab:gray", "tab:blue", "tab:orange"][: len(sub)],
            label="jobs/s (median, min-max)",
        )
        _base_labels(
            ax,
            bars,
            [f"{m:,.0f}/s\n{r['ratio_to_two_statements']}x" for m, r in zip(med, sub, strict=True)],
        )
        ax.set_xticks(range(len(sub)), [r["variant"] for r in sub])
        # Headroom above the highest error bar for the legend.
        ax.set_ylim(0, max(float(r["jobs_per_s_max"]) for r in sub) * 1.3)
        ax.set_title(f"{sub[0]['concurrency']} threads, batch {b}", fontsize=10)
        ax.set_xlabel("complete batch k, claim batch k+1 as ...")
        ax.set_ylabel("jobs per second")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(
            fontsize=7,
            loc="upper left",
            title="in the bars: ratio to two statements",
            title_fontsize=7,
        )
    fig.suptitle("Fewer round trips: the hand loop with pipeline mode or one statement")
    return fig


def draw_housekeeping(rows: list[dict[str, str]]) -> Any:
    fig = _figure(10, 4.6)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    by = {r["operation"]: r for r in rows}
    stats = [op for op in ("stats", "stats-exact") if op in by]
    ms = [float(by[op]["seconds_median"]) * 1000 for op in stats]
    bars = left.bar(stats, ms, color=["tab:green", "tab:red"][: len(stats)], label="median of runs")
    left.bar_label(bars, labels=[f"{v:,.1f} ms" for v in ms], fontsize=7, padding=2)
    left.set_yscale("log")
    left.set_ylim(top=max(ms, default=1) * 5)
    left.set_ylabel("time per call (ms, log scale)")
    left.set_xlabel("Queue.stats() / Queue.stats(exact=True)")
    left.set_title("stats", fontsize=10)
    left.legend(fontsize=7)
    ops = [op for op in ("prune", "delete", "archive-move", "archive-drop") if op in by]
    width = 0.38
    for k, (col, label) in enumerate(
        (("seconds_median", "whole operation"), ("longest_txn_s", "longest single transaction"))
    ):
        vals = [float(by[op][col]) for op in ops]
        xs = [i + (k - 0.5) * width for i in range(len(ops))]
        bars = right.bar(xs, vals, width, label=label)
        right.bar_label(bars, labels=[f"{v:.3g}" for v in vals], fontsize=7, padding=2)
    right.set_xticks(
        range(len(ops)), [f"{op}\n{int(by[op]['rows_affected']):,} rows" for op in ops], fontsize=8
    )
    right.set_yscale("log")
    right.set_ylim(top=max((float(by[o]["seconds_median"]) for o in ops), default=1) * 5)
    right.set_ylabel("seconds (log scale)")
    right.set_xlabel("removing the oldest day of done jobs")
    right.set_title("prune, one DELETE, and the day-partition recipe", fontsize=10)
    right.legend(fontsize=7, loc="upper right")
    for ax in (left, right):
        ax.grid(alpha=0.3, axis="y")
    n = int(rows[0]["rows_in_table"]) if rows else 0
    fig.suptitle(f"Housekeeping at {n:,} rows")
    return fig


def draw_notify(rows: list[dict[str, str]]) -> Any:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig = _figure(10, 4.4)
    for i, method in enumerate(methods, start=1):
        ax = fig.add_subplot(1, len(methods), i)
        for trigger, label in (
            ("on", "NOTIFY trigger (default)"),
            ("off", "no trigger (--no-notify)"),
        ):
            sub = sorted(
                (r for r in rows if r["method"] == method and r["trigger"] == trigger),
                key=lambda r: int(r["producers"]),
            )
            if not sub:
                continue
            med, err = _spread(sub)
            ax.errorbar(
                [int(r["producers"]) for r in sub],
                med,
                yerr=err,
                marker="o",
                capsize=3,
                label=label,
            )
        producers = sorted({int(r["producers"]) for r in rows})
        ax.set_xscale("log")
        ax.set_xticks(producers, [str(p) for p in producers])
        ax.set_xlabel("concurrent producers (threads, a connection each)")
        ax.set_ylabel("jobs enqueued per second (median, min-max)")
        size = next(r["jobs_per_transaction"] for r in rows if r["method"] == method)
        ax.set_title(f"{method}: {size} job(s) per transaction", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("The cost of NOTIFY on enqueue (durable commits)")
    return fig


DRAWINGS: dict[str, Callable[[list[dict[str, str]]], Any]] = {
    "drain": draw_drain,
    "polling": draw_polling,
    "cli_worker": draw_cli_worker,
    "cpu": draw_cpu,
    "roundtrips": draw_roundtrips,
    "housekeeping": draw_housekeeping,
    "notify": draw_notify,
}


def figures(out: Path | str) -> list[Path]:
    """Draw ``bench_<name>.png`` for every benchmark CSV in ``out`` that has a drawing
    (needs matplotlib; uses no pyplot state, so it is safe inside a notebook)."""
    out = Path(out)
    machine_file = out / "machine.json"
    machine = json.loads(machine_file.read_text()) if machine_file.exists() else {}
    written = []
    for name, draw in DRAWINGS.items():
        path = out / f"bench_{name}.csv"
        if not path.exists():
            continue
        rows = _read_csv(path)
        if not rows:
            continue
        fig = draw(rows)
        fig.text(
            0.5,
            0.008,
            stamp(rows, machine, name),
            ha="center",
            va="bottom",
            fontsize=6.5,
            color="0.3",
        )
        fig.savefig(out / f"bench_{name}.png", dpi=110)
        written.append(out / f"bench_{name}.png")
    return written
