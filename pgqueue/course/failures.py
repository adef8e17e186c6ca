"""Two production failures the committed benchmark measures, read and drawn for the
notebooks: claims slowing down over dead row versions that vacuum may not remove (09), and
the NOTIFY trigger serialising the commits of concurrent producers (08).

Everything here reads ``data/`` as ``pgqueue bench --out data`` (``make data``) wrote it; a
figure names the machine and the date of the run it shows. Teaching aids, not the queue."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = [
    "claim_cases",
    "claim_cases_line",
    "notify_ratios",
    "plot_claim_cases",
    "plot_notify_cost",
    "read_bench",
    "stamp",
]


def read_bench(name: str, data: Path | str) -> tuple[pd.DataFrame, dict[str, Any]]:
    """``data/bench_<name>.csv`` as a DataFrame, and ``data/machine.json`` (or ``{}``)."""
    import pandas as pd

    data = Path(data)
    frame = pd.read_csv(data / f"bench_{name}.csv")
    machine_file = data / "machine.json"
    machine = json.loads(machine_file.read_text()) if machine_file.exists() else {}
    return frame, machine


def stamp(frame: pd.DataFrame, machine: dict[str, Any]) -> str:
    """One line saying when and on what the rows of ``frame`` were measured: the CSV's own
    columns first (each row carries its run's date and machine), then ``machine.json``."""
    first = frame.iloc[0].to_dict() if len(frame) else {}
    info = {**machine, **{k: v for k, v in first.items() if isinstance(v, str) or v == v}}
    dates = sorted(frame["date_utc"].dropna().unique()) if "date_utc" in frame else []
    when = ", ".join(map(str, dates)) or info.get("date_utc", "an unknown date")
    return (
        f"measured {when} UTC ({info.get('mode', '?')} run) on {info.get('cpu_model', '?')}, "
        f"{info.get('cores', '?')} cores, PostgreSQL {info.get('postgres', '?')}, "
        f"fsync {info.get('fsync', '?')}, synchronous_commit "
        f"{info.get('synchronous_commit', '?')}"
    )


# -- 07: claims over dead row versions -------------------------------------------------
CLAIM_CASES = {
    # label -> (phase, done_rows or None for the churned cases' own count)
    "empty table, vacuumed": ("vacuumed", 0),
    "5,000,000 done jobs, vacuumed": ("vacuumed", 5_000_000),
    "jobs churned, dead versions kept": ("churned, not vacuumed", None),
    "the same table after VACUUM": ("churned, vacuumed", None),
    "the same churn, VACUUM while a session held the horizon": (
        "churned, vacuumed, horizon held",
        None,
    ),
}


def claim_cases(claim: pd.DataFrame) -> pd.DataFrame:
    """The partial-index rows of ``bench_claim_size.csv`` that tell dead versions from mere
    size, one per ``CLAIM_CASES`` label: done rows, dead tuples, claim median and p95 (ms)."""
    import pandas as pd

    partial = claim[claim["index"] == "partial"]
    rows = []
    for label, (phase, done) in CLAIM_CASES.items():
        match = partial[partial["phase"] == phase]
        if done is not None:
            match = match[match["done_rows"] == done]
        if len(match) != 1:
            raise ValueError(f"bench_claim_size.csv has {len(match)} rows for {label!r}")
        row = match.iloc[0]
        rows.append(
            {
                "case": label,
                "done_rows": int(row["done_rows"]),
                "dead_tuples": int(row["dead_tuples"]),
                "table_mb": float(row["table_mb"]),
                "claim_ms_median": float(row["claim_ms_median"]),
                "claim_ms_p95": float(row["claim_ms_p95"]),
                "samples": int(row["samples"]),
                "batch": int(row["batch"]),
            }
        )
    return pd.DataFrame(rows).set_index("case")


def claim_cases_line(cases: pd.DataFrame, where: str) -> str:
    """``claim_cases`` told in one paragraph: each case's median claim (p95) and how many
    times the vacuumed table's it is."""
    kept = cases.loc["jobs churned, dead versions kept"]
    vacuumed = cases.loc["the same table after VACUUM"]
    held = cases.loc["the same churn, VACUUM while a session held the horizon"]
    base = vacuumed.claim_ms_median
    size_only = (
        cases.loc["5,000,000 done jobs, vacuumed"].claim_ms_median
        / cases.loc["empty table, vacuumed"].claim_ms_median
    )
    return (
        f"{where}:\nover {int(kept.dead_tuples):,} dead versions a claim took "
        f"{kept.claim_ms_median:.2f} ms (median; p95 {kept.claim_ms_p95:.1f}), after VACUUM "
        f"{base:.2f} ms (p95 {vacuumed.claim_ms_p95:.1f}): {kept.claim_ms_median / base:.1f}x; "
        f"after VACUUM with the horizon held {held.claim_ms_median:.1f} ms: "
        f"{held.claim_ms_median / base:.0f}x; 5,000,000 vacuumed done jobs: {size_only:.2f}x "
        "an empty table"
    )


def plot_claim_cases(cases: pd.DataFrame, where: str) -> Figure:
    """Median claim time per case (bars) with its p95 (marks), dead versions kept in red."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.2))
    held = cases["dead_tuples"] > 0
    labels = [
        f"{case}\n({int(row.done_rows):,} jobs, {int(row.dead_tuples):,} dead versions)"
        for case, row in cases.iterrows()
    ]
    y = range(len(cases))
    bars = ax.barh(
        y, cases["claim_ms_median"], color=["C3" if h else "C0" for h in held], height=0.6
    )
    ax.bar_label(bars, fmt="%.2f ms", padding=3, fontsize=8)
    ax.plot(cases["claim_ms_p95"], y, "k|", ms=16, mew=2, label="p95 of the claims")
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.15 * cases["claim_ms_p95"].max())
    ax.set_xlabel(f"time of one claim of {cases['batch'].iloc[0]} jobs (ms)")
    ax.set_ylabel("table the claims ran on")
    ax.set_title("Claims slow down over dead row versions, not over finished rows")
    _footer(fig, f"data/bench_claim_size.csv, partial ready index; {where}")
    ax.legend(
        handles=[
            plt.Rectangle((0, 0), 1, 1, color="C3", label="median, dead versions kept"),
            plt.Rectangle((0, 0), 1, 1, color="C0", label="median, vacuumed"),
            *ax.get_legend_handles_labels()[0],
        ],
        loc="upper right",
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


# -- 06: the cost of the NOTIFY trigger ------------------------------------------------
def notify_ratios(notify: pd.DataFrame) -> pd.DataFrame:
    """Per method and producers: jobs/s and commits/s with the trigger on and off, the
    median (min, max) of the per-repetition ratios off/on that the benchmark recorded, and
    ``apart``: whether every run without the trigger beat every run with it (when it is
    False, the runs overlap and the difference is within this machine's noise)."""
    import pandas as pd

    rows = []
    for (method, producers), part in notify.groupby(["method", "producers"]):
        on = part[part["trigger"] == "on"].iloc[0]
        off = part[part["trigger"] == "off"].iloc[0]
        rows.append(
            {
                "method": method,
                "jobs_per_transaction": int(on["jobs_per_transaction"]),
                "producers": int(producers),
                "jobs_per_s_on": float(on["jobs_per_s_median"]),
                "jobs_per_s_off": float(off["jobs_per_s_median"]),
                "commits_per_s_on": float(on["commits_per_s_median"]),
                "ratio_off_to_on": float(off["ratio_off_to_on"]),
                "ratio_min": float(off["ratio_min"]),
                "ratio_max": float(off["ratio_max"]),
                "apart": bool(off["jobs_per_s_min"] > on["jobs_per_s_max"]),
            }
        )
    return pd.DataFrame(rows).set_index(["method", "producers"]).sort_index()


def _runs(row: Any, prefix: str) -> list[float]:
    """A setting's runs as the CSV records them: its min, median and max (with three runs,
    as the committed benchmark made, these are the runs themselves)."""
    return [
        float(row[f"{prefix}_min"]),
        float(row[f"{prefix}_median"]),
        float(row[f"{prefix}_max"]),
    ]


def plot_notify_cost(notify: pd.DataFrame, where: str) -> Figure:
    """Every run, not a trend line: left, each run's enqueue rate (one job per transaction)
    with the trigger on and off, side by side per producer count, a bar at the median, and
    whether the two sets of runs overlap; right, each repetition's ratio off/on per method.
    With three 2 s runs on a shared machine the spread is as large as the effect at 1 and 4
    producers, and the figure says so instead of drawing a line through the medians."""
    import matplotlib.pyplot as plt

    ratios = notify_ratios(notify)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    single = notify[notify["method"] == "enqueue"]
    producers = sorted(int(p) for p in single["producers"].unique())
    xs = range(len(producers))
    for shift, trigger, color, marker, label in (
        (-0.17, "on", "C3", "o", "NOTIFY trigger on (the default)"),
        (0.17, "off", "C0", "s", "trigger off (install(notify=False))"),
    ):
        part = single[single["trigger"] == trigger].set_index("producers")
        for x, p in enumerate(producers):
            runs = _runs(part.loc[p], "jobs_per_s")
            left.plot(
                [x + shift] * 3,
                runs,
                marker,
                color=color,
                mfc="none",
                ms=7,
                label=f"{label}: one 2 s run" if x == 0 else None,
            )
            left.hlines(
                runs[1],
                x + shift - 0.12,
                x + shift + 0.12,
                color=color,
                lw=2.5,
                label="median of 3 runs" if x == 0 and trigger == "off" else None,
            )
    top = float(single["jobs_per_s_max"].max())
    for x, p in enumerate(producers):
        apart = bool(ratios.loc[("enqueue", p), "apart"])
        left.text(
            x,
            top * 1.06,
            "every run faster\nwithout" if apart else "runs overlap:\nwithin noise",
            ha="center",
            va="bottom",
            fontsize=8,
            color="0.1" if apart else "0.45",
        )
    left.set_ylim(0, top * 1.3)
    left.set_ylabel("jobs enqueued per second (jobs/s)")
    left.set_title("enqueue, one job per transaction: every run")
    left.legend(fontsize=7.5, loc="lower left")
    for shift, method, color in ((-0.12, "enqueue", "C3"), (0.12, "enqueue_many", "C1")):
        part = ratios.loc[method]
        per_tx = part["jobs_per_transaction"].iloc[0]
        for x, p in enumerate(producers):
            row = part.loc[p]
            runs = [float(row[k]) for k in ("ratio_min", "ratio_off_to_on", "ratio_max")]
            right.plot(
                [x + shift] * 3,
                runs,
                "o",
                color=color,
                mfc="none",
                ms=7,
                label=f"{method} ({per_tx} job(s) per transaction): one repetition"
                if x == 0
                else None,
            )
            right.hlines(runs[1], x + shift - 0.1, x + shift + 0.1, color=color, lw=2.5)
    right.axhline(1, color="0.4", ls=":", label="no cost (ratio 1)")
    right.set_ylim(bottom=0)
    right.set_ylabel("jobs/s without trigger / with it, per repetition (ratio)")
    right.set_title("Times faster without the trigger (bar: median)")
    right.legend(fontsize=7.5, loc="upper left")
    for ax in (left, right):
        ax.set_xticks(list(xs), [str(p) for p in producers])
        ax.set_xlim(-0.5, len(producers) - 0.5)
        ax.set_xlabel("concurrent producers (threads, one connection each)")
    fig.suptitle("Notifying commits take turns: enqueue with and without the NOTIFY trigger")
    _footer(fig, f"data/bench_notify.csv, three 2 s runs per setting; {where}")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def _footer(fig: Figure, text: str) -> None:
    """The data's origin under the axes, wrapped to the figure's width."""
    width = int(fig.get_figwidth() * 16)
    fig.text(0.01, 0.01, textwrap.fill(text, width), fontsize=8, color="0.3", va="bottom")
