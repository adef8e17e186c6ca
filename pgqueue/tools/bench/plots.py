"""The README's figures, drawn from the benchmark CSVs (matplotlib, imported only to draw)."""

from __future__ import annotations

import csv
from pathlib import Path


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
